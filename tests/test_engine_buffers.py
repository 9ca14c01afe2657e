"""`group_buffers`: the one rule for a flat group's buffers matches what `FlatGroup` allocates."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.policy import GroupPlacement, StateHome


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


PLACEMENTS = [
    GroupPlacement(shard_world=1, rank=0, shard_params=False, keep_full_grads=True),  # stage 0 / one rank
    GroupPlacement(shard_world=2, rank=1, shard_params=False, keep_full_grads=True),  # stage 1
    GroupPlacement(shard_world=2, rank=0, shard_params=False, keep_full_grads=False),  # stage 2
    GroupPlacement(shard_world=2, rank=1, shard_params=True, keep_full_grads=False),  # stage 3
    GroupPlacement(shard_world=2, rank=0, shard_params=False, keep_full_grads=False, state_home=StateHome.HOST_STEPPED),
    GroupPlacement(shard_world=1, rank=0, shard_params=True, keep_full_grads=False, state_home=StateHome.HOST_STEPPED,
                   offload_params=True),
    # stage 3 parameter offload with the optimizer state on the device (no optimizer offload, or a ratio below 1)
    GroupPlacement(shard_world=1, rank=0, shard_params=True, keep_full_grads=False, offload_params=True),
]


def test_fp32_master_of_offloaded_parameters_is_a_device_buffer():
    """fp32 compute steps the parameter shard itself - unless that shard lives in host memory while the state is on
    the device: the optimizer cannot step a host tensor with a device gradient, so the master is its own device
    buffer (found on a GPU: `rebind_optimizer` refused to bind a CUDA gradient to the host shard)."""
    from zerofit.engine.buffers import group_buffers
    from zerofit.engine.layout import plan_layout
    layout = plan_layout([10], 1, align=16)
    kept = GroupPlacement(shard_world=1, rank=0, shard_params=True, keep_full_grads=False)
    offloaded = GroupPlacement(shard_world=1, rank=0, shard_params=True, keep_full_grads=False, offload_params=True)
    assert group_buffers(layout, kept, trainable=True, compute_dtype=torch.float32).master is None
    b = group_buffers(layout, offloaded, trainable=True, compute_dtype=torch.float32)
    assert b.master is not None and not b.master.host and b.param_shard.host


@pytest.mark.parametrize("placement,dtype,trainable,compact", [
    (pl, dt, tr, cp) for pl, dt, tr, cp in itertools.product(PLACEMENTS, (torch.float32, torch.bfloat16),
                                                              (True, False), (False, True))
    if not (cp and (not tr or dt == torch.float32 or pl.host_stepped))])
def test_flat_group_allocates_what_group_buffers_says(placement, dtype, trainable, compact):
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    g = FlatGroup("u", ["a", "b"], params, [0, 0], trainable=trainable, placement=placement, compute_dtype=dtype,
                  device=torch.device("cpu"), align=16, compact_grads=compact)
    b = g.buffers
    assert (g.param_flat.dtype, g.param_flat.numel()) == (b.param_flat.dtype, b.param_flat.numel)
    assert b.params_released == placement.shard_params
    if b.param_shard is None:
        assert _shares_storage(g.param_shard, g.param_flat)
    else:
        assert not _shares_storage(g.param_shard, g.param_flat)
        assert (g.param_shard.dtype, g.param_shard.numel()) == (b.param_shard.dtype, b.param_shard.numel)
    if not trainable:
        assert g.master is None and g.grad_shard is None and b.grad_shard is None
        return
    if b.master is None:
        assert g.master is g.param_shard
    else:
        assert g.master is not g.param_shard
        assert (g.master.dtype, g.master.numel()) == (b.master.dtype, b.master.numel)
    assert (g.grad_shard.dtype, g.grad_shard.numel()) == (b.grad_shard.dtype, b.grad_shard.numel)
    assert g.compact == compact == (b.step_upcast is not None)
    if b.grad_flat_is_shard:
        assert g.grad_flat is g.grad_shard
    elif b.grad_flat is not None:
        assert (g.grad_flat.dtype, g.grad_flat.numel()) == (b.grad_flat.dtype, b.grad_flat.numel)
    else:
        assert g.grad_flat is None and b.grad_transient is not None
        g.accumulate(0, torch.ones(5, 3))  # the transient full gradient backward fills
        assert (g.grad_flat.dtype, g.grad_flat.numel()) == (b.grad_transient.dtype, b.grad_transient.numel)
