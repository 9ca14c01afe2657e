"""Every TRL trainer zerofit exports trains as TRL's own class does (#38).

2 gloo ranks, a tiny GPT-2 saved to disk, fp32, 2 steps, ZeRO-2 and ZeRO-3 with optimizer and parameter
offload. `RewardTrainer` and `KTOTrainer` (KTO's reference model prepared frozen) equal a single-process
run of TRL's class on the same global batch. GRPO, RLOO (both with `beta > 0`: a frozen reference model)
and distillation sample completions with a per-rank seed (seed + process index, through Accelerate's
state), so they equal TRL's class under Accelerate's DDP on the same 2 ranks; GRPO's and RLOO's losses are
about zero by construction, so their gradient norms and saved weights are what is compared. Nothing
imports deepspeed, and `DistillationTrainer` at ZeRO-3 is refused by name (tests/trl_cases.py builds each).
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("trl")
pytest.importorskip("datasets")

import trainer_cases as tc  # noqa: E402
import trl_cases as tr  # noqa: E402
from engine_cases import max_diff  # noqa: E402

from zerofit.testing.distributed import run_distributed  # noqa: E402

LOSS_TOL = 1e-5
WEIGHT_TOL = 2e-5  # as tests/test_trainer.py: AdamW divides near-zero gradients by near-zero second moments
NOISE = {"reward": {"transformer.ln_f.bias"}}
"""Weights whose gradient is zero in exact arithmetic, so AdamW steps them by the sign of rounding noise, up to
lr per step, differently for any other summation order: a reward model's last norm bias moves the chosen and
the rejected score alike, and the loss reads only their difference. Bounded by 2 lr (2 steps)."""
LR = 1e-3

CONFIGS = {
    "stage2": {"zero": {"stage": 2}},
    "stage3_offload": {"zero": {"stage": 3, "param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"},
                                "offload_param": {"device": "cpu"}}},
}
CASES = [(kind, config) for kind in ("grpo", "rloo", "reward", "kto") for config in CONFIGS] + [
    ("distillation", "stage2")]


def _zerofit_runs(rank: int, world: int, root: str) -> dict:
    out = {}
    for kind, config in CASES:
        os.environ["ZEROFIT_CONFIG_FILE"] = os.path.join(root, f"{config}.json")
        out[f"{kind}-{config}"] = tr.run(kind, root, os.path.join(root, f"{kind}-{config}"), zerofit=True, per_device=4)
    out["deepspeed_imported"] = "deepspeed" in sys.modules
    os.environ["ZEROFIT_CONFIG_FILE"] = os.path.join(root, "stage3.json")
    try:
        tr.run("distillation", root, os.path.join(root, "distillation-stage3"), zerofit=True, per_device=4)
        out["distillation_stage3"] = "trained"
    except Exception as e:  # noqa: BLE001 - the refusal's message is what the test checks
        out["distillation_stage3"] = f"{type(e).__name__}: {e}"
    os.environ.pop("ZEROFIT_CONFIG_FILE")
    for kind in tr.SAMPLING:  # TRL's own class under Accelerate's DDP, on the same ranks and seeds
        out[f"{kind}-ddp"] = tr.run(kind, root, os.path.join(root, f"{kind}-ddp"), zerofit=False, per_device=4)
    return out


def _single_process(rank: int, world: int, root: str) -> dict:
    return {kind: tr.run(kind, root, os.path.join(root, f"{kind}-one"), zerofit=False, per_device=8)
            for kind in ("reward", "kto")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trl"))
    tr.write_models(root)
    tc.write_configs(root, {**CONFIGS, "stage3": {"zero": {"stage": 3}}})
    ranks = run_distributed(_zerofit_runs, 2, root, timeout=600)
    return {"ranks": ranks[0], "one": run_distributed(_single_process, 1, root, timeout=300)[0]}


def _reference(results, kind):
    return results["ranks"][f"{kind}-ddp"] if kind in tr.SAMPLING else results["one"][kind]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_trains_as_trls_own_class(results, case):
    kind, config = case
    got, want = results["ranks"][f"{kind}-{config}"], _reference(results, kind)
    assert len(got["losses"]) == 2 and len(got["grad_norms"]) == 2
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) < LOSS_TOL, (got["losses"], want["losses"])
    assert max(abs(a - b) / max(b, 1e-3) for a, b in zip(got["grad_norms"], want["grad_norms"])) < LOSS_TOL, (
        got["grad_norms"], want["grad_norms"])
    got_w, want_w = tc.saved_weights(got["saved"]), tc.saved_weights(want["saved"])
    noise = NOISE.get(kind, set())
    assert max_diff({k: v for k, v in got_w.items() if k not in noise},
                    {k: v for k, v in want_w.items() if k not in noise}) < WEIGHT_TOL
    assert all((got_w[k] - want_w[k]).abs().max() <= 2 * LR for k in noise)


def test_grpo_at_zero3_never_imports_deepspeed(results):
    """TRL gathers ZeRO-3 weights for generation with deepspeed when the accelerator's state claims ZeRO-3."""
    assert results["ranks"]["deepspeed_imported"] is False


def test_distillation_at_zero3_is_refused_naming_the_stage(results):
    message = results["ranks"]["distillation_stage3"]
    assert message.startswith("ConfigError") and "zero_optimization.stage is 3" in message
    assert "set zero_optimization.stage to 2 or lower" in message


def test_vllm_generation_is_refused_by_name():
    """TRL would copy each rank's ZeRO-3 shard (empty) into vLLM: refused when the Trainer is built."""
    from types import SimpleNamespace

    from zerofit.errors import ConfigError
    from zerofit.integrations.transformers import _refuse_other_engines

    with pytest.raises(ConfigError, match=r"use_vllm=True\): zerofit does not send .* drop --use_vllm"):
        _refuse_other_engines(SimpleNamespace(use_vllm=True))
