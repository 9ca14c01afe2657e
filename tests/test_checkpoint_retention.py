"""`checkpoint.total_limit` / `ProjectConfiguration(total_limit=...)`: after a save only the newest N of
zerofit's checkpoints stay, the one `latest` names always stays, and nothing else is ever deleted."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from engine_cases import SEQ, VOCAB, TinyLM, loss_fn

from zerofit import Accelerator
from zerofit.checkpoint import retention
from zerofit.checkpoint.commit import LATEST, resolve
from zerofit.checkpoint.manifest import FORMAT, MANIFEST
from zerofit.checkpoint.resume import latest_complete
from zerofit.config.schema import CheckpointConfig, RunConfig, ZeroConfig
from zerofit.errors import CheckpointError
from zerofit.testing.distributed import run_distributed
from zerofit.utils import ProjectConfiguration


def _fake_checkpoint(folder: Path, name: str, when: int) -> Path:
    path = folder / name
    path.mkdir(parents=True)
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": {}}))
    os.utime(path / MANIFEST, ns=(when, when))
    return path


def _folder(tmp_path: Path) -> Path:
    """Five zerofit checkpoints (0 oldest), and everything retention must never touch."""
    folder = tmp_path / "checkpoints"
    for i in range(5):
        _fake_checkpoint(folder, f"checkpoint_{i}", 10**18 + i * 10**9)
    (folder / "notes").mkdir()  # no manifest
    (folder / "other_tool").mkdir()
    (folder / "other_tool" / MANIFEST).write_text(json.dumps({"format": "someone-else/1"}))
    (folder / "broken").mkdir()
    (folder / "broken" / MANIFEST).write_text("{not json")
    (folder / "README").write_text("mine")
    (folder / "link").symlink_to(folder / "checkpoint_0")
    _fake_checkpoint(folder, "checkpoint_5.tmp-abc", 0)  # an unfinished commit: the next save cleans it
    (folder / LATEST).write_text("checkpoint_1\n")
    return folder


def _left(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_prune_keeps_the_newest_and_latest_and_touches_nothing_else(tmp_path):
    folder = _folder(tmp_path)
    gone = retention.prune(folder / "checkpoint_4", config_limit=2, project_limit=None, is_main=True)
    assert [p.name for p in gone] == ["checkpoint_0", "checkpoint_2"]  # oldest first
    assert _left(folder) == {"checkpoint_1", "checkpoint_3", "checkpoint_4", "notes", "other_tool", "broken",
                             "README", "link", "checkpoint_5.tmp-abc", LATEST}


def test_a_limit_of_one_keeps_the_new_checkpoint_and_the_one_latest_names(tmp_path):
    folder = _folder(tmp_path)
    retention.prune(folder / "checkpoint_4", config_limit=None, project_limit=1, is_main=True)
    assert {n for n in _left(folder) if n.startswith("checkpoint_") and ".tmp-" not in n} == {
        "checkpoint_1", "checkpoint_4"}


def test_equal_write_times_order_by_the_number_in_the_name(tmp_path):
    folder = tmp_path / "ckpt"
    for i in (8, 9, 10, 11):
        _fake_checkpoint(folder, f"step_{i}", 5)  # a coarse file-system clock: one time for all
    (folder / LATEST).write_text("step_11\n")
    retention.prune(folder / "step_11", config_limit=2, project_limit=None, is_main=True)
    assert _left(folder) == {"step_10", "step_11", LATEST}


@pytest.mark.parametrize("kwargs", [
    {"config_limit": 1, "project_limit": None, "is_main": False},  # only the main rank deletes
    {"config_limit": None, "project_limit": None, "is_main": True},  # no limit: keep all
], ids=["not-main", "no-limit"])
def test_nothing_is_deleted_without_a_limit_or_off_the_main_rank(tmp_path, kwargs):
    folder = _folder(tmp_path)
    before = _left(folder)
    assert retention.prune(folder / "checkpoint_4", **kwargs) == []
    assert _left(folder) == before


def test_a_save_at_checkpoint_output_dir_itself_prunes_nothing_beside_it(tmp_path):
    folder = _folder(tmp_path)
    before = _left(folder)
    saved = folder / "checkpoint_4"
    assert retention.prune(saved, config_limit=1, project_limit=None, is_main=True, fixed_dir=str(saved)) == []
    assert _left(folder) == before


def test_the_config_limit_wins_over_the_script_and_says_so():
    assert retention.limit_of(None, 3) == 3 and retention.limit_of(2, None) == 2
    with pytest.warns(UserWarning, match=r"checkpoint\.total_limit is 2 in the config but the script passes "
                                         r"ProjectConfiguration\(total_limit=5\); keeping 2 checkpoints"):
        assert retention.limit_of(2, 5) == 2


def test_a_failed_deletion_is_a_warning_not_a_failed_save(tmp_path, monkeypatch):
    folder = _folder(tmp_path)

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with pytest.warns(UserWarning, match=r"checkpoint\.total_limit 4: could not delete the old checkpoint "
                                         r".*checkpoint_0 .*Permission denied.*the next save tries again, or "
                                         r"delete it by hand"):
        retention.prune(folder / "checkpoint_4", config_limit=4, project_limit=None, is_main=True)
    assert [n for n in _left(folder) if n.startswith("checkpoint_0")] == [_doomed(folder).name]


def _doomed(folder: Path) -> Path:
    """The one checkpoint of `folder` whose removal was interrupted."""
    (found,) = [p for p in folder.iterdir() if ".doomed-" in p.name]
    return found


class _Killed(BaseException):
    """Stands in for SIGKILL: nothing after it runs, and no `except Exception` stops it."""


def _killed_after_the_manifest(real_rmtree):
    """shutil.rmtree that dies once the first checkpoint it deletes has lost its manifest (the files go in
    directory order, and nothing makes the manifest last)."""
    def rmtree(path, *args, **kwargs):
        if (Path(path) / MANIFEST).is_file():
            (Path(path) / MANIFEST).unlink()
            raise _Killed
        return real_rmtree(path, *args, **kwargs)
    return rmtree


def test_a_prune_killed_mid_deletion_leaves_nothing_behind_after_the_next_prune(tmp_path, monkeypatch):
    """#25: the half-deleted folder lost its manifest, so no later prune counted it and its shards stayed."""
    folder = _folder(tmp_path)
    (folder / "checkpoint_0" / "state.bin").write_bytes(b"x" * 1000)
    with monkeypatch.context() as patched:
        patched.setattr(shutil, "rmtree", _killed_after_the_manifest(shutil.rmtree))
        with pytest.raises(_Killed):
            retention.prune(folder / "checkpoint_4", config_limit=4, project_limit=None, is_main=True)
    doomed = _doomed(folder)
    assert (doomed / "state.bin").is_file() and "checkpoint_0" not in _left(folder)
    assert not retention.is_zerofit_checkpoint(doomed)
    with pytest.raises(CheckpointError, match=r"checkpoint_0\.doomed-\w+ is a checkpoint zerofit was deleting "
                                              r"\(checkpoint\.total_limit left it out .*: load another checkpoint"):
        resolve(doomed)
    (folder / LATEST).write_text(f"{doomed.name}\n")
    with pytest.raises(CheckpointError, match=rf"{LATEST} names it: .*{doomed.name} is a checkpoint zerofit was"):
        latest_complete(folder)
    (folder / LATEST).write_text("checkpoint_1\n")
    retention.prune(folder / "checkpoint_4", config_limit=4, project_limit=None, is_main=True)
    assert _left(folder) == {"checkpoint_1", "checkpoint_2", "checkpoint_3", "checkpoint_4", "notes", "other_tool",
                             "broken", "README", "link", "checkpoint_5.tmp-abc", LATEST}


