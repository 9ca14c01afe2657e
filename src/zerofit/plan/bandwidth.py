"""The machine's offload rates (pinned copies each way, CPU and GPU AdamW, host memory) and the time model on them.

Offloaded optimizer state is stepped one of two ways (`offload_optimizer.step_on`): on the host
(CPU fused AdamW; the gradient goes down, the updated compute-dtype parameter comes up) or on the
device (fp32 master and optimizer state streamed up in chunks, stepped by the fused CUDA kernel,
streamed back). Which is faster, and whether a split of the two beats both, depends on the machine's
PCIe link and CPU, so the rates are measured once (`measure`, a few seconds on the GPU), cached per
(host, GPU name, torch version) in `bandwidth.json` (`probe`, `cached`), and the planner reads them
through the pure functions at the end of this file.

[Note: offload time model]
Per offloaded parameter, with k optimizer state tensors (AdamW: 2), G gradient bytes and P parameter
bytes on the host path (fp32 gradient 4 or bf16 2; compute-dtype parameter 2), B = both_gbs * 1e9
bytes/s each way, and times in seconds for n parameters:

    streamed   T_s(n)      = max((M + 4k) n / B,  gpu_adam_s n / 1e9)
    host       T_h(n)      = max(c n / 1e9,     max(G, P) n / B')      c = cpu_adam_s, or cpu_adam_busy_s when busy
    split      T(n_s, n_h) = max(cpu_adam_busy_s n_h / 1e9,  max(down, up) / B',  gpu_adam_s n_s / 1e9)
                             down = (M + 4k) n_s + G n_h,   up = (M + 4k) n_s + P n_h

with M the master's bytes on the link: 4, or 2.125 where it travels split (bf16 parameters on the GPU:
low halves and carries, zerofit.engine.offload.master_split).

B' = both_busy_gbs * 1e9: the link each way while the CPU steps (B where not measured). Host memory
bandwidth is shared: on the H200 box the link falls from about 50 to about 33-36 GB/s each way while
fused CPU AdamW runs, which is what makes a split pay less there than B alone would say
(benchmarks/results/split_gpt2xl_h200.md: no split 0.450 s, 35 % on the CPU 0.451 s, 55 % 0.479 s).

Streamed: master plus k state tensors go up and come back (no gradient or parameter copies), and the
kernel steps chunks already up while others move, so the longer of the two is the time. Host: the
copies of one unit overlap the CPU step of another. Split: both parts run at once; the CPU serves the
host part only, at the rate it keeps while copies run both ways; the link carries both parts' bytes
at the rate it keeps while the CPU steps. So T(n, 0) = T_s(n) and T(0, n) = T_h(n, busy=True). Both
directions' rate is used because in all three ways copies run both ways at once (pipelined over units).
Left out: launch and per-chunk
synchronisation overheads, the forward that overlaps the step in both paths, and host memory
bandwidth shared beyond what the busy rate saw. Without a busy rate (not measured cleanly, see
`measure`) the alone rate stands in for it, which favours host stepping.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

import torch

from zerofit.config.files import BadFile, load
from zerofit.engine.offload import master_split
from zerofit.engine.pinned import pinned_empty
from zerofit.logging import get_logger

logger = get_logger(__name__)

GB = 1e9
"""Rates are in GB/s of 1e9 bytes and in seconds per 1e9 parameters."""
COPY_BYTES = 256 * 2**20
"""One timed copy: big enough to reach the link's steady rate, small enough to time in milliseconds."""
CPU_ADAM_NUMEL = 2**25
"""Parameters of the CPU AdamW probe (32 Mi, 512 MiB of fp32 state): far past every cache, as real shards are."""
GPU_ADAM_NUMEL = 2**25
TRIALS = 5
"""Timed repeats of each measurement after one warm-up; the median is kept."""
COPIES_PER_TRIAL = 4
GPU_STEPS_PER_TRIAL = 4
GEMM_SHAPE = (4096, 4096, 4096)
"""(tokens, in features, out features) of the timed bf16 matrix product: a micro-batch of 8 x 512 tokens
through a 4096-wide projection, the size of the layers fine-tuned on one GPU."""
HOST_COPY_BYTES = 2**30
"""One timed host memory copy: past the largest CPU caches (about 1 GiB of L3 on the largest server parts)."""
MAX_BUSY_COPY_S = 3.0
"""The longest the copies behind the busy CPU measurement may run; past it that rate is not measured."""

