"""Optimizer and parameter offload give the same training as no offload (gloo, CPU).

On CPU the host is the device, so these runs exercise every offload code path (separate host
masters, gradient hand-off after each reduction, the host optimizer step, uploads of updated and of
offloaded parameters) while the arithmetic stays the same: accumulation 1 matches bit for bit, and
accumulation > 1 to 2e-6 (offloaded gradients are summed per micro-step, as in stage 2).
"""

from __future__ import annotations

import dataclasses

import pytest
from engine_cases import Case, max_diff, run_cases

from zerofit.testing.distributed import run_distributed

BASE = [Case(stage=s, gas=g) for s in (1, 2, 3) for g in (1, 4)] + [Case(stage=3, gas=2, precision="bf16"),
                                                                     Case(stage=2, clip=0.05),
                                                                     Case(stage=3, freeze=True, gas=2),
                                                                     Case(stage=3, sched=True)]
OFFLOADED = ([dataclasses.replace(c, offload="cpu") for c in BASE]
             + [dataclasses.replace(c, offload="cpu", offload_param="cpu") for c in BASE if c.stage == 3]
             + [dataclasses.replace(BASE[2], offload="cpu", ratio=0.5)])
FP16 = [Case(stage=2, precision="fp16", overflow_at=3), Case(stage=2, precision="fp16", overflow_at=3, offload="cpu")]




@pytest.fixture(scope="module")
def results():
    cases = BASE + OFFLOADED + FP16
    return dict(zip(cases, run_distributed(run_cases, 2, cases, timeout=600)[0]))


@pytest.mark.parametrize("case", OFFLOADED, ids=repr)
def test_offloaded_equals_on_device(results, case):
    got = results[case]
    assert got["offloaded"] > 0
    if case.offload_param != "none":
        assert got["param_offloaded"] > 0
    base = results[dataclasses.replace(case, offload="none", offload_param="none", ratio=1.0)]
    tol = 0.0 if case.gas == 1 or case.stage >= 2 else 2e-6
    assert max(abs(a - b) for a, b in zip(got["losses"], base["losses"])) <= tol * 10
    assert max_diff(got["params"], base["params"]) <= tol
    for g1, g2 in zip(got["grads"], base["grads"]):
        assert max_diff(g1, g2) <= tol


@pytest.mark.parametrize("case", OFFLOADED, ids=repr)
def test_host_steps_start_during_backward_only_when_exact(results, case):
    """No clipping, no fp16: from the second step on the host steps overlap backward (and the runs
    above still match the on-device runs bit for bit); with clipping they must wait for the norm."""
    early = results[case]["early"]
    if case.clip:
        assert early == 0
    else:
        assert early >= (case.steps - 1) * results[case]["offloaded"]


def test_partial_ratio_keeps_some_units_on_device(results):
    full = results[dataclasses.replace(BASE[2], offload="cpu")]["offloaded"]
    half = results[dataclasses.replace(BASE[2], offload="cpu", ratio=0.5)]["offloaded"]
    assert 0 < half < full


def test_fp16_overflow_skips_the_step_with_offload(results):
    a, b = results[FP16[0]], results[FP16[1]]
    assert a["skipped"] == b["skipped"] and b["skipped"][3]
    assert a["scale"] == b["scale"]
    assert max_diff(a["params"], b["params"]) == 0.0


def test_parameter_offload_on_one_rank():
    cases = [Case(stage=3, gas=2), Case(stage=3, gas=2, offload="cpu", offload_param="cpu")]
    plain, offloaded = run_distributed(run_cases, 1, cases)[0]
    assert offloaded["param_offloaded"] > 0  # one rank still keeps parameters off the device
    assert max_diff(plain["params"], offloaded["params"]) == 0.0
