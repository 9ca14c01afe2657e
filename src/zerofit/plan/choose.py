"""Planning a run: estimate every setting for a model and pick the fastest that fits.

[Note: speed order]
Settings are ranked by what they add to a step, fastest first: stage 0 (no extra communication),
1, 2, 3 (each adds collectives), optimizer offload (a CPU step and host copies), parameter offload
(host uploads before every gather), NVMe (file I/O). Activation checkpointing (a second forward,
about a third of a step more) ranks below the same offload level without it but above any more
offloading: on GPT-2 XL (benchmarks/results) optimizer offload made the step 5-10x slower, a recomputed
forward cannot cost more than about 1.4x. With one rank stages 1-3 shard nothing and cost what
stage 0 costs, so only stage 0 is listed for them. GPU-stepped offload with a share of the state
stepped on the host at the same time (the split this machine's measured rates favour, see
`zerofit.plan.bandwidth`) ranks just before the same setting without the split.

[Note: open ratio]
With `offload_optimizer.ratio: auto` (what `stage: auto` or `device: auto` means when the ratio is
not written) an offloading setting keeps as much of the optimizer state on the GPU as fits: of the
ratios that select a different set of units (`offload_ratios`: the last unit, the last two, ...),
the smallest whose estimate fits. State on the GPU is stepped where it lives, so less offloaded is
never slower. The GPU need falls and the host need grows with the ratio; the search stops at the
first ratio whose host bytes do not fit.

[Note: headroom]
A setting fits when its GPU total plus `GPU_RESERVE_BYTES` (CUDA context, cuBLAS workspaces, the
allocator's rounding and fragmentation) stays below `(1 - headroom)` of the GPU memory, and its
pinned host bytes plus `HOST_BASELINE_BYTES` (the resident size of a Python process with torch and
CUDA loaded, 1.4-1.5 GiB in benchmarks/results) stay below `(1 - headroom)` of the host memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from zerofit.engine.policy import offload_ratios
from zerofit.plan.activations import ActivationTrace, trace_step
from zerofit.plan.bandwidth import Rates
from zerofit.plan.host_memory import read_host_memory
from zerofit.plan.memory import (
    GIB,
    Estimate,
    ModelCounts,
    Setting,
    Workload,
    all_settings,
    estimate,
)
from zerofit.plan.sharing import shared_rates, sharing_said
from zerofit.plan.sources import FakeModel
from zerofit.plan.step_time import added_seconds

GPU_RESERVE_BYTES = 1 * GIB
HOST_BASELINE_BYTES = 3 * GIB // 2
DEFAULT_HEADROOM = 0.10


@dataclass(frozen=True)
class Budget:
    """Memory one rank may use; None: unknown (that side is not checked)."""

    gpu_bytes: int | None
    host_bytes: int | None
    """Host memory of the machine, shared by the ranks on it."""
    ranks_per_host: int = 1
    headroom: float = DEFAULT_HEADROOM
    unified: bool = False
    """No accelerator (CPU runs): the "GPU" bytes live in host memory too, so both must fit the host."""
    host_note: str = ""
    """Why `host_bytes` may be less than this machine will have (memory that grows as it is used, see
    [Note: host memory that grows]), said in the plan's reason; empty: nothing to say."""

    def gpu_fits(self, e: Estimate) -> bool | None:
        if self.gpu_bytes is None:
            return None
        return e.gpu_total + GPU_RESERVE_BYTES <= (1 - self.headroom) * self.gpu_bytes

    def host_fits(self, e: Estimate) -> bool | None:
        if self.host_bytes is None:
            return None
        per_rank = e.host_total + HOST_BASELINE_BYTES + (e.gpu_total if self.unified else 0)
        return self.ranks_per_host * per_rank <= (1 - self.headroom) * self.host_bytes

    def gpu_allowance(self, e: Estimate) -> int | None:
        """The device bytes `e`'s setting may reach and still fit with headroom (None: unknown).

        The same rule as `gpu_fits` (or `host_fits` without a GPU) solved for the device total, so a
        measured peak can be held against it (`zerofit.frontend.planning.first_step_check`)."""
        if not self.unified:
            return None if self.gpu_bytes is None else int((1 - self.headroom) * self.gpu_bytes) - GPU_RESERVE_BYTES
        if self.host_bytes is None:
            return None
        per_rank = (1 - self.headroom) * self.host_bytes / self.ranks_per_host
        return int(per_rank) - HOST_BASELINE_BYTES - e.host_total

    def need(self, e: Estimate) -> int:
        """The bytes that decide the smallest setting: GPU bytes, or device and host together without a GPU."""
        return e.gpu_total + e.host_total if self.unified else e.gpu_total

    def fits(self, e: Estimate) -> bool:
        return self.gpu_fits(e) is not False and self.host_fits(e) is not False


