"""Faults under the real `zerofit launch` on two CPU ranks (gloo): a killed rank, a hung rank, uneven
batches, and what the run listens on. Every launch is bounded by a timeout; the script is
tests/scripts/fault_train.py (12 ZeRO-2 steps, a checkpoint every 4, resume by `checkpoint.resume`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from parallel_runs import two_at_a_time

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN = SCRIPTS / "fault_train.py"
CONFIG = SCRIPTS / "zerofit_faults.yaml"
LAUNCH_TIMEOUT_S = 120
KILL_RUNS = 3
"""The kill-and-resume run is repeated: a restart racing the resume would show in some runs only (3, not more: the
suite's time)."""


def launch(out: Path, *flags: str, script_args: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ)
    env.pop("ZEROFIT_CONFIG_FILE", None)
    env.pop("OMP_NUM_THREADS", None)
    env.pop("GLOO_SOCKET_IFNAME", None)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "zerofit.cli.main", "launch", "--config_file", str(CONFIG), *flags,
           str(TRAIN), "--out", str(out), *script_args]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env)
    return proc, time.monotonic() - start


def worker_pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob("pid-*"))]


def assert_all_gone(pids: list[int]) -> None:
    assert pids, "the workers wrote no pid files"
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()
             and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
    assert not alive, f"worker processes left behind: {alive}"


@dataclasses.dataclass
class Run:
    proc: subprocess.CompletedProcess
    seconds: float
    ended: float  # time.time() when the launch returned
    out: Path