CACHE_FILE = "bandwidth.json"
CACHE_FORMAT = 1
MAX_CACHE_BYTES = 1 << 20
MAX_CACHE_ENTRIES = 32
"""Entries kept (newest last): one per (host, GPU, torch version) ever probed from this cache directory."""


@dataclass(frozen=True)
class Rates:
    """One machine's measured offload rates and what they were measured on."""

    h2d_gbs: float
    """Host to device, GB/s, pinned memory, that direction alone."""
    d2h_gbs: float
    """Device to host, GB/s, pinned memory, that direction alone."""
    both_gbs: float
    """Each way, GB/s, while both directions run at once on two streams."""
    cpu_adam_s: float
    """Seconds per 1e9 parameters of torch's fused AdamW on CPU fp32 tensors, nothing else running."""
    cpu_adam_busy_s: float | None
    """The same while pinned copies run both ways; None where the probe could not keep the copies going
    for the whole measurement (nothing is derived in its place)."""
    gpu_adam_s: float
    """Seconds per 1e9 parameters of the fused CUDA AdamW kernel, state resident on the GPU."""
    device_name: str
    torch_version: str
    host: str
    cpus: int
    """CPUs this process may run on when measured (its CPU AdamW ran on as many threads)."""
    measured_at: str
    """ISO 8601 time, UTC."""
    both_busy_gbs: float | None = None
    """Each way, GB/s, both directions at once while the CPU runs fused AdamW: host memory is shared, so
    the link slows while the CPU steps (None: not measured)."""
    gpu_tflops: float | None = None
    """Tera-FLOP/s of a bf16 matrix product of a fine-tuning layer's shape (`GEMM_SHAPE`): what a recomputed
    forward runs at, for the planner's price of activation checkpointing (None: measured by an older zerofit)."""
    host_copy_gbs: float | None = None
    """GB/s of host memory traffic (bytes read plus bytes written) of a copy between two pageable CPU tensors
    far past every cache, on every usable CPU: what the processes of a host share ([Note: rates shared on
    one host]; None: measured by an older zerofit)."""

    def __post_init__(self):
        for name in ("h2d_gbs", "d2h_gbs", "both_gbs", "cpu_adam_s", "cpu_adam_busy_s", "gpu_adam_s",
                     "both_busy_gbs", "gpu_tflops", "host_copy_gbs"):
            value = getattr(self, name)
            if value is None and name in ("cpu_adam_busy_s", "both_busy_gbs", "gpu_tflops", "host_copy_gbs"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"Rates.{name} must be a finite number > 0 (got {value!r})")
            object.__setattr__(self, name, float(value))
        for name in ("device_name", "torch_version", "host", "measured_at"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"Rates.{name} must be a non-empty string (got {getattr(self, name)!r})")
        if isinstance(self.cpus, bool) or not isinstance(self.cpus, int) or self.cpus < 1:
            raise ValueError(f"Rates.cpus must be an integer >= 1 (got {self.cpus!r})")

    @property
    def current(self) -> bool:
        """Every rate this zerofit measures is here (an older zerofit's entry lacks the matmul or the host
        memory rate: `probe` measures it again)."""
        return self.gpu_tflops is not None and self.host_copy_gbs is not None

    @property
    def key(self) -> tuple[str, str, str]:
        """What the cache is keyed by: (host, device_name, torch_version)."""
        return (self.host, self.device_name, self.torch_version)

    def to_json(self) -> dict:
        """The rates as a JSON-ready dict, every field by name."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> Rates:
        """Rates from `to_json`'s dict: its keys (those with a default may be missing: an older zerofit's
        entry), each value checked (ValueError otherwise)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"offload rates must be a JSON object (got {type(data).__name__})")
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        if not required <= set(data) <= names:
            extra, missing = sorted(map(str, set(data) - names)), sorted(required - set(data))
            raise ValueError(f"offload rates: unknown keys {extra[:5]}, missing keys {missing}")
        return cls(**data)

    def summary(self) -> str:
        """One line: `h2d 55.2 / d2h 54.8 / both 48.8 GB/s; CPU AdamW 0.25 s (...) per 1e9 params (...)`."""
        busy = "" if self.cpu_adam_busy_s is None else f" ({self.cpu_adam_busy_s:.2f} s beside copies)"
        link = "" if self.both_busy_gbs is None else f" ({self.both_busy_gbs:.1f} beside CPU AdamW)"
        gemm = "" if self.gpu_tflops is None else f"; bf16 matmul {self.gpu_tflops:.0f} TFLOP/s"
        memory = "" if self.host_copy_gbs is None else f"; host memory copy {self.host_copy_gbs:.0f} GB/s"
        return (f"h2d {self.h2d_gbs:.1f} / d2h {self.d2h_gbs:.1f} / both {self.both_gbs:.1f}{link} GB/s; "
                f"CPU AdamW {self.cpu_adam_s:.2f} s{busy}, GPU AdamW {self.gpu_adam_s:.3f} s per 1e9 params{gemm}"
                f"{memory} (measured {self.measured_at[:10]})")


