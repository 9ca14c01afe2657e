"""The rows' processes: each method of each table in processes of its own, relaunched where needed.

A row starts one process (`zerofit.bench.row_process`; under torchrun with several). The process
reports every result as it happens, so when a process ends early - an out-of-memory that one process
cannot recover from, any out-of-memory with several processes, a crash inside a peer's engine after
recovering - the next worker starts from the bounds already known instead of from scratch. A try
that never reported back counts as out of memory only when the process said so (stderr names the
out-of-memory error); anything else ends the row with its error. An `--equal-only` row is done once its
one measurement is in, out of memory or not: it is never relaunched.

Time is bounded twice: each launch by `--timeout`, and, with `--budget`, the whole command by a deadline
that no launch may run past (a row with no time left for a launch is skipped, and says so). A launch
that runs out of time is stopped with SIGTERM first: torchrun then stops its workers, which run in
sessions of their own and would outlive a SIGKILL of torchrun, holding their GPUs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from zerofit.bench.methods import parse
from zerofit.bench.search import BatchSearch
from zerofit.bench.workloads import Workload

MAX_LAUNCHES = 6
MIN_LAUNCH_S = 30.0
"""A launch starts only with this much of `--budget` left (starting the processes alone takes ~10 s)."""
STOP_GRACE_S = 30.0
"""After SIGTERM, how long a launch that ran out of time has to stop before SIGKILL (torchrun's own
grace for its workers is 30 s); kept back from `--budget` so that stopping fits too."""
_UNBOUNDED = 2**31  # the parent only records what the workers tried; the workers apply --max-batch
_OOM_MARKERS = ("OutOfMemoryError", "out of memory", "SimulatedOutOfMemory")


@dataclasses.dataclass
class RowState:
    method: str
    table: str
    equal: dict[str, Any] | None = None
    searches: dict[str, BatchSearch] = dataclasses.field(
        default_factory=lambda: {phase: BatchSearch(max_batch=_UNBOUNDED) for phase in ("train", "eval")})
    """What every launch of this row found so far: the largest batch that fit, the smallest that did not."""
    timing: dict[str, Any] | None = None
    evaluation: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    done: dict[str, Any] | None = None
    launches: int = 0
    timing_failures: int = 0
    error: str | None = None
    skipped: str | None = None
    log: list[str] = dataclasses.field(default_factory=list)

    def record(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "config":
            self.config = event["config"]
        elif kind == "equal":
            self.equal = event
            self.searches["train"].record(event["batch"], event["fits"])
        elif kind == "tried":
            self.searches[event["phase"]].record(event["batch"], event["fits"])
        elif kind == "timing":
            self.timing = event
        elif kind == "evaluation":
            self.evaluation = event
        elif kind == "done":
            self.done = event

    def below(self, phase: str, batch: int) -> None:
        """Search `phase` again from scratch under `batch`, which failed where a smaller try had passed."""
        self.searches[phase] = BatchSearch(max_batch=_UNBOUNDED, fails=batch)

    @property
    def bounds(self) -> dict[str, list[int | None]]:
        return {phase: [s.fits, s.fails] for phase, s in self.searches.items()}

    def as_record(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("log", "searches")}
        out["bounds"] = self.bounds
        out["log_tail"] = self.log[-40:]
        return out


def deepspeed_missing() -> bool:
    return importlib.util.find_spec("deepspeed") is None


def run_row(workload: Workload, method: str, opts: dict[str, Any], *, nproc: int, timeout: float,
            deadline: float | None = None, echo: bool = True) -> RowState:
    """All processes of one row until it is done, failed, or out of launches or time (`deadline`, in
    `time.monotonic()` seconds: no launch runs past it)."""
    state = RowState(method=method, table=workload.key)
    family, _, _ = parse(method)
    if family == "deepspeed" and deepspeed_missing():
        state.skipped = "DeepSpeed is not installed here (pip install deepspeed)"
        return state
    while state.done is None and state.error is None:
        if state.launches >= MAX_LAUNCHES:
            state.error = f"gave up after {MAX_LAUNCHES} launches"
            break
        limit = timeout
        if deadline is not None:
            left = deadline - time.monotonic() - STOP_GRACE_S
            if left < MIN_LAUNCH_S:
                spent = f"--budget spent: {max(left, 0):.0f} s left, a launch needs {MIN_LAUNCH_S:.0f}"
                if state.launches == 0:
                    state.skipped = spent
                else:
                    state.error = f"{spent} (after {state.launches} launch(es))"
                break
            limit = min(timeout, left)
        state.launches += 1
        proc = _launch(workload, method, opts, state, nproc=nproc, timeout=limit)
        for event in _row_events(proc["events"]):
            state.record(event)
        state.log += [ln for ln in (proc["stdout"] + proc["stderr"]).splitlines() if ln.strip()][-200:]
        if echo:
            print(f"  {method}: process {state.launches} ended (exit code {proc['rc']}); "
                  f"{searched_said(state.bounds)}",
                  file=sys.stderr, flush=True)
        if state.done is None:
            _after_early_end(state, proc, equal_only=bool(opts.get("equal_only")))
    return state


def searched_said(bounds: dict[str, list[int | None]]) -> str:
    """What the largest-batch search has found so far, in words: `train batch 16 fits, 32 runs out of memory`."""
    parts = []
    for phase, (fits, fails) in bounds.items():
        found = [f"{fits} fits"] if fits else []
        found += [f"{fails} runs out of memory"] if fails is not None else []
        parts.append(f"{phase} batch {', '.join(found)}" if found else f"{phase} batch not tried yet")
    return "; ".join(parts)


def _row_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's events, where a try (or the equal batch) fits only if it fitted on every rank (any rank's
    failure counts)."""
    failed = {(e["phase"], e["batch"]) for e in events if e["event"] == "tried" and not e["fits"]}
    equal_failed = any(e["event"] == "equal" and not e["fits"] for e in events)
    out = []
    for e in events:
        if e["event"] == "tried" and e["fits"] and (e["phase"], e["batch"]) in failed:
            continue
        if e["event"] == "equal" and e["fits"] and equal_failed:
            continue
        if e["rank"] == 0 or e["event"] in ("tried", "equal") and not e["fits"]:
            out.append(e)
    return out


