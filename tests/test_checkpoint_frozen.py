"""`save_state(exclude_frozen=True)`: a checkpoint without the frozen parameters' values ([Note: a checkpoint
without the frozen weights] in zerofit.checkpoint.sharded), at ZeRO-3 on 2 gloo ranks.

It holds every trainable value and optimizer state element exactly as a full checkpoint does and no frozen
value; loaded into a model built the same way it restores the same state; a model built on another base is
refused before anything loads; `zerofit merge` refuses it, naming why.
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
    for name in ("full", "trainable"):
        _, _, _, fresh = build(3, freeze=True)  # untrained: other masters, no optimizer state
        before = owned_state(fresh, rank)
        load_state(os.path.join(root, name), fresh)
        out[name] = {"before": before, "after": owned_state(fresh, rank)}
    _, _, _, other = build(3, freeze=True, perturb=0.5)  # another base
    before = owned_state(other, rank)
    try:
        load_state(os.path.join(root, "trainable"), other)
        out["other_base"] = None
    except CheckpointError as e:
        out["other_base"] = {"error": str(e), "untouched": all(
            all(torch.equal(t, b[2][k]) for k, t in a[2].items()) for a, b in zip(owned_state(other, rank), before))}
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


def test_a_model_built_on_another_base_is_refused_before_anything_loads(runs):
    """The frozen values are the loading model's own, so they must be the base the run was saved with: the
    checkpoint's probe of each frozen parameter's first values says whether they are."""
    _, per_rank = runs
    for r in per_rank:
        got = r["other_base"]
        assert got is not None, "loaded into another base without a word"
        assert all(words in got["error"] for words in ("from another base", "(flattened) is", "same from_pretrained"))
        assert got["untouched"]  # refused before any value was read in


def test_merge_refuses_it_naming_why(runs, tmp_path):
    root, _ = runs
    with pytest.raises(CheckpointError, match="exclude_frozen_parameters.*frozen parameters.*save_model"):
        merge(os.path.join(root, "trainable"), tmp_path / "out")
    assert merge(os.path.join(root, "full"), tmp_path / "full_out")  # the full one merges


def test_the_base_probe_compares_exactly_in_one_dtype_and_within_the_coarser_rounding_across_two():
    from zerofit.checkpoint.sharded import base_probe, merge_probes, other_base
    from zerofit.engine.state import Fragment

    def frag(values, dtype, start=0, numel=None):
        t = torch.tensor(values, dtype=dtype)
        return Fragment(name="w", shape=(numel or len(values),), dtype=dtype, numel=numel or len(values), start=start,
                        length=len(values), trainable=False, tensors={"param": t})

    base = torch.linspace(-1, 1, 16).tolist()
    base[0] = 0.0  # a padding row: the same in many bases, so the probe looks across the whole parameter
    saved = base_probe([frag(base, torch.float32)])
    assert len(saved["w"]["values"]) == 8 and "0" in saved["w"]["values"] and "14" in saved["w"]["values"]
    assert other_base(saved, [frag(base, torch.float32)]) == []
    one_ulp = list(base)
    one_ulp[14] = float(torch.nextafter(torch.tensor(base[14]), torch.tensor(2.0)))
    assert other_base(saved, [frag(one_ulp, torch.float32)])  # one ulp off, same dtype: another base
    assert other_base(saved, [frag(base, torch.bfloat16)]) == []  # the same base, loaded in bf16
    assert other_base(saved, [frag([v * 1.05 for v in base], torch.bfloat16)])  # another base, 5 % off
    assert other_base({}, [frag(base, torch.float32)]) == []  # a checkpoint without a probe: nothing to compare
    halves = merge_probes([base_probe([frag(base[:5], torch.float32, 0, 16)]),  # a parameter split over two ranks
                           base_probe([frag(base[5:], torch.float32, 5, 16)])])
    assert halves == saved
    assert other_base(saved, [frag(one_ulp[5:], torch.float32, 5, 16)])  # a rank holding the differing part
