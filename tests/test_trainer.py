"""transformers' Trainer and TRL's SFT / DPO trainers on zerofit train as the unsharded reference (#26).

2 gloo ranks, a tiny GPT-2 built from a config, every ZeRO stage with and without offload, full
fine-tuning and LoRA: the logged losses and the saved weights equal a single-process run of the
library's own class (real Accelerate, no zerofit) on the same global batch; a run resumed from its
step-2 checkpoint in a fresh Trainer ends bit-identical to the uninterrupted one; a ZeRO-3 checkpoint
resumes at one process under ZeRO-2; and a plain `Trainer` under DDP (Accelerate's own data sharding)
logs the same losses as zerofit's. transformers, accelerate, peft, trl and datasets come from the
`trainer` extra; without them the file is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("peft")
pytest.importorskip("trl")
pytest.importorskip("datasets")

import trainer_cases as tc  # noqa: E402
from engine_cases import max_diff  # noqa: E402

from zerofit.checkpoint.chunks import read_index  # noqa: E402
from zerofit.checkpoint.sharded import STATE_DIR  # noqa: E402
from zerofit.integrations.transformers import ZEROFIT_STATE  # noqa: E402
from zerofit.testing.distributed import run_distributed  # noqa: E402

LOSS_TOL = 2e-6
WEIGHT_TOL = 2e-5  # AdamW divides tiny gradients by tiny second moments: a 1e-9 difference in a gradient
# near zero (the two batch splits round their sums differently) moves such a weight by ~1e-6 per step

CONFIGS = {
    "stage0": {"zero": {"stage": 0}},
    "stage2": {"zero": {"stage": 2}},
    "stage2_offload": {"zero": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "stage2_gpu_stepped": {"zero": {"stage": 2, "offload_optimizer": {"device": "cpu", "step_on": "device"}}},
    "stage3": {"zero": {"stage": 3, "param_persistence_threshold": 0}},
    "stage3_offload": {"zero": {"stage": 3, "param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"},
                                "offload_param": {"device": "cpu"}}},
}
FULL, LORA, EVAL, PROMPT = tc.Run(), tc.Run(lora=True), tc.Run(evaluate=True), tc.Run(prompt=True)
NOCLIP = tc.Run(max_grad_norm=0.0)  # offloaded updates start during backward from the second step on
SFT, SFT_LORA, DPO = tc.Run("sft"), tc.Run("sft", lora=True), tc.Run("dpo")
CASES = ([(FULL, c) for c in CONFIGS] + [(LORA, c) for c in ("stage0", "stage2", "stage3", "stage3_offload")]
         + [(EVAL, "stage3"), (PROMPT, "stage3"), (SFT, "stage0"), (SFT, "stage2_offload"), (SFT, "stage3"),
            (SFT_LORA, "stage3"), (DPO, "stage3")]
         + [(NOCLIP, c) for c in ("stage2_offload", "stage2_gpu_stepped", "stage3_offload")])


# Resumed too (a second Trainer from checkpoint-2): every stage and offload once, and each other kind at ZeRO-3
RESUMED = [(FULL, c) for c in CONFIGS] + [(LORA, "stage3_offload"), (PROMPT, "stage3"), (SFT, "stage3"),
                                          (DPO, "stage3"), (NOCLIP, "stage2_gpu_stepped")]


def _case_id(case) -> str:
    run, config = case
    extras = "".join(f"_{name}" for name in ("lora", "evaluate", "prompt") if getattr(run, name))
    extras += "_noclip" if run.max_grad_norm == 0 else ""
    return f"{run.kind}{extras}-{config}"


def _zerofit_runs(rank: int, world: int, root: str) -> dict:
    out = {}
    for run, config in CASES:
        os.environ["ZEROFIT_CONFIG_FILE"] = os.path.join(root, f"{config}.json")
        where = os.path.join(root, _case_id((run, config)))
        out[_case_id((run, config))] = {"whole": tc.run(run, where, zerofit=True)}
        state = os.path.join(where, "checkpoint-2", ZEROFIT_STATE, STATE_DIR)
        out[_case_id((run, config))]["frozen_saved"] = sum(k.startswith("param/") for k in read_index(Path(state)))
        if (run, config) in RESUMED:
            again = tc.run(tc.Run(**{**run.__dict__, "resume_from": os.path.join(where, "checkpoint-2")}),
                           where + "-resumed", zerofit=True)
            out[_case_id((run, config))]["resumed"] = again
    os.environ.pop("ZEROFIT_CONFIG_FILE")
    ddp = tc.run(FULL, os.path.join(root, "ddp"), zerofit=False)  # the library's own Trainer: Accelerate's DDP
    return {"zerofit": out, "ddp": ddp}


def _references(rank: int, world: int, root: str) -> dict:
    """One process, per-device batch doubled: the same global batch as the 2-rank runs, unsharded."""
    out = {}
    for run in (FULL, LORA, EVAL, PROMPT, SFT, SFT_LORA, DPO, NOCLIP):
        out[_case_id((run, "reference"))] = tc.run(tc.Run(**{**run.__dict__, "per_device": 2 * run.per_device}),
                                                   os.path.join(root, _case_id((run, "reference"))), zerofit=False)
    # a ZeRO-3 checkpoint of 2 ranks, resumed by 1 process under ZeRO-2 offload (another world, stage, offload)
    os.environ["ZEROFIT_CONFIG_FILE"] = os.path.join(root, "stage2_offload.json")
    source = os.path.join(root, _case_id((FULL, "stage3")), "checkpoint-2")
    out["regrouped"] = tc.run(tc.Run(per_device=8, resume_from=source), os.path.join(root, "regrouped"), zerofit=True)
    os.environ.pop("ZEROFIT_CONFIG_FILE")
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trainer"))
    tc.write_configs(root, CONFIGS)
    ranks = run_distributed(_zerofit_runs, 2, root, timeout=600)
    reference = run_distributed(_references, 1, root, timeout=300)[0]
    return {"ranks": ranks, "reference": reference}


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_trains_as_the_unsharded_reference(results, case):
    run, _ = case
    got = results["ranks"][0]["zerofit"][_case_id(case)]["whole"]
    want = results["reference"][_case_id((run, "reference"))]
    assert len(got["losses"]) == run.steps
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) < LOSS_TOL, (got["losses"], want["losses"])
    assert max_diff(tc.saved_weights(got["saved"]), tc.saved_weights(want["saved"])) < WEIGHT_TOL
    assert len(got["evals"]) == len(want["evals"])  # evaluate() before train() (unsharded), then every 2 steps
    if run is NOCLIP:  # every NOCLIP case offloads the optimizer
        assert got["early"] > 0  # Trainer's loop lets offloaded updates start during backward
    assert max((abs(a - b) for a, b in zip(got["evals"], want["evals"])), default=0.0) < LOSS_TOL


@pytest.mark.parametrize("case", RESUMED, ids=_case_id)
def test_a_resumed_run_ends_bit_identical(results, case):
    got = results["ranks"][0]["zerofit"][_case_id(case)]
    assert max_diff(tc.saved_weights(got["whole"]["saved"]), tc.saved_weights(got["resumed"]["saved"])) == 0.0
    assert got["resumed"]["losses"] == got["whole"]["losses"]  # steps 1-2 from the checkpoint's trainer state


def test_lora_saves_the_adapter_alone_and_it_reloads_into_a_plain_peft_model(results):
    import peft

    saved = results["ranks"][0]["zerofit"][_case_id((LORA, "stage3_offload"))]["whole"]["saved"]
    adapter = tc.saved_weights(saved)
    assert adapter and all("lora_" in k for k in adapter) and all(t.numel() > 0 for t in adapter.values())
    model = peft.PeftModel.from_pretrained(tc.tiny_gpt2(), saved)
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(adapter)


@pytest.mark.parametrize("case", [c for c in CASES if c[0].lora], ids=_case_id)
def test_a_peft_models_checkpoint_holds_no_frozen_weight(results, case):
    """As Trainer under DeepSpeed (`exclude_frozen_parameters`): the base is the script's to load again; the
    resumed LoRA run above still ends bit-identical."""
    assert results["ranks"][0]["zerofit"][_case_id(case)]["frozen_saved"] == 0


def test_a_zero3_checkpoint_of_two_ranks_resumes_at_one_process_under_zero2_offload(results):
    whole = results["ranks"][0]["zerofit"][_case_id((FULL, "stage3"))]["whole"]
    regrouped = results["reference"]["regrouped"]
    assert len(regrouped["losses"]) == len(whole["losses"])
    assert max(abs(a - b) for a, b in zip(regrouped["losses"], whole["losses"])) < LOSS_TOL
    assert max_diff(tc.saved_weights(regrouped["saved"]), tc.saved_weights(whole["saved"])) < WEIGHT_TOL


def test_zerofit_logs_the_losses_of_trainer_under_ddp(results):
    ddp = results["ranks"][0]["ddp"]["losses"]
    for config in ("stage0", "stage3"):
        ours = results["ranks"][0]["zerofit"][_case_id((FULL, config))]["whole"]["losses"]
        assert max(abs(a - b) for a, b in zip(ours, ddp)) < 1e-6, (config, ours, ddp)
