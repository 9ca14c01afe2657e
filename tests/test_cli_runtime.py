"""`zerofit.distributed.runtime`: what a worker learns about its run, with and without the launcher."""

from __future__ import annotations

import os

import pytest
import torch

from zerofit.config import load_config, save_config
from zerofit.distributed import runtime
from zerofit.errors import ConfigError


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(runtime.CONFIG_FILE_ENV, raising=False)
    monkeypatch.setattr(runtime, "_cache", {})


def test_without_the_launcher_the_config_is_the_default():
    assert runtime.current_config() == load_config(None)


def test_with_the_launcher_the_config_is_its_file(monkeypatch, tmp_path):
    path = tmp_path / "config.json"
    save_config(load_config(None, overrides={"zero.stage": 2, "launch.use_cpu": True}), path)
    monkeypatch.setenv(runtime.CONFIG_FILE_ENV, str(path))
    cfg = runtime.current_config()
    assert cfg.zero.stage == 2 and runtime.current_config() is cfg  # read once per process
    assert runtime.backend(cfg) == "gloo" and runtime.device(cfg) == torch.device("cpu")


def test_a_missing_config_file_names_the_variable_and_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(runtime.CONFIG_FILE_ENV, str(tmp_path / "gone.json"))
    with pytest.raises(ConfigError, match=r"ZEROFIT_CONFIG_FILE=.*gone.json.* does not exist: start the script with"):
        runtime.current_config()


def test_gpu_selection_follows_the_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = load_config(None)
    assert runtime.backend(cfg) == "nccl" and runtime.device(cfg) == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "3")  # more local ranks than GPUs it sees: wraps around, as Accelerate
    assert runtime.device(cfg) == torch.device("cuda", 1)  # (see tests/test_device_choice.py)
    assert runtime.backend(load_config(None, overrides={"launch.use_cpu": True})) == "gloo"


def test_worker_error_record_appears_whole(tmp_path, monkeypatch):
    """[Note: the error file appears whole or not at all] in zerofit.cli.worker_entry."""
    import json as _json

    from zerofit.cli.worker_entry import _WholeFileErrorHandler

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ValueError("the user's bug")
    except ValueError as e:
        _WholeFileErrorHandler().record_exception(e)
    record = _json.loads(path.read_text())
    assert "the user's bug" in _json.dumps(record)
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]
    assert os.environ["TORCHELASTIC_ERROR_FILE"] == str(path)


@pytest.mark.parametrize(("rank", "shown"), [("0", True), ("1", False), (None, True)])
def test_repeated_warnings_show_on_rank_0_only(rank, shown, monkeypatch):
    """[Note: warnings once per run] in zerofit.cli.worker_entry: deprecations every rank would repeat."""
    import warnings

    from zerofit.cli.worker_entry import REPEATED_WARNINGS, quiet_repeated_warnings

    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings(record=True) as seen:  # restores the filters afterwards
        warnings.simplefilter("always")
        quiet_repeated_warnings()
        for category in REPEATED_WARNINGS:
            warnings.warn(f"{category.__name__} of every rank", category, stacklevel=1)
        warnings.warn("about this rank's own data", UserWarning, stacklevel=1)
    assert [w.category for w in seen] == [*REPEATED_WARNINGS, UserWarning] if shown else [UserWarning]


def test_only_rank_0_of_a_run_that_never_built_zerofit_state_names_the_import_to_change(monkeypatch):
    """[Note: a run that never used zerofit] in zerofit.cli.worker_entry."""
    from zerofit import PartialState
    from zerofit.cli.worker_entry import unused_notice
    from zerofit.frontend import processes

    monkeypatch.setattr(runtime, "_zerofit_state_built", False)
    monkeypatch.setenv("RANK", "0")
    assert "train.py never created a zerofit Accelerator" in unused_notice(["/x/train.py", "--lr", "1"])
    assert unused_notice(["-m", "pkg.train", "--lr", "1"]).startswith("zerofit launch: -m pkg.train never")
    import sys
    import types

    for loaded, named in ((None, "from zerofit import Accelerator"),
                          ("transformers.trainer", "from zerofit.integrations.transformers import Trainer"),
                          ("trl", "from zerofit.integrations.trl import SFTTrainer")):
        for module in ("trl", "transformers.trainer"):
            monkeypatch.delitem(sys.modules, module, raising=False)
        if loaded:  # the script used transformers' or TRL's trainer: the import to change is that one
            monkeypatch.setitem(sys.modules, loaded, types.ModuleType(loaded))
        assert named in unused_notice(["train.py"])
    monkeypatch.setenv("RANK", "1")
    assert unused_notice(["train.py"]) is None  # said once, by rank 0
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(processes, "_SHARED", None)
    PartialState()  # a world of one here; an Accelerator builds the same state
    assert runtime.zerofit_state_built() and unused_notice(["train.py"]) is None


def test_a_failed_script_given_deepspeed_or_fsdp_arguments_is_told_where_the_file_belongs():
    from zerofit.cli.failure_report import engine_argument_hint

    hint = engine_argument_hint(["train.py", "--bf16", "--deepspeed", "ds_z3.json"])
    assert "zerofit launch --config_file ds_z3.json" in hint and "zerofit.integrations.transformers" in hint
    assert "--config_file ds.json" in engine_argument_hint(["train.py", "--deepspeed=ds.json"])
    assert "stage 3" in engine_argument_hint(["-m", "pkg.train", "--fsdp", "full_shard"])
    assert engine_argument_hint(["train.py", "--lr", "1"]) is None