@dataclass(frozen=True)
class Plan:
    """Every setting's estimate, fastest first, and the choice with the reason for it."""

    estimates: tuple[Estimate, ...]
    choice: Estimate | None
    reason: str
    smallest: Estimate | None = None
    """The setting needing the least memory (what runs when nothing fits)."""
    seconds: dict | None = None
    """Setting -> seconds it adds to a step on the machine's measured rates (`zerofit.plan.step_time`;
    None for one that cannot be priced); None: no rates, the fixed order of [Note: speed order] decided."""


def machine_budget(*, gpu_memory_gib: float | None = None, host_memory_gib: float | None = None,
                   ranks_per_host: int = 1, headroom: float = DEFAULT_HEADROOM,
                   host_override: str = "ZEROFIT_HOST_MEMORY_GIB") -> Budget:
    """This machine's memory (first GPU's total; host memory as `zerofit.plan.host_memory` reads it) unless
    given in GiB; `host_override` names the setting that gives the host's, for the note on memory that may
    grow."""
    gpu = int(gpu_memory_gib * GIB) if gpu_memory_gib is not None else None
    if gpu is None:
        import torch

        if torch.cuda.is_available():
            gpu = allowed_gpu_bytes(0)
    if host_memory_gib is not None:
        return Budget(gpu_bytes=gpu, host_bytes=int(host_memory_gib * GIB), ranks_per_host=ranks_per_host,
                      headroom=headroom)
    host = read_host_memory()
    return Budget(gpu_bytes=gpu, host_bytes=host.total_bytes, ranks_per_host=ranks_per_host, headroom=headroom,
                  host_note=host.note(host_override))


def allowed_gpu_bytes(device) -> int:
    """What this process may allocate on `device`: the card's total times the fraction a script set
    with `torch.cuda.set_per_process_memory_fraction` (a card shared with others, or one standing in
    for a smaller one), not the card's total."""
    import torch

    if isinstance(device, (str, torch.device)):  # the fraction query wants an index; "cuda": the current one
        index = torch.device(device).index
        device = torch.cuda.current_device() if index is None else index
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.5
    return int(total * min(1.0, fraction(device))) if fraction is not None else total


def speed_rank(s: Setting) -> tuple:
    """Sort key, fastest first (see [Note: speed order])."""
    offload = (s.offload_optimizer != "none") + (s.offload_param != "none") + (s.offload_optimizer == "nvme")
    return (offload, s.checkpointing, s.stage, s.host_share == 0)  # a split is listed for its measured gain


def least_offload(counts: ModelCounts, setting: Setting, work: Workload, budget: Budget,
                  trace: ActivationTrace | None) -> Estimate:
    """`setting` with the smallest `offload_ratio` that fits `budget` (see [Note: open ratio]); when none
    fits, the estimate with everything offloaded."""
    ratios = offload_ratios([t + f for _, t, f in counts.units])
    for ratio in ratios:
        e = estimate(counts, dataclasses.replace(setting, offload_ratio=ratio), work, trace)
        if budget.fits(e):
            return e
        if budget.host_fits(e) is False:  # host bytes only grow with the ratio: no larger one fits
            break
    return estimate(counts, dataclasses.replace(setting, offload_ratio=1.0), work, trace)


