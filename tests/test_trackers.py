"""Experiment trackers (zerofit.frontend.tracking.selection): what `log_with` selects, a script's own tracker object,
the main-process-only rule, one error for a missing library, and wandb and MLflow through their own
libraries in their offline / local modes (skipped when the `trackers` extra is not installed)."""

from __future__ import annotations

import importlib.util
import json
import struct
import warnings
from pathlib import Path

import pytest

from zerofit import Accelerator
from zerofit.config import config_from_dict
from zerofit.config.schema import RunConfig
from zerofit.errors import ConfigError
from zerofit.frontend.tracking import selection as tracking
from zerofit.frontend.tracking.base import BlankTracker
from zerofit.frontend.tracking.services import Service
from zerofit.testing.distributed import run_distributed
from zerofit.tracking import GeneralTracker


class Recording(GeneralTracker):
    """A script's own tracker: remembers every call."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self):
        self.calls: list[tuple] = []

    def start(self):
        self.calls.append(("start",))

    @property
    def tracker(self):
        return self.calls

    def store_init_configuration(self, values):
        self.calls.append(("config", values))

    def log(self, values, step=None, **kwargs):
        self.calls.append(("log", values, step, kwargs))

    def finish(self):
        self.calls.append(("finish",))


class Bare:
    """Not a GeneralTracker: the four members a tracker object needs, nothing else."""

    name = "bare"

    def __init__(self):
        self.logged = []

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        self.logged.append((values, step))

    def finish(self):
        pass


class _Kind:  # an enum member's shape (Accelerate's LoggerType has .value)
    value = "JSONL"


def test_log_with_names_lists_all_and_objects():
    mine = Recording()
    assert tracking.requested(None) == []
    assert tracking.requested("jsonl") == ["jsonl"]
    assert tracking.requested(["WandB", "jsonl", "wandb", _Kind()]) == ["wandb", "jsonl"]
    assert tracking.requested(mine) == [mine]
    every = tracking.requested(["all", mine])
    assert every[0] == "jsonl" and every[-1] is mine
    assert [n for n in every[:-1]] == [n for n in tracking.NAMES if tracking.installed(n)]


def test_unknown_names_and_objects_missing_a_method_are_errors_at_construction():
    with pytest.raises(ConfigError, match=r"Accelerator\(log_with=...\): 'wandbb' is not a tracker zerofit has; "
                                          r"did you mean 'wandb'\? choose from jsonl, tensorboard, wandb, mlflow"):
        Accelerator(config=RunConfig(), log_with=["wandbb"])
    with pytest.raises(ConfigError, match=r"logging.log_with: 'csv' is not a tracker"):
        Accelerator(config=config_from_dict({"logging": {"log_with": ["csv"]}}))
    with pytest.raises(ConfigError, match=r"is not a tracker object: it has no name \(a non-empty str\), "
                                          r"store_init_configuration\(\), log\(\), finish\(\)"):
        tracking.requested([object()])


def test_a_missing_library_is_one_error_at_init_trackers_naming_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(tracking.LIBRARIES, "dvclive", Service("zerofit_absent_dvclive", "dvclive"))
    monkeypatch.setitem(tracking.LIBRARIES, "aim", Service("zerofit_absent_aim", "aim"))
    acc = Accelerator(config=RunConfig(), log_with=["jsonl", "dvclive", "aim"], logging_dir=tmp_path)
    assert "dvclive" not in tracking.requested("all")
    with pytest.raises(ModuleNotFoundError, match=r"log_with asks for dvclive, aim, whose client libraries are not "
                                                  r"installed: pip install dvclive aim"):
        acc.init_trackers("proj")
    assert acc.trackers == [] and not (tmp_path / "proj").exists()


def test_a_tracker_object_gets_accelerates_calls_beside_jsonl(tmp_path):
    mine, bare = Recording(), Bare()
    acc = Accelerator(config=RunConfig(), log_with=[mine, bare], logging_dir=tmp_path)
    assert isinstance(acc.get_tracker("recording"), BlankTracker)  # before init_trackers: nothing started
    acc.init_trackers("proj", config={"lr": 0.5}, init_kwargs={"recording": {"ignored": True}})
    acc.log({"loss": 1.5}, step=3, log_kwargs={"recording": {"commit": False}})
    assert acc.get_tracker("recording") is mine and acc.get_tracker("recording", unwrap=True) is mine.calls
    assert acc.get_tracker("jsonl", unwrap=True) is acc.get_tracker("jsonl").tracker
    with pytest.raises(ValueError, match=r"get_tracker\('wandb'\): no tracker of that name was started \(started: "
                                         r"jsonl, recording, bare\)"):
        acc.get_tracker("wandb")
    acc.end_training()
    assert mine.calls == [("start",), ("config", {"lr": 0.5}), ("log", {"loss": 1.5}, 3, {"commit": False}),
                          ("finish",)]
    assert bare.logged == [({"loss": 1.5}, 3)]
    lines = [json.loads(x) for x in (tmp_path / "proj" / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["loss"]) for x in lines] == [(3, 1.5)]
    assert json.loads((tmp_path / "proj" / "config.json").read_text()) == {"lr": 0.5}


def _two_ranks(rank: int, world: int, logging_dir: str) -> dict:
    mine = Recording()
    acc = Accelerator(config=RunConfig(), log_with=mine, logging_dir=logging_dir)
    acc.init_trackers("proj", config={"a": 1})
    acc.log({"loss": 2.0}, step=1)
    tracker = acc.get_tracker("recording")
    tracker.log({"loss": 2.0})  # a script calling it on every rank: the blank one does nothing
    acc.end_training()
    tracking.LIBRARIES["dvclive"] = Service("zerofit_absent_dvclive", "dvclive")
    try:
        Accelerator(config=RunConfig(), log_with=[mine, "dvclive"], logging_dir=logging_dir).init_trackers("p")
    except ModuleNotFoundError as error:
        return {"calls": [c[0] for c in mine.calls], "tracker": type(tracker).__name__, "error": str(error)}
    return {}


def test_trackers_run_on_the_main_process_only_and_a_missing_library_stops_every_rank(tmp_path):
    main, other = run_distributed(_two_ranks, 2, str(tmp_path))
    assert main["calls"] == ["start", "config", "log", "log", "finish"] and main["tracker"] == "Recording"
    assert other["calls"] == [] and other["tracker"] == "BlankTracker"
    assert "pip install dvclive" in main["error"] and "pip install dvclive" in other["error"]


def test_deepspeed_monitors_become_trackers():
    with pytest.warns(UserWarning, match=r"wandb.group, project ignored: zerofit starts wandb from the script's "
                                         r"accelerator.init_trackers\(project_name, init_kwargs="):
        cfg = config_from_dict({"wandb": {"enabled": True, "project": "p", "group": "g"},
                                "comet": {"enabled": True}, "tensorboard": {"enabled": False}})
    assert cfg.logging.log_with == ("wandb", "comet_ml")


# --- the services, through their own libraries ------------------------------------------------------


def _wandb_records(run_file: Path) -> list:
    """The records of a wandb run file (LevelDB's log format: 7-byte block headers after wandb's own
    7-byte file header); wandb 0.2x-0.3x ships no reader of it."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunk, records = run_file.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += 32768 - pos % 32768
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or a fragmented one's last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_wandb_offline_run_records_the_config_and_every_step(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's stdout and stderr alone
    acc = Accelerator(config=RunConfig(), log_with="wandb", logging_dir=tmp_path / "logs")
    acc.init_trackers("zf-proj", config={"lr": 0.25}, init_kwargs={"wandb": {"mode": "offline", "tags": ["t"]}})
    run = acc.get_tracker("wandb", unwrap=True)
    assert type(run).__name__ == "Run" and run.project == "zf-proj" and run.config["lr"] == 0.25
    acc.log({"loss": 0.5}, step=1)
    acc.log({"loss": 0.375, "note": "x"}, step=2, log_kwargs={"wandb": {"commit": True}})
    acc.end_training()
    wandb.teardown()
    [run_file] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    steps = {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            steps[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    assert steps == {1: {"loss": 0.5}, 2: {"loss": 0.375, "note": "x"}}
    assert (tmp_path / "logs" / "zf-proj" / "metrics.jsonl").exists()


def test_mlflow_file_store_run_records_params_and_metrics(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store = f"file://{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.x refuses file stores otherwise
    acc = Accelerator(config=RunConfig(), log_with=["mlflow"], logging_dir=tmp_path / "logs")
    with pytest.warns(UserWarning, match="config value 'long' is 7000 characters long"):
        acc.init_trackers("zf-exp", config={"lr": 0.25, "name": "tiny", "long": "x" * 7000},
                          init_kwargs={"mlflow": {"run_name": "first", "tags": {"who": "zerofit"}}})
    run_id = acc.get_tracker("mlflow", unwrap=True).info.run_id
    with pytest.warns(UserWarning, match="'note' is a str, and MLflow metrics are numbers"):
        acc.log({"loss": 0.5, "note": "x"}, step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per key
        acc.log({"loss": 0.25, "note": "y"}, step=2)
    acc.end_training()
    client = MlflowClient(store)
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.25", "name": "tiny"} and run.data.tags["who"] == "zerofit"
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "zf-exp"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 0.5), (2, 0.25)]


def test_comet_ml_offline_experiment_zip_holds_the_params_and_every_step(tmp_path, monkeypatch):
    pytest.importorskip("comet_ml")
    import zipfile

    from comet_ml import ExperimentConfig

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.comet.config is read
    monkeypatch.setenv("COMET_ERROR_TRACKING_ENABLE", "false")  # no Sentry reports from the client
    monkeypatch.chdir(tmp_path)
    quiet = {k: False for k in ("log_code", "log_graph", "parse_args", "log_git_metadata", "log_git_patch",
                                "log_env_details", "log_env_gpu", "log_env_host", "log_env_cpu", "log_env_network",
                                "log_env_disk", "auto_output_logging", "auto_log_co2")}
    config = ExperimentConfig(offline_directory=str(tmp_path / "comet"), name="first", display_summary_level=0, **quiet)
    acc = Accelerator(config=RunConfig(), log_with="comet_ml", logging_dir=tmp_path / "logs")
    acc.init_trackers("zf-proj", config={"lr": 0.25, "name": "tiny"},
                      init_kwargs={"comet_ml": {"online": False, "experiment_config": config}})
    assert type(acc.get_tracker("comet_ml", unwrap=True)).__name__ == "OfflineExperiment"
    acc.log({"loss": 0.5}, step=1)
    with pytest.warns(UserWarning, match="comet_ml: 'odd' is a list"):
        acc.log({"loss": 0.375, "note": "x", "odd": [1]}, step=2)
    acc.end_training()
    [archive] = (tmp_path / "comet").glob("*.zip")
    with zipfile.ZipFile(archive) as z:
        assert json.loads(z.read("experiment.json"))["project_name"] == "zf-proj"
        messages = [json.loads(x) for x in z.read("messages.json").splitlines()]
    params = {m["payload"]["param"]["paramName"]: m["payload"]["param"]["paramValue"]
              for m in messages if m["type"] == "parameter_msg"}
    metrics = [(m["payload"]["metric"]["step"], m["payload"]["metric"]["metricValue"])
               for m in messages if m["type"] == "metric_msg" and m["payload"]["metric"]["metricName"] == "loss"]
    others = {m["payload"]["key"]: m["payload"]["value"] for m in messages if m["type"] == "log_other"}
    assert params["lr"] == 0.25 and params["name"] == "tiny" and metrics == [(1, 0.5), (2, 0.375)]
    assert others["note"] == "x" and others["Name"] == "first"


def test_aim_local_repo_run_holds_hparams_metrics_and_text(tmp_path):
    pytest.importorskip("aim")
    from aim import Repo, Run
    from aim.sdk.index_manager import RepoIndexManager
    from aim.storage.context import Context

    acc = Accelerator(config=RunConfig(), log_with="aim", logging_dir=tmp_path)
    acc.init_trackers("zf-proj", config={"lr": 0.25, "name": "tiny"}, init_kwargs={"aim": {
        "experiment": "exp1", "system_tracking_interval": None, "capture_terminal_logs": False}})
    run_hash = acc.get_tracker("aim", unwrap=True).hash
    acc.log({"loss": 0.5}, step=1)
    with pytest.warns(UserWarning, match="aim: 'odd' is a NoneType, which Aim does not track"):
        acc.log({"loss": 0.375, "note": "x", "odd": None}, step=2)
    acc.end_training()
    repo = Repo.from_path(str(tmp_path))
    RepoIndexManager.get_index_manager(repo).index(run_hash)  # what `aim up` does in the background
    RepoIndexManager.index_manager_pool.pop(repo.path, None)
    run = Run(run_hash, repo=repo, read_only=True)
    assert run.name == "zf-proj" and run.experiment == "exp1" and not run.active
    assert run["hparams"] == {"lr": 0.25, "name": "tiny"}
    steps, (values, *_) = run.get_metric("loss", Context({})).data.items_list()
    assert list(steps) == [1, 2] and list(values) == [0.5, 0.375]
    steps, (texts, *_) = run.get_text_sequence("note", Context({})).data.items_list()
    assert list(steps) == [2] and texts[0].data == "x"


def test_clearml_offline_session_holds_the_configuration_and_scalars(tmp_path, monkeypatch):
    if importlib.util.find_spec("clearml") is None:
        pytest.skip("clearml is not installed")
    config = tmp_path / "clearml.conf"  # the reporter in a thread: its subprocess takes ~10 s to stop
    config.write_text("sdk { development { report_use_subprocess: false } }\n")
    for var, value in {"HOME": tmp_path, "CLEARML_CACHE_DIR": tmp_path / "cache", "CLEARML_CONFIG_FILE": config,
                       "CLEARML_OFFLINE_MODE": "1"}.items():
        monkeypatch.setenv(var, str(value))
    monkeypatch.delenv("CLEARML_PROJECT", raising=False)
    monkeypatch.delenv("CLEARML_TASK", raising=False)
    import clearml  # noqa: F401  (reads CLEARML_OFFLINE_MODE when first imported; stays offline in this process)

    acc = Accelerator(config=RunConfig(), log_with="clearml", logging_dir=tmp_path / "logs")
    acc.init_trackers("zf-proj", config={"lr": 0.25, "name": "tiny"}, init_kwargs={"clearml": {
        "auto_connect_frameworks": {"detect_repository": False}, "auto_resource_monitoring": False,
        "auto_connect_streams": False, "auto_connect_arg_parser": False}})
    task = acc.get_tracker("clearml", unwrap=True)
    folder = Path(task.get_offline_mode_folder())
    acc.log({"loss": 0.5, "eval_loss": 0.75}, step=1)
    with pytest.warns(UserWarning, match="clearml: 'note' is a str, not a number"):
        acc.log({"loss": 0.375, "note": "x"}, step=2)
    acc.log({"final": 3.0})
    acc.end_training()
    assert folder.is_relative_to(tmp_path)
    events = [e for line in (folder / "metrics.jsonl").read_text().splitlines() for e in json.loads(line)]
    scalars = [(e["iter"], e["metric"], e["variant"], e["value"]) for e in events if e["metric"] != "Summary"]
    assert scalars == [(1, "loss", "train", 0.5), (1, "loss", "eval", 0.75), (2, "loss", "train", 0.375)]
    assert [(e["variant"], e["value"]) for e in events if e["metric"] == "Summary"] == [("final", 3.0)]
    task_json = json.loads((folder / "task.json").read_text())
    assert task_json["name"] == "zf-proj"
    assert task_json["configuration"]["General"]["value"] == 'lr = 0.25\nname = "tiny"'


def test_dvclive_writes_metrics_plots_and_params_under_its_dir(tmp_path, monkeypatch):
    pytest.importorskip("dvclive")
    import yaml

    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.setenv("DO_NOT_TRACK", "1")
    monkeypatch.chdir(tmp_path)  # DVCLive writes dvc.yaml at the working directory's repository root
    acc = Accelerator(config=RunConfig(), log_with="dvclive", logging_dir=tmp_path / "logs")
    acc.init_trackers("zf-proj", config={"lr": 0.25, "name": "tiny"},
                      init_kwargs={"dvclive": {"dir": str(tmp_path / "dvc"), "save_dvc_exp": False}})
    acc.log({"loss": 0.5}, step=1)
    with pytest.warns(UserWarning, match="dvclive: 'note' is a str, not a number"):
        acc.log({"loss": 0.375, "note": "x"}, step=2)
    acc.end_training()
    assert json.loads((tmp_path / "dvc" / "metrics.json").read_text()) == {"loss": 0.375, "step": 2}
    assert (tmp_path / "dvc" / "plots" / "metrics" / "loss.tsv").read_text().split() == [
        "step", "loss", "1", "0.5", "2", "0.375"]
    assert yaml.safe_load((tmp_path / "dvc" / "params.yaml").read_text()) == {"lr": 0.25, "name": "tiny"}
