"""`zerofit launch` end to end: real torchrun launches of tests/scripts/allreduce_check.py on CPU.

Each launch takes a few seconds (process start-up and a gloo rendezvous); every one is bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
CHECK = SCRIPTS / "allreduce_check.py"
TIMEOUT_S = 120


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ZEROFIT_CONFIG_FILE", None)
    env.pop("OMP_NUM_THREADS", None)
    return env


def zerofit_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "zerofit.cli.main", *args]


def run_zerofit(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(zerofit_cmd(*args), capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=_env(), cwd=cwd)


def reports(stdout: str) -> list[dict]:
    """The JSON lines the check script prints, one per rank, sorted by rank."""
    found = [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("ZEROFIT_TEST ")]
    return sorted(found, key=lambda r: r["rank"])


def test_two_process_cpu_launch_runs_all_reduce_on_gloo_with_the_config_file():
    proc = run_zerofit("launch", "--num_processes", "2", str(CHECK))
    assert proc.returncode == 0, proc.stderr
    ranks = reports(proc.stdout)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["sum"] == 3.0
        assert r["master_addr"] == "127.0.0.1"  # single-node rendezvous stays on loopback
        assert r["config_file"] and r["num_processes"] == 2 and r["use_cpu"] is True  # read from the launcher's file
        assert r["omp"] == str(max(1, len(os.sched_getaffinity(0)) // 2))
        assert r["argv0"] == "allreduce_check.py"
    assert "OMP_NUM_THREADS" not in proc.stderr  # torchrun's warning is not shown


def test_failing_rank_shows_its_traceback_and_fails_the_launch():
    proc = run_zerofit("launch", "--num_processes", "2", "-m", "allreduce_check", "--fail-rank", "1", cwd=SCRIPTS)
    assert proc.returncode == 1
    err = proc.stderr
    assert "[rank1]: Traceback (most recent call last)" in err
    assert err.count("RuntimeError: deliberate failure on rank 1") == 2  # the traceback once, the summary once
    assert err.count("Traceback (most recent call last)") == 1  # rank 0 ended cleanly: only rank 1's
    assert "zerofit/cli/worker_entry.py" not in err and "elastic/multiprocessing/errors" not in err  # bootstrap trimmed
    summary = err[err.index("zerofit launch: -m allreduce_check failed"):]
    assert summary.startswith("zerofit launch: -m allreduce_check failed: rank 1 first (local rank 1, exit code 1): "
                              "RuntimeError: deliberate failure on rank 1")
    assert "Root Cause" not in err  # torchelastic's summary, which printed every traceback again, is not shown


def test_exit_code_of_a_worker_is_the_exit_code_of_the_launch():
    proc = run_zerofit("launch", str(CHECK), "--exit-code", "3")
    assert proc.returncode == 3, proc.stderr
    assert [r["world_size"] for r in reports(proc.stdout)] == [1]


# Two machines joining one world over loopback: tests/test_cli_cluster.py, with the machine ranks from SLURM's
# variables and from --machine_rank (the launch a hostfile run starts over ssh).


def test_zerofit_demo_trains_on_two_cpu_processes():
    pytest.importorskip("zerofit.demo.train")
    proc = run_zerofit("demo", "--stage", "3", "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    # stage 3 shards the demo's 4 blocks (its persistence threshold), and prepare() says so, once
    assert proc.stdout.count("zerofit: ZeRO-3, 4 of 5 units sharded over 2 ranks, fp32, 2 processes (gloo)\n") == 1
    assert "done:" in proc.stdout
    assert "never created a zerofit Accelerator" not in proc.stderr  # it did
    first, last = re.search(r"done: loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups()
    assert float(last) < float(first)  # it learns


WAIT_FOR_CTRL_C = """
import os, sys, time
from zerofit import Accelerator

accelerator = Accelerator()
open(os.path.join(sys.argv[1], f"ready-{accelerator.process_index}"), "w").close()
while True:  # a training loop between collectives, as Ctrl-C usually finds it
    accelerator.wait_for_everyone()
    time.sleep(0.05)
"""


def test_ctrl_c_prints_one_line_and_no_traceback(tmp_path):
    """Ctrl-C reaches the launcher and every rank (one process group, as in a terminal): the ranks end
    without a KeyboardInterrupt traceback, torchrun's stop lines are left out, and the launcher's one line
    says what happened; the exit code is 130, as a shell reports a SIGINT."""
    script = tmp_path / "wait.py"
    script.write_text(WAIT_FOR_CTRL_C)
    proc = subprocess.Popen(zerofit_cmd("launch", "--cpu", "--num_processes", "2", str(script), str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err == "zerofit launch: stopped by SIGINT; the workers were terminated\n"
    assert "Traceback" not in out


PLAIN_TORCH_TRAINING = """
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # the launcher's environment, as under torchrun: no zerofit anywhere
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
print(f"trained rank {dist.get_rank()}", flush=True)
dist.destroy_process_group()
sys.exit()  # a success (code None), as `sys.exit(main())` ends many scripts
"""
NEVER_USED = "plain_train.py never created a zerofit Accelerator: the script ran without zerofit"


def test_a_launch_that_never_built_zerofits_accelerator_says_so_once_at_the_end(tmp_path):
    script = tmp_path / "plain_train.py"
    script.write_text(PLAIN_TORCH_TRAINING)
    proc = run_zerofit("launch", "--cpu", "--num_processes", "2", str(script))
    assert proc.returncode == 0, proc.stderr
    # the two ranks share one stdout pipe: their lines may interleave, so count them, not their order
    assert proc.stdout.count("trained rank 0") == proc.stdout.count("trained rank 1") == 1, proc.stdout
    assert proc.stderr.count(NEVER_USED) == 1, proc.stderr  # rank 0 only
    notice = next(line for line in proc.stderr.splitlines() if NEVER_USED in line)
    assert "Change `from accelerate import Accelerator` to `from zerofit import Accelerator`" in notice
    assert "zerofit.integrations" not in notice  # the script loaded no Trainer: the Accelerator import is the one
