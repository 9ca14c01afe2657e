"""Clusters without hand work (#28 item 4): SLURM's variables and a DeepSpeed hostfile become the launch plan.

The pure part (host lists, SLURM variables -> settings -> LaunchPlan, hostfile parsing) runs in-process;
two launches on one machine check the wiring end to end: two SLURM "nodes" (simulated variables) and a
hostfile run whose second machine is started through a fake `ssh` that runs the command locally; each
joins 2 x 2 CPU processes into one world of 4 over loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerofit.cli import hostfile, slurm
from zerofit.cli.cluster import MachineSettings
from zerofit.cli.launch import free_loopback_port, plan_launch
from zerofit.cli.main import main
from zerofit.config import load_config
from zerofit.errors import ConfigError

CHECK = Path(__file__).parent / "scripts" / "allreduce_check.py"
TIMEOUT_S = 120


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("tux", ["tux"]),
    ("tux1,tux2", ["tux1", "tux2"]),
    ("tux[0-3]", ["tux0", "tux1", "tux2", "tux3"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("linux[009-011]", ["linux009", "linux010", "linux011"]),
    ("rack[1-2]-node[1,3]", ["rack1-node1", "rack1-node3", "rack2-node1", "rack2-node3"]),
    ("a[1],b-x.y[2-3]", ["a1", "b-x.y2", "b-x.y3"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_slurm_host_lists_expand_as_slurm_documents_them(nodelist, hosts):
    assert slurm.expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["tux[1-3", "tux[3-1]", "tux[a-b]", "tux[[1]]"])
def test_a_malformed_host_list_names_itself(bad):
    with pytest.raises(ValueError, match="host list"):
        slurm.expand_hostlist(bad)


def job(node_id: int, **extra: str) -> dict[str, str]:
    """The variables srun --ntasks-per-node=1 sets on node `node_id` of a 3-node job with 4 GPUs each."""
    return {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[01-02],gpu07",
            "SLURM_STEP_NODELIST": "gpu[01-02],gpu07", "SLURM_NNODES": "3", "SLURM_STEP_NUM_NODES": "3",
            "SLURM_NODEID": str(node_id), "SLURM_PROCID": str(node_id), "SLURM_LOCALID": "0",
            "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_GPUS_ON_NODE": "4", **extra}


def plan_under(environ: dict[str, str], flags: dict | None = None, gpus: int = 4):
    flags = flags or {}
    config = load_config(None, overrides=flags, settle=MachineSettings(flags, slurm.launch_values(environ)))
    return plan_launch(config, ("train.py",), gpu_count=gpus)


def test_slurm_variables_give_the_rank_address_and_process_counts():
    plan = plan_under(job(2))
    la = plan.config.launch
    assert (la.num_machines, la.machine_rank, la.main_process_ip, la.main_process_port) == (3, 2, "gpu01", 29500)
    assert (plan.nproc_per_node, plan.world_size) == (4, 12)
    assert "--node-rank 2" in " ".join(plan.torchrun_argv())


def test_without_slurm_nothing_is_derived_and_one_node_stays_on_loopback():
    assert slurm.launch_values({}) is None
    one = {"SLURM_JOB_ID": "5", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "gpu01", "SLURM_NODEID": "0",
           "SLURM_GPUS_ON_NODE": "2"}
    plan = plan_under(one)
    assert plan.loopback_only and plan.world_size == 2


def test_user_flags_win_and_a_contradicting_rank_names_both():
    plan = plan_under(job(1), {"launch.num_processes": 6, "launch.main_process_ip": "10.0.0.1"})
    assert (plan.config.launch.main_process_ip, plan.nproc_per_node) == ("10.0.0.1", 2)
    with pytest.raises(ConfigError, match=r"--machine_rank 0 contradicts SLURM_NODEID=1: drop --machine_rank"):
        plan_under(job(1), {"launch.machine_rank": 0})


@pytest.mark.parametrize(("extra", "message"), [
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, "srun --ntasks-per-node=1 zerofit launch"),
    ({"SLURM_STEP_ID": "", "SLURM_STEP_NODELIST": "", "SLURM_STEP_NUM_NODES": "", "SLURM_STEP_TASKS_PER_NODE": ""},
     "no srun step"),
    ({"SLURM_NODEID": "5"}, "SLURM_NODEID is '5'"),
])
def test_slurm_setups_that_cannot_work_are_refused_with_the_fix(extra, message):
    with pytest.raises(ConfigError, match=message):
        slurm.launch_values(job(0, **extra))


def test_a_hostfile_reads_hosts_slots_and_comments_and_names_bad_lines():
    hosts = hostfile.parse("# two machines\nworker-1 slots=4  # first\n\nworker-2 slots=4\n", "hf")
    assert hosts == [hostfile.Host("worker-1", 4), hostfile.Host("worker-2", 4)]
    values = hostfile.launch_values(hosts, "hf")
    assert {k: v for k, (v, _) in values.items()} == {
        "launch.num_machines": 2, "launch.main_process_ip": "worker-1", "launch.num_processes": 8}
    with pytest.raises(ConfigError, match="line 2: 'slots:4' is not slots=N") as info:
        hostfile.parse("a slots=1\nb slots:4\na\n", "hf")
    assert "host 'a' is listed twice" in str(info.value)
    with pytest.raises(ConfigError, match="same slots=N"):
        hostfile.launch_values(hostfile.parse("a slots=1\nb slots=2\n", "hf"), "hf")


def test_a_hostfile_refuses_a_host_ssh_reads_as_an_option_and_drops_a_byte_order_mark(tmp_path):
    with pytest.raises(ConfigError, match=r"line 2: host '-oProxyCommand=x' starts with '-', which ssh reads as an "
                                          r"option: write the machine's name"):
        hostfile.parse("a slots=1\n-oProxyCommand=x slots=1\n", "hf")
    path = tmp_path / "hosts"
    path.write_bytes("worker-1 slots=2\nworker-2 slots=2\n".encode("utf-8-sig"))
    hosts = hostfile.read(str(path))
    assert [h.name for h in hosts] == ["worker-1", "worker-2"]
    assert hostfile.launch_values(hosts, "hf")["launch.main_process_ip"][0] == "worker-1"


def test_a_cluster_launch_reads_its_file_once_and_warns_once(tmp_path, capsys, monkeypatch):
    """SLURM's values and a hostfile's settle the config as it is read: no second load repeats its warnings,
    and a --machine_rank 1 that holds only with the hostfile's machine count is no problem."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("node-a slots=2\nnode-b slots=2\n")
    for name, env, args in (("slurm.json", job(1), ["--num_processes", "6"]),
                            ("hostfile.json", {}, ["--hostfile", "hosts", "--machine_rank", "1"])):
        (tmp_path / name).write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}}))
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert main(["launch", "--dry-run", "--cpu", "--config_file", name, *args, str(CHECK)]) == 0
        captured = capsys.readouterr()
        assert captured.err.count("zerofit: warning: zero_optimization.reduce_bucket_size") == 1, captured.err
        assert "this is machine 1" in captured.out
        for key in env:
            monkeypatch.delenv(key)


