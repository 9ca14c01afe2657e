"""The engine on CUDA (side streams, NCCL-free world of one): same results as on CPU. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from engine_cases import Case, batches, loss_fn, make_model_and_optim

from zerofit.config.schema import PrecisionConfig, ZeroConfig
from zerofit.engine import ZeroEngine

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _train(device: str, stage: int, precision: str = "no", gas: int = 2):
    case = Case(stage=stage, gas=gas, steps=6)
    model, opt = make_model_and_optim(case)
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=stage), device=torch.device(device),
                        precision=PrecisionConfig(mixed_precision=precision), gradient_accumulation_steps=gas,
                        gradient_clipping=0.5)
    losses = []
    micro = case.batch // gas
    for x, y in batches(case):
        for k in range(gas):
            loss = loss_fn(model(x[k * micro:(k + 1) * micro].to(device)), y[k * micro:(k + 1) * micro].to(device))
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, {k: v.cpu() for k, v in engine.named_full_tensors("master").items()}


@requires_cuda
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cuda_matches_cpu_in_fp32(stage):
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu_losses, cpu_params = _train("cpu", stage)
    gpu_losses, gpu_params = _train("cuda", stage)
    assert max(abs(a - b) for a, b in zip(cpu_losses, gpu_losses)) < 1e-4
    assert max((cpu_params[k] - gpu_params[k]).abs().max().item() for k in cpu_params) < 1e-4


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_low_precision_trains(precision):
    losses, _ = _train("cuda", 3, precision)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
