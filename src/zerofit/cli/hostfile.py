"""A DeepSpeed hostfile: the machines of a run, and starting the other machines' launches over ssh.

[Note: one command line, every machine] The launch given a hostfile (`--hostfile`, or the Accelerate
YAML's `deepspeed_config.deepspeed_hostfile`) and no `--machine_rank` is the driver: it is machine 0
(the first host) and starts every other host's launch over `ssh -o BatchMode=yes`: the same Python,
the same working directory, its own command line with `--machine_rank R` added, and the variables
of `FORWARDED_ENV`. A launch given `--machine_rank` is one machine of the run: it reads the same
hostfile for the machine count, the address of machine 0 and the slots, and starts only itself. So
the rendezvous is torchrun's, as when each machine is started by hand; `--hostfile_print` prints the
line for each machine instead of running anything. ssh gets a terminal (`-tt`), so ending the local
ssh hangs up the remote launch, which stops its workers: Ctrl-C, or one machine failing, stops all.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zerofit.errors import ConfigError

FORWARDED_ENV = ("PYTHON", "NCCL_", "GLOO_", "TORCH_", "HF_", "ZEROFIT_", "OMP_NUM_THREADS")
"""Prefixes of the variables a remote launch gets from the driver's environment (ssh passes none)."""
NOT_FORWARDED = ("ZEROFIT_CONFIG_FILE",)
SSH = ("ssh", "-o", "BatchMode=yes", "-tt")
STOP_GRACE_S = 10.0
"""How long the other machines get to end after the driver's own launch ended, when it failed."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int | None
    """Processes on this machine (DeepSpeed's `slots=N`, its GPU count); None: the launch's default."""


def parse(text: str, source: str) -> list[Host]:
    """The hosts of a hostfile: `host [slots=N]` per line, `#` comments and blank lines skipped."""
    hosts: list[Host] = []
    problems = []
    # Editors on Windows save UTF-8 with a byte-order mark; left in, it would lead machine 0's address.
    for lineno, raw in enumerate(text.removeprefix("\ufeff").splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        slots = None
        for extra in fields[1:]:
            key, _, value = extra.partition("=")
            if key == "slots" and value.isdigit() and int(value) > 0:
                slots = int(value)
            else:
                problems.append(f"{source} line {lineno}: {extra!r} is not slots=N (N > 0): write `host slots=N`")
        if fields[0].startswith("-"):
            # ssh reads an argument starting with `-` as one of its options, not as the host to reach.
            problems.append(f"{source} line {lineno}: host {fields[0]!r} starts with '-', which ssh reads as an "
                            "option: write the machine's name or address")
        if any(h.name == fields[0] for h in hosts):
            problems.append(f"{source} line {lineno}: host {fields[0]!r} is listed twice: list each machine once")
        hosts.append(Host(fields[0], slots))
    if not hosts and not problems:
        problems.append(f"{source} lists no host: write one `host slots=N` line per machine")
    if problems:
        raise ConfigError(problems)
    return hosts


def read(path: str) -> list[Host]:
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            return parse(f.read(), f"hostfile {path}")
    except OSError as e:
        raise ConfigError(f"launch.hostfile (--hostfile) {path!r} cannot be read ({e.strerror}) from "
                          f"{os.getcwd()}: pass the path of a `host slots=N` file") from None


def launch_values(hosts: Sequence[Host], path: str) -> dict[str, tuple[Any, str]]:
    """Launch settings the hostfile gives: dotted key -> (value, where it came from)."""
    out: dict[str, tuple[Any, str]] = {"launch.num_machines": (len(hosts), f"the {len(hosts)} hosts of {path}")}
    if len(hosts) > 1:
        out["launch.main_process_ip"] = (hosts[0].name, f"the first host of {path}")
    slots = {h.slots for h in hosts}
    if slots != {None}:
        if len(slots) > 1:
            listed = ", ".join(f"{h.name} slots={h.slots}" for h in hosts)
            raise ConfigError(f"hostfile {path}: every machine runs as many processes (torchrun's rule), but the "
                              f"slots differ ({listed}): give every host the same slots=N")
        out["launch.num_processes"] = (hosts[0].slots * len(hosts), f"slots={hosts[0].slots} x {len(hosts)} hosts "
                                                                    f"of {path}")
    return out


def node_argv(launch_argv: Sequence[str], rank: int) -> list[str]:
    """The launch command of machine `rank`: this Python, `launch --machine_rank R`, then the driver's own
    launch arguments (`launch_argv`, everything after `launch`)."""
    return [sys.executable, "-m", "zerofit.cli.main", "launch", "--machine_rank", str(rank), *launch_argv]


def shell_line(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> str:
    """What the remote shell runs: the driver's working directory, the forwarded variables, `argv`."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(environ.items())
           if k.startswith(FORWARDED_ENV) and k not in NOT_FORWARDED]
    return f"cd {shlex.quote(os.getcwd())} && " + " ".join([*(["env", *env] if env else []), shlex.join(argv)])


