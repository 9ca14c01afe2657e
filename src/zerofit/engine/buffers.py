"""Which flat buffers one flat group holds: one pure rule, read by `FlatGroup` and the memory model.

`group_buffers` answers, for one group's layout and placement, what `FlatGroup` allocates (dtype,
elements, GPU or host) and what it only aliases (see [Note: aliasing] in zerofit.engine.flat_group).
`FlatGroup` allocates from the record; `zerofit.plan.memory` counts its bytes. A buffer that is
`None` here costs nothing: it is another buffer (or does not exist for this group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerofit.engine.layout import FlatLayout
from zerofit.engine.policy import GroupPlacement


@dataclass(frozen=True)
class Buffer:
    """One flat buffer: its dtype, its number of elements, and whether it lives in host memory."""

    dtype: torch.dtype
    numel: int
    host: bool = False
    """In host memory (pinned on a GPU run); else on the engine's device."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class GroupBuffers:
    """The buffers of one flat group (N: padded elements, S: shard elements)."""

    param_flat: Buffer
    """All N compute-dtype parameters; with `params_released`, only while the group is gathered."""
    params_released: bool
    """Stage 3: `param_flat` has no storage between uses (see [Note: released parameters])."""
    param_shard: Buffer | None
    """The S-element parameter shard with its own storage (stage 3; host with parameter offload);
    None: a view of `param_flat`."""
    master: Buffer | None
    """The fp32 master shard; None: `param_shard` itself (fp32 compute, state and parameters on the device) or
    frozen."""
    grad_shard: Buffer | None
    """The S-element reduced gradient (compute dtype when compact); None for frozen groups."""
    grad_flat: Buffer | None
    """A full fp32 gradient that persists across micro-steps (stage 1 on several ranks); None: it is
    `grad_shard` (`grad_flat_is_shard`) or transient (`grad_transient`)."""
    grad_flat_is_shard: bool
    """Backward accumulates straight into `grad_shard` (nothing to reduce into a separate buffer)."""
    grad_transient: Buffer | None
    """The full fp32 gradient backward fills before each reduction, freed once it is handed over."""
    reduce_output: Buffer | None
    """The fp32 shard a reduce-scatter of `grad_transient` writes (several ranks), while it runs."""
    grad_staging: Buffer | None
    """Host buffer a later micro-step's offloaded gradient lands in before it is added (accumulating)."""
    step_upcast: Buffer | None
    """The fp32 copy of a compact gradient, while its group steps (see [Note: compact gradients])."""
    optimizer_state: Buffer | None
    """The optimizer's state tensors of this shard, together (allocated by the optimizer itself)."""


def group_buffers(layout: FlatLayout, placement: GroupPlacement, *, trainable: bool,
                  compute_dtype: torch.dtype, compact: bool = False, optimizer_states: int = 0,
                  accumulates: bool = False) -> GroupBuffers:
    """The buffers of a flat group laid out as `layout` and held as `placement`.

    `compact`: the gradient stays in the compute dtype (`keeps_compact_grads`); `optimizer_states`:
    fp32 state tensors per element (Adam: 2); `accumulates`: windows have several micro-steps.
    """
    n, s = layout.padded_numel, layout.shard_numel
    fp32 = torch.float32
    released = placement.shard_params
    param_shard = Buffer(compute_dtype, s, host=placement.offload_params) if released else None
    if not trainable:
        return GroupBuffers(Buffer(compute_dtype, n), released, param_shard, None, None, None, False,
                            None, None, None, None, None)
    state_on_host = placement.offloaded
    # fp32 compute with the state on the device steps the parameter shard itself, unless that shard lives in host
    # memory (stage 3 parameter offload): then the master is a device copy the step publishes into it
    own_master = compute_dtype != fp32 or state_on_host or placement.offload_params
    master = Buffer(fp32, s, host=state_on_host) if own_master else None
    grad_shard = Buffer(compute_dtype if compact else fp32, s, host=placement.host_stepped)
    is_shard = placement.shard_world == 1 and not placement.host_stepped
    persistent = placement.keep_full_grads and not is_shard
    transient = not placement.keep_full_grads
    return GroupBuffers(
        param_flat=Buffer(compute_dtype, n), params_released=released, param_shard=param_shard,
        master=master, grad_shard=grad_shard,
        grad_flat=Buffer(fp32, n) if persistent else None, grad_flat_is_shard=is_shard,
        grad_transient=Buffer(fp32, n) if transient else None,
        reduce_output=Buffer(fp32, s) if transient and placement.shard_world > 1 else None,
        grad_staging=Buffer(fp32, s, host=True) if placement.host_stepped and accumulates else None,
        # GPU-stepped groups upcast chunk by chunk, in the streaming pool (`stream_pool_bytes`)
        step_upcast=Buffer(fp32, s) if compact and not placement.gpu_stepped else None,
        optimizer_state=Buffer(fp32, optimizer_states * s, host=state_on_host))
