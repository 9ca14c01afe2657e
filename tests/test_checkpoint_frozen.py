"""`save_state(exclude_frozen=True)`: a checkpoint without the frozen parameters' values ([Note: a checkpoint
without the frozen weights] in zerofit.checkpoint.sharded), at ZeRO-3 on 2 gloo ranks.

It holds every trainable value and optimizer state element exactly as a full checkpoint does and no frozen
value; loaded into a model built the same way it restores the same state; a frozen parameter keeps what the
loading model holds; `zerofit merge` refuses it, naming why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_checkpoint_support import assemble, build, owned_state, train

from zerofit.checkpoint import load_state, save_state
from zerofit.checkpoint.chunks import read_index
from zerofit.checkpoint.merge import merge
from zerofit.checkpoint.sharded import STATE_DIR
from zerofit.errors import CheckpointError
from zerofit.testing.distributed import run_distributed


def frozen_names(engine) -> set[str]:
    return {name for g in engine.groups if not g.trainable for name in g.names}


def save_and_load(rank, world, root):
    case, model, _, engine = build(3, freeze=True)
    train(engine, model, case, rank, world, range(3))
    save_state(os.path.join(root, "full"), engine)
    save_state(os.path.join(root, "trainable"), engine, exclude_frozen=True)
    out = {"saved": owned_state(engine, rank), "frozen": frozen_names(engine)}
    for name, perturb in (("full", 0.0), ("trainable", 0.0), ("trainable_other_base", 0.5)):
        _, _, _, fresh = build(3, freeze=True, perturb=perturb)  # untrained: other masters, no optimizer state
        before = owned_state(fresh, rank)
        load_state(os.path.join(root, name.removesuffix("_other_base")), fresh)
        out[name] = {"before": before, "after": owned_state(fresh, rank)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen")
    return str(root), run_distributed(save_and_load, 2, str(root))


def test_it_holds_no_frozen_value_and_every_other_one(runs):
    root, per_rank = runs
    frozen = per_rank[0]["frozen"]
    assert frozen
    full, trainable = (set(read_index(Path(root, name, STATE_DIR))) for name in ("full", "trainable"))
    assert {f"param/{n}" for n in frozen} <= full
    assert trainable == {k for k in full if not k.startswith("param/")}
    size = {name: sum(f.stat().st_size for f in Path(root, name, STATE_DIR).iterdir())
            for name in ("full", "trainable")}
    assert size["trainable"] < size["full"], size


def test_it_loads_the_state_a_full_checkpoint_loads(runs):
    _, per_rank = runs
    want = assemble([r["saved"] for r in per_rank])
    for name in ("full", "trainable"):
        got = assemble([r[name]["after"] for r in per_rank])
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            assert torch.equal(got[key], value), (name, key)
    before = assemble([r["trainable"]["before"] for r in per_rank])
    assert not all(torch.equal(before[k], v) for k, v in want.items() if k[1] == "master")  # not vacuous


def test_a_frozen_parameter_keeps_what_the_loading_model_holds(runs):
    _, per_rank = runs
    want = assemble([r["saved"] for r in per_rank])
    before = assemble([r["trainable_other_base"]["before"] for r in per_rank])
    got = assemble([r["trainable_other_base"]["after"] for r in per_rank])
    for (name, key), value in got.items():
        if key == "param":  # frozen: the loading model's own (another base here), not the checkpoint's
            assert torch.equal(value, before[(name, key)]) and not torch.equal(value, want[(name, key)])
        else:
            assert torch.equal(value, want[(name, key)]), (name, key)


def test_merge_refuses_it_naming_why(runs, tmp_path):
    root, _ = runs
    with pytest.raises(CheckpointError, match="exclude_frozen_parameters.*frozen parameters.*save_model"):
        merge(os.path.join(root, "trainable"), tmp_path / "out")
    assert merge(os.path.join(root, "full"), tmp_path / "full_out")  # the full one merges
