"""A GAN under one Accelerator: two models, each with its optimizer, trained as plain PyTorch + DDP would.

2 gloo ranks on CPU, against one plain-PyTorch process on the same global batch (each backward's gradient
the mean of the ranks' row blocks, summed in rank order, as DDP computes it): the discriminator steps after
its loss, the generator after its loss, which runs through the discriminator too, so the discriminator
keeps that gradient until its next `zero_grad()`: one loop variant zeroes it before the discriminator's
loss, as most GAN loops do, the other right after the discriminator's step, so the generator's loss's
gradient adds up with the next discriminator loss's, as in PyTorch. Stages 0-3, optimizer offload (host-
and GPU-stepped, the CPU standing in), parameter offload, fp32; each model's gradient norm clipped on its own.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerofit import Accelerator
from zerofit.config.schema import OffloadConfig, RunConfig, ZeroConfig
from zerofit.testing.distributed import run_distributed

Z, D_IN, BATCH, STEPS = 5, 7, 8, 4
TOL = 2e-6


def models():
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(Z, 11), nn.Tanh(), nn.Linear(11, D_IN))
    d = nn.Sequential(nn.Linear(D_IN, 13), nn.Tanh(), nn.Linear(13, 1))
    return g, d, torch.optim.AdamW(g.parameters(), lr=1e-2), torch.optim.AdamW(d.parameters(), lr=2e-2)


def data():
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, D_IN, generator=gen), torch.randn(BATCH, Z, generator=gen)) for _ in range(STEPS)]


bce = nn.functional.binary_cross_entropy_with_logits


def loss_d(g, d, real, z):
    fake = g(z).detach()
    return bce(d(real), torch.ones(len(real), 1)) + bce(d(fake), torch.zeros(len(z), 1))


def loss_g(g, d, z):
    return bce(d(g(z)), torch.ones(len(z), 1))


def _ddp_backward(params, losses_per_rank) -> None:
    """Add the rank-order mean of the ranks' gradients of their losses to each parameter's `.grad`."""
    grads = [torch.autograd.grad(loss, params, allow_unused=True) for loss in losses_per_rank]
    for i, p in enumerate(params):
        parts = [gr[i] if gr[i] is not None else torch.zeros_like(p) for gr in grads]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        p.grad = total / len(grads) if p.grad is None else p.grad + total / len(grads)


def reference(zero_d_first: bool, world: int = 2):
    g, d, opt_g, opt_d = models()
    params = list(g.parameters()) + list(d.parameters())
    for real, z in data():
        blocks = list(zip(real.chunk(world), z.chunk(world)))
        if zero_d_first:
            opt_d.zero_grad()
        _ddp_backward(params, [loss_d(g, d, r, zz) for r, zz in blocks])
        torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
        opt_d.step()
        if not zero_d_first:
            opt_d.zero_grad()
        _ddp_backward(params, [loss_g(g, d, zz) for _, zz in blocks])
        torch.nn.utils.clip_grad_norm_(g.parameters(), 1.0)
        opt_g.step()
        opt_g.zero_grad()
    return {**{f"g.{n}": p.detach().clone() for n, p in g.named_parameters()},
            **{f"d.{n}": p.detach().clone() for n, p in d.named_parameters()}}


def train(rank: int, world: int, stage: int, offload: str, offload_param: str, zero_d_first: bool):
    device, _, step_on = offload.partition("-")
    zero = ZeroConfig(stage=stage, param_persistence_threshold=0,
                      offload_optimizer=OffloadConfig(device=device, step_on=step_on or "auto"),
                      offload_param=OffloadConfig(device=offload_param))
    acc = Accelerator(config=RunConfig(zero=zero))
    g, d, opt_g, opt_d = acc.prepare(*models())
    micro = BATCH // world
    for real, z in data():
        real, z = real[rank * micro:(rank + 1) * micro], z[rank * micro:(rank + 1) * micro]
        if zero_d_first:
            opt_d.zero_grad()
        acc.backward(loss_d(g, d, real, z))
        acc.clip_grad_norm_(d.parameters(), 1.0)
        opt_d.step()
        if not zero_d_first:
            opt_d.zero_grad()
        acc.backward(loss_g(g, d, z))
        acc.clip_grad_norm_(g.parameters(), 1.0)
        opt_g.step()
        opt_g.zero_grad()
    out = {}
    for prefix, model in (("g", g), ("d", d)):
        out.update({f"{prefix}.{n}": t for n, t in acc._prepared.engine_of(model).named_full_tensors("master").items()})
    try:
        acc.save_state("/nonexistent-zerofit-two-models")
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return out, refusal


CONFIGS = [(0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (3, "none", "none"),
           (2, "cpu", "none"), (2, "cpu-device", "none"), (3, "cpu", "cpu")]


def run_all(rank: int, world: int) -> dict:
    return {(c, zero_first): train(rank, world, *c, zero_first) for c in CONFIGS for zero_first in (True, False)}


@pytest.fixture(scope="module")
def world2():
    return run_distributed(run_all, 2, timeout=300)


@pytest.mark.parametrize("zero_d_first", [True, False])
def test_a_gan_trains_as_plain_pytorch_at_every_stage(world2, zero_d_first):
    ref = reference(zero_d_first)
    g, d, _, _ = models()
    start = {**{f"g.{n}": p for n, p in g.named_parameters()}, **{f"d.{n}": p for n, p in d.named_parameters()}}
    assert min((ref[k] - start[k]).abs().max().item() for k in ref) > 1e-3  # every parameter moved
    for config in CONFIGS:
        for rank, result in enumerate(world2):
            got, _ = result[(config, zero_d_first)]
            worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
            assert worst <= TOL, f"stage/offload {config} rank {rank}: {worst:.3g} from PyTorch"


def test_save_state_with_two_trained_models_is_refused_naming_the_way_out(world2):
    for result in world2:
        _, refusal = result[((2, "none", "none"), True)]
        assert refusal is not None and "save_state with 2 models with optimizers is not supported" in refusal
        assert "get_state_dict(model)" in refusal


def test_fp16_with_two_trained_models_is_refused_at_prepare():
    acc = Accelerator(config=RunConfig(), mixed_precision="fp16")
    with pytest.raises(ValueError, match="fp16 loss scaling with several models with optimizers .* use bf16"):
        acc.prepare(*models())
