"""#37 item 5: a run never replaces or prunes the checkpoints an earlier run left (the same command launched
again in the same project folder), unless it resumed from them or `checkpoint.overwrite` says so; the refusal
comes before anything is written and names the folder, what it holds and the ways forward."""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from engine_cases import SEQ, VOCAB, TinyLM, loss_fn

from zerofit import Accelerator
from zerofit.checkpoint.commit import LATEST
from zerofit.checkpoint.ownership import RUN_ENV
from zerofit.cli.main import build_parser
from zerofit.config.schema import CheckpointConfig, RunConfig, ZeroConfig
from zerofit.errors import CheckpointError
from zerofit.testing.distributed import run_distributed
from zerofit.utils import ProjectConfiguration

REFUSED = (r"holds checkpoints of an earlier run \({names}; its latest names checkpoint_2\) and this run loaded none: "
           r".*, and zerofit keeps another run's checkpoints\. Resume from them \(--resume auto, or load_state after "
           r"prepare\(\)\), replace them \(--overwrite_checkpoints, i\.e\. checkpoint\.overwrite: true\) or save into "
           r"{elsewhere}$")


def _contents(folder: Path) -> dict[str, str]:
    """Every file under `folder` with the hash of its bytes."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _accelerator(project: Path, **checkpoint) -> Accelerator:
    return Accelerator(config=RunConfig(zero=ZeroConfig(stage=2), checkpoint=CheckpointConfig(**checkpoint)),
                       project_config=ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True,
                                                           total_limit=3))


def _train(acc: Accelerator, saves: int) -> list[str]:
    """One SGD step before each of `saves` save_state() calls; returns the saved paths."""
    torch.manual_seed(0)
    model = TinyLM()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(acc.process_index))
    paths = []
    for _ in range(saves):
        acc.backward(loss_fn(model(x), x))
        opt.step()
        opt.zero_grad()
        paths.append(acc.save_state())
    return paths


def first_run(rank: int, world: int, root: str) -> list[str]:
    """checkpoint_0..2 and `latest` in <root>/first/checkpoints, then one copy of that project per case."""
    acc = _accelerator(Path(root) / "first")
    paths = _train(acc, 3)
    acc.wait_for_everyone()
    if rank == 0:
        for case in ("restart", "auto_no_latest", "auto", "overwrite"):
            shutil.copytree(Path(root) / "first", Path(root) / case)
        (Path(root) / "auto_no_latest" / "checkpoints" / LATEST).unlink()
    acc.wait_for_everyone()
    return paths


def second_run(rank: int, world: int, root: str) -> dict:
    """The same script launched again (new processes, so another run), once per case."""
    out = {}
    for case, checkpoint in (("restart", {}), ("auto_no_latest", {"resume": "auto"})):
        acc = _accelerator(Path(root) / case, **checkpoint)
        try:
            _train(acc, 1)
            out[case] = "saved"
        except CheckpointError as e:
            out[case] = str(e)
    acc = _accelerator(Path(root) / "auto", resume="auto")
    out["auto"] = _train(acc, 1) + [acc.resumed_from, acc.completed_steps]
    acc = _accelerator(Path(root) / "overwrite", overwrite=True)
    out["overwrite"] = _train(acc, 4)
    acc.wait_for_everyone()
    return out


def test_a_second_fresh_launch_is_refused_and_leaves_the_first_runs_checkpoints_as_they_were(tmp_path):
    run_distributed(first_run, 2, str(tmp_path))
    before = {case: _contents(tmp_path / case) for case in ("restart", "auto_no_latest")}
    assert sorted(before["restart"]) != sorted(before["auto_no_latest"])  # the second has no `latest`
    got = run_distributed(second_run, 2, str(tmp_path))
    for rank in range(2):  # every rank raises the same error
        for case in ("restart", "auto_no_latest"):
            folder = tmp_path / case / "checkpoints"
            pattern = REFUSED.format(names="checkpoint_0, checkpoint_1, checkpoint_2", elsewhere="another project_dir")
            if case == "auto_no_latest":
                pattern = pattern.replace("; its latest names checkpoint_2", "")
            assert got[rank][case].startswith(str(folder))
            assert "its numbering restarts at checkpoint_0, so its saves would replace them and total_limit 3 " \
                   "delete the rest" in got[rank][case]
            assert re.search(pattern, got[rank][case]), got[rank][case]
    for case in ("restart", "auto_no_latest"):  # byte for byte: nothing replaced, deleted or added
        assert _contents(tmp_path / case) == before[case]
    # Resuming continues numbering and retention as before: checkpoint_3 saved, checkpoint_0 pruned.
    path, resumed_from, steps = got[0]["auto"]
    assert path.endswith("checkpoint_3") and resumed_from.endswith("checkpoint_2") and steps == 4
    assert sorted(p.name for p in (tmp_path / "auto" / "checkpoints").iterdir()) == [
        "checkpoint_1", "checkpoint_2", "checkpoint_3", LATEST]
    # The explicit setting replaces them as a fresh run always did: checkpoint_0..3, the newest three kept.
    assert [Path(p).name for p in got[0]["overwrite"]] == [f"checkpoint_{i}" for i in range(4)]
    left = tmp_path / "overwrite" / "checkpoints"
    assert sorted(p.name for p in left.iterdir()) == ["checkpoint_1", "checkpoint_2", "checkpoint_3", LATEST]
    first = _contents(tmp_path / "first" / "checkpoints")
    assert _contents(left)["checkpoint_1/manifest.json"] != first["checkpoint_1/manifest.json"]  # this run's


def _save_as(run: str, monkeypatch, acc: Accelerator, model, opt, where: str | None = None) -> str:
    monkeypatch.setenv(RUN_ENV, run)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    acc.backward(loss_fn(model(x), x))
    opt.step()
    opt.zero_grad()
    return acc.save_state(where)


def _prepared(**checkpoint):
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=1), checkpoint=CheckpointConfig(**checkpoint)))
    torch.manual_seed(0)
    model = TinyLM()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return acc, model, opt


def test_a_directory_the_script_names_is_refused_only_where_an_earlier_run_would_lose_a_checkpoint(
        tmp_path, monkeypatch):
    out = tmp_path / "out"
    earlier = _prepared()
    _save_as("run-1", monkeypatch, *earlier, str(out / "step_1"))
    _save_as("run-1", monkeypatch, *earlier, str(out / "step_1"))  # a run replaces its own checkpoint
    before = _contents(out)
    later = _prepared()
    with pytest.raises(CheckpointError, match=r"out holds checkpoints of an earlier run \(step_1; its latest names "
                                              r"step_1\) .*: this save would replace step_1, .* or save into another "
                                              r"directory$"):
        _save_as("run-2", monkeypatch, *later, str(out / "step_1"))
    assert _contents(out) == before
    _save_as("run-2", monkeypatch, *later, str(out / "step_2"))  # another name, no limit: nothing is lost
    assert (out / "step_1").is_dir() and (out / "step_2").is_dir()
    limited = _prepared(total_limit=1)
    with pytest.raises(CheckpointError, match=r"out holds checkpoints of an earlier run \(step_1, step_2; its latest "
                                              r"names step_2\) .*: total_limit 1 would delete them"):
        _save_as("run-3", monkeypatch, *limited, str(out / "step_3"))
    # A run that loaded from the folder continues it: its retention prunes the older checkpoints.
    limited[0].load_state(str(out / "step_2"))
    _save_as("run-3", monkeypatch, *limited, str(out / "step_3"))
    assert sorted(p.name for p in out.iterdir()) == [LATEST, "step_3"]


def test_checkpoint_output_dir_is_not_replaced_by_another_run(tmp_path, monkeypatch):
    fixed = tmp_path / "ckpt"
    _save_as("run-1", monkeypatch, *_prepared(output_dir=str(fixed)))
    before = _contents(fixed)
    with pytest.raises(CheckpointError, match=r"ckpt holds checkpoints of an earlier run \(ckpt\) .*every save to "
                                              r"checkpoint\.output_dir replaces the checkpoint there, .*or save into "
                                              r"another checkpoint\.output_dir"):
        _save_as("run-2", monkeypatch, *_prepared(output_dir=str(fixed)))
    assert _contents(fixed) == before
    _save_as("run-3", monkeypatch, *_prepared(output_dir=str(fixed), overwrite=True))
    assert _contents(fixed) != before


def test_prepare_warns_at_once_when_a_fresh_run_finds_an_earlier_runs_checkpoints(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(RUN_ENV, "run-1")
    _train(_accelerator(tmp_path), 1)
    monkeypatch.setenv(RUN_ENV, "run-2")
    with caplog.at_level(logging.WARNING, logger="zerofit.checkpoint.resume"):
        model = TinyLM()
        _accelerator(tmp_path).prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert f"{tmp_path / 'checkpoints'} holds checkpoints of an earlier run (checkpoint_0) and this run starts from " \
           "step 0: its first save there will be refused unless it loads one of them first" in caplog.text
    assert "--overwrite_checkpoints (checkpoint.overwrite: true)" in caplog.text


def test_the_launch_flag_sets_checkpoint_overwrite():
    from zerofit.cli.launch import FLAG_TO_KEY

    args = build_parser().parse_args(["launch", "--overwrite_checkpoints", "train.py"])
    assert args.overwrite_checkpoints is True and FLAG_TO_KEY["overwrite_checkpoints"] == "checkpoint.overwrite"