# -- measuring -------------------------------------------------------------------------------------

def device_name(device: torch.device | str | int | None = None) -> str | None:
    """The CUDA device's name (`None`: the current one), None on any other device or without CUDA."""
    try:
        dev = _cuda_device(device)
    except (ValueError, RuntimeError, TypeError):
        return None
    return torch.cuda.get_device_name(dev)


def _cuda_device(device: torch.device | str | int | None) -> torch.device:
    dev = torch.device("cuda" if device is None else device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"no accelerator: nothing to measure (device {str(dev)!r}; offload rates are "
                         f"measured on a CUDA device: run on a machine where torch.cuda.is_available())")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"no accelerator: nothing to measure (device {str(dev)!r}, but torch sees "
                         f"{torch.cuda.device_count()} CUDA device(s))")
    return torch.device("cuda", index)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; where there is none, every CPU)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def measure(device: torch.device | str | int | None = None) -> Rates:
    """Measure this machine's offload rates on a CUDA device (`None`: the current one), in a few seconds.

    On an H200 box the measuring takes 0.8 s; in a fresh process the first `torch.optim` optimizer
    adds about 5 s of torch's own imports (`torch._dynamo`), which any training run pays anyway.
    Uses 2 x 256 MiB of pinned host memory, 2 GiB of pageable host memory, about 1.5 GiB of GPU memory
    and a CPU thread per usable CPU
    (whatever `torch.get_num_threads()` says; restored after), all freed on return (the GPU memory back
    to the driver, `torch.cuda.empty_cache`).
    Run it from one process per machine: probes running side by side share the link and the CPUs.
    Raises ValueError on a device that is not CUDA.
    """
    dev = _cuda_device(device)
    try:
        with torch.cuda.device(dev):
            return _measure(dev)
    finally:
        torch.cuda.empty_cache()


def _measure(dev: torch.device) -> Rates:
    host_src, host_dst = pinned_empty(COPY_BYTES, torch.uint8), pinned_empty(COPY_BYTES, torch.uint8)
    dev_src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=dev)
    dev_dst = torch.empty_like(dev_src)
    # One stream per direction, as the engine's uploads and downloads have, so the two can overlap.
    up, down = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    upload, download = (up, dev_dst, host_src), (down, host_dst, dev_src)
    h2d, d2h = _copy_gbs([upload]), _copy_gbs([download])
    both = _copy_gbs([upload, download])
    gpu_adam_s = _gpu_adam_seconds(dev)
    gpu_tflops = _gemm_tflops(dev)
    with _threads(usable_cpus()):  # the machine's rate, whichever process measures it
        cpu_step = _cpu_adam_stepper(CPU_ADAM_NUMEL)
        cpu_alone = statistics.median(cpu_step() for _ in range(TRIALS))
        cpu_busy = _busy_step_seconds(cpu_step, [upload, download], both_gbs=both, alone_s=cpu_alone)
        both_busy = _copy_gbs_beside(cpu_step, [upload, download])
        del cpu_step  # its 512 MiB of state, before the host copy takes 2 x HOST_COPY_BYTES
        host_copy = _host_copy_gbs()
    per = GB / CPU_ADAM_NUMEL
    return Rates(h2d_gbs=h2d, d2h_gbs=d2h, both_gbs=both, cpu_adam_s=cpu_alone * per,
                 cpu_adam_busy_s=None if cpu_busy is None else cpu_busy * per, gpu_adam_s=gpu_adam_s,
                 device_name=torch.cuda.get_device_name(dev), torch_version=torch.__version__,
                 host=socket.gethostname(), cpus=usable_cpus(),
                 measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), both_busy_gbs=both_busy,
                 gpu_tflops=gpu_tflops, host_copy_gbs=host_copy)


