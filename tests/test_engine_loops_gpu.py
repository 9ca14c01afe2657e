"""Loops off the one-backward, one-elementwise-optimizer path, on CUDA (one process). Skipped without a GPU.

- a script's own `loss.backward()` (the engine notices it from hooks autograd runs on its device thread)
  gives the same weights as `engine.backward(loss)`, at stages 0-3 and with GPU-stepped offload;
- Muon beside AdamW (an `OptimizerSet`: Muon's matrices stepped whole, AdamW's rest on shards, its state
  GPU-stepped from host memory) gives the same weights as the same optimizers with nothing offloaded.
"""

from __future__ import annotations

import pytest
import torch
from engine_cases import Case, batches, loss_fn, make_model_and_optim

from zerofit.config.schema import OffloadConfig, PrecisionConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.optimizer_set import OptimizerSet

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _zero(stage: int, offload: str) -> ZeroConfig:
    step_on = "device" if offload != "none" else "auto"
    return ZeroConfig(stage=stage, param_persistence_threshold=0,
                      offload_optimizer=OffloadConfig(device=offload, step_on=step_on))


def _train(stage: int, offload: str, precision: str, plain: bool):
    case = Case(stage=stage, steps=4)
    model, opt = make_model_and_optim(case)
    engine = ZeroEngine(model, opt, zero=_zero(stage, offload), device=torch.device("cuda"),
                        precision=PrecisionConfig(mixed_precision=precision))
    for x, y in batches(case):
        loss = loss_fn(model(x.cuda()), y.cuda())
        if plain:
            loss.backward()
        else:
            engine.backward(loss)
        assert engine.step()
    return {k: v.cpu() for k, v in engine.named_full_tensors("master").items()}


@requires_cuda
@pytest.mark.parametrize("stage,offload", [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "cpu")])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_plain_backward_equals_the_engines_backward_on_cuda(stage, offload, precision):
    ours, plain = _train(stage, offload, precision, False), _train(stage, offload, precision, True)
    assert all(torch.equal(ours[k], plain[k]) for k in ours)


def _muon(stage: int, offload: str):
    case = Case(stage=stage, steps=4)
    model, _ = make_model_and_optim(case)
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "blocks" in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "blocks" in n)]
    opt = OptimizerSet([torch.optim.Muon(matrices, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2, fused=True)])
    engine = ZeroEngine(model, opt, zero=_zero(stage, offload), device=torch.device("cuda"),
                        precision=PrecisionConfig(mixed_precision="bf16"), gradient_clipping=1.0)
    for x, y in batches(case):
        engine.backward(loss_fn(model(x.cuda()), y.cuda()))
        engine.step()
    return {k: v.cpu() for k, v in engine.named_full_tensors("master").items()}


@requires_cuda
@pytest.mark.parametrize("stage", [2, 3])
def test_muon_beside_adamw_with_gpu_stepped_offload_equals_state_on_the_gpu(stage):
    on_gpu, offloaded = _muon(stage, "none"), _muon(stage, "cpu")
    worst = max((on_gpu[k] - offloaded[k]).abs().max().item() for k in on_gpu)
    assert worst == 0.0, worst
