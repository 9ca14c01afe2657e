"""Optimizer offload: the groups whose optimizer state lives off the device, and how they are stepped.

| module | owns |
|---|---|
| `part.py` | `OffloadPart`: the hooks forwarded to the inner step mode, before-use and before-read wiring, finalizer |
| `host.py` | `HostStep`: the host-stepped part (CPU optimizer on host memory; may start during backward) |
| `host_thread.py` | `HostStepper`: the thread that runs host steps and uploads the stepped parameters |
| `gpu.py` | `GpuStep`: the GPU-stepped part (state in host memory, streamed through device chunks) |
| `gpu_issue.py` | `IssueThread`: the thread that queues the GPU-stepped part's chunks |
| `gpu_runs.py` | what the GPU-stepped part streams: runs of optimizer pieces and their chunks |
| `gpu_slot.py` | one chunk's device buffers of the stream |
| `gpu_homes.py` | where each run of the stream keeps its state, verified once and kept while it holds |
| `stored_homes.py` | where a run keeps bf16 / 8-bit state, and how its pieces view it |
| `host_narrow.py` | bf16 / 8-bit state widened for the CPU optimizer, one group at a time |
| `master_split.py` | the fp32 master as its bf16 rounding plus low halves and carries (what crosses the bus) |
| `nvme.py` | `NvmeSwapper`: each group's state in its own file, read ahead and written behind |
| `threads.py` | the loop both threads run |

`ZeroEngine` builds at most one part of each kind, chained (`HostStep` around `GpuStep` around the
device's `PlainStep`/`CompactStep`, see [Note: offload parts] in zerofit.engine.offload.part), and
exposes them as `engine.offload`, an `Offload`.

[Note: one offloaded step, in order]
A host-stepped group (`offload_optimizer.step_on: host`), one accumulation window of one micro-step:
  1. forward, per unit:  part.py:OffloadPart._await (forward pre-hook) -> host.py:HostStep._await_group
     -> host_thread.py:HostStepper.wait (last step's upload) -> step_mode.py:gather_params (stages 1-2)
  2. backward starts:    engine.py:ZeroEngine._begin_backward (from ZeroEngine.backward, or from the first
     hook of a script's own loss.backward(): plain_backward.py) -> part.py:OffloadPart.begin_backward
     -> host.py:HostStep._begin_backward (publish skipped units; may the update start now?)
  3. per unit reduced:   engine.py:ZeroEngine._reduce -> unit.py:Unit._reduce_to_host (reduce-scatter,
     flat_group.py:FlatGroup.take_reduced_grad starts the download) -> host.py:HostStep._reduced
     (an early window hands the unit to host_thread.py:HostStepper.submit here)
  4. backward ends:      host.py:HostStep._end_backward (flat_group.py:FlatGroup.settle_host_grad)
  5. step():             engine.py:ZeroEngine.step -> part.py:OffloadPart._begin_step (early.py)
     -> engine.py:ZeroEngine._unscale_and_clip -> host.py:HostStep._prepare_grads
     -> part.py:OffloadPart.step -> host.py:HostStep._before_inner_step (an early window's rest)
     -> the inner mode's step (device groups) -> host.py:HostStep._step -> host_thread.py:HostStepper.submit
  6. host thread:        host_thread.py:HostStepper._run_one -> _step (nvme.py:NvmeSwapper.swap_in,
     optim.py:step_with_factor, _publish: flat_group.py:FlatGroup.publish_master on a copy stream,
     NvmeSwapper.swap_out)
  7. the next forward:   1.
A GPU-stepped group (`step_on: device`, the default on CUDA):
  1. forward, per unit:  part.py:OffloadPart._await -> gpu.py:GpuStep._await_group
     (gpu_issue.py:IssueThread.wait, then the main stream waits for the group's done event)
     -> step_mode.py:gather_params (stages 1-2)
  2. backward:           part.py:OffloadPart.begin_backward -> gpu.py:GpuStep._begin_backward;
     gradients are reduced into the device gradient shard as without offload (unit.py:Unit.reduce); in an
     early window (no clipping: early.py) gpu.py:GpuStep._reduced -> _submit_ready -> _launch hands each
     reduced unit's groups to gpu_issue.py:IssueThread.submit now, and step() only hands over the rest
  3. step():             engine.py:ZeroEngine.step -> engine.py:ZeroEngine._unscale_and_clip
     -> part.py:OffloadPart.step -> the inner mode's step -> gpu.py:GpuStep._step (factor, settings,
     the "gradients final" event) -> gpu.py:GpuStep._launch -> gpu_issue.py:IssueThread.submit
  4. issuing thread:     gpu_issue.py:IssueThread._run_one -> gpu.py:GpuStep._issue
     (nvme.py:NvmeSwapper.swap_in) -> gpu.py:GpuStep._step_run per run (gpu_runs.py), per chunk:
     upload to a slot -> master_split.py:join -> gpu.py:GpuStep._step_chunk (the optimizer's kernel,
     the parameter published, the gradient zeroed) -> master_split.py:split -> download
     -> (nvme.py:NvmeSwapper.swap_out)
  5. the next forward:   1.
Checkpoints and inspection read host state through `settle(state=True)` (part.py:OffloadPart.settle,
or `FlatGroup.before_read`).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerofit.engine.offload.gpu import GpuStep
from zerofit.engine.offload.host import HostStep
from zerofit.engine.offload.host_thread import HostStepper
from zerofit.engine.offload.nvme import NvmeSwapper

__all__ = ["GpuStep", "HostStep", "Offload"]


@dataclass(frozen=True)
class Offload:
    """An engine's offload parts, for inspection (tests, benchmarks): `engine.offload`."""

    host: HostStep | None = None
    """The host-stepped part, if some group is host-stepped."""
    gpu: GpuStep | None = None
    """The GPU-stepped part, if some group is GPU-stepped."""

    @property
    def stepper(self) -> HostStepper | None:
        """The host-stepped part's thread."""
        return self.host.stepper if self.host is not None else None

    @property
    def swapper(self) -> NvmeSwapper | None:
        """The NVMe files (the host-stepped part's, else the GPU-stepped part's); None without NVMe."""
        for part in (self.host, self.gpu):
            if part is not None and part.swapper is not None:
                return part.swapper
        return None
