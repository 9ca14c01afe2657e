"""Compact gradients (one rank, no accumulation, bf16/fp16 compute): half the gradient bytes, the same
update as fp32 gradient buffers (see [Note: compact gradients] in zerofit.engine.optim)."""

from __future__ import annotations

import warnings

import pytest
import torch
from engine_cases import Case, batches, loss_fn, make_model_and_optim

from zerofit.config.schema import OffloadConfig, PrecisionConfig, ZeroConfig
from zerofit.engine import ZeroEngine


def _engine(stage=2, precision="bf16", gas=1, clip=0.0, optim="adamw", offload="none", ratio=1.0, wide=False):
    model, opt = make_model_and_optim(Case(optim=optim))
    if optim == "foreach":  # not fused: the unscale/clip factor cannot be folded into the kernel
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=stage, offload_optimizer=OffloadConfig(device=offload,
                                                                                                 ratio=ratio)),
                        precision=PrecisionConfig(mixed_precision=precision), gradient_accumulation_steps=gas,
                        gradient_clipping=clip, device=torch.device("cpu"))
    if wide:
        engine.mode.widen()  # the fp32 gradient path, as a second backward would switch to
    return model, opt, engine


def _train(model, engine, steps=6, backwards=1):
    losses = []
    for x, y in batches(Case(steps=steps)):
        for k in range(backwards):
            half = x.shape[0] // backwards
            loss = loss_fn(model(x[k * half:(k + 1) * half]), y[k * half:(k + 1) * half])
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.named_full_tensors("master")


def _same(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_one_rank_without_accumulation_keeps_gradients_in_the_compute_dtype():
    for stage in range(4):
        _, _, engine = _engine(stage=stage)
        assert all(g.grad_shard.dtype == torch.bfloat16 for g in engine.trainable_groups), stage
    for kwargs in ({"precision": "no"}, {"gas": 2}, {"offload": "cpu"}):
        _, _, engine = _engine(**kwargs)
        assert all(g.grad_shard.dtype == torch.float32 for g in engine.trainable_groups), kwargs
    _, _, engine = _engine(offload="cpu", ratio=0.5)  # the groups that stay on the device are compact
    kept = [g for g in engine.trainable_groups if not g.placement.host_stepped]
    assert kept and all(g.compact for g in kept)
    assert all(not g.compact for g in [g for g in engine.trainable_groups if g.placement.host_stepped])


@pytest.mark.parametrize("precision,clip,optim", [("bf16", 0.0, "adamw"), ("bf16", 0.5, "adamw"),
                                                  ("bf16", 0.5, "foreach"), ("fp16", 0.5, "adamw"),
                                                  ("bf16", 0.5, "sgd")])
def test_compact_steps_match_fp32_gradient_buffers(precision, clip, optim):
    model_a, _, compact = _engine(precision=precision, clip=clip, optim=optim)
    model_b, _, wide = _engine(precision=precision, clip=clip, optim=optim, wide=True)
    assert compact.mode.compact and not wide.mode.compact
    la, pa = _train(model_a, compact)
    lb, pb = _train(model_b, wide)
    # without clipping the same numbers meet the same kernels; with it, the norm's summation order
    # differs (fp32 norm of bf16 shards vs of their fp32 copies) by rounding at most
    tol = 0.0 if clip == 0 else 1e-6
    assert max(abs(a - b) for a, b in zip(la, lb)) <= tol * 10
    assert _same(pa, pb) <= tol, _same(pa, pb)
    assert compact.last_grad_norm is None or torch.isfinite(compact.last_grad_norm)


def test_offload_ratio_steps_the_compact_device_part_with_the_host_part():
    model_a, _, compact = _engine(offload="cpu", ratio=0.5, clip=0.5)
    model_b, _, wide = _engine(offload="cpu", ratio=0.5, clip=0.5, wide=True)
    la, pa = _train(model_a, compact)
    lb, pb = _train(model_b, wide)
    assert _same(pa, pb) <= 1e-6


def test_a_second_backward_before_step_widens_first():
    model_a, _, compact = _engine()
    model_b, _, wide = _engine(wide=True)
    la, pa = _train(model_a, compact, backwards=2)
    lb, pb = _train(model_b, wide, backwards=2)
    assert not compact.mode.compact and all(g.grad_shard.dtype == torch.float32 for g in compact.trainable_groups)
    assert la == lb and _same(pa, pb) == 0.0  # the first backward's bf16 values carried over exactly
    grads = compact.named_full_tensors("grad")
    assert all(t.dtype == torch.float32 for t in grads.values())


def test_schedulers_see_the_step():
    model, opt, engine = _engine()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        for x, y in batches(Case(steps=2)):
            engine.backward(loss_fn(model(x), y))
            engine.step()
            sched.step()
