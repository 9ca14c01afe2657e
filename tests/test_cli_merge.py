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


def train_and_save_as_trainer(rank, world, output):
    """Two saves where a zerofit Trainer writes them (`checkpoint-N/zerofit_state/`, no `latest`), the second
    after one more step; returns the masters after each."""
    case = Case(stage=3, steps=2)
    model, opt = make_model_and_optim(case)
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=3, param_persistence_threshold=0),
                        device=torch.device("cpu"))
    micro = case.batch // world
    masters = {}
    for step, (x, y) in enumerate(batches(case), start=1):
        engine.backward(loss_fn(model(x[rank * micro:(rank + 1) * micro]), y[rank * micro:(rank + 1) * micro]))
        engine.step()
        save_state(f"{output}/checkpoint-{step * 5}/zerofit_state", engine, extra_state={}, config=None,
                   update_latest=False)
        masters[step * 5] = {k: v.clone() for k, v in engine.named_full_tensors("master").items()}
    return masters


def test_merge_reads_a_trainer_checkpoint_and_the_newest_of_its_output_folder(tmp_path, capsys):
    """`zerofit merge OUT/checkpoint-5` merges its zerofit_state/; `zerofit merge OUT` the newest checkpoint-N
    by step (10 after 5, not by name) and says which; a folder of merged weights is named as such."""
    output = tmp_path / "output"
    masters = run_distributed(train_and_save_as_trainer, 2, str(output))[0]
    (output / "model.safetensors").write_bytes(b"")  # the Trainer's final save_model beside its checkpoints
    for given, step in ((output / "checkpoint-5", 5), (output, 10)):
        assert main(["merge", str(given), str(tmp_path / f"merged{step}")]) == 0
        err = capsys.readouterr().err
        weights = load_file(str(tmp_path / f"merged{step}" / "model.safetensors"))
        for name, value in masters[step].items():
            assert torch.equal(weights[name], value), (step, name)
    assert f"merging {output / 'checkpoint-10' / 'zerofit_state'}: the newest of the Trainer checkpoints" in err
    assert "(also checkpoint-5: pass one of them" in err
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"")
    assert main(["merge", str(final), str(tmp_path / "merged")]) == 2
    assert "already-merged weights (model.safetensors" in capsys.readouterr().err
