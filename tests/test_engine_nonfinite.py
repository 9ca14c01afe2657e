"""fp32 / bf16 have no loss scaler to catch a NaN or inf: the engine names the step whose gradient norm was
not finite, and with `precision.skip_nonfinite_steps` skips it on every rank (as fp16's scaler does)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from zerofit.config.schema import OffloadConfig, PrecisionConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.testing.distributed import run_distributed


def _train(skip: bool, clip: float, bad_step: int = 2, steps: int = 4, stage: int = 2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=stage), precision=PrecisionConfig(skip_nonfinite_steps=skip),
                        gradient_clipping=clip, device=torch.device("cpu"))
    results = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(1, steps + 1):
            loss = model(torch.ones(2, 4)).pow(2).mean()
            if step == bad_step:
                loss = loss * float("nan")
            engine.backward(loss)
            results.append(engine.step())
    finite = all(bool(torch.isfinite(t).all()) for t in engine.named_full_tensors("master").values())
    return results, finite, [str(w.message) for w in seen if "gradient norm" in str(w.message)]


def test_a_nan_step_is_named_and_left_applied_by_default():
    applied, finite, said = _train(skip=False, clip=1.0)
    assert applied == [True] * 4 and not finite
    assert len(said) == 1 and said[0].startswith("optimizer step 2: the gradient norm was NaN or inf, and the step "
                                                 "was applied") and "precision.skip_nonfinite_steps: true" in said[0]


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_with_the_switch_a_nan_step_is_skipped_and_the_weights_stay_finite(clip):
    applied, finite, said = _train(skip=True, clip=clip)
    assert applied == [True, False, True, True] and finite
    assert said == ["optimizer step 2: the gradient norm is nan; the step was skipped on every rank "
                    "(precision.skip_nonfinite_steps)"]


def _two_ranks(rank, world):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), zero=ZeroConfig(stage=2),
                        precision=PrecisionConfig(skip_nonfinite_steps=True), device=torch.device("cpu"))
    out = []
    for step in range(3):
        loss = model(torch.ones(2, 4)).sum()
        if step == 1 and rank == 1:  # only one rank's gradient goes bad
            loss = loss * float("inf")
        engine.backward(loss)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.append(engine.step())
    return out, {k: v.tolist() for k, v in engine.named_full_tensors("master").items()}


def test_one_ranks_bad_gradient_skips_the_step_on_every_rank():
    (steps0, params0), (steps1, params1) = run_distributed(_two_ranks, 2, timeout=120)
    assert steps0 == steps1 == [True, False, True] and params0 == params1


def test_offloaded_groups_do_not_start_stepping_before_the_norm_is_known():
    model = nn.Linear(4, 1)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        zero=ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu")),
                        precision=PrecisionConfig(skip_nonfinite_steps=True), device=torch.device("cpu"))
    assert "skip_nonfinite_steps" in engine.early_off
