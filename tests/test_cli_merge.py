"""`zerofit merge` turns a sharded checkpoint into safetensors that hold the trained weights."""

from __future__ import annotations

import json

import pytest
import torch
from engine_cases import Case, batches, loss_fn, make_model_and_optim
from safetensors.torch import load_file

from zerofit.checkpoint import save_state
from zerofit.cli.main import main
from zerofit.config.schema import ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.testing.distributed import run_distributed

pytestmark = pytest.mark.slow  # trains on gloo ranks, then merges through the CLI


def train_and_save(rank, world, directory):
    case = Case(stage=3, steps=1)
    model, opt = make_model_and_optim(case)
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=3, param_persistence_threshold=0),
                        device=torch.device("cpu"))
    x, y = batches(case)[0]
    micro = case.batch // world
    engine.backward(loss_fn(model(x[rank * micro:(rank + 1) * micro]), y[rank * micro:(rank + 1) * micro]))
    engine.step()
    save_state(directory, engine, extra_state={}, config=None)
    return engine.named_full_tensors("master")


def test_merge_writes_the_trained_weights(tmp_path, capsys):
    masters = run_distributed(train_and_save, 2, str(tmp_path / "ckpt"))[0]
    assert main(["merge", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, value in masters.items():
        assert torch.equal(weights[name], value), name
    assert "head.weight" not in weights or torch.equal(weights["head.weight"], weights["emb.weight"])


def test_merge_given_the_folder_that_holds_checkpoints_names_them(tmp_path, capsys):
    """`zerofit merge output/` for `output/checkpoint-3`: say which checkpoints are there, not "the save did
    not finish"."""
    from zerofit.checkpoint.manifest import FORMAT, MANIFEST

    output = tmp_path / "output"
    for name in ("checkpoint-10", "checkpoint-3", "logs"):
        (output / name).mkdir(parents=True)
    for name in ("checkpoint-10", "checkpoint-3"):
        (output / name / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": {}}))
    assert main(["merge", str(output), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"zerofit merge: error: {output} is not a checkpoint, it holds checkpoints (checkpoint-3, "
                   f"checkpoint-10): pass one of them, e.g. {output / 'checkpoint-10'}\n")
    assert not (tmp_path / "out").exists()
