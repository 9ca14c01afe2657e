"""The host master of a GPU-stepped group kept packed between steps: 2.125 bytes per element instead of 4.

[Note: packed master at rest]
A GPU-stepped group whose master travels split ([Note: split master] in zerofit.engine.offload.master_split)
never needs its fp32 master in host memory during training: each step uploads the low halves and carries,
rebuilds the master on the device from the bf16 parameter there, steps, and downloads the new low halves and
carries. So the group keeps its packed form in a page-locked home of its own (`home`: the shard's n low halves,
then its n carries, eight to a byte), and its fp32 host master `g.master` holds no memory: its pages are given
back to the system (`release_pages`, madvise(MADV_DONTNEED)) and read as zeros until something writes them.
The master tensor itself stays - same address, same size - so the optimizer's pieces (views of it, the keys of
its state) and every lookup by address keep working; only its contents are absent. For the largest model a
box trains this is the host memory that decides: AdamW with 8-bit state then keeps 2.125 + 2.5 bytes per
element in host memory instead of 4 + 2.5.

A group is in one of two forms, and `packed` says which:
- packed: the home holds the master (with the parameter on the device); `g.master` has no pages. Each step
  uploads from the home and downloads into it.
- fp32: `g.master` holds the master (a reader joined it, a checkpoint load wrote it); the next step uploads it
  whole, downloads the packed form into the home, and gives the pages back once the uploads are done.
Readers go through `join_all` (`settle(state=True)`: every group at once, for inspection) or `readable` (one
group at a time: checkpoints and exports, `ZeroEngine.state_by_group`); a reader that writes (a load) leaves
the group packed again from the values it wrote.

Built from the fp32 master when the engine builds the group (`pack`), one group at a time, so no moment holds
every group's fp32 master in host memory either.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys

import torch

from zerofit.engine.offload import master_split
from zerofit.engine.pinned import pinned_empty

PIECE = 1 << 24
"""Elements packed or joined at a time on the host (bounds the scratch and the parameter's host copy)."""
_PAGE = 4096
_MADV_DONTNEED = 4


def home_bytes(n: int) -> int:
    """Bytes of a shard of `n` elements in packed form: low halves, then carries."""
    return master_split.packed_bytes(n)


def low(home: torch.Tensor, n: int, start: int, length: int) -> torch.Tensor:
    """The low halves of elements [start, start + length) of a shard of `n` in `home` (uint8, 2 per element)."""
    return home[2 * start:2 * (start + length)]


def carries(home: torch.Tensor, n: int, start: int, length: int) -> torch.Tensor:
    """The carries of elements [start, start + length) (`start` a multiple of 8: a byte holds 8 elements')."""
    assert start % 8 == 0, "a chunk of a packed master starts off a carry byte"
    return home[2 * n + start // 8:2 * n + -(-(start + length) // 8)]


def pack(master: torch.Tensor, param: torch.Tensor, *, pin: bool) -> torch.Tensor:
    """The packed home of `master` (fp32, host) whose rounding is `param` (compute dtype, any device)."""
    n = master.numel()
    home = pinned_empty(home_bytes(n), torch.uint8) if pin else torch.empty(home_bytes(n), dtype=torch.uint8)
    pack_into(home, master, param)
    return home


def pack_into(home: torch.Tensor, master: torch.Tensor, param: torch.Tensor) -> None:
    """Write `master`'s packed form into its `home`, a piece at a time."""
    n = master.numel()
    scratch = torch.empty(master_split.scratch_bytes(min(n, PIECE)), dtype=torch.uint8)
    for s in range(0, n, PIECE):
        m = min(PIECE, n - s)
        master_split.split_parts(master[s:s + m], param[s:s + m].to("cpu"), low(home, n, s, m),
                                 carries(home, n, s, m), scratch)


def unpack(home: torch.Tensor, param: torch.Tensor, master: torch.Tensor) -> None:
    """Write the master packed in `home` into `master` (fp32, host), from its rounding `param`."""
    n = master.numel()
    scratch = torch.empty(master_split.scratch_bytes(min(n, PIECE)), dtype=torch.uint8)
    for s in range(0, n, PIECE):
        m = min(PIECE, n - s)
        master_split.join_parts(low(home, n, s, m), carries(home, n, s, m), param[s:s + m].to("cpu"),
                                master[s:s + m], scratch)


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # pragma: no cover - no libc to ask: the pages stay (correct, just not smaller)
        return None
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise


_MADVISE = _madvise()


def release_pages(t: torch.Tensor) -> None:
    """Give the whole pages under host tensor `t` back to the system; they read as zeros until written. A no-op
    where the system cannot (not Linux): the contents are then stale, never read before they are written."""
    if _MADVISE is None or t.numel() == 0:
        return
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
    first, last = -(-begin // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if last > first:
        _MADVISE(first, last - first, _MADV_DONTNEED)


class PackedMasters:
    """The packed homes of a GPU-stepped part's split groups (`FlatGroup`s: not imported here, the group module
    packs through this one), and which form each group is in (module note)."""

    def __init__(self, groups: list):
        """`groups`: packed when the engine built them (`FlatGroup(packed_master=True)`)."""
        self.groups = {id(g): g for g in groups}
        self.packed: set[int] = set(self.groups)
        """Groups whose home holds the master (their `g.master` has no pages)."""
        self._one_at_a_time = False

    def holds(self, g) -> bool:
        return id(g) in self.groups

    def stepped(self, g, uploaded) -> None:
        """A step that uploaded `g`'s fp32 master (`g` was not packed) downloaded its packed form into its home
        (issuing thread): the master's pages go back once `uploaded` (the event after its uploads; None: done)."""
        if uploaded is not None:
            uploaded.synchronize()  # once per read of the group, not per step
        release_pages(g.master)
        self.packed.add(id(g))

    def join(self, g) -> None:
        """`g.master` holds the fp32 master from here on (main thread, the group's downloads done)."""
        if id(g) in self.packed:
            unpack(g.packed_master, g.param_shard, g.master)
            self.packed.discard(id(g))

    def join_all(self) -> None:
        """Every group in fp32 (`settle(state=True)`), unless readers take one group at a time."""
        if not self._one_at_a_time:
            for g in self.groups.values():
                self.join(g)

    @contextlib.contextmanager
    def one_at_a_time(self):
        """While open, `join_all` leaves the groups packed and `readable` joins one at a time."""
        self._one_at_a_time = True
        try:
            yield
        finally:
            self._one_at_a_time = False

    @contextlib.contextmanager
    def readable(self, g, *, write: bool = False):
        """`g.master` in fp32 while open, then packed again (`write`: from the values written, whose rounding the
        reader published into the parameter, as a load does). A group already in fp32 stays so."""
        if id(g) not in self.packed:
            yield
            return
        self.join(g)
        try:
            yield
        finally:
            if write:
                pack_into(g.packed_master, g.master, g.param_shard)
            release_pages(g.master)
            self.packed.add(id(g))