@contextlib.contextmanager
def _threads(count: int):
    """torch's CPU threads set to `count` inside, as they were after: CPU AdamW is measured on every usable
    CPU, so a rank the launcher gave cpus // N threads (`zerofit.cli.launch`) caches the machine's rate, the
    one [Note: rates shared on one host] divides among the processes of a host."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _host_copy_gbs() -> float:
    """GB/s of host memory traffic of one copy between two pageable CPU tensors of `HOST_COPY_BYTES`, on
    torch's CPU threads, the median of TRIALS timings: read and written bytes both counted (a write may
    cost a read for ownership too, not counted: the figure errs low)."""
    src = torch.ones(HOST_COPY_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: every page of both touched
    times = []
    for _ in range(TRIALS):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * HOST_COPY_BYTES / statistics.median(times) / GB


def _copy_gbs_beside(step, copies) -> float:
    """`_copy_gbs` of `copies` while a thread keeps stepping the CPU AdamW (torch's kernels run without the
    interpreter lock, so the two truly overlap)."""
    stop = threading.Event()

    def keep_stepping() -> None:
        while not stop.is_set():
            step()

    worker = threading.Thread(target=keep_stepping, name="zerofit-probe-cpu-adam", daemon=True)
    worker.start()
    try:
        step_s = step()  # the worker is at full speed by now
        time.sleep(min(0.05, step_s))
        return _copy_gbs(copies)
    finally:
        stop.set()
        worker.join()


def _issue(copies: list[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]], count: int) -> None:
    """`count` copies on each (stream, dst, src), interleaved so every stream starts at once."""
    for _ in range(count):
        for stream, dst, src in copies:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)


def _copy_gbs(copies: list[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]]) -> float:
    """GB/s each way with the given copy streams running at once: the median of TRIALS timings."""
    rates = []
    main = torch.cuda.current_stream(copies[0][0].device)  # the copies' device, not the current one
    for trial in range(TRIALS + 1):
        start = torch.cuda.Event(enable_timing=True)
        start.record(main)
        for stream, _, _ in copies:
            stream.wait_event(start)
        count = 1 if trial == 0 else COPIES_PER_TRIAL
        _issue(copies, count)
        ends = []
        for stream, _, _ in copies:
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record(stream)
        for end in ends:
            end.synchronize()
        # The slowest direction ends the trial; the host's few microseconds of issuing are inside it.
        seconds = max(start.elapsed_time(end) for end in ends) / 1e3
        if trial:  # trial 0 warms the copy engines and the streams up
            rates.append(count * COPY_BYTES / seconds / GB)
    return statistics.median(rates)


def _gpu_adam_seconds(dev: torch.device) -> float:
    """Seconds per 1e9 parameters of fused CUDA AdamW over one flat fp32 tensor, state resident."""
    param = torch.zeros(GPU_ADAM_NUMEL, device=dev, requires_grad=True)
    param.grad = torch.full_like(param, 1e-3)
    opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
    opt.step()  # creates the state
    opt.step()
    return _gpu_seconds(dev, opt.step) * GB / GPU_ADAM_NUMEL


def _gemm_tflops(dev: torch.device) -> float:
    """TFLOP/s of one bf16 matrix product of `GEMM_SHAPE`, the median of TRIALS timings."""
    m, k, n = GEMM_SHAPE
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    out = torch.mm(a, b)  # warm-up: cuBLAS picks its kernel
    return 2 * m * k * n / _gpu_seconds(dev, lambda: torch.mm(a, b, out=out)) / 1e12


def _gpu_seconds(dev: torch.device, run: Callable[[], object]) -> float:
    """Seconds per call of `run`, which issues its work on `dev`'s current stream: the median of TRIALS
    timings, each of GPU_STEPS_PER_TRIAL calls between two CUDA events on that stream."""
    stream = torch.cuda.current_stream(dev)
    times = []
    for _ in range(TRIALS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(GPU_STEPS_PER_TRIAL):
            run()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / GPU_STEPS_PER_TRIAL)
    return statistics.median(times)


def _cpu_adam_stepper(numel: int):
    """A function timing one step (seconds) of fused CPU AdamW over `numel` fp32 parameters, warmed up."""
    param = torch.zeros(numel, requires_grad=True)
    param.grad = torch.full_like(param, 1e-3)
    opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
    opt.step()  # creates the state and touches every page of it

    def step() -> float:
        start = time.perf_counter()
        opt.step()
        return time.perf_counter() - start

    return step


def _busy_step_seconds(step, copies, *, both_gbs: float, alone_s: float) -> float | None:
    """The CPU step's median seconds while `copies` run both ways, or None if they ran out before it ended.

    Enough copies are queued (async) to outlast TRIALS steps twice over at the alone time; the rate
    counts only if the copies are all still running when the last step ends, so every timed step had
    both directions busy.
    """
    copy_s = COPY_BYTES / (both_gbs * GB)
    count = min(math.ceil(2 * TRIALS * alone_s / copy_s) + 2, max(2, int(MAX_BUSY_COPY_S / copy_s)))
    _issue(copies, count)
    ends = []
    for stream, _, _ in copies:
        ends.append(torch.cuda.Event())
        ends[-1].record(stream)
    times = [step() for _ in range(TRIALS)]
    covered = not any(end.query() for end in ends)
    for end in ends:
        end.synchronize()
    return statistics.median(times) if covered else None


# -- the cache -------------------------------------------------------------------------------------

def cache_path() -> Path:
    """`bandwidth.json` under $ZEROFIT_CACHE_DIR, else $XDG_CACHE_HOME/zerofit, else ~/.cache/zerofit."""
    own = os.environ.get("ZEROFIT_CACHE_DIR")
    if own:
        return Path(own).expanduser() / CACHE_FILE
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"  # the XDG spec ignores relative
    return base / "zerofit" / CACHE_FILE


def _entries(path: Path) -> list[Rates]:
    """The well-formed entries of the cache file; none for a file missing, unreadable, too big or malformed."""
    try:
        data = load(path, as_json=True, max_bytes=MAX_CACHE_BYTES, what="offload-rates cache", max_values=None)
    except (BadFile, OSError, ValueError, RecursionError):
        return []
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("entries"), list):
        return []
    out = []
    for entry in data["entries"]:
        try:
            out.append(Rates.from_json(entry))
        except (TypeError, ValueError):
            continue
    return out


def cached(device: torch.device | str | int | None = None) -> Rates | None:
    """This machine's cached rates for the CUDA device (`None`: the current one), or None: nothing cached
    for this (host, GPU name, torch version), no CUDA device, or a cache file that cannot be read. Never raises."""
    name = device_name(device)
    if name is None:
        return None
    key = (socket.gethostname(), name, torch.__version__)
    hits = [r for r in _entries(cache_path()) if r.key == key]
    return hits[-1] if hits else None


def probe(device: torch.device | str | int | None = None, *, refresh: bool = False) -> Rates:
    """The cached rates, or (none cached, an older zerofit's entry that lacks a rate, or `refresh`)
    freshly measured ones, then cached.

    A cache that cannot be written (a read-only home, a full disk) costs only a warning: the rates are
    returned all the same. Raises ValueError on a device that is not CUDA, as `measure` does.
    """
    if not refresh:
        hit = cached(device)
        if hit is not None and hit.current:
            return hit
    rates = measure(device)
    store(rates)
    return rates


def store(rates: Rates) -> bool:
    """Write `rates` into the cache file in place of any entry of the same key; False if it could not be written.

    Atomic: a temporary file in the same directory, then `os.replace`, so a reader never sees half a
    file. Two processes storing at once both leave a whole file, and one of the two new entries.
    """
    path = cache_path()
    kept = [e for e in _entries(path) if e.key != rates.key][-(MAX_CACHE_ENTRIES - 1):]
    text = json.dumps({"format": CACHE_FORMAT, "entries": [e.to_json() for e in [*kept, rates]]}, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".bandwidth.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        logger.warning("zerofit: could not cache the offload rates in %s (%s); they will be measured again "
                       "next time: set ZEROFIT_CACHE_DIR to a writable directory to keep them", path, e.strerror or e)
        return False
    return True


# -- the time model: see [Note: offload time model] --------------------------------------------------

def _count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (got {value!r})")


SPLIT_MASTER_BYTES = master_split.LINK_BYTES
"""Bytes per element a bf16 run's master takes on the link: low halves and carries (engine.offload.master_split)."""


def _stream_bytes(numel: int, state_tensors: int, master_bytes: float = 4, state_bytes: float = 4) -> float:
    """Bytes each way of GPU-stepping `numel` offloaded parameters: the master (4 bytes, or
    `SPLIT_MASTER_BYTES` when it travels split) plus k state tensors of `state_bytes` per element as stored
    (`precision.optimizer_state`: 4, 2 or 1.25)."""
    _count("numel", numel)
    _count("state_tensors", state_tensors)
    return (master_bytes + state_bytes * state_tensors) * numel


def streamed_seconds(rates: Rates, numel: int, *, state_tensors: int = 2, master_bytes: float = 4,
                     state_bytes: float = 4) -> float:
    """Seconds to GPU-step `numel` offloaded parameters: T_s of [Note: offload time model]."""
    return max(_stream_bytes(numel, state_tensors, master_bytes, state_bytes) / (rates.both_gbs * GB),
               rates.gpu_adam_s * numel / GB)


def host_seconds(rates: Rates, numel: int, *, grad_bytes: int = 4, param_bytes: int = 2,
                 busy: bool = False) -> float:
    """Seconds to host-step `numel` offloaded parameters: T_h of [Note: offload time model]."""
    _count("numel", numel)
    _count("grad_bytes", grad_bytes)
    _count("param_bytes", param_bytes)
    cpu_s = (_busy_rate(rates) if busy else rates.cpu_adam_s) * numel / GB
    return max(cpu_s, max(grad_bytes, param_bytes) * numel / (_link_beside_cpu(rates) * GB))


def _busy_rate(rates: Rates) -> float:
    return rates.cpu_adam_s if rates.cpu_adam_busy_s is None else rates.cpu_adam_busy_s


def _link_beside_cpu(rates: Rates) -> float:
    """The link's rate each way while the CPU steps (host memory is shared): measured, else `both_gbs`."""
    return rates.both_gbs if rates.both_busy_gbs is None else rates.both_busy_gbs


def offload_seconds(rates: Rates, numel_streamed: int, numel_host: int, *, state_tensors: int = 2,
                    grad_bytes: int = 4, param_bytes: int = 2, master_bytes: float = 4,
                    state_bytes: float = 4) -> float:
    """Seconds to step `numel_streamed` parameters on the GPU and `numel_host` on the host at once: T of
    [Note: offload time model], max(CPU time of the host part at the busy rate, the link's time for both
    parts' bytes in the busier direction, the GPU kernel's time for the streamed part)."""
    stream = _stream_bytes(numel_streamed, state_tensors, master_bytes, state_bytes)
    _count("numel_host", numel_host)
    _count("grad_bytes", grad_bytes)
    _count("param_bytes", param_bytes)
    down, up = stream + grad_bytes * numel_host, stream + param_bytes * numel_host
    link = _link_beside_cpu(rates) if numel_host else rates.both_gbs
    return max(_busy_rate(rates) * numel_host / GB, max(down, up) / (link * GB),
               rates.gpu_adam_s * numel_streamed / GB)


SPLIT_MIN_GAIN = 0.10
"""A split must beat stepping everything one way by this much in the model to be chosen: the model
leaves out the host path's waits and publishes (on the H200 box a split the model put 2 % ahead ran
6 % behind)."""


def best_host_share(rates: Rates, numel: int, *, state_tensors: int = 2, grad_bytes: int = 4,
                    param_bytes: int = 2, steps: int = 20) -> float:
    """The share of `numel` offloaded parameters, one of 0, 1/steps, ..., 1, to step on the host (the rest
    GPU-stepped, at once) that minimises `offload_seconds`; a tie goes to the smaller share (fewer CPU
    threads busy), and a split that gains less than `SPLIT_MIN_GAIN` over the better of all-streamed
    and all-host gives way to it."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1 (got {steps!r})")
    best, best_s = 0.0, math.inf
    for i in range(steps + 1):
        host = round(numel * i / steps)
        seconds = offload_seconds(rates, numel - host, host, state_tensors=state_tensors,
                                  grad_bytes=grad_bytes, param_bytes=param_bytes)
        if seconds < best_s * (1 - 1e-9):  # a real gain, not float noise, to move to a larger share
            best, best_s = i / steps, seconds
    if 0 < best < 1:
        ends = {0.0: offload_seconds(rates, numel, 0, state_tensors=state_tensors, grad_bytes=grad_bytes,
                                     param_bytes=param_bytes),
                1.0: offload_seconds(rates, 0, numel, state_tensors=state_tensors, grad_bytes=grad_bytes,
                                     param_bytes=param_bytes)}
        end = min(ends, key=lambda k: (ends[k], k))
        if best_s > (1 - SPLIT_MIN_GAIN) * ends[end]:
            return end
    return best
