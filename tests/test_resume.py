"""Automatic resume (`checkpoint.resume`) and named collective failures, in one process.

The launched, multi-process versions (a killed rank restarted, a hung rank, uneven batches) are in
tests/test_faults.py; here are the decisions and messages behind them, and a resume through
`prepare()` in a world of one.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerofit import Accelerator
from zerofit.checkpoint import resume
from zerofit.config.schema import CheckpointConfig, RunConfig
from zerofit.distributed import failures
from zerofit.distributed.process_group import restart_count
from zerofit.errors import CheckpointError, CollectiveError, ConfigError
from zerofit.utils import ProjectConfiguration

pytest.importorskip("zerofit.checkpoint")


def _complete(directory):
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text("{}")
    return directory


# --- which checkpoint, when ---------------------------------------------------------------------
def test_never_and_a_first_attempt_under_restart_load_nothing(tmp_path):
    _complete(tmp_path / "checkpoint_0")
    (tmp_path / "latest").write_text("checkpoint_0\n")
    assert resume.choose("never", 3, tmp_path) is None
    assert resume.choose("restart", 0, tmp_path) is None
    assert resume.choose("restart", 1, tmp_path) == tmp_path / "checkpoint_0"
    assert resume.choose("auto", 0, tmp_path) == tmp_path / "checkpoint_0"


def test_only_the_checkpoint_latest_names_is_chosen_never_a_partial_one(tmp_path):
    _complete(tmp_path / "checkpoint_0")
    (tmp_path / "checkpoint_1.tmp-abc").mkdir()  # a save that died before its commit
    (tmp_path / "checkpoint_1").mkdir()  # no manifest: not a checkpoint
    (tmp_path / "latest").write_text("checkpoint_0\n")
    assert resume.latest_complete(tmp_path) == tmp_path / "checkpoint_0"


def test_a_directory_that_is_itself_a_checkpoint_is_chosen(tmp_path):
    root = _complete(tmp_path / "ckpt")
    assert resume.choose("auto", 0, root) == root


def test_latest_naming_an_incomplete_checkpoint_is_an_error(tmp_path):
    (tmp_path / "checkpoint_1").mkdir()
    (tmp_path / "latest").write_text("checkpoint_1\n")
    with pytest.raises(CheckpointError, match=r"latest names 'checkpoint_1', which is not a complete checkpoint "
                                              r"\(no manifest.json\): point latest at a complete"):
        resume.choose("auto", 1, tmp_path)


def test_must_without_a_checkpoint_directory_is_a_config_error():
    with pytest.raises(ConfigError, match=r"checkpoint.resume is 'must' \(attempt 0\) but the run has no checkpoint "
                                          r"directory: pass ProjectConfiguration\(project_dir=\.\.\., "
                                          r"automatic_checkpoint_naming=True\)"):
        resume.choose("must", 0, None)


def test_must_with_nothing_saved_yet_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint.resume is 'must' but .* holds no complete checkpoint .*"
                                              r"set checkpoint.resume to auto to start from scratch"):
        resume.choose("must", 0, tmp_path)


def test_an_unknown_mode_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.resume is 'often': use one of restart, auto, must, never"):
        resume.choose("often", 0, tmp_path)


def test_a_restart_with_nothing_to_resume_from_says_so_loudly(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="zerofit.checkpoint.resume"):
        assert resume.choose("restart", 2, None) is None
        assert resume.choose("restart", 2, tmp_path) is None
    assert "restart' (attempt 2) but the run has no checkpoint directory" in caplog.text
    assert "starts again from step 0" in caplog.text
    assert f"restart attempt 2 found no complete checkpoint in {tmp_path}" in caplog.text


def test_checkpoint_root_prefers_automatic_naming_then_output_dir():
    assert str(resume.checkpoint_root("proj", True, "out")) == "proj/checkpoints"
    assert str(resume.checkpoint_root("proj", False, "out")) == "out"
    assert resume.checkpoint_root(None, True, None) is None


def test_restart_count_comes_from_torchelastic(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_count() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_count() == 2


# --- a resume through prepare() -----------------------------------------------------------------
class Seen:
    """Records what the loop saw; registered for checkpointing after prepare(), as Accelerate scripts do."""

    def __init__(self):
        self.rows: list[float] = []

    def state_dict(self):
        return {"rows": list(self.rows)}

    def load_state_dict(self, sd):
        self.rows = list(sd["rows"])


def _run(project_dir, mode: str, steps: int):
    """A fresh script that trains up to optimizer step `steps`; returns (accelerator, losses, seen)."""
    torch.manual_seed(0)
    acc = Accelerator(config=RunConfig(checkpoint=CheckpointConfig(resume=mode)),
                      project_config=ProjectConfiguration(project_dir=str(project_dir),
                                                          automatic_checkpoint_naming=True))
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.arange(40, dtype=torch.float32).reshape(10, 4) / 40
    dl = DataLoader(TensorDataset(data), batch_size=1, shuffle=True)
    model, opt, dl = acc.prepare(model, opt, dl)
    seen = Seen()
    acc.register_for_checkpointing(seen)
    losses = []
    for (x,) in dl:
        seen.rows.append(float(x[0, 0]))
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if acc.completed_steps == steps:  # stop right after a step, where scripts save
            break
    return acc, losses, seen


def test_prepare_resumes_model_optimizer_rng_data_position_step_and_registered_objects(tmp_path):
    _, straight, straight_seen = _run(tmp_path / "straight", "never", 7)
    first, head, _ = _run(tmp_path / "run", "auto", 3)  # nothing saved yet: starts from scratch
    assert first.resumed_from is None
    first.save_state()
    again, tail, seen = _run(tmp_path / "run", "auto", 7)
    assert again.resumed_from.endswith("checkpoint_0") and again.completed_steps == 7
    assert head + tail == straight  # bit-identical: nothing repeated, nothing skipped
    assert seen.rows == straight_seen.rows  # the registered object came back, then saw rows 4-7
    assert len(set(seen.rows)) == 7


def test_must_fails_in_prepare_when_there_is_nothing_to_resume(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint.resume is 'must' but .*checkpoints holds no complete"):
        _run(tmp_path, "must", 1)


# --- a failed collective names itself -----------------------------------------------------------
def test_a_timed_out_collective_names_its_label_rank_and_the_timeout_key():
    with pytest.raises(CollectiveError, match=r"rank 1: collective reduce_scatter:layers.3 did not complete within "
                                              r".*\(launch.process_group_timeout\): another rank is hung .* raise "
                                              r"launch.process_group_timeout \(--process_group_timeout SECONDS\)"):
        with failures.named("reduce_scatter:layers.3", 1):
            raise RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete")


def test_a_collective_whose_peer_left_says_so():
    with pytest.raises(CollectiveError, match=r"rank 0: collective grad_norm failed because another rank left the "
                                              r"run .*Connection closed by peer \[127.0.0.1\]:30880\]$") as info:
        with failures.named("grad_norm", 0):
            raise RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:30880")
    assert (info.value.label, info.value.rank) == ("grad_norm", 0)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_errors_that_are_not_communication_failures_pass_through():
    with pytest.raises(ValueError, match="shape"):
        with failures.named("all_gather:x", 0):
            raise ValueError("shape")


# --- the recipes' --resume_from_checkpoint '' -----------------------------------------------------
def test_recipes_resume_the_checkpoint_latest_names_never_a_newer_partial_one(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "examples"))
    common = pytest.importorskip("common")

    class Loads:
        def __init__(self):
            self.paths = []

        def load_state(self, path):
            self.paths.append(path)

        def print(self, *args):
            pass

    _complete(tmp_path / "step_4")
    (tmp_path / "latest").write_text("step_4\n")
    (tmp_path / "step_8.tmp-abc").mkdir()  # newer, but a save that never committed
    args = argparse.Namespace(resume_from_checkpoint="", output_dir=str(tmp_path), gradient_accumulation_steps=1)
    acc = Loads()
    assert common.resume(acc, args, batches_per_epoch=3) == (1, 1, 4)
    assert acc.paths == [str(tmp_path / "step_4")]
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint '' found no checkpoint in .* \(no 'latest' file\)"):
        common.resume(acc, argparse.Namespace(resume_from_checkpoint="", output_dir=str(tmp_path / "none"),
                                              gradient_accumulation_steps=1), batches_per_epoch=3)
