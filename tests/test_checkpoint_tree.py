"""Pure pieces of the checkpoint package: the pickle-free value store, shard planning, `latest`, and a
one-process save/load without any process group."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from zerofit.checkpoint.commit import LATEST, commit, point_latest, resolve, temp_dir
from zerofit.checkpoint.export import file_names, plan_shards
from zerofit.checkpoint.inventory import Entry
from zerofit.checkpoint.tree import read_tree, write_tree
from zerofit.errors import CheckpointError


def test_tree_round_trips_without_pickle(tmp_path):
    value = {"int": 3, "float": 0.1 + 0.2, "inf": float("inf"), "none": None, "s": "x", "tuple": (1, (2, "3")),
             "int_keys": {0: [1.5], 7: {"deep": torch.arange(5)}}, "t": torch.tensor(6.0),
             "bf": torch.ones(2, dtype=torch.bfloat16),
             "np": np.arange(4, dtype=np.uint32), "np_scalar": np.int64(9), "dtype": torch.float16,
             "tagged": {"__zerofit__": "tensor"}}
    names = write_tree(tmp_path, "x", value, "extra_state")
    assert names == ["x.json", "x.safetensors"]
    assert b"pickle" not in (tmp_path / "x.json").read_bytes()
    got = read_tree(tmp_path, "x")
    assert torch.equal(got["int_keys"][7]["deep"], torch.arange(5)) and got["t"].dtype == torch.float32
    assert got["np"].dtype == np.uint32 and got["np"].tolist() == [0, 1, 2, 3]
    assert got["bf"].dtype == torch.bfloat16 and got["dtype"] is torch.float16
    for key in ("int", "float", "inf", "none", "s", "tuple", "np_scalar", "tagged"):
        assert got[key] == (9 if key == "np_scalar" else value[key]), key
    assert got["int_keys"][0] == [1.5]


def test_tree_refuses_objects_with_their_path(tmp_path):
    class Opaque:
        pass

    with pytest.raises(CheckpointError, match=r"extra_state\['a'\]\[1\] is a .*Opaque, which a checkpoint cannot "
                                              r"store without pickle: .*state_dict\(\)"):
        write_tree(tmp_path, "x", {"a": [1, Opaque()]}, "extra_state")
    assert not (tmp_path / "x.json").exists()


def test_tree_reports_damaged_files(tmp_path):
    write_tree(tmp_path, "x", {"t": torch.ones(3)}, "v")
    (tmp_path / "x.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(CheckpointError, match=r"x.safetensors: unreadable safetensors file"):
        read_tree(tmp_path, "x")
    (tmp_path / "x.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointError, match=r"x.json: not a zerofit-tree/1 file"):
        read_tree(tmp_path, "x")


def _entry(name, n):
    return Entry(name=name, shape=(n,), dtype="float32", kind="master")


def test_shard_plan_respects_the_limit_in_order():
    entries = [_entry(f"p{i}", n) for i, n in enumerate([10, 10, 30, 5, 5, 1])]  # 4 bytes per element
    plan = plan_shards(entries, 80)
    assert [[e.name for e in s] for s in plan] == [["p0", "p1"], ["p2"], ["p3", "p4", "p5"]]
    assert [e for s in plan for e in s] == entries
    assert file_names(3, True) == (["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                    "model-00003-of-00003.safetensors"], "model.safetensors.index.json")
    assert file_names(1, False) == (["pytorch_model.bin"], "pytorch_model.bin.index.json")


def test_commit_replaces_and_latest_points(tmp_path):
    final = tmp_path / "ck"
    for token, content in (("t1", "first"), ("t2", "second")):
        tmp = temp_dir(final, token)
        tmp.mkdir()
        (tmp / "manifest.json").write_text(content)
        commit(tmp, final, token)
        point_latest(final, token)
    assert (final / "manifest.json").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", LATEST]
    assert resolve(tmp_path) == final and resolve(final) == final


def test_one_process_save_and_load_without_process_group(tmp_path):
    from test_checkpoint_support import assemble, build, owned_state, train

    from zerofit.checkpoint import load_state, save_state

    case, model, _, engine = build(2)
    train(engine, model, case, 0, 1, range(2))
    save_state(tmp_path / "one", engine, extra_state={"n": 1})
    _, _, _, other = build(0, perturb=1.0)
    assert load_state(tmp_path, other) == {"n": 1}
    want, got = assemble([owned_state(engine, 0)]), assemble([owned_state(other, 0)])
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)


def test_a_save_refuses_json_larger_than_a_load_reads_back(tmp_path):
    """A load refuses a JSON file over MAX_JSON_BYTES (#18), so a save must not write one."""
    from zerofit.checkpoint.tree import MAX_JSON_BYTES

    with pytest.raises(CheckpointError, match=r"x.json: would hold 64 MiB of JSON, more than the 64 MiB a load reads "
                                              r"back: keep large values in tensors or numpy arrays"):
        write_tree(tmp_path, "x", {"rows": "r" * MAX_JSON_BYTES}, "extra_state")
    assert not (tmp_path / "x.json").exists()
