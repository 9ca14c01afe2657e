"""Consolidated weights: `full_state_dict` equals the unsharded reference, `save_consolidated` of a stage-3
GPT-2 loads with `from_pretrained` and gives the same logits (one file, or shards + index), and the
offline `merge` of a sharded checkpoint writes the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_cases import Case, reference
from safetensors.torch import load_file
from test_checkpoint_support import build, train

from zerofit.checkpoint import full_state_dict, merge, save_consolidated, save_state
from zerofit.checkpoint.export import parse_size
from zerofit.errors import CheckpointError
from zerofit.testing.distributed import run_distributed

transformers = pytest.importorskip("transformers")

STEPS = 4
SMALL_SHARD = "40KB"


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def export_all(rank, world, root):
    from zerofit.config.schema import ZeroConfig
    from zerofit.engine import ZeroEngine

    root = Path(root)
    case, model, _, engine = build(3, steps=STEPS)
    train(engine, model, case, rank, world, range(STEPS))
    tiny = {"state": full_state_dict(engine, model), "masters": engine.named_full_tensors("master")}

    model = tiny_gpt2()
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                        zero=ZeroConfig(stage=3, param_persistence_threshold=0), device=torch.device("cpu"))
    ids = torch.randint(0, 97, (4, 8), generator=torch.Generator().manual_seed(5))
    mine = ids[rank * 2:(rank + 1) * 2]
    engine.backward(model(input_ids=mine, labels=mine).loss)
    engine.step()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    save_consolidated(engine, model, root / "single")
    save_consolidated(engine, model, root / "sharded", max_shard_size=SMALL_SHARD)
    save_state(root / "ckpt" / "step-1", engine)
    keys = list(full_state_dict(engine, model))
    return {"tiny": tiny, "logits": logits, "keys": keys, "state_keys": list(model.state_dict())}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    return root, run_distributed(export_all, 2, str(root))


def test_full_state_dict_equals_reference(exported):
    _, ranks = exported
    state, masters = ranks[0]["tiny"]["state"], ranks[0]["tiny"]["masters"]
    other = ranks[1]["tiny"]["state"]  # stage 3: placeholders off rank 0, the same keys, shapes and dtypes
    assert {k: (v.device.type, v.shape, v.dtype) for k, v in other.items()} == {
        k: ("meta", v.shape, v.dtype) for k, v in state.items()}
    _, _, ref_params = reference(Case(stage=3, steps=STEPS))
    torch.manual_seed(0)
    ref_keys = list(build(0)[1].state_dict())
    assert list(state) == [k for k in ref_keys if k != "head.weight"]  # state-dict order, tied weight once
    for name, value in state.items():
        assert value.dtype == torch.float32 and value.device.type == "cpu"
        assert torch.equal(value, masters[name]), name
        assert (value - ref_params[name]).abs().max() < 2e-6, name
    assert not torch.equal(state["emb.weight"], build(0)[1].emb.weight.detach())  # it did train


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_save_consolidated_loads_with_from_pretrained(exported):
    root, ranks = exported
    assert sorted(p.name for p in (root / "single").iterdir()) == ["config.json", "generation_config.json",
                                                                  "model.safetensors"]
    tensors = load_file(str(root / "single" / "model.safetensors"))
    assert "transformer.wte.weight" in tensors and "lm_head.weight" not in tensors  # tied: saved once
    assert sorted(tensors) == sorted(ranks[0]["keys"])
    assert set(ranks[0]["state_keys"]) - set(tensors) == {"lm_head.weight"}
    for name in ("single", "sharded"):
        loaded = transformers.GPT2LMHeadModel.from_pretrained(root / name).eval()
        ids = torch.randint(0, 97, (4, 8), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, ranks[0]["logits"], rtol=1e-5, atol=1e-6)
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_sharded_export_writes_an_index(exported):
    root, _ = exported
    index = json.loads((root / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in (root / "sharded").glob("*.safetensors")) == files
    assert all((root / "sharded" / f).stat().st_size <= parse_size(SMALL_SHARD) + 4096 for f in files[:-1])
    total = sum(t.numel() * t.element_size() for t in _safetensors(root / "sharded").values())
    assert index["metadata"]["total_size"] == total


@pytest.mark.parametrize("shard", [None, SMALL_SHARD])
def test_merge_offline_equals_save_consolidated(exported, tmp_path, shard):
    root, _ = exported
    out = tmp_path / "merged"
    written = merge(root / "ckpt", out, **({"max_shard_size": shard} if shard else {}))
    online = root / ("sharded" if shard else "single")
    assert sorted(written) == sorted(p.name for p in online.iterdir())
    want, got = _safetensors(online), _safetensors(out)
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]) and got[name].dtype == want[name].dtype, name
    if shard:
        assert (out / "model.safetensors.index.json").read_text() == \
            (online / "model.safetensors.index.json").read_text()
    transformers.GPT2LMHeadModel.from_pretrained(out)


def test_bad_max_shard_size_is_refused():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(123) == 123
    with pytest.raises(CheckpointError, match=r"max_shard_size='5 gigs' is not a size"):
        parse_size("5 gigs")


def gather_everywhere(rank, world):
    """The export's gather to every rank (a stage 1-2 master split over the ranks, an adapter at stage 3)."""
    import warnings

    from zerofit.checkpoint.consolidate import _gather_to_host
    from zerofit.checkpoint.ranks import Ranks

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full = _gather_to_host(torch.full((3,), float(rank)), Ranks(None), torch.device("cpu"), everywhere=True,
                               label="test")
    return full, [f"{w.category.__name__}: {w.message}" for w in caught]


def test_the_export_gathers_without_torchs_deprecation_warning():
    """consolidate.py called dist.all_gather_into_tensor itself, which newer torch marks deprecated (a
    FutureWarning on every save); it goes through the engine's shim, torch's newer name where there is one."""
    for full, caught in run_distributed(gather_everywhere, 2):
        assert torch.equal(full, torch.tensor([0.0, 0, 0, 1, 1, 1]))
        assert not [w for w in caught if "deprecated" in w], caught
