"""A checkpoint saved at world size 2 (stage 3, stage 1) loads at world sizes 1 and 3 under stages 0, 2
and 3 (and stage 3 with CPU offload), with every fp32 master and optimizer state element exactly as saved."""

from __future__ import annotations

import os

import pytest
import torch
from test_checkpoint_support import assemble, build, owned_state, train

from zerofit.checkpoint import load_state, save_state
from zerofit.testing.distributed import run_distributed

pytestmark = pytest.mark.slow  # a long parity sweep: the full suite runs it, the fast loop does not

SAVED = {"s3": 3, "s1": 1}
LOAD_STAGES = (0, 2, 3, "3+offload")


def save_both(rank, world, root):
    out = {}
    for name, stage in SAVED.items():
        case, model, _, engine = build(stage, freeze=True)
        train(engine, model, case, rank, world, range(3))
        save_state(os.path.join(root, name), engine, extra_state={"rank": rank, "stage": stage})
        out[name] = owned_state(engine, rank)
    return out


def load_all(rank, world, root):
    out = {}
    for name in SAVED:
        for stage in LOAD_STAGES:
            case, model, _, engine = build(int(str(stage)[0]), freeze=True, perturb=0.5,
                                           offload=str(stage).endswith("offload"))
            before = owned_state(engine, rank)
            # "s1" resolves through root/latest (the last save), "s3" is named directly
            extra = load_state(root if name == "s1" else os.path.join(root, name), engine)
            params, masters = engine.named_full_tensors("param"), engine.named_full_tensors("master")
            refreshed = all(torch.equal(params[k], v) for k, v in masters.items())
            after = owned_state(engine, rank)
            loss = train(engine, model, case, rank, world, range(3, 4))[0]  # the loaded state trains on
            out[(name, stage)] = {"before": before, "after": after, "extra": extra,
                                  "refreshed": refreshed, "loss": loss}
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    per_rank = run_distributed(save_both, 2, str(root))
    return str(root), {name: assemble([r[name] for r in per_rank]) for name in SAVED}


@pytest.mark.parametrize("world", [1, 3])
def test_reshard_loads_exact_state(saved, world):
    root, want = saved
    per_rank = run_distributed(load_all, world, root)
    for name in SAVED:
        for stage in LOAD_STAGES:
            results = [r[(name, stage)] for r in per_rank]
            got = assemble([r["after"] for r in results])
            before = assemble([r["before"] for r in results])
            expected = want[name]
            assert sorted(got) == sorted(expected), (name, stage)
            assert any(k[1] == "exp_avg_sq" for k in got) and any(k[1] == "param" for k in got)
            for key, value in expected.items():
                assert torch.equal(got[key], value), (name, stage, key)
            # not vacuous: the fresh engine held other values and no optimizer state before loading
            assert not torch.equal(before[("emb.weight", "master")], expected[("emb.weight", "master")])
            assert ("emb.weight", "exp_avg") not in before
            assert all(r["refreshed"] for r in results), (name, stage)
            assert [r["extra"]["rank"] for r in results] == [r % 2 for r in range(world)]
            assert results[0]["extra"]["stage"] == SAVED[name]
            assert len({r["loss"] for r in results}) == 1
        # the loaded state trains on: one more step gives the same loss under every stage
        losses = [per_rank[0][(name, stage)]["loss"] for stage in LOAD_STAGES]
        assert max(losses) - min(losses) < 1e-6, (name, losses)

