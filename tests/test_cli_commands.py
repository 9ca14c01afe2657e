"""`zerofit --version`, `launch --dry-run`, `env`, `config` and `demo`, run in-process (no workers start)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from zerofit import __version__
from zerofit.cli import launch
from zerofit.cli.main import main
from zerofit.config import AUTO, load_config

CHECK = Path(__file__).parent / "scripts" / "allreduce_check.py"


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"zerofit {__version__}"


def test_dry_run_prints_the_plan_and_a_loadable_resolved_config(capsys, tmp_path):
    assert main(["launch", "--dry-run", "--num_processes", "4", "--mixed_precision", "bf16", "--cpu",
                 str(CHECK), "--lr", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# zerofit launch plan: 4 rank(s) = 1 machine(s) x 4 process(es)")
    assert "backend gloo" in out and "rendezvous zerofit-loopback at 127.0.0.1:" in out
    assert f"# each rank runs: {CHECK} --lr 1" in out
    (tmp_path / "resolved.yaml").write_text(out)
    cfg = load_config(tmp_path / "resolved.yaml")
    assert (cfg.launch.num_processes, cfg.launch.use_cpu, cfg.precision.mixed_precision) == (4, True, "bf16")
    assert cfg.launch.main_process_ip == "127.0.0.1" and cfg.launch.main_process_port


def test_dry_run_reads_a_deepspeed_config_and_flags_override_it(capsys, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                              "bf16": {"enabled": True}, "gradient_accumulation_steps": 2}))
    assert main(["launch", "--dry-run", "--config_file", str(ds), "--num_processes", "2",
                 "--mixed_precision", "no", str(CHECK)]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["zero"]["stage"] == 3 and resolved["zero"]["offload_optimizer"]["device"] == "cpu"
    assert resolved["precision"]["mixed_precision"] == "no"  # the flag wins over the file
    assert resolved["launch"]["num_processes"] == 2
    assert resolved["batch"]["oom_backoff"] is True  # on unless asked otherwise


def test_dry_run_checks_the_trackers_and_the_nvme_directory_in_the_files_own_spelling(capsys, tmp_path):
    """#40: a misspelt tracker and an NVMe directory that does not exist passed --dry_run and failed in every
    worker after the model and data loaded, the directory named in DeepSpeed's words for a zerofit YAML."""
    missing = tmp_path / "no_such_dir"
    files = {
        "zerofit.yaml": (yaml.safe_dump({"zero": {"stage": 3, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(missing)}}, "logging": {"log_with": ["tensorbord"]}}),
            "zero.offload_optimizer.nvme_path", "logging.log_with"),
        "ds.json": (json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(missing)}}}), "zero_optimization.offload_optimizer.nvme_path", None),
        "accelerate.yaml": (yaml.safe_dump({"distributed_type": "DEEPSPEED", "deepspeed_config": {
            "zero_stage": 3, "offload_optimizer_device": "nvme", "offload_optimizer_nvme_path": str(missing)}}),
            "deepspeed_config.offload_optimizer_nvme_path", None),
    }
    for name, (text, nvme_key, trackers_key) in files.items():
        (tmp_path / name).write_text(text)
        assert main(["launch", "--dry_run", "--cpu", "--config_file", str(tmp_path / name), str(CHECK)]) == 2, name
        err = capsys.readouterr().err
        assert f"{nvme_key} '{missing}' does not exist (this machine): create the directory or point {nvme_key}" \
            in err, (name, err)
        assert "zero_optimization" not in err or name == "ds.json", err
        if trackers_key:
            assert re.search(rf"{trackers_key}: 'tensorbord' is not a tracker zerofit has; did you mean "
                             r"'tensorboard'\? choose from jsonl, tensorboard", err), err
    missing.mkdir()  # the directory exists and the tracker is spelt right: the launch plan prints
    (tmp_path / "good.yaml").write_text(files["zerofit.yaml"][0].replace("tensorbord", "jsonl"))
    assert main(["launch", "--dry_run", "--cpu", "--config_file", str(tmp_path / "good.yaml"), str(CHECK)]) == 0
    assert "nvme_path: " in capsys.readouterr().out and sorted(missing.iterdir()) == []  # the probe is gone