def test_an_accelerate_yaml_hands_its_deepspeed_hostfile_to_the_launch(tmp_path):
    path = tmp_path / "accel.yaml"
    path.write_text("distributed_type: DEEPSPEED\nnum_machines: 2\ndeepspeed_config:\n  zero_stage: 2\n"
                    "  deepspeed_hostfile: /etc/hosts.ds\n  deepspeed_multinode_launcher: pdsh\n")
    assert load_config(path).launch.hostfile == "/etc/hosts.ds"


def test_hostfile_print_gives_each_machine_its_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("node-a slots=2\nnode-b slots=2\n")
    assert main(["launch", "--cpu", "--hostfile", "hosts", "--hostfile_print", str(CHECK), "--exit-code", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# machine 0: node-a" and out[2] == "# machine 1: node-b"
    assert out[3].startswith(f"cd {tmp_path} && ")
    assert out[3].endswith(f"-m zerofit.cli.main launch --machine_rank 1 --cpu --hostfile hosts {CHECK} "
                           "--exit-code 0")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.pop("ZEROFIT_CONFIG_FILE", None)
    env.pop("OMP_NUM_THREADS", None)
    return {**env, **extra}


def reports(stdout: str) -> list[dict]:
    """The check script's JSON lines (a remote machine's led by `[host] `), sorted by rank."""
    found = [json.loads(line.split("ZEROFIT_TEST ", 1)[1]) for line in stdout.splitlines() if "ZEROFIT_TEST " in line]
    return sorted(found, key=lambda r: r["rank"])


def zerofit_launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "zerofit.cli.main", "launch", "--cpu", *args]


@pytest.mark.slow
def test_two_slurm_nodes_on_loopback_join_one_world_of_four():
    port = str(free_loopback_port())
    nodes = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "127.0.0.[1-2]",
             "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    procs = [subprocess.Popen(zerofit_launch("--num_processes", "4", "--main_process_port", port, str(CHECK)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(**nodes, SLURM_NODEID=str(node), SLURM_PROCID=str(node)))
             for node in (0, 1)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
    ranks = [reports(out) for out, _ in outputs]
    assert [[r["rank"] for r in node] for node in ranks] == [[0, 1], [2, 3]]  # node 1 from SLURM_NODEID
    assert all(r["world_size"] == 4 and r["sum"] == 10.0 and r["master_addr"] == "127.0.0.1"
               for node in ranks for r in node)


FAKE_SSH = """#!/bin/sh
# ssh [-o OPT] [-tt] HOST COMMAND: runs COMMAND here, as if on HOST
while [ "${1#-}" != "$1" ]; do [ "$1" = "-o" ] && shift; shift; done
shift
exec sh -c "$*"
"""


@pytest.mark.slow
def test_a_hostfile_launch_starts_the_other_machine_over_ssh(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    (tmp_path / "hosts").write_text("127.0.0.1 slots=2\n127.0.0.2 slots=2  # the second 'machine'\n")
    port = str(free_loopback_port())
    proc = subprocess.run(zerofit_launch("--hostfile", "hosts", "--main_process_port", port, str(CHECK)),
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path,
                          env=_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"))
    assert proc.returncode == 0, proc.stderr
    ranks = reports(proc.stdout)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["world_size"] == 4 and r["sum"] == 10.0 for r in ranks)
    remote = [line for line in proc.stdout.splitlines() if line.startswith("[127.0.0.2] ZEROFIT_TEST ")]
    assert len(remote) == 2  # machine 1's two ranks, through ssh, led by its host name
    assert "starting machines 1..1 over ssh: 127.0.0.2" in proc.stderr
