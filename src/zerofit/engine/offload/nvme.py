"""NVMe offload of optimizer state: each offloaded flat group's fp32 master and optimizer state in a file.

With `offload_optimizer: {device: nvme}` a rank keeps only its host gradient shards in memory
between steps. Each offloaded flat group owns one file `<nvme_path>/zerofit-rank<r>-<pid>-<id>/group-<i>.bin`
laid out as `[master | state tensor 0 | state tensor 1 | ...]`, the master's region `shard_numel` fp32
elements, each state's region `shard_numel` elements as the state is stored (state tensors are per
piece, at the piece's offset inside its region, so a region mirrors the master's layout). The host
stepper swaps a group in just before its step and out right after:

    read k+1.. (I/O threads)   step k (stepper thread)   write k-1 (I/O threads)

GPU-stepped offload (`step_on: device`) drives the same swapper from `GpuStep`'s issuing thread:
step k is its chunks' upload, step and download on the device, and write k waits for the downloads.

[Note: narrow state on file]
With `precision.optimizer_state` bf16 or 8bit ([Note: narrow optimizer state] in zerofit.engine.state_codec) a
state region holds the stored form, as the state entries do: `shard_numel` codes (2 or 1 bytes each, the
region rounded up to 4 bytes) and, 8-bit, right after them the fp32 absmax of each block of 16 of the shard,
which the pieces' `K + ".absmax"` entries view at `offset // 16` (pieces start at multiples of 16 of the
shard). So the file, the slots and the reads and writes shrink with the state: GPT-2 XL's Adam state at 8 bits
is 2.5 bytes per element on file instead of 8. Regions are laid out in bytes; each tensor is bound to the
slot's storage at its byte offset divided by its element size.

[Note: NVMe residency]
An offloaded group is in exactly one of three states, and its tensors say which:
- *on file*: `g.master`, its optimizer pieces and their 1-D state tensors are zero-element tensors
  (so a stray read fails loudly instead of reading garbage); the file holds the values;
- *in a slot*: bound (`Tensor.set_`) to one buffer of the bounded pool, only between `swap_in` and
  the end of its `swap_out` write; the stepper thread (host-stepped) or the issuing thread
  (GPU-stepped: the device reads and writes the slot until the group's downloads are done) owns it,
  then the I/O thread that writes it;
- *materialised*: bound to a private temporary buffer, for inspection and checkpoints
  (`materialize`), until the next step writes it back (`evict_materialized`). This is the one time
  a whole rank's state is in host memory at once; training never does it.
Rebinding with `set_` keeps every tensor object (the keys of `optimizer.state`, the entries of the
param groups) alive and identical, so the optimizer, schedulers and checkpoints never notice.
A slot goes back to the pool only after its write succeeded: a failed write leaves the group bound
to its slot, so the file is never the only copy of values it does not hold; it also fails the pool, so
every later read raises instead of waiting for a slot that will not come back.

I/O is plain `os.preadv`/`os.pwritev` into the slots (pinned when CUDA, so uploads are DMA):
`torch.from_file`/`numpy.memmap` would make the page cache the buffer - unpinnable, faulted in at
unpredictable times, and unbounded - whereas explicit reads into a fixed pool keep host memory
bounded and the copies asynchronous. The files are preallocated at start (ENOSPC shows up at
`prepare()`, not at step 10 000) and removed when the engine is collected or the process exits.

[Note: swap file checksum]
The files are zerofit's alone, but nothing stops another process (a second job given the same
nvme_path, a cleanup script) from truncating or overwriting one. A truncated file would fail the read
deep in a worker thread; an overwritten one would be read as master weights and optimizer state, and
the next loss and every weight would silently become NaN - or, with finite garbage, just wrong. So every
write records the CRC-32 of the bytes it wrote (`_Swapped.crc`, computed chunk by chunk as `_io` moves
them, while they are in cache) and every read checks it before the values are bound to the group; either
failure is an EngineError naming the file, nvme_path and the fix (`SwapFileChanged`). zlib's CRC-32
releases the GIL and runs on the I/O threads, overlapped with the step: measured 160-185 ms per GiB on
one core of an AMD EPYC (5.4-6.2 GiB/s, about what one NVMe drive reads), paid once per write and once
per read. A plain sum over an int64 view is cheaper (32-64 ms per GiB on two threads) but misses blocks
that moved, and zeroed blocks whose values summed to zero.

[Note: GPU-stepped offload from NVMe]
With `offload_optimizer.device: nvme` a group's master and state live in its file (`NvmeSwapper`, see
[Note: NVMe residency]), and host memory holds only the swapper's pool of pinned slots. Per group,
on the issuing thread:
  swap_in   block until the group's file is read into a slot; master, pieces and state are bound to it
            (later groups' reads are already under way on the I/O threads)
  issue     the chunks as above: uploads read the slot, downloads write it back
  swap_out  hand the slot to an I/O thread, which waits for the group's last download event, then
            writes the slot to the file and returns it to the pool
so reads of the next groups, the device work of this one and the writes of earlier ones overlap. The
pool cannot deadlock: a write waits only for the device, which never waits for the host, and the
swapper reads at most one group fewer ahead than it has slots (its FIFO argument). A checkpoint's
`settle(state=True)` waits for the writes and materialises every group in host memory; the next
`step()` writes them back (`evict_materialized`) before any group is read.

[Note: saving from NVMe]
Materialising every group at once needs a rank's whole master and state in host memory (12 bytes a
parameter with fp32 Adam state, 6.5 with 8-bit): the memory NVMe was chosen to avoid, so a model sized for
NVMe could train but not be checkpointed. A checkpoint's save reads the groups one at a time instead
(`one_at_a_time`, `readable`; `ZeroEngine.state_by_group`): each group's file is read into a buffer of its
size, its tensors written into the checkpoint (each group its own file of the rank's, see
zerofit.checkpoint.sharded), and the group goes back on file without a write - the save only read it. A
load does the same, group by group, and writes each group's file once its values are read in. The host
memory a save or a load needs is then the largest group's, as a step's.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import tempfile
import threading
import weakref
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.offload.stored_homes import SCALE_SUFFIX, is_scale_key
from zerofit.engine.state_codec import BLOCK, Codec, blocks
from zerofit.errors import EngineError

_KEY = "zero_optimization.offload_optimizer"
_MARGIN_BYTES = 64 << 20  # filesystem metadata and other tenants of the disk
_MARGIN_FRACTION = 0.05
_STATE_TENSORS = {"Adagrad": 1, "ASGD": 1, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Rprop": 2}
"""Shard-sized state tensors per parameter of torch's other elementwise optimizers."""