# Every launch the tests below read: (launcher flags, script flags). The sockets report costs the
# fault-free run nothing (rank 0 writes it before the first step), so it is that run's too.
RUNS = {
    "uninterrupted": ((), ("--sockets", "{out}/sockets.json")),
    "hung": (("--process_group_timeout", "5"), ("--hang_step", "3")),
    "uneven": ((), ("--uneven",)),
    "main_only_save": ((), ("--main_only_save",)),
    **{f"kill{i}": (("--max_restarts", "3"), ("--kill_step", "6")) for i in range(KILL_RUNS)},
    "own_init": (("--max_restarts", "3"), ("--kill_step", "6", "--own_init")),
}
READS = {  # test name (without parameters) -> the runs it reads
    "test_killed_rank_restarts_and_resumes_without_losing_or_repeating_a_step": lambda p: [f"kill{p['run']}"],
    "test_a_script_that_creates_the_process_group_itself_also_survives_the_kill": lambda p: ["own_init"],
    "test_hung_rank_times_out_naming_the_collective_and_every_rank_is_stopped": lambda p: ["hung"],
    "test_a_rank_with_more_batches_raises_a_clear_error_instead_of_hanging": lambda p: ["uneven"],
    "test_a_save_on_the_main_process_alone_stops_every_rank_within_seconds": lambda p: ["main_only_save"],
    "test_a_one_machine_launch_listens_on_loopback_only": lambda p: [],
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Each launch in RUNS at most once. Those the selected tests read start together on first use, two at
    a time: a launch alone leaves a core idle much of the time (the launcher's start-up, a restart, the
    5 s a hung run waits for its timeout, the seconds an uneven one takes to find its ranks apart), two keep
    both busy. Each waits for itself only."""
    root = tmp_path_factory.mktemp("faults")

    def run(key: str) -> Run:
        out = root / key
        flags, script_args = RUNS[key]
        proc, seconds = launch(out, *flags, script_args=tuple(a.format(out=out) for a in script_args))
        return Run(proc, seconds, time.time(), out)

    wanted = {"uninterrupted"}  # every kill run is compared with it
    for item in request.session.items:
        if item.path == Path(__file__).resolve() and item.originalname in READS:
            wanted.update(READS[item.originalname](getattr(item, "callspec", None) and item.callspec.params))
    return two_at_a_time([key for key in RUNS if key in wanted], run)  # RUNS' order: hung, uneven early


@pytest.fixture(scope="module")
def uninterrupted_run(runs) -> Run:
    """The fault-free run, which also reports what it listens on (one launch for both)."""
    run = runs("uninterrupted")
    assert run.proc.returncode == 0, run.proc.stderr
    result = json.loads((run.out / "losses.json").read_text())
    assert len(result["losses"]) == 12 and len(set(result["losses"])) == 12  # 12 distinct steps: a real run
    assert result["attempts"] == [0] * 12 and result["resumed_from"] is None
    return run


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run) -> dict:
    return json.loads((uninterrupted_run.out / "losses.json").read_text())


@pytest.mark.parametrize("run", range(KILL_RUNS))
def test_killed_rank_restarts_and_resumes_without_losing_or_repeating_a_step(run, uninterrupted, runs):
    proc, seconds, _, out = dataclasses.astuple(runs(f"kill{run}"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads((out / "losses.json").read_text())
    # Attempt 0 died after step 6; attempt 1 resumed from the step-4 checkpoint: steps 1-4 come from
    # attempt 0 through the checkpoint, 5-12 were computed once more by attempt 1.
    assert result["attempts"] == [0] * 4 + [1] * 8, proc.stderr[-3000:]
    assert result["losses"] == uninterrupted["losses"]  # exactly: same data, RNG, optimizer and schedule
    assert result["completed_steps"] == 12
    assert result["resumed_from"].endswith("checkpoint_0")
    assert "zerofit: resumed from checkpoint" in proc.stderr and "continuing with step 5" in proc.stderr
    assert_all_gone(worker_pids(out))
    print(f"kill run {run}: {seconds:.1f} s")


def test_a_script_that_creates_the_process_group_itself_also_survives_the_kill(uninterrupted, runs):
    """Its keys never carry zerofit's attempt prefix: the launcher's fresh store per restart covers it."""
    proc, out = runs("own_init").proc, runs("own_init").out
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads((out / "losses.json").read_text())
    assert result["attempts"] == [0] * 4 + [1] * 8
    assert result["losses"] == uninterrupted["losses"]
    assert_all_gone(worker_pids(out))


def test_hung_rank_times_out_naming_the_collective_and_every_rank_is_stopped(runs):
    proc, _, ended, out = dataclasses.astuple(runs("hung"))
    assert proc.returncode != 0
    # Rank 1 sleeps inside step 3; rank 0 waits in the backward's first gradient reduction.
    assert "CollectiveError: rank 0: collective reduce_scatter:" in proc.stderr
    assert "did not complete within 5 s (launch.process_group_timeout)" in proc.stderr
    # Rank 1 sleeps for an hour: the launch ending at all (launch() stops waiting after LAUNCH_TIMEOUT_S) is
    # the timeout's work, and the message above says which timeout fired. Wall time on a loaded machine
    # proves nothing more, so only the lower bound is checked: the ranks did wait out the 5 s.
    hung_for = ended - float((out / "hang-start").read_text())
    assert hung_for >= 5, f"the launch ended {hung_for:.1f} s after rank 1 hung, before the timeout"
    assert_all_gone(worker_pids(out))


def test_a_rank_with_more_batches_raises_a_clear_error_instead_of_hanging(runs):
    proc, out = runs("uneven").proc, runs("uneven").out
    assert proc.returncode != 0
    # Rank 1 finishes its 4 batches and waits at the final barrier while rank 0 runs a 5th step: rank 0's
    # gradient reduction stalls, it finds rank 1 waiting at the barrier ([Note: a rank that went on training]
    # in zerofit.distributed.arrival), and both stop within seconds, long before the 30 s timeout, each saying why.
    assert "RanksApartError: rank 1 is in accelerator.wait_for_everyone(), while rank 0 went on" in proc.stderr
    # rank 0 says so too in its collective error - unless rank 1's exit ended the launch first, which then stops
    # rank 0 (seen once under load); the launcher's summary names it either way
    assert ("CollectiveError: rank 0: collective reduce_scatter:<root> failed: rank 0 went on" in proc.stderr
            or "then rank 0 (exit code -15): stopped by SIGTERM" in proc.stderr), proc.stderr[-2000:]
    assert "a DataLoader not passed to prepare()" in proc.stderr
    assert "did not complete within" not in proc.stderr  # the timeout did not end it
    assert not (out / "losses.json").exists()
    assert_all_gone(worker_pids(out))


def test_a_save_on_the_main_process_alone_stops_every_rank_within_seconds(runs):
    """#29 item 4 under the real launcher (the check goes through the agent's store that zerofit joined):
    rank 0 gathers alone while rank 1 waits at the barrier; before, both waited out the 30 s timeout."""
    proc, out = runs("main_only_save").proc, runs("main_only_save").out
    assert proc.returncode != 0
    assert ("RanksApartError: rank 0 is in accelerator.save_model(model, ...), while rank 1 is in "
            "accelerator.wait_for_everyone()") in proc.stderr
    assert ("RanksApartError: rank 1 is in accelerator.wait_for_everyone(), while rank 0 is in "
            "accelerator.save_model(model, ...)") in proc.stderr
    assert "is_main_process=accelerator.is_main_process" in proc.stderr
    assert "did not complete within" not in proc.stderr
    assert_all_gone(worker_pids(out))


def test_a_one_machine_launch_listens_on_loopback_only(uninterrupted_run):
    proc, report_file = uninterrupted_run.proc, uninterrupted_run.out / "sockets.json"
    assert "WARNING" not in proc.stderr
    report = json.loads(report_file.read_text())
    assert report["launcher"], "the launcher's rendezvous store was not found listening"
    assert report["workers"], "no gloo listener was found in the workers"
    for entry in report["launcher"] + report["workers"]:
        assert _is_loopback(entry.rsplit(":", 1)[0]), f"{entry} listens beyond loopback: {report}"


def _is_loopback(hex_address: str) -> bool:
    """/proc/net/tcp{,6} addresses are hex in host byte order, 32-bit words each."""
    raw = bytes.fromhex(hex_address)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def test_killing_the_launcher_kills_its_workers_and_the_next_launch_clears_what_it_left(tmp_path):
    """#18: a SIGKILL of the launcher left the workers running (one would sleep for an hour) and
    /tmp/zerofit-run-* behind; every launch left a /tmp/torchelastic_* directory."""
    import signal

    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\nfrom zerofit import Accelerator\nacc = Accelerator()\n"
                      f"open(os.path.join({str(tmp_path)!r}, f'pid-{{acc.process_index}}'), 'w')"
                      ".write(str(os.getpid()))\n"
                      "time.sleep(3600)\n")
    temp = tmp_path / "tmp"  # this test's own temporary directory: what the launches leave there is theirs
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROFIT_CONFIG_FILE", "OMP_NUM_THREADS")}
    env["TMPDIR"] = str(temp)
    launcher = subprocess.Popen([sys.executable, "-m", "zerofit.cli.main", "launch", "--cpu", "--num_processes", "2",
                                 str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while len(worker_pids(tmp_path)) < 2 and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.2)
    pids = worker_pids(tmp_path)
    run_dirs = list(temp.glob(f"zerofit-run-{launcher.pid}-*"))
    assert len(pids) == 2 and len(run_dirs) == 1
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    for _ in range(100):  # the kernel delivers the parent-death signal at once; allow for a loaded machine
        if not any(Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text().lower()
                   for p in pids if Path(f"/proc/{p}").exists()):
            break
        time.sleep(0.1)
    assert_all_gone(pids)
    assert run_dirs[0].exists()  # a killed process cannot clean up; the next launch does
    proc = subprocess.run([sys.executable, "-m", "zerofit.cli.main", "launch", "--cpu", "--num_processes", "1",
                           str(SCRIPTS / "allreduce_check.py")], env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert list(temp.iterdir()) == []  # the killed launch's run directory cleared; no torchelastic_* left