def _after_early_end(state: RowState, proc: dict[str, Any], *, equal_only: bool = False) -> None:
    """A launch ended before its row was done: learn what its end says, or give the row its error."""
    if proc.get("timed_out"):  # a relaunch would take as long: the row ends here
        state.error = f"timed out after {proc['timed_out']:.0f} s\n" + (proc["stderr"] or proc["stdout"])[-3000:]
        return
    if equal_only and state.equal is not None:  # the row's one measurement is in (fitted or out of memory)
        state.done = {"event": "done", "equal_only": True}
        return
    events = proc["events"]
    last = events[-1] if events else {"event": None}
    oom = proc["rc"] == 3 or any(m in proc["stderr"] for m in _OOM_MARKERS)
    recovered = any(e["event"] == "recovered" for e in events)
    if not oom and not recovered:  # a genuine failure (a crash after an in-process recovery gets a fresh process)
        state.error = (proc["stderr"] or proc["stdout"] or f"exit code {proc['rc']}")[-3000:]
    elif last["event"] == "try":  # the try died with its process: that batch did not fit
        state.searches[last["phase"]].record(last["batch"], False)
    elif state.config is None:
        state.error = "out of memory while building the model and its engine (before any step)"
    elif last["event"] == "timing_start":  # the timed steps at the largest batch ran out of memory
        state.timing_failures += 1
        if state.timing_failures >= 2:  # in a fresh process too: search again below that batch
            state.below("train", last["batch"])
    elif last["event"] == "evaluation_start":  # eval at the train batch did not fit: search below it
        state.below("eval", last["batch"])


def _launch(workload: Workload, method: str, opts: dict[str, Any], state: RowState, *, nproc: int,
            timeout: float) -> dict[str, Any]:
    args = ["--table", workload.key, "--method", method, "--device", opts["device"], "--precision", opts["precision"],
            "--clip", str(opts["clip"]), "--steps", str(opts["steps"]), "--eval-steps", str(opts["eval_steps"]),
            "--warmup", str(opts["warmup"]), "--max-batch", str(opts["max_batch"])]
    for flag in ("gpu_memory_gib", "equal_batch", "simulate_oom_above", "process_group_timeout", "compile_backend"):
        if opts.get(flag) is not None:
            args += [f"--{flag.replace('_', '-')}", str(opts[flag])]
    for flag in ("tiny", "equal_only"):
        if opts.get(flag):
            args.append(f"--{flag.replace('_', '-')}")
    if state.equal is not None:
        args.append("--skip-equal")
    if state.timing is not None:
        args.append("--train-timed")
    for phase, (lo, hi) in state.bounds.items():
        args += [f"--{phase}-fits", str(lo)] + ([f"--{phase}-fails", str(hi)] if hi is not None else [])
    events = tempfile.mkdtemp(prefix="zerofit-bench-")
    args += ["--events", events]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", env["MASTER_PORT"], "-m", "zerofit.bench.row_process", *args]
    else:
        cmd = [sys.executable, "-m", "zerofit.bench.row_process", *args]
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    out = run_bounded(cmd, env, timeout)
    out["events"] = read_events(events)
    shutil.rmtree(events, ignore_errors=True)
    return out


def run_bounded(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """`cmd`'s exit code and output; past `timeout` seconds it is stopped (SIGTERM, then SIGKILL after
    STOP_GRACE_S) and the result carries `timed_out` (the timeout, in seconds)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return {"rc": proc.returncode, "stdout": stdout, "stderr": stderr}
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun stops its workers on SIGTERM (see the module doc)
        try:
            stdout, stderr = proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        return {"rc": proc.returncode, "stdout": stdout, "stderr": stderr + f"\ntimed out after {timeout:.0f} s",
                "timed_out": timeout}


def read_events(directory: str) -> list[dict[str, Any]]:
    """Every rank's events, rank 0 first; a line cut off by a dying process is dropped."""
    events = []
    for name in sorted(os.listdir(directory), key=lambda n: int(n[4:].split(".")[0])):
        with open(os.path.join(directory, name)) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