def planned_state_tensors(optimizer: torch.optim.Optimizer) -> int:
    """How many shard-sized state tensors `optimizer` keeps per parameter (sizes the files up front)."""
    name = type(optimizer).__name__
    groups = optimizer.param_groups
    if name in ("Adam", "AdamW"):
        return 2 + int(any(g.get("amsgrad") for g in groups))
    if name == "SGD":
        return int(any(g.get("momentum", 0) for g in groups))
    if name == "RMSprop":
        return 1 + int(any(g.get("momentum", 0) for g in groups)) + int(any(g.get("centered") for g in groups))
    # unknown elementwise optimizers are taken as Adam-like; more is refused at the first swap-out
    return _STATE_TENSORS.get(name, 2)


def state_region_bytes(n: int, codec: Codec) -> int:
    """Bytes of one state key's region of a file of `n`-element shards: the codes, rounded up to 4 bytes, then
    the 8-bit block scales (see [Note: narrow state on file]; fp32: `n` * 4, as before)."""
    codes = -(-n * codec.code_dtype.itemsize // 4) * 4
    return codes + (blocks(n) * 4 if codec.scaled else 0)


def planned_bytes(groups: list[FlatGroup], state_tensors: int, codec: Codec | None = None) -> int:
    codec = codec or Codec()
    return sum(g.layout.shard_numel * 4 + state_tensors * state_region_bytes(g.layout.shard_numel, codec)
               for g in groups)


def preflight_error(path: str | None, need_bytes: int, rank: int, *, key: str = f"{_KEY}.nvme_path",
                    who: str | None = None) -> str | None:
    """Why `path` cannot hold `need_bytes` of swap files for `rank` (None: it can). `key` is the setting as the
    user's file spells it, `who` the one that checks (default: the rank)."""
    where, who = key, who or f"rank {rank}"
    if not path:
        return f"{_KEY}.device is 'nvme' but {where} is not set: set it to a directory on a fast local disk"
    if not os.path.exists(path):
        return f"{where} '{path}' does not exist ({who}): create the directory or point {where} at one"
    if not os.path.isdir(path):
        return f"{where} '{path}' is not a directory ({who}): point {where} at a directory"
    probe = os.path.join(path, f".zerofit-probe-{rank}-{os.getpid()}")
    try:  # os.access is not enough: root, read-only mounts and ACLs all disagree with mode bits
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"zerofit")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return (f"{where} '{path}' is not writable by {who} ({e.strerror or e}): make it writable "
                f"(chmod/chown) or point {where} at a writable directory")
    free = shutil.disk_usage(path).free
    want = need_bytes + max(_MARGIN_BYTES, int(need_bytes * _MARGIN_FRACTION))
    if free < want:
        return (f"{where} '{path}' has {free / 2**30:.2f} GiB free but {who} needs {want / 2**30:.2f} GiB "
                f"({need_bytes} bytes of optimizer state and master weights plus margin): free space there, "
                f"point {where} at a larger disk, or lower offload_optimizer.ratio")
    return None