def test_the_oom_backoff_flag_reaches_a_deepspeed_run(capsys, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    assert main(["launch", "--dry-run", "--config_file", str(ds), "--oom_backoff", "off", str(CHECK)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["batch"]["oom_backoff"] is False


def test_missing_script_is_one_clear_error(capsys, tmp_path):
    assert main(["launch", str(tmp_path / "nope.py")]) == 2
    err = capsys.readouterr().err
    assert "zerofit launch: error:" in err and "nope.py' does not exist" in err and "-m NAME" in err


def test_a_directory_as_the_script_is_named_as_a_directory(capsys, tmp_path):
    assert main(["launch", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a directory, not a Python file: pass the script inside it" in err and "does not exist" not in err


def test_missing_module_is_one_clear_error(capsys):
    assert main(["launch", "-m", "zerofit_no_such_module.train"]) == 2
    assert "no module named 'zerofit_no_such_module.train'" in capsys.readouterr().err


def test_a_misspelt_launch_flag_is_rejected_not_passed_on(capsys):
    with pytest.raises(SystemExit) as info:
        main(["launch", "--num_procs", "2", str(CHECK)])
    assert info.value.code == 2 and "--num_procs" in capsys.readouterr().err


def test_env_prints_a_paste_ready_block(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert out.count("```") == 2
    for line in (f"zerofit: {__version__}", "python: 3.", "torch: ", "NCCL: ", "transformers: ", "deepspeed: ",
                 "GPUs: ", "CPUs: ", "host memory: ", "locked-memory limit",
                 "torch.utils.collect_env (took ", "PyTorch version: "):  # torch's own block, inside the fence
        assert line in out


def test_torch_collect_env_running_over_its_bound_is_one_line():
    from zerofit.cli.env import torch_env_lines

    assert torch_env_lines.__wrapped__(0.0) == ("torch.utils.collect_env: not shown: still running after 0 s",)


def test_env_can_show_a_resolved_config(capsys, tmp_path):
    path = tmp_path / "z.yaml"
    path.write_text("zero:\n  stage: 2\n")
    assert main(["env", "--config_file", str(path)]) == 0
    assert "stage: 2" in capsys.readouterr().out


CASES = [
    ["--stage", "0"],
    ["--stage", "1", "--offload_optimizer", "cpu", "--mixed_precision", "bf16", "--gradient_accumulation_steps", "4",
     "--gradient_clipping", "1.0"],
    ["--stage", "2", "--offload_optimizer", "cpu", "--mixed_precision", "fp16"],
    ["--stage", "3", "--offload_optimizer", "cpu", "--offload_param", "cpu", "--mixed_precision", "bf16"],
    ["--stage", "3", "--offload_optimizer", "nvme", "--offload_param", "cpu", "--nvme_path", "/local_nvme"],
]


def _flag(case: list[str], name: str, default: str | None) -> str | None:
    return case[case.index(name) + 1] if name in case else default


@pytest.mark.parametrize("fmt", ["zerofit", "deepspeed", "accelerate"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c[1::2]))
def test_config_writes_a_file_that_loads_back_to_the_same_settings(fmt, case, tmp_path, capsys):
    suffix = ".json" if fmt == "deepspeed" else ".yaml"
    out = tmp_path / f"cfg{suffix}"
    procs = [] if fmt == "deepspeed" else ["--num_processes", "2"]
    assert main(["config", *case, *procs, "--format", fmt, "-o", str(out)]) == 0
    assert "zerofit launch --config_file" in capsys.readouterr().out
    cfg = load_config(out)
    assert cfg.zero.stage == int(case[1])
    assert cfg.zero.offload_optimizer.device == _flag(case, "--offload_optimizer", "none")
    assert cfg.zero.offload_param.device == _flag(case, "--offload_param", "none")
    for offload in (cfg.zero.offload_optimizer, cfg.zero.offload_param):
        if offload.device == "nvme":
            assert offload.nvme_path == "/local_nvme"
    assert cfg.precision.mixed_precision == _flag(case, "--mixed_precision", "no")
    unset = AUTO  # in every format an unset accumulation comes from the script, as in Accelerate
    gas, clip = _flag(case, "--gradient_accumulation_steps", None), _flag(case, "--gradient_clipping", None)
    assert cfg.batch.gradient_accumulation_steps == (unset if gas is None else int(gas))
    assert cfg.gradient_clipping == ((0.0 if fmt == "zerofit" else AUTO) if clip is None else float(clip))
    if procs:
        assert cfg.launch.num_processes == 2
    if fmt == "deepspeed":
        assert "zero_optimization" in json.loads(out.read_text())
    if fmt == "accelerate":
        assert yaml.safe_load(out.read_text())["distributed_type"] == "DEEPSPEED"


@pytest.mark.parametrize(("args", "match"), [
    (["--stage", "3", "--offload_optimizer", "nvme"], r"--offload_optimizer nvme needs a directory: add --nvme_path"),
    (["--stage", "2", "--nvme_path", "/x"], r"--nvme_path /x is unused: add --offload_optimizer nvme"),
    (["--stage", "2", "--format", "deepspeed", "--num_processes", "2"], r"--num_processes has no place in a DeepSpeed"),
    (["--stage", "2", "--offload_param", "cpu"], r"offload_param"),
])
def test_config_rejects_contradictions_naming_the_flag(args, match, tmp_path, capsys):
    out = tmp_path / "c.yaml"
    assert main(["config", *args, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "zerofit config: error:" in err
    assert re.search(match, err), err
    assert not out.exists()


@pytest.mark.parametrize("extra", [[], ["--nvme_path", "/x"]])
def test_config_offers_no_nvme_for_parameters(extra, tmp_path, capsys):
    """Parameters do not go to NVMe: argparse rejects the choice at once (not after asking for --nvme_path),
    and --help does not offer it."""
    out = tmp_path / "c.yaml"
    with pytest.raises(SystemExit) as exit_:
        main(["config", "--stage", "3", "--offload_param", "nvme", *extra, "-o", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"argument --offload_param\S*: invalid choice: 'nvme' \(choose from '?none'?, '?cpu'?\)", err), err
    assert "needs a directory" not in err and not out.exists()
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    assert "--offload_param {none,cpu}" in capsys.readouterr().out


def test_config_stage_auto_writes_a_planned_config_and_dash_writes_to_stdout(tmp_path, capsys):
    """`stage: auto` is the README's headline: `--stage auto` writes it (offload left to the planner unless
    given), and `-o -` prints the file instead of writing one named `-`."""
    assert main(["config", "--stage", "auto", "--mixed_precision", "bf16", "-o", "-"]) == 0
    out = capsys.readouterr()
    assert yaml.safe_load(out.out) == {"zero": {"stage": "auto"}, "precision": {"mixed_precision": "bf16"}}
    assert "wrote zerofit config to stdout" in out.err and not (tmp_path / "-").exists()
    path = tmp_path / "auto.yaml"
    path.write_text(out.out)
    cfg = load_config(path)
    assert cfg.zero.stage == AUTO and cfg.zero.offload_optimizer.device == AUTO
    assert main(["config", "--stage", "auto", "--offload_param", "none", "-o", str(path)]) == 0
    assert load_config(path).zero.offload_param.device == "none"
    assert main(["config", "--stage", "auto", "--format", "deepspeed", "-o", "-"]) == 2
    assert "--stage auto is planned by zerofit at launch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["config", "--stage", "4", "-o", "-"])
    assert "invalid choice: 4 (choose from 0, 1, 2, 3, 'auto')" in capsys.readouterr().err


def test_demo_is_a_two_process_cpu_launch_of_the_demo_module(monkeypatch):
    seen = {}

    def execute(plan):
        seen["plan"] = plan
        return 0

    monkeypatch.setattr(launch, "check_target", lambda target: None)  # the demo module ships with the engine
    monkeypatch.setattr(launch, "execute", execute)
    assert main(["demo", "--stage", "3", "--steps", "20"]) == 0
    plan = seen["plan"]
    assert plan.world_size == 2 and plan.backend == "gloo" and plan.config.launch.use_cpu
    assert plan.target == ("-m", "zerofit.demo.train", "--stage", "3", "--steps", "20")


def test_demo_hands_the_ranks_canonical_options_so_an_old_name_warns_once(monkeypatch, capsys):
    seen = {}
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(launch, "check_target", lambda target: None)
    monkeypatch.setattr(launch, "execute", lambda plan: seen.setdefault("plan", plan) and 0)
    assert main(["demo", "--batch-size", "4", "--lr", "0.01", "--steps", "60"]) == 0  # 60: the default, not passed
    assert seen["plan"].target == ("-m", "zerofit.demo.train", "--micro_batch", "4", "--lr", "0.01")
    assert capsys.readouterr().err.count("is deprecated: use --micro_batch") == 1


def test_demo_help_lists_the_demos_options_and_a_wrong_one_fails_before_launch(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    shown = capsys.readouterr().out
    for option in ("--stage {0,1,2,3}", "--steps N", "--micro_batch B", "--gradient_accumulation_steps K",
                   "--context C", "--lr LR", "--mixed_precision {no,bf16,fp16}"):
        assert option in shown, shown
    monkeypatch.setattr(launch, "execute", lambda plan: pytest.fail("launched with a wrong option"))
    with pytest.raises(SystemExit):
        main(["demo", "--stage", "4"])
    assert "argument --stage: invalid choice: 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--stpes", "3"])
    assert "unrecognized arguments: --stpes 3" in capsys.readouterr().err


def test_a_taken_rendezvous_port_is_named_with_the_option_that_moves_it(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["launch", "--cpu", "--num_processes", "2", "--main_process_port", str(port), str(CHECK)]) == 1
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is already in use" in err and "--main_process_port PORT" in err
    assert "Traceback" not in err and "Errno 98" not in err


def test_resume_auto_is_read_from_a_file_and_from_the_flag(tmp_path, capsys):
    """"auto" is one of checkpoint.resume's modes, not the placeholder that "auto" means elsewhere."""
    path = tmp_path / "run.yaml"
    path.write_text("checkpoint:\n  resume: auto\n  output_dir: ckpt\n")
    assert load_config(path).checkpoint.resume == "auto"
    assert main(["launch", "--dry-run", "--resume", "auto", str(CHECK)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["checkpoint"]["resume"] == "auto"


def test_script_arguments_that_look_like_torchrun_options_reach_the_script(tmp_path):
    """#18: `--n`, `--max`, `--log`, `--local`, `--master` after the script were taken by torchrun's parser."""
    script = tmp_path / "args.py"
    out = tmp_path / "argv.json"
    script.write_text(f"import json, sys\njson.dump(sys.argv[1:], open({str(out)!r}, 'w'))\n")
    given = ["--n", "3", "--max", "2", "--log", "x", "--local", "1", "--master", "y", "--", "--nproc-per-node", "9"]
    assert main(["launch", "--cpu", "--num_processes", "1", str(script), *given]) == 0
    assert json.loads(out.read_text()) == given


def test_the_failure_summary_names_the_first_rank_and_how_the_others_ended():
    from types import SimpleNamespace

    from zerofit.cli.failure_report import summary

    def failure(exitcode, message=None, local_rank=0):
        data = {"message": {"message": message}} if message else {}
        return SimpleNamespace(exitcode=exitcode, error_file_data=data, message="", local_rank=local_rank,
                               signal_name=lambda: "SIGTERM")

    text = summary("train.py", {0: failure(-15), 1: failure(1, "ValueError: bad\nsecond line", 1),
                                2: failure(2)}, first_rank=1)
    assert text.splitlines() == [
        "zerofit launch: train.py failed: rank 1 first (local rank 1, exit code 1): ValueError: bad second line",
        "  its traceback is above, its lines prefixed [rank1]",
        "  then rank 0 (exit code -15): stopped by SIGTERM",
        "  then rank 2 (exit code 2): exited with code 2 without an exception (the script called sys.exit, or "
        "rejected its arguments): see its output above"]
    assert "x" * 401 not in summary("t.py", {0: failure(1, "E: " + "x" * 5000)}, first_rank=0)


def test_the_rank_named_first_is_the_one_whose_error_is_its_own_not_a_peer_that_saw_it_leave():
    """#40: torchelastic orders failures by whole-second timestamps, so rank 0's "another rank left the run"
    (or, at a checked place, "rank 1 has left the script") was named first when rank 1 raised in the same
    second."""
    from types import SimpleNamespace

    from zerofit.cli.failure_report import first_failure, summary

    def failure(message=None, timestamp=1000, exitcode=1):
        data = {"message": {"message": message}} if message else {}
        return SimpleNamespace(exitcode=exitcode, error_file_data=data, message="", local_rank=0, timestamp=timestamp,
                               signal_name=lambda: "SIGKILL")

    left = failure("CollectiveError: rank 0: collective grad_norm failed because another rank left the run (it "
                   "crashed, was killed, ...)")
    own = failure("ValueError: bad batch")
    assert first_failure({0: left, 1: own}) == 1
    assert first_failure({0: left, 1: failure("ValueError: bad batch", timestamp=1001)}) == 1
    assert first_failure({0: left, 1: failure(exitcode=-9)}) == 1  # killed without a record: its own end
    assert first_failure({0: failure(exitcode=-9), 1: own}) == 1  # a recorded error says more
    assert first_failure({0: own, 1: failure("OSError: disk", timestamp=999)}) == 1  # else the earliest
    assert first_failure({0: left, 1: left}) == 0
    apart = failure("RanksApartError: rank 0 is in accelerator.wait_for_everyone(), while rank 1 has left the script "
                    "(its process is exiting): each waits for the other, ...")
    assert first_failure({0: apart, 1: own}) == 1
    assert summary("train.py", {0: left, 1: own}, first_failure({0: left, 1: own})).startswith(
        "zerofit launch: train.py failed: rank 1 first (local rank 0, exit code 1): ValueError: bad batch")


def test_a_sigsegv_under_zero3_names_reading_a_weight_outside_forward_and_the_fix():
    from types import SimpleNamespace

    from zerofit.cli.failure_report import segfault_hint

    segv, term = SimpleNamespace(exitcode=-11), SimpleNamespace(exitcode=-15)
    assert "gathered_parameters" in segfault_hint({0: term, 1: segv}, 3)
    assert "gathered_parameters" in segfault_hint({0: segv}, "auto")  # the planner may choose stage 3
    assert segfault_hint({0: segv}, 2) is None and segfault_hint({0: term}, 3) is None


@pytest.mark.parametrize(("argv", "said"), [
    (["--num_processes", "0"], "--num_processes 0: must be at least 1 (it sets launch.num_processes)"),
    (["--num-processes=0"], "--num-processes 0: must be at least 1"),
    (["--main_process_port", "70000"], "--main_process_port 70000: more than the 65535 zerofit accepts"),
])
def test_a_launch_flags_bad_value_is_named_as_typed(capsys, argv, said):
    assert main(["launch", *argv, "--dry_run", "train.py"]) == 2
    err = capsys.readouterr().err
    assert said in err and "  - launch.num_processes" not in err


@pytest.mark.parametrize(("argv", "guess"), [
    (["launch", "--num_procesess", "2", "--dry_run", "train.py"], "--num_procesess: did you mean --num_processes?"),
    (["estimate", "--model", "m", "--gpu_memroy_gib", "8"], "--gpu_memroy_gib: did you mean --gpu_memory_gib?"),
])
def test_a_mistyped_flag_gets_a_did_you_mean(capsys, argv, guess):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and guess in capsys.readouterr().err


def test_torchruns_failure_line_is_left_to_zerofits_summary(caplog):
    """torchelastic logs `failed (exitcode: 1) local_rank: ...` before the launcher's summary, which says it."""
    import logging

    from zerofit.cli import failure_report

    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    with caplog.at_level(logging.INFO), failure_report.torchrun_stop_lines_hidden():
        log.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 0, 123, "python")
        log.info("Sending process %s closing signal %s", 123, "SIGTERM")
        log.warning("another line")
    assert [r.getMessage() for r in caplog.records] == ["another line"]


def test_demo_help_mentions_no_config(capsys):
    """`zerofit demo` takes no config file: its defaults are the built-in ones."""
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "config" not in out and "(default: 0, plain data parallelism)" in out
