"""The launch plan and how launch parses, without starting any process (flag sets: test_cli_flags.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from torch.distributed import run as torchrun

from zerofit.cli.launch import (
    DEFAULT_MULTI_NODE_PORT,
    WORKER_MODULE,
    exposure_warning,
    network_env,
    plan_launch,
)
from zerofit.cli.main import build_parser, main
from zerofit.config.schema import LaunchConfig, RunConfig
from zerofit.errors import ConfigError

TARGET = ("train.py", "--lr", "1e-3")


def config(**launch) -> RunConfig:
    return RunConfig(launch=dataclasses.replace(LaunchConfig(), **launch))


def test_cpu_default_is_one_process_on_a_free_loopback_port():
    plan = plan_launch(config(), TARGET, gpu_count=0)
    la = plan.config.launch
    assert (plan.world_size, plan.nproc_per_node, plan.backend) == (1, 1, "gloo")
    assert la.num_processes == 1 and la.use_cpu is True and la.main_process_ip == "127.0.0.1"
    assert 0 < la.main_process_port < 65536


def test_gpu_default_is_one_process_per_gpu_on_nccl():
    plan = plan_launch(config(), TARGET, gpu_count=4)
    assert (plan.world_size, plan.backend, plan.config.launch.use_cpu) == (4, "nccl", False)


def test_use_cpu_wins_over_gpus():
    plan = plan_launch(config(use_cpu=True, num_processes=3), TARGET, gpu_count=8)
    assert (plan.world_size, plan.backend) == (3, "gloo")


def test_num_processes_counts_all_machines():
    plan = plan_launch(config(num_processes=8, num_machines=2, machine_rank=1, main_process_ip="10.0.0.1"),
                       TARGET, gpu_count=4)
    assert plan.nproc_per_node == 4 and plan.world_size == 8
    assert plan.config.launch.main_process_port == DEFAULT_MULTI_NODE_PORT


def test_one_machine_argv_uses_the_loopback_rendezvous():
    plan = plan_launch(config(num_processes=2, main_process_port=1234), TARGET, gpu_count=0)
    args = torchrun.parse_args(plan.torchrun_argv())
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("1", "2", "zerofit-loopback")
    assert args.rdzv_endpoint == "127.0.0.1:1234"
    assert args.module and args.training_script == WORKER_MODULE
    assert args.training_script_args == list(TARGET)
    assert plan.loopback_only and exposure_warning(plan) is None


def test_static_argv_is_accepted_by_torchrun():
    plan = plan_launch(config(num_processes=2, num_machines=2, main_process_ip="10.0.0.1", main_process_port=1234),
                       TARGET, gpu_count=0)
    args = torchrun.parse_args(plan.torchrun_argv())
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2", "1", "static")
    assert (args.master_addr, args.master_port, args.node_rank) == ("10.0.0.1", 1234, 0)
    assert not plan.loopback_only
    assert re.search(r"WARNING: the rendezvous store on 10.0.0.1:1234 listens on every network interface",
                     exposure_warning(plan))


def test_one_machine_with_a_network_address_warns_that_it_is_exposed():
    plan = plan_launch(config(num_processes=2, main_process_ip="192.168.1.5"), TARGET, gpu_count=0)
    assert not plan.loopback_only
    assert "listens on every network interface" in exposure_warning(plan)


def test_a_non_loopback_gloo_interface_chosen_by_the_user_is_warned_about(monkeypatch):
    plan = plan_launch(config(num_processes=2), TARGET, gpu_count=0)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert network_env(plan) == {"NCCL_SOCKET_IFNAME": "=eth0"}  # the user's choice wins, for NCCL too
    assert re.search(r"GLOO_SOCKET_IFNAME=eth0 makes the workers' gloo sockets listen beyond loopback",
                     exposure_warning(plan))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert network_env(plan) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo"}


def test_c10d_argv_uses_an_endpoint_and_no_node_rank():
    plan = plan_launch(config(num_machines=2, machine_rank=1, main_process_ip="10.0.0.1", main_process_port=29400,
                              rdzv_backend="c10d", use_cpu=True, num_processes=2),
                       ("-m", "pkg.train"), gpu_count=0)
    argv = plan.torchrun_argv()
    args = torchrun.parse_args(argv)
    assert args.rdzv_backend == "c10d" and args.rdzv_endpoint == "10.0.0.1:29400"
    assert "--node-rank" not in argv
    assert args.training_script_args == ["-m", "pkg.train"]


def test_launch_flags_are_checked_by_config_validation_all_at_once(capsys):
    """plan_launch trusts load_config for the rules among launch settings (tests/test_config_errors.py has
    each rule): the flags must reach it as overrides, and every broken one is reported in one run."""
    assert main(["launch", "--dry-run", "--num_processes", "3", "--num_machines", "2", "--machine_rank", "2",
                 "--max_restarts", "-1", "--main_process_port", "0", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "zerofit launch: error: 5 problem(s)" in err
    for rule in ("launch.num_processes (3) must be a multiple of launch.num_machines (2)",
                 "launch.machine_rank (2) must be below launch.num_machines (2)",
                 "launch.main_process_ip is required when launch.num_machines > 1",
                 "--max_restarts -1: must be at least 0 (it sets launch.max_restarts)",  # named as typed
                 "--main_process_port 0: must be at least 1 (it sets launch.main_process_port)"):
        assert rule in err


def test_more_processes_than_gpus_names_the_flag_and_the_fix():
    with pytest.raises(ConfigError, match=r"--num_processes .* 3 process\(es\) per machine .* 2 GPU\(s\).*--cpu"):
        plan_launch(config(num_processes=3), TARGET, gpu_count=2)


def test_the_batch_triple_is_checked_against_the_world_size_the_plan_gives():
    """Without --num_processes the world size is known only to the plan (one per GPU): the rule every
    rank's prepare() checks is checked there, once."""
    batch = dataclasses.replace(RunConfig().batch, train_batch_size=10, train_micro_batch_size_per_gpu=2,
                                gradient_accumulation_steps=1)
    bad = RunConfig(batch=batch)
    with pytest.raises(ConfigError, match=r"batch\.train_batch_size \(10\) != batch\.train_micro_batch_size_per_gpu "
                                          r"\(2\) \* batch\.gradient_accumulation_steps \(1\) \* world size \(4\) = 8: "
                                          r"set batch\.train_batch_size to 8 or to \"auto\""):
        plan_launch(bad, TARGET, gpu_count=4)
    assert plan_launch(bad.replace(batch=dataclasses.replace(batch, train_batch_size=8)), TARGET,
                       gpu_count=4).world_size == 4