def preflight(path: str | None, need_bytes: int, comm) -> None:
    """Check `path` on every rank; raise EngineError on every rank if any rank failed (none hangs)."""
    # Ranks of a node share the disk: each checks room for all of its node's files.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    error = preflight_error(path, need_bytes * local, comm.rank)
    failed = torch.tensor([0.0 if error is None else 1.0], device=comm.device)
    comm.all_reduce_now(failed, "nvme_preflight")
    if error is not None:
        raise EngineError(error)
    if failed.item():
        raise EngineError(f"{_KEY}.nvme_path '{path}' failed the NVMe preflight on {int(failed.item())} other "
                          f"rank(s) (rank {comm.rank} passed): see their errors")


class _IOThreads:
    """A few daemon threads running file reads and writes in submission order.

    Not a ThreadPoolExecutor: its threads are joined at interpreter exit, and a read waiting for a
    slot that a failed step never returns would then hang the exit.
    """

    def __init__(self, n: int):
        self._queue: queue.Queue = queue.Queue()
        self._n = n
        for i in range(n):
            threading.Thread(target=self._run, name=f"zerofit-nvme-io-{i}", daemon=True).start()

    def close(self) -> None:
        for _ in range(self._n):
            self._queue.put(None)

    def submit(self, fn, *args) -> Future:
        self._queue.put((fut := Future(), fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - surfaced to whoever waits on the future
                fut.set_exception(e)


class BufferPool:
    """At most `count` fp32 host buffers of `capacity` elements, allocated on first use, reused after."""

    def __init__(self, count: int, capacity: int, pin: bool):
        self.count, self.capacity, self.pin = count, capacity, pin
        self.allocated = 0
        self._free: list[torch.Tensor] = []
        self._cond = threading.Condition()
        self._failed: BaseException | None = None

    def acquire(self) -> torch.Tensor:
        with self._cond:
            while not self._free and self.allocated >= self.count and self._failed is None:
                self._cond.wait()
            if self._failed is not None:
                raise EngineError(f"an NVMe write failed ({self._failed}), so its buffer never returns to the pool: "
                                  f"check the disk under {_KEY}.nvme_path and resume from the last checkpoint"
                                  ) from self._failed
            if self._free:
                return self._free.pop()
            self.allocated += 1
        return torch.empty(self.capacity, dtype=torch.float32, pin_memory=self.pin)

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def fail(self, error: BaseException) -> None:
        """A buffer is kept by a failed write: every acquire raises from now on (a dead disk fails every
        write, and a read waiting for their buffers would wait forever)."""
        with self._cond:
            self._failed = error
            self._cond.notify_all()


@dataclass
class _Swapped:
    """One offloaded group's file and the tensor objects its values are bound into."""

    fd: int
    path: str
    n: int
    region: int
    """Bytes of each state key's region (`state_region_bytes`)."""
    master: torch.Tensor
    """The group's `master` (the tensor object, not the group: see HostStepper._run)."""
    pieces: list  # (layout piece, the optimizer's master-piece tensor)
    keys: list[str] = field(default_factory=list)
    """State keys stored in the file, in region order (append-only: regions never move)."""
    slot: torch.Tensor | None = None
    temp: torch.Tensor | None = None
    read: Future | None = None
    write: Future | None = None
    crc: int = 0
    """CRC-32 of the file's first `numel` elements as last written (see [Note: swap file checksum])."""

    @property
    def numel(self) -> int:
        """fp32 elements of the file's used part (the slot's length)."""
        return (self.n * 4 + len(self.keys) * self.region) // 4


class _ShortRead(OSError):
    """The file ended before the bytes zerofit wrote there: something else truncated it."""


def _io(fn, fd: int, t: torch.Tensor, offset: int, chunk: int) -> int:
    """Move `t`'s bytes (contiguous, CPU) to or from file offset `offset`, in `chunk`-byte requests;
    returns the CRC-32 of the bytes moved (see [Note: swap file checksum])."""
    view = memoryview(t.numpy()).cast("B")
    pos, crc = 0, 0
    while pos < len(view):
        done = fn(fd, [view[pos:pos + chunk]], offset + pos)
        if done <= 0:
            if fn is os.preadv:
                raise _ShortRead(f"short read at byte {offset + pos}")
            raise OSError(f"short write at byte {offset + pos} of fd {fd}")
        crc = zlib.crc32(view[pos:pos + done], crc)
        pos += done
    return crc


class SwapFileChanged(EngineError):
    """A swap file does not hold what zerofit wrote to it (see [Note: swap file checksum])."""

    def __init__(self, path: str, problem: str, nvme_path: str, rank: int):
        super().__init__(f"NVMe swap file {path!r} {problem}: something outside zerofit changed it (rank {rank}). "
                         f"Point {_KEY}.nvme_path (now {nvme_path!r}) at a directory no other process writes, and "
                         "restart from the last checkpoint")


def _cleanup(io_dir: str, fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    shutil.rmtree(io_dir, ignore_errors=True)


class NvmeSwapper:
    """Moves offloaded groups between their files and a bounded buffer pool (see [Note: NVMe residency])."""

    def __init__(self, groups: list[FlatGroup], optimizer: torch.optim.Optimizer, offload, aio, comm,
                 device: torch.device, codec: Codec | None = None):
        """`codec`: how the optimizer state is stored (see [Note: narrow state on file])."""
        if offload.buffer_count < 2:
            raise EngineError(f"{_KEY}.buffer_count must be >= 2 for NVMe offload (got {offload.buffer_count}): "
                              "one group steps while the next is read; set it to 2 or more (default 4)")
        self.optimizer = optimizer
        self.codec = codec or Codec()
        self.rank, self.nvme_path = comm.rank, offload.nvme_path
        self.state_tensors = planned_state_tensors(optimizer)
        preflight(offload.nvme_path, planned_bytes(groups, self.state_tensors, self.codec), comm)
        # unique per engine: several engines of one process (tests, evaluation copies) never collide
        self.dir = tempfile.mkdtemp(prefix=f"zerofit-rank{comm.rank}-{os.getpid()}-", dir=offload.nvme_path)
        self._chunk = max(1, aio.block_size) * max(1, aio.queue_depth)
        fds: list[int] = []
        self._finalizer = weakref.finalize(self, _cleanup, self.dir, fds)
        self._info: dict[int, _Swapped] = {}
        by_ptr = {t.data_ptr(): t for pg in optimizer.param_groups for t in pg["params"]}
        for i, g in enumerate(groups):
            path = os.path.join(self.dir, f"group-{i:05d}.bin")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            fds.append(fd)
            n = g.layout.shard_numel
            region = state_region_bytes(n, self.codec)
            if n:  # reserve the blocks now: no ENOSPC in the middle of training
                os.posix_fallocate(fd, 0, n * 4 + self.state_tensors * region)
            pieces = [(p, by_ptr[g.master[p.shard_offset:].data_ptr()]) for p in g.layout.pieces(g.placement.rank)]
            assert not self.codec.scaled or all(p.shard_offset % BLOCK == 0 for p, _ in pieces), \
                "8-bit state on file: a piece starts off a block boundary of its shard"
            info = self._info[id(g)] = _Swapped(fd=fd, path=path, n=n, region=region, master=g.master, pieces=pieces)
            info.crc = _io(os.pwritev, fd, g.master, 0, self._chunk)  # the initial master; no state exists yet
            self._bind(info, None)
        self._infos = list(self._info.values())
        capacity = max(((i.n * 4 + self.state_tensors * i.region) // 4 for i in self._infos), default=0)
        pin = device.type == "cuda" and offload.pin_memory
        self.pool = BufferPool(min(offload.buffer_count, max(1, len(self._infos))), capacity, pin)
        self.ahead = self.pool.count - 1
        """Groups read ahead of the one stepping: one slot short of the pool, so a read only ever
        waits for a slot that an earlier-submitted write frees (no deadlock with FIFO I/O threads)."""
        self._io = _IOThreads(max(2, aio.thread_count))  # at least one read and one write at a time
        self._lock = threading.Lock()
        self._order: list[_Swapped] = []  # this step's groups, in stepping order
        self._fetched = 0  # how many of them have their read submitted
        self._one_at_a_time = False
        """`materialize` leaves the groups on file; readers take one at a time (`readable`: a checkpoint's save)."""
        if pin and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # the construction-time pinned masters: give them back now

    # --- binding ------------------------------------------------------------------------------
    def _targets(self, info: _Swapped):
        """(tensor, byte offset in the group's file, numel) for the master, pieces and their state (codes, and
        8-bit block scales after each key's codes: see [Note: narrow state on file])."""
        yield info.master, 0, info.n
        size = self.codec.code_dtype.itemsize
        for piece, t in info.pieces:
            yield t, piece.shard_offset * 4, piece.length
            state = self.optimizer.state.get(t, {})
            for i, key in enumerate(info.keys):
                base = info.n * 4 + i * info.region
                v = state.get(key)
                if isinstance(v, torch.Tensor) and v.ndim == 1:
                    yield v, base + piece.shard_offset * size, piece.length
                scale = state.get(key + SCALE_SUFFIX) if self.codec.scaled else None
                if isinstance(scale, torch.Tensor) and scale.ndim == 1:
                    scales_at = base + info.region - blocks(info.n) * 4
                    yield scale, scales_at + piece.shard_offset // BLOCK * 4, blocks(piece.length)

    @torch.no_grad()
    def _bind(self, info: _Swapped, flat: torch.Tensor | None) -> None:
        """Point every tensor of the group into `flat` (None: at zero-element storage, i.e. on file)."""
        for t, off, length in list(self._targets(info)):
            if flat is None:
                t.set_(torch.empty(0, dtype=t.dtype).untyped_storage())
            else:
                t.set_(flat.untyped_storage(), (flat.storage_offset() * 4 + off) // t.element_size(), (length,), (1,))

    @torch.no_grad()
    def _collect(self, info: _Swapped, flat: torch.Tensor) -> None:
        """Make `flat` hold the group's current values: adopt state the optimizer created (its first
        step, a checkpoint load) and copy in whatever is not already bound there."""
        stored = self.codec.code_dtype
        for _, t in info.pieces:
            for key, v in self.optimizer.state.get(t, {}).items():
                if (isinstance(v, torch.Tensor) and v.ndim == 1 and v.numel() == t.numel() and key not in info.keys
                        and not is_scale_key(key)):
                    if v.dtype != stored or len(info.keys) >= self.state_tensors:
                        raise EngineError(
                            f"NVMe offload planned {self.state_tensors} state tensor(s) per parameter stored as "
                            f"{stored} for {type(self.optimizer).__name__}, but it keeps '{key}' ({v.dtype}) too: "
                            f"use {_KEY}.device 'cpu' for this optimizer")
                    info.keys.append(key)
        raw = flat.view(torch.uint8)
        for t, off, length in list(self._targets(info)):
            region = raw[off:off + length * t.element_size()].view(t.dtype)
            if t.numel() == length and t.data_ptr() != region.data_ptr():
                region.copy_(t)

    # --- the step path (stepper / issuing thread) ------------------------------------------------
    def schedule(self, groups: list[FlatGroup]) -> None:
        """The groups about to be stepped, in order: start reading the first ones."""
        with self._lock:
            self._order, self._fetched = [self._info[id(g)] for g in groups], 0
            self._fetch_through(self.ahead)

    def _fetch_through(self, last: int) -> None:
        while self._fetched <= min(last, len(self._order) - 1):
            info = self._order[self._fetched]
            info.read = self._io.submit(self._read, info, info.write)
            self._fetched += 1

    def _read(self, info: _Swapped, write: Future | None) -> torch.Tensor:
        if write is not None:
            write.result()  # the file must hold the last step's values before they are read back
        slot = self.pool.acquire()
        try:
            self._read_checked(info, slot[:info.numel])
        except BaseException:
            self.pool.release(slot)
            raise
        return slot

    def _read_checked(self, info: _Swapped, buf: torch.Tensor) -> None:
        """Fill `buf` from `info`'s file; SwapFileChanged unless it holds exactly what was last written."""
        try:
            crc = _io(os.preadv, info.fd, buf, 0, self._chunk)
        except _ShortRead as e:
            raise SwapFileChanged(info.path, f"is shorter than zerofit wrote it ({e}, of {buf.numel() * 4} bytes)",
                                  self.nvme_path, self.rank) from None
        except OSError as e:
            raise EngineError(f"NVMe swap file {info.path!r} cannot be read ({e.strerror or e}) on rank {self.rank}: "
                              f"check the disk under {_KEY}.nvme_path and restart from the last checkpoint") from e
        if crc != info.crc:
            raise SwapFileChanged(info.path, f"no longer holds what zerofit wrote to it (CRC-32 {crc:08x}, written "
                                  f"{info.crc:08x})", self.nvme_path, self.rank)

    def swap_in(self, g: FlatGroup) -> None:
        """Block until `g` is in a slot and bound to it; start reading the groups after it."""
        info = self._info[id(g)]
        with self._lock:
            if info.read is None:  # not scheduled (defensive): read it now
                info.read = self._io.submit(self._read, info, info.write)
            position = next((i for i, o in enumerate(self._order) if o is info), len(self._order))
            self._fetch_through(position + self.ahead)
        read, info.read = info.read, None
        info.slot = read.result()
        self._bind(info, info.slot)

    def swap_out(self, g: FlatGroup, uploaded=None, ready=None) -> None:
        """Write `g` back in the background; its slot returns to the pool once the write succeeded
        and `uploaded` (the event of the parameter upload that reads the slot) has completed.

        `ready`: the event after which the device no longer writes the slot (a GPU-stepped group's last
        download; None: the values are final now). The group stays bound to its slot until the I/O
        thread has waited for it, gathered the values and written them (see [Note: NVMe residency])."""
        info = self._info[id(g)]
        info.write = self._io.submit(self._write, info, info.slot, ready, uploaded)

    def _write(self, info: _Swapped, slot: torch.Tensor, ready, uploaded) -> None:
        if ready is not None:
            ready.synchronize()  # downloads into the slot (and uploads from it) are done
        try:
            self._collect(info, slot)
            info.crc = _io(os.pwritev, info.fd, slot[:info.numel], 0, self._chunk)
        except BaseException as e:
            self.pool.fail(e)  # the group stays bound to its slot: the file may now be half-written
            raise
        self._bind(info, None)
        if uploaded is not None:
            uploaded.synchronize()  # the upload reads the slot; it must finish before the slot is reused
        info.slot = None
        self.pool.release(slot)

    def flush(self) -> None:
        """Wait for every write in flight; raise the first failure."""
        for info in self._info.values():
            if info.write is not None:
                info.write.result()

    # --- inspection and checkpoints (main thread, stepper idle) --------------------------------
    def materialize(self) -> None:
        """Bind every group to a temporary buffer holding its file's values (idempotent); inside
        `one_at_a_time`, only wait for the writes."""
        self.flush()
        if self._one_at_a_time:
            return
        for info in self._infos:
            self._materialize(info)

    def _materialize(self, info: _Swapped) -> None:
        if info.temp is None and info.slot is None:
            info.temp = torch.empty(info.numel, dtype=torch.float32)
            try:
                self._read_checked(info, info.temp)
            except EngineError:
                info.temp = None  # still on file: nothing was bound to the bad values
                raise
            self._bind(info, info.temp)
        for _, t in info.pieces:  # state a checkpoint load created while the group was on file
            for k, v in self.optimizer.state.get(t, {}).items():
                if isinstance(v, torch.Tensor) and v.ndim == 1 and v.numel() == 0:
                    want = blocks(t.numel()) if is_scale_key(k) else t.numel()
                    v.set_(torch.zeros(want, dtype=v.dtype).untyped_storage())

    @contextlib.contextmanager
    def one_at_a_time(self):
        """While open, `materialize` (a reader's settle) leaves every group on file and `readable` brings one
        group into host memory at a time (see [Note: saving from NVMe])."""
        self._one_at_a_time = True
        try:
            yield
        finally:
            self._one_at_a_time = False

    def holds(self, g: FlatGroup) -> bool:
        return id(g) in self._info

    @contextlib.contextmanager
    def readable(self, g: FlatGroup, *, write: bool = False):
        """`g`'s master and state in host memory, then back on file: written there with `write` (a checkpoint's
        load changed them), else without a write (the file still holds these values). A group already
        materialised stays so."""
        info = self._info[id(g)]
        if info.temp is not None or info.slot is not None:
            yield
            return
        self._materialize(info)
        try:
            yield
        finally:
            if write:
                self._evict(info)
            else:
                self._bind(info, None)
                info.temp = None

    def evict_materialized(self) -> None:
        """Write materialised groups back to their files and drop their buffers (before a step)."""
        for info in self._infos:
            if info.temp is not None:
                self._evict(info)

    def _evict(self, info: _Swapped) -> None:
        slot = self.pool.acquire()
        try:
            self._collect(info, slot)
            info.crc = _io(os.pwritev, info.fd, slot[:info.numel], 0, self._chunk)
        finally:
            self.pool.release(slot)
        self._bind(info, None)
        info.temp = None

    def resident(self) -> int:
        """How many groups have their master in host memory right now (in a slot or materialised)."""
        return sum(info.master.numel() > 0 for info in self._infos)

    def close(self) -> None:
        """Remove the swap files and stop the I/O threads (the engine does it when it is collected; at
        process exit the files go in any case)."""
        try:
            self.flush()  # a write in flight must not land in a file being removed
        except BaseException:  # noqa: BLE001 - the files are scratch; removing them is all that is left
            pass
        self._io.close()
        self._finalizer()