def test_the_next_save_finishes_a_deletion_a_kill_interrupted(tmp_path, monkeypatch):
    """The same kill inside `save_state` of a real run: the run's next save leaves only the newest checkpoint."""
    project = tmp_path / "project"
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=1)), project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=1))
    torch.manual_seed(0)
    model = TinyLM()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))

    def train_and_save():
        acc.backward(loss_fn(model(x), x))
        opt.step()
        opt.zero_grad()
        return acc.save_state()

    train_and_save()
    with monkeypatch.context() as patched:
        patched.setattr(shutil, "rmtree", _killed_after_the_manifest(shutil.rmtree))
        with pytest.raises(_Killed):
            train_and_save()  # checkpoint_1 committed, checkpoint_0's deletion killed
    assert sorted(os.listdir(project / "checkpoints")) == [_doomed(project / "checkpoints").name, "checkpoint_1",
                                                           LATEST]
    assert latest_complete(project / "checkpoints") == project / "checkpoints" / "checkpoint_1"
    train_and_save()  # checkpoint_1 again: the kill came before the iteration counter moved on
    assert sorted(os.listdir(project / "checkpoints")) == ["checkpoint_1", LATEST]


def _train_and_save(acc: Accelerator, saves: list[str | None]) -> list[str]:
    torch.manual_seed(0)
    model = TinyLM()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(acc.process_index))
    paths = []
    for target in saves:
        acc.backward(loss_fn(model(x), x))
        opt.step()
        opt.zero_grad()
        paths.append(acc.save_state(target))
    return paths


def save_four_times(rank: int, world: int, root: str) -> dict:
    project = Path(root) / "project"
    if rank == 0:
        (project / "checkpoints" / "keep_me").mkdir(parents=True)  # the user's, not a checkpoint
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=2)), project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=2))
    auto = _train_and_save(acc, [None] * 4)
    acc.wait_for_everyone()
    named = Accelerator(config=RunConfig(zero=ZeroConfig(stage=2), checkpoint=CheckpointConfig(total_limit=1)))
    explicit = _train_and_save(named, [f"{root}/out/step_{i}" for i in range(3)])
    named.wait_for_everyone()
    return {"auto": auto, "explicit": explicit, "auto_left": sorted(os.listdir(project / "checkpoints")),
            "explicit_left": sorted(os.listdir(Path(root) / "out"))}


def test_save_state_keeps_the_newest_on_two_ranks(tmp_path):
    for got in run_distributed(save_four_times, 2, str(tmp_path)):
        assert got["auto_left"] == ["checkpoint_2", "checkpoint_3", "keep_me", LATEST]
        assert got["explicit_left"] == [LATEST, "step_2"]
    assert (tmp_path / "out" / LATEST).read_text().strip() == "step_2"
