"""Optimizer state stored in bf16 or 8 bits is saved as stored (codes and per-block absmax beside them),
reloads exactly at another world size and stage in the same form, and is widened and narrowed once (with
one warning naming both forms) into a run that stores it in another form."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint_support import assemble, build, owned_state, train

from zerofit.checkpoint import load_state, save_state
from zerofit.checkpoint.merge import merge
from zerofit.engine.state_codec import Codec, Stored, blocks
from zerofit.testing.distributed import run_distributed

FORMS = ("fp32", "bf16", "8bit")
KEYS = ("exp_avg", "exp_avg_sq")
SCALE_SUFFIX = ".absmax"  # the engine's name for a key's block scales, as the checkpoint keeps it


def stored_engine(stage: int, form: str, rank: int, world: int, **kw):
    """An engine whose run stores its optimizer state as `form`, trained 3 steps; state the engine still keeps
    in fp32 is put in the stored format by hand (what `precision.optimizer_state` has the engine keep)."""
    case, model, opt, engine = build(stage, freeze=True, optimizer_state=form, **kw)
    train(engine, model, case, rank, world, range(3))
    codec = Codec(form)
    for state in opt.state.values():
        for key in KEYS:
            value = state.get(key)
            if codec.narrow and value is not None and value.dtype == torch.float32:
                stored = codec.empty(value.numel(), value.device)
                codec.encode(value, stored, key)
                state[key] = stored.codes
                if stored.scale is not None:
                    state[key + SCALE_SUFFIX] = stored.scale
    return engine


def save_forms(rank, world, root):
    out = {}
    for form in FORMS:
        engine = stored_engine(2, form, rank, world)
        save_state(os.path.join(root, form), engine, update_latest=False)
        out[form] = owned_state(engine, rank)
    return out


def load_forms(rank, world, root):
    out = {}
    for saved in FORMS:
        for form in FORMS:
            _, _, _, engine = build(3, freeze=True, perturb=0.5, optimizer_state=form)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                load_state(os.path.join(root, saved), engine)
            said = [str(w.message) for w in caught if "precision.optimizer_state" in str(w.message)]
            out[(saved, form)] = {"state": owned_state(engine, rank), "said": said,
                                  "dtypes": {k: v.dtype for s in engine.optimizer.state.values() for k, v in s.items()
                                             if isinstance(v, torch.Tensor) and v.ndim == 1}}
    # stage 0 keeps the state replicated: each rank writes its 1/world share of it, cut at any element,
    # and each block scale goes with the block's first element (the save checks the chunks tile exactly)
    engine = stored_engine(0, "8bit", rank, world)
    save_state(os.path.join(root, "replicated"), engine, update_latest=False)
    want = owned_state(engine, rank)
    _, _, _, again = build(3, freeze=True, perturb=0.5, optimizer_state="8bit")
    load_state(os.path.join(root, "replicated"), again)
    out["replicated"] = {"want": want, "got": owned_state(again, rank)}
    return out


def widened(full: dict, key: str, name: str, form: str) -> torch.Tensor:
    """Parameter `name`'s state `key` as fp32, from the full state of a run storing it as `form`."""
    codes = full[(name, key)]
    if form != "8bit":
        return codes.float()
    out = torch.empty(codes.numel())
    Codec(form).decode(Stored(codes, full[(name, key + SCALE_SUFFIX)]), out, key)
    return out


def narrowed(value: torch.Tensor, key: str, form: str) -> dict[str, torch.Tensor]:
    """fp32 `value` (a whole parameter's state) as a run storing `form` holds it: {key (+ scale key): tensor}."""
    codec = Codec(form)
    stored = codec.empty(value.numel(), "cpu")
    codec.encode(value, stored, key)
    return {key: stored.codes} | ({key + SCALE_SUFFIX: stored.scale} if stored.scale is not None else {})


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("forms"))
    saved = run_distributed(save_forms, 1, root)[0]
    loaded = run_distributed(load_forms, 2, root)
    return root, {form: assemble([saved[form]]) for form in FORMS}, loaded