def plan(counts: ModelCounts, work: Workload, budget: Budget, traces: dict[bool, ActivationTrace | None], *,
         settings: list[Setting] | None = None, open_ratio: bool = False, rates: Rates | None = None) -> Plan:
    """Estimate `settings` (default: all for the world size) and choose the fastest that fits `budget`.

    `traces` maps checkpointing on/off to its activation trace (None: activations unknown, counted 0).
    `open_ratio`: each optimizer-offloading setting offloads the least that fits (`least_offload`) instead
    of its own `offload_ratio`. `rates`: this machine's measured rates; where given and every setting that
    fits can be priced, the fastest is the one that adds the fewest seconds (`zerofit.plan.step_time`),
    else the first in [Note: speed order]. They are priced at one process's share of them where
    `budget.ranks_per_host` processes share the host ([Note: rates shared on one host]).
    """
    rates = shared_rates(rates, budget.ranks_per_host) if rates else None
    if settings is None:
        settings = all_settings(work.world, checkpointing=tuple(sorted(traces)))
    settings = sorted(settings, key=speed_rank)
    estimates = tuple(
        least_offload(counts, s, work, budget, traces.get(s.checkpointing))
        if open_ratio and s.offload_optimizer != "none" else estimate(counts, s, work, traces.get(s.checkpointing))
        for s in settings)
    seconds = {e.setting: added_seconds(rates, counts, e.setting, work) for e in estimates} if rates else None
    fitting = [e for e in estimates if budget.fits(e)]
    if seconds is not None and all(seconds[e.setting] is not None for e in fitting):
        fitting.sort(key=lambda e: (round(seconds[e.setting], 4), speed_rank(e.setting)))
    if not fitting:
        smallest = min(estimates, key=budget.need)
        if not budget.unified and budget.gpu_fits(smallest) and budget.host_fits(smallest) is False:
            host = min(estimates, key=lambda e: e.host_total if budget.gpu_fits(e) else float("inf"))
            why = (f"nothing fits: the GPU holds some settings, but the least host memory any of them needs is "
                   f"{host.setting.label} at {host.host_total / GIB:.2f} GiB pinned per rank{_of(budget)}; "
                   "add host memory or GPUs, or offload the optimizer state to NVMe "
                   "(offload_optimizer.device: nvme with an nvme_path)")
            return Plan(estimates, None, why + _host_said(budget), smallest, seconds)
        what = "memory" if budget.unified else "GPU need"
        why = (f"nothing fits: the smallest {what} is {smallest.setting.label} at {budget.need(smallest) / GIB:.2f} GiB"
               f"{_of(budget)}; lower the micro-batch, add GPUs or turn on checkpointing")
        return Plan(estimates, None, why + _host_said(budget), smallest, seconds)
    choice = fitting[0]
    faster = [e for e in estimates if _faster(e, choice, seconds)]
    why = f"{choice.setting.label}: the fastest setting that fits, {_size(choice.gpu_total)} GPU"
    why += f" and {_size(choice.host_total)} pinned host{_of(budget)}"
    if faster:
        why += f"; faster ones do not fit ({faster[-1].setting.label} needs {faster[-1].gpu_total / GIB:.1f} GiB GPU)"
    if seconds is not None and seconds.get(choice.setting) is not None:
        why += f"; it adds {seconds[choice.setting]:.3f} s a step {sharing_said(rates, budget.ranks_per_host)}"
    if not any(traces.values()):
        why += "; activations unknown (not counted)"
    return Plan(estimates, choice, why + _host_said(budget), None, seconds)


def _faster(e: Estimate, choice: Estimate, seconds: dict | None) -> bool:
    """`e` would have been chosen before `choice` had it fit."""
    if seconds is not None and seconds.get(e.setting) is not None and seconds.get(choice.setting) is not None:
        return (round(seconds[e.setting], 4), speed_rank(e.setting)) < \
            (round(seconds[choice.setting], 4), speed_rank(choice.setting))
    return speed_rank(e.setting) < speed_rank(choice.setting)


def _size(n: int) -> str:
    """Bytes in GiB, or in MiB below 0.1 GiB (a tiny model's need would read 0.0 GiB)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB // 10 else f"{n / 2**20:.1f} MiB"


def _host_said(budget: Budget) -> str:
    return f"; {budget.host_note}" if budget.host_note else ""


def _of(budget: Budget) -> str:
    parts = []
    if budget.gpu_bytes is not None:
        parts.append(f"{budget.gpu_bytes / GIB:.1f} GiB GPU")
    if budget.host_bytes is not None:
        parts.append(f"{budget.host_bytes / GIB:.1f} GiB host")
    return f" of {' / '.join(parts)} with {budget.headroom:.0%} headroom" if parts else ""


def traces_for(fake: FakeModel | None, work: Workload,
               checkpointing: tuple[bool, ...]) -> dict[bool, ActivationTrace | None]:
    """Activation traces for each checkpointing choice (None: no model to trace). A model that cannot
    checkpoint (transformers raises ValueError) has no checkpointing entry: those settings are not listed."""
    out: dict[bool, ActivationTrace | None] = {}
    for ck in checkpointing:
        if fake is None:
            out[ck] = None
            continue
        try:
            out[ck] = trace_step(fake, batch=work.micro_batch, seq=work.seq, checkpointing=ck,
                                 unit_size_threshold=work.unit_size_threshold)
        except ValueError:
            if not ck:
                raise
    return out


def counts_of(model: nn.Module, work: Workload) -> ModelCounts:
    return ModelCounts.of(model, unit_size_threshold=work.unit_size_threshold)