@pytest.mark.parametrize("dry_run", [["--dry_run"], []])
def test_an_impossible_batch_triple_stops_dry_run_and_launch_alike(dry_run, tmp_path, monkeypatch, capsys):
    from zerofit.cli import launch

    script = tmp_path / "train.py"
    script.write_text("")
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}')
    monkeypatch.setattr(launch, "execute", lambda plan: pytest.fail("started the workers"))
    assert main(["launch", *dry_run, "--cpu", "--config_file", str(path), str(script)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"zerofit launch: error: 1 problem(s) in {path}:\n  - train_batch_size (10) != "
                            "train_micro_batch_size_per_gpu (2) * gradient_accumulation_steps (1) * world size (1) = "
                            '2: set train_batch_size to 2 or to "auto"\n')


def test_script_arguments_after_the_target_are_not_zerofit_flags():
    args = build_parser().parse_args(["launch", "--num_processes", "2", "train.py", "--num_processes", "9", "-m"])
    assert args.num_processes == 2 and args.target == "train.py" and not args.module
    assert args.target_args == ["--num_processes", "9", "-m"]


def test_gpu_ids_limit_the_processes_and_the_visible_gpus():
    plan = plan_launch(config(gpu_ids="1,3"), TARGET, gpu_count=4)
    assert plan.world_size == 2 and plan.cuda_visible_devices == "1,3"
    with pytest.raises(ConfigError, match=r"launch.gpu_ids is '1,7' .* GPUs 0..3"):
        plan_launch(config(gpu_ids="1,7"), TARGET, gpu_count=4)


ACCELERATE_DEFAULT = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
  offload_optimizer_device: cpu
  offload_param_device: cpu
mixed_precision: bf16
num_machines: 1
"""


def _write_accelerate_default(folder) -> str:
    path = folder / "accelerate" / "default_config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(ACCELERATE_DEFAULT)
    return str(path)


@pytest.mark.parametrize("where", ["HF_HOME", "XDG_CACHE_HOME", "HOME"])
def test_the_default_config_is_where_accelerate_config_writes_it(where, tmp_path, monkeypatch):
    from zerofit.cli.launch import accelerate_default_config

    for name in ("HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert accelerate_default_config() is None
    base = {"HF_HOME": tmp_path, "XDG_CACHE_HOME": tmp_path / "huggingface",
            "HOME": tmp_path / "home" / ".cache" / "huggingface"}[where]
    monkeypatch.setenv(where, str(tmp_path if where != "HOME" else tmp_path / "home"))
    expected = _write_accelerate_default(base)
    assert str(accelerate_default_config()) == expected


def test_launch_without_config_file_reads_accelerates_default_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    path = _write_accelerate_default(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["launch", "--dry_run", "--num_processes", "1", str(script)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == f"# config: {path} (accelerate's default config; --config_file FILE reads another)"
    assert "stage: 3" in out and "mixed_precision: bf16" in out
    # --cpu skips it, as `accelerate launch --cpu` does; an explicit --config_file wins
    assert main(["launch", "--dry_run", "--cpu", str(script)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == "# config: built-in defaults" and "stage: 0" in out
    own = tmp_path / "own.yaml"
    own.write_text("zero:\n  stage: 1\n")
    assert main(["launch", "--dry_run", "--config_file", str(own), "--num_processes", "1", str(script)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == f"# config: {own}" and "stage: 1" in out


def test_a_real_launch_names_accelerates_default_config_before_it_starts(tmp_path, monkeypatch, capsys):
    from zerofit.cli import launch

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    path = _write_accelerate_default(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("")
    seen = {}
    monkeypatch.setattr(launch, "execute", lambda plan: seen.setdefault("plan", plan) and 0)
    assert main(["launch", "--num_processes", "1", str(script)]) == 0
    assert seen["plan"].config.zero.stage == 3 and seen["plan"].config.source == path
    assert capsys.readouterr().err == f"zerofit launch: config: {path} (accelerate's default config; " \
                                      "--config_file FILE reads another)\n"
