"""Exact resume: 12 steps straight == 6 steps, save, new processes, load, 6 more (bit-identical losses),
and `extra_state` (RNG states, counters, nested values) comes back to the rank that saved it."""

from __future__ import annotations

import os

import pytest
import torch
from test_checkpoint_support import build, train

from zerofit.checkpoint import load_state, save_state, saved_config
from zerofit.config.schema import RunConfig, ZeroConfig
from zerofit.testing.distributed import run_distributed

PRECISIONS = ("no", "bf16", "fp16")
STAGE = 3


def extra_for(rank: int, step: int) -> dict:
    torch.manual_seed(100 + rank)
    return {"step": step, "rank": rank, "rng": torch.get_rng_state(), "ids": (1, 2.5, None),
            "by_epoch": {0: "a", 3: "b"}, "nested": {"lr": [0.1, 0.01], "flag": True}}


def straight_and_save(rank, world, root):
    out = {}
    for precision in PRECISIONS:
        case, model, _, engine = build(STAGE, precision=precision)
        out[precision] = train(engine, model, case, rank, world, range(12))
        case, model, _, engine = build(STAGE, precision=precision)
        train(engine, model, case, rank, world, range(6))
        config = RunConfig(zero=ZeroConfig(stage=STAGE))
        save_state(os.path.join(root, precision, "step-6"), engine, extra_state=extra_for(rank, 6), config=config)
        out[precision + ":scale"] = engine.scaler.state_dict()
    return out


def resume(rank, world, root):
    out = {}
    for precision in PRECISIONS:
        case, model, _, engine = build(STAGE, precision=precision, perturb=0.25)
        extra = load_state(os.path.join(root, precision), engine)
        out[precision + ":scale"] = engine.scaler.state_dict()
        out[precision] = train(engine, model, case, rank, world, range(6, 12))
        out[precision + ":extra"] = extra
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    first = run_distributed(straight_and_save, 2, root)
    second = run_distributed(resume, 2, root)
    return root, first, second


@pytest.mark.slow  # a sweep of trained runs
@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_is_bit_identical(runs, precision):
    _, first, second = runs
    straight = first[0][precision]
    assert len(straight) == 12 and len(set(straight)) > 1
    assert second[0][precision] == straight[6:]  # exact float equality, not a tolerance
    assert second[1][precision] == straight[6:]
    assert second[0][precision + ":scale"] == first[0][precision + ":scale"]


def test_extra_state_comes_back_to_its_rank(runs):
    root, _, second = runs
    for rank in range(2):
        want = extra_for(rank, 6)
        got = second[rank]["no:extra"]
        assert torch.equal(got.pop("rng"), want.pop("rng"))
        assert got == want
        assert isinstance(got["ids"], tuple) and 3 in got["by_epoch"]
    assert saved_config(os.path.join(root, "no")).zero.stage == STAGE