def print_lines(hosts: Sequence[Host], launch_argv: Sequence[str]) -> str:
    lines = []
    for rank, host in enumerate(hosts):
        lines += [f"# machine {rank}: {host.name}", shell_line(node_argv(launch_argv, rank))]
    return "\n".join(lines) + "\n"


class Fleet:
    """The other machines' launches, each through its own ssh; their output goes to ours, each line led by
    the host's name. A machine that fails while the driver runs is reported and stops the driver (SIGINT to
    this process, which ends its torchrun as Ctrl-C does)."""

    def __init__(self, hosts: Sequence[Host], launch_argv: Sequence[str]):
        self.stopping = False
        self._deadline: threading.Timer | None = None
        self.failure: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.threads = []
        for rank, host in enumerate(hosts[1:], 1):
            proc = subprocess.Popen([*SSH, host.name, shell_line(node_argv(launch_argv, rank))],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # Ctrl-C reaches them through us, not the terminal
            self.procs.append((host.name, proc))
            thread = threading.Thread(target=self._pump, args=(host.name, proc), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _pump(self, name: str, proc: subprocess.Popen) -> None:
        for raw in proc.stdout:
            sys.stdout.write(f"[{name}] {raw.decode(errors='replace').rstrip(chr(13) + chr(10))}\n")
            sys.stdout.flush()
        code = proc.wait()
        if code != 0:
            with self._lock:
                first = self.failure is None and not self.stopping
                if first:
                    self.failure = (name, code)
            if first:
                print(describe_failure(name, code) + "; stopping the run", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGINT)
                # A launch waiting in torchrun's rendezvous takes signals only when it returns to Python.
                self._deadline = threading.Timer(STOP_GRACE_S, self._exit_now, args=(code,))
                self._deadline.daemon = True
                self._deadline.start()

    def _exit_now(self, code: int) -> None:
        """The driver did not stop after a machine failed: end the ssh sessions, then this process (its
        workers, if any started, die with it: `zerofit.cli.worker_entry.die_with_launcher`)."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        print(f"zerofit launch: this machine did not stop within {STOP_GRACE_S:.0f} s; exiting", file=sys.stderr,
              flush=True)
        os._exit(code)

    def finish(self, driver_code: int) -> int:
        """Wait for the machines (briefly when the driver failed), stop the rest; the run's exit code."""
        with self._lock:
            self.stopping = True  # the driver has ended: a machine ending now interrupts nothing
        if self._deadline is not None:
            self._deadline.cancel()
        for _, proc in self.procs:
            try:
                proc.wait(timeout=None if driver_code == 0 else STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.terminate()  # ssh ends, the remote launch is hung up and stops its workers
            except KeyboardInterrupt:
                driver_code = driver_code or 128 + signal.SIGINT
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for thread in self.threads:
            thread.join(timeout=STOP_GRACE_S)
        if self.failure:
            return self.failure[1]
        failed = [(n, p.returncode) for n, p in self.procs if p.returncode not in (0, None)]
        if driver_code == 0 and failed:
            for name, code in failed:
                print(describe_failure(name, code), file=sys.stderr, flush=True)
            return failed[0][1]
        return driver_code


def describe_failure(name: str, code: int) -> str:
    if code == 255:
        return (f"zerofit launch: ssh to {name} failed (exit code 255): check that `ssh -o BatchMode=yes {name} "
                "true` works from this machine without a prompt")
    return f"zerofit launch: machine {name} failed (exit code {code}); its output above is led by [{name}]"