def test_state_saved_as_stored(forms):
    root, saved, _ = forms
    common = json.load(open(os.path.join(root, "8bit", "common.json")))["value"]["optimizer"]
    assert common["state_keys"] == list(KEYS)
    assert common["state_forms"] == {"exp_avg": "8bit", "exp_avg_sq": "8bit"}
    assert json.load(open(os.path.join(root, "bf16", "common.json")))["value"]["optimizer"]["state_forms"] == \
        {"exp_avg": "bf16", "exp_avg_sq": "bf16"}
    # fp32 state: the checkpoint is written as before narrow state existed (no new entry)
    assert "state_forms" not in json.load(open(os.path.join(root, "fp32", "common.json")))["value"]["optimizer"]
    files = [f for f in os.listdir(os.path.join(root, "8bit", "state")) if f.endswith(".safetensors")]
    tensors = load_file(os.path.join(root, "8bit", "state", files[0]))
    assert tensors["exp_avg/emb.weight"].dtype == torch.uint8 and tensors["exp_avg/emb.weight"].numel() == 37 * 13
    # 481 elements: 31 blocks, the last one partial
    assert tensors["exp_avg.absmax/emb.weight"].dtype == torch.float32
    assert tensors["exp_avg.absmax/emb.weight"].numel() == blocks(37 * 13) == 31
    assert load_file(os.path.join(root, "bf16", "state", files[0]))["exp_avg_sq/emb.weight"].dtype == torch.bfloat16


def test_same_form_reshards_exactly(forms):
    _, saved, loaded = forms
    for form in FORMS:
        got = assemble([r[(form, form)]["state"] for r in loaded])
        assert sorted(got) == sorted(saved[form]), form
        for key, value in saved[form].items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), (form, key)
        assert all(r[(form, form)]["said"] == [] for r in loaded), form
    dtypes = loaded[0][("8bit", "8bit")]["dtypes"]
    assert dtypes == {"exp_avg": torch.uint8, "exp_avg_sq": torch.uint8,
                      "exp_avg.absmax": torch.float32, "exp_avg_sq.absmax": torch.float32}


def test_other_form_widened_and_narrowed_once(forms):
    _, saved, loaded = forms
    names = sorted({name for name, key in saved["fp32"] if key == "exp_avg"})
    for source in FORMS:
        for form in FORMS:
            if source == form:
                continue
            got = assemble([r[(source, form)]["state"] for r in loaded])
            for name in names:
                assert torch.equal(got[(name, "master")], saved[source][(name, "master")])
                for key in KEYS:
                    want = narrowed(widened(saved[source], key, name, source), key, form)
                    for k, value in want.items():
                        assert got[(name, k)].dtype == value.dtype, (source, form, name, k)
                        assert torch.equal(got[(name, k)], value), (source, form, name, k)
            said = [r[(source, form)]["said"] for r in loaded]
            assert said[1] == [] and len(said[0]) == 1, (source, form, said)
            assert f"stored as {source} in the checkpoint, as {form} in this run" in said[0][0]


def test_replicated_state_cut_anywhere_reloads(forms):
    _, _, loaded = forms
    want = assemble([r["replicated"]["want"] for r in loaded][:1])  # stage 0: rank 0's copy is the whole state
    got = assemble([r["replicated"]["got"] for r in loaded])
    assert ("emb.weight", "exp_avg.absmax") in want
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_merge_of_8bit_checkpoint_writes_the_weights(forms, tmp_path):
    root, saved, _ = forms
    merge(os.path.join(root, "8bit"), tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(weights["emb.weight"].reshape(-1), saved["8bit"][("emb.weight", "master")])
    assert not any("exp_avg" in k for k in weights)


def test_block_scales_follow_their_first_element():
    """A fragment cut at any element: each block scale goes to the cut holding the block's first element,
    so the cuts' scale chunks tile the parameter's blocks exactly once."""
    from zerofit.engine.state import Fragment

    numel = 100  # 7 blocks, the last one partial
    f = Fragment(name="w", shape=(numel,), dtype=torch.float32, numel=numel, start=0, length=numel,
                 trainable=True, tensors={"exp_avg": torch.arange(numel).float(),
                                          "exp_avg.absmax": torch.arange(blocks(numel)).float()})
    for cuts in ([0, 100], [0, 1, 100], [0, 15, 16, 17, 50, 99, 100], [0, 33, 64, 100]):
        seen = []
        for lo, hi in zip(cuts, cuts[1:]):
            part = f.cut(lo, hi)
            start, total = part.span("exp_avg.absmax")
            scale = part.tensors["exp_avg.absmax"]
            assert total == 7 and torch.equal(scale, torch.arange(start, start + scale.numel()).float())
            assert part.span("exp_avg") == (lo, numel) and torch.equal(part.tensors["exp_avg"],
                                                                        torch.arange(lo, hi).float())
            seen += scale.tolist()
        assert seen == list(range(7)), cuts
