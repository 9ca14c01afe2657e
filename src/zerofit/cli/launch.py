"""`zerofit launch`: resolve the config, then start the workers through torchrun.

The launcher is a thin front end over `torch.distributed.run`. It turns the config (file plus flags)
into a `LaunchPlan` (a pure function of the config and the machine's GPU count, so it is testable
without processes), writes the resolved config where every worker can read it (`ZEROFIT_CONFIG_FILE`,
see `zerofit.distributed.runtime`), builds a torchrun argv and runs it in this process.

[Note: loopback by default] A one-machine run listens on 127.0.0.1 only: its rendezvous store is
bound there by zerofit's own rendezvous backend (`zerofit.cli.rendezvous`, a free port, a new store
per restart), and gloo is told to use the loopback interface (GLOO_SOCKET_IFNAME), so nothing is
reachable from the network and two runs on one machine never fight over 29500. Several machines (or
one machine given a non-loopback main_process_ip) use `main_process_ip:main_process_port` (port 29500
when unset) through torchrun's static or c10d rendezvous, whose store listens on every interface: the
launcher warns about that, and the README tells users to firewall the port. NCCL's bootstrap socket is
told the same (NCCL_SOCKET_IFNAME), else it binds the first non-loopback interface; on several
machines an interface the user named for one of gloo and NCCL is named for the other too.

An NCCL run also gets torch's flight recorder, dumping to a folder of the launcher's, so a watchdog
timeout is named in the failure summary ([Note: failures under NCCL] in zerofit.cli.flight_recorder).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import ipaddress
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from zerofit.cli import failure_report, flight_recorder, hostfile, preflight, rendezvous, slurm
from zerofit.cli.cluster import MachineSettings
from zerofit.cli.flags import add_flag, flag_value_problems, flags_named
from zerofit.config import load_config, save_config, validate_config
from zerofit.config.schema import OptimizerStateDtype, RunConfig
from zerofit.distributed.runtime import CONFIG_FILE_ENV, RUN_ID_ENV, backend_for
from zerofit.errors import ConfigError
from zerofit.plan.bandwidth import usable_cpus

WORKER_MODULE = "zerofit.cli.worker_entry"
"""Every worker starts here; it runs the user's target as __main__ and records its traceback."""

DEFAULT_MULTI_NODE_PORT = 29500
"""Rendezvous port on several machines when the config names none (the port every launcher uses)."""

# flag -> dotted config key it overrides; the flag wins over the config file.
FLAG_TO_KEY = {
    "num_processes": "launch.num_processes",
    "num_machines": "launch.num_machines",
    "machine_rank": "launch.machine_rank",
    "main_process_ip": "launch.main_process_ip",
    "main_process_port": "launch.main_process_port",
    "mixed_precision": "precision.mixed_precision",
    "optimizer_state": "precision.optimizer_state",
    "cpu": "launch.use_cpu",
    "max_restarts": "launch.max_restarts",
    "process_group_timeout": "launch.process_group_timeout",
    "resume": "checkpoint.resume",
    "overwrite_checkpoints": "checkpoint.overwrite",
    "oom_backoff": "batch.oom_backoff",
    "hostfile": "launch.hostfile",
}
def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "launch", allow_abbrev=False,
        help="run a training script on several processes (one per GPU, or N on CPU)",
        description="Run SCRIPT (or -m MODULE) on every process of the run. Flags override the config file.")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The launch flags, then the target (everything after it goes to the script untouched).

    Flags shared with `accelerate launch` keep its names, in both of its spellings; launch has no deprecated
    aliases, so a torchrun option given out of habit (`--nproc-per-node`, `--master-port`) is rejected, not
    taken for something else.
    """
    add_flag(p, "--config_file", metavar="FILE",
             help="zerofit YAML, Accelerate launch YAML or DeepSpeed JSON (default: the default config "
                  "`accelerate config` wrote, unless --cpu; else built-in defaults)")
    add_flag(p, "--num_processes", type=int, metavar="N",
             help="processes over all machines (default: one per GPU, or 1 on CPU)")
    add_flag(p, "--num_machines", type=int, metavar="M", help="machines taking part")
    add_flag(p, "--machine_rank", type=int, metavar="R", help="this machine's index, 0..M-1")
    add_flag(p, "--main_process_ip", metavar="IP", help="address of machine 0 (default on one machine: 127.0.0.1)")
    add_flag(p, "--main_process_port", type=int, metavar="PORT",
             help=f"rendezvous port (default: a free port on one machine, {DEFAULT_MULTI_NODE_PORT} on several)")
    add_flag(p, "--mixed_precision", choices=("no", "fp16", "bf16"), help="compute precision")
    add_flag(p, "--optimizer_state", choices=get_args(OptimizerStateDtype),
             help="how optimizer state is stored between steps: fp32 (default), bf16 or 8bit (block-wise "
                  "quantised); the update itself runs in fp32, the master weights stay fp32")
    add_flag(p, "--cpu", action="store_true", default=None, help="run on CPU with gloo even where GPUs exist")
    add_flag(p, "--max_restarts", type=int, metavar="K", help="restart the worker group up to K times after a failure")
    add_flag(p, "--resume", choices=("restart", "auto", "must", "never"),
             help="when prepare() loads the latest complete checkpoint (default: restart, on restarted attempts)")
    add_flag(p, "--overwrite_checkpoints", action="store_true", default=None,
             help="let this run replace and prune the checkpoints an earlier run left in its checkpoint folder "
                  "(default: such a save is refused, unless the run resumed from that folder)")
    add_flag(p, "--process_group_timeout", type=float, metavar="SECONDS",
             help="how long a collective waits for a peer before it raises (default: 1800)")
    add_flag(p, "--oom_backoff", choices=("on", "off"), type=str.lower,
             help="on a CUDA out-of-memory error in a step, halve the micro-batch and double accumulation "
                  "(default: on; the flag reaches DeepSpeed JSON and Accelerate YAML runs too)")
    add_flag(p, "--hostfile", metavar="PATH",
             help="DeepSpeed hostfile (`host slots=N` lines): start every other host's launch over ssh "
                  "(with --machine_rank: be that machine of it)")
    add_flag(p, "--hostfile_print", action="store_true",
             help="with a hostfile: print the command to run on each machine, start nothing")
    add_flag(p, "--dry_run", action="store_true",
             help="validate, print the resolved config and the launch plan, start nothing")
    add_target_arguments(p)


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    add_flag(p, "-m", "--module", action="store_true", help="TARGET is a module, run as with `python -m`")
    p.add_argument("target", metavar="TARGET", help="the training script (or module, with -m)")
    p.add_argument("target_args", nargs=argparse.REMAINDER, metavar="...", help="arguments for the script")


def overrides_from_args(args: argparse.Namespace) -> dict[str, object]:
    """The dotted config overrides for the flags the user actually gave."""
    out = {key: getattr(args, flag) for flag, key in FLAG_TO_KEY.items() if getattr(args, flag) is not None}
    if "batch.oom_backoff" in out:
        out["batch.oom_backoff"] = out["batch.oom_backoff"] == "on"
    return out


@dataclass(frozen=True)
class LaunchPlan:
    """Everything torchrun needs for this machine, derived from a resolved config."""

    config: RunConfig
    """The config the workers read, with process count, address, port and use_cpu filled in."""
    nproc_per_node: int
    omp_num_threads: int
    """Threads per worker when OMP_NUM_THREADS is unset: this machine's cores shared by its workers."""
    target: tuple[str, ...]
    """What the worker runs: (script, *args) or ("-m", module, *args)."""
    cuda_visible_devices: str | None = None
    """The GPUs the workers may see, from `launch.gpu_ids`; None: leave CUDA_VISIBLE_DEVICES as it is."""

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.config.launch.num_machines

    @property
    def backend(self) -> str:
        return backend_for(self.config.launch.use_cpu)

    @property
    def loopback_only(self) -> bool:
        """True when every socket of the run can listen on loopback (see [Note: loopback by default])."""
        la = self.config.launch
        return la.num_machines == 1 and la.rdzv_backend == "static" and is_loopback(la.main_process_ip)

    def rendezvous(self) -> str:
        la = self.config.launch
        backend = rendezvous.BACKEND if self.loopback_only else la.rdzv_backend
        return f"{backend} at {la.main_process_ip}:{la.main_process_port}"

    def torchrun_argv(self) -> list[str]:
        la = self.config.launch
        argv = ["--nnodes", str(la.num_machines), "--nproc-per-node", str(self.nproc_per_node),
                "--max-restarts", str(la.max_restarts)]
        if self.loopback_only:
            argv += ["--rdzv-backend", rendezvous.BACKEND, "--rdzv-endpoint",
                     f"{la.main_process_ip}:{la.main_process_port}", "--rdzv-id", f"zerofit-{la.main_process_port}"]
        elif la.rdzv_backend == "static":
            argv += ["--rdzv-backend", "static"]
            argv += ["--master-addr", la.main_process_ip, "--master-port", str(la.main_process_port),
                     "--node-rank", str(la.machine_rank)]
        else:  # c10d assigns machine ranks itself, in the order machines join
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{la.main_process_ip}:{la.main_process_port}",
                     "--rdzv-id", f"zerofit-{la.main_process_port}"]
        return [*argv, "--module", WORKER_MODULE, *self.target]

    def torchrun_args(self, torchrun: Any, log_dir: str) -> argparse.Namespace:
        """torchrun's parsed arguments for this plan, its logs under `log_dir` (the run's own temporary
        directory, removed with it: else each launch leaves a /tmp/torchelastic_* behind). The script's own
        arguments are set after parsing, never parsed by torchrun: its parser would take `--n`, `--max`,
        `--log` ... for abbreviations of its own options."""
        argv = self.torchrun_argv()
        head = argv[: len(argv) - len(self.target)]  # ends with `--module <worker>`
        args = torchrun.parse_args(["--log-dir", log_dir, *head])
        args.training_script_args = list(self.target)  # what the worker runs, untouched
        return args


def is_loopback(address: str | None) -> bool:
    try:
        return ipaddress.ip_address(address or "").is_loopback
    except ValueError:
        return address == "localhost"


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (lo on Linux), for GLOO_SOCKET_IFNAME."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n in ("lo", "lo0")), None)


_PLAIN_IFNAMES = re.compile(r"[\w.:-]+(,[\w.:-]+)*")
"""A list of interface names as gloo takes it; NCCL's `^` (exclude) and `=` (exact) forms are not one."""


def network_env(plan: LaunchPlan, environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """The socket interfaces the workers' gloo and NCCL use (a setting the user made is never replaced).

    gloo: loopback on one machine, else what the user named for NCCL. NCCL: what gloo uses, so on one
    machine loopback too (its data goes over NVLink or shared memory there; only its bootstrap uses the
    socket, which would otherwise bind the first non-loopback interface). NCCL matches names as prefixes
    unless the list starts with `=`, gloo exactly: names given to NCCL get the `=`, and an NCCL list
    with `^`/`=` is not given to gloo.
    """
    gloo, nccl = environ.get("GLOO_SOCKET_IFNAME"), environ.get("NCCL_SOCKET_IFNAME")
    out = {}
    if gloo is None:
        if plan.loopback_only:
            gloo = loopback_interface()
        elif nccl and _PLAIN_IFNAMES.fullmatch(nccl):
            gloo = nccl
        if gloo:
            out["GLOO_SOCKET_IFNAME"] = gloo
    if nccl is None and gloo:
        out["NCCL_SOCKET_IFNAME"] = f"={gloo}"
    return out


ACCELERATE_USE_CPU_ENV = "ACCELERATE_USE_CPU"
"""What `accelerate launch` sets in its workers to say the run is on CPUs (`--cpu`)."""


def device_env(plan: LaunchPlan) -> dict[str, str]:
    """What libraries under the script read to run on the launch's devices: ACCELERATE_USE_CPU, set as
    `accelerate launch` sets it (true on CPUs, else false), replacing a value inherited from the shell.

    transformers' `TrainingArguments` builds Accelerate's process state from it: without it a CPU worker of
    torchrun is a world of one there (Accelerate counts a CPU process as distributed only when told it runs
    on CPU), so every rank of a `--cpu` run acted as Trainer's main process (each wrote `all_results.json`
    and the checkpoints, logged its own loss, and counted the loss's tokens on its own process: the loss
    and gradients came out twice as large on 2 processes). A script's `--use_cpu` says the same; zerofit's
    own Accelerator reads the launch config instead."""
    return {ACCELERATE_USE_CPU_ENV: "true" if plan.config.launch.use_cpu else "false"}


def exposure_warning(plan: LaunchPlan) -> str | None:
    """What the launcher says when some socket of the run listens beyond loopback (None: nothing does)."""
    la = plan.config.launch
    if not plan.loopback_only:
        return (f"zerofit launch: WARNING: the rendezvous store on {la.main_process_ip}:{la.main_process_port} "
                "listens on every network interface and runs requests from anyone who can reach it (torch's "
                "TCPStore has no authentication): let only the training machines reach that port (firewall)")
    user_choice = os.environ.get("GLOO_SOCKET_IFNAME")
    if user_choice is not None and user_choice != loopback_interface():
        return (f"zerofit launch: WARNING: GLOO_SOCKET_IFNAME={user_choice} makes the workers' gloo sockets "
                "listen beyond loopback: unset it to keep a one-machine run on loopback")
    if loopback_interface() is None:
        return ("zerofit launch: WARNING: no loopback interface (lo) was found, so the workers' gloo sockets "
                "may listen on every interface: set GLOO_SOCKET_IFNAME to your loopback interface")
    return None


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_launch(config: RunConfig, target: tuple[str, ...], *, gpu_count: int) -> LaunchPlan:
    """Check the launch settings against this machine; fill in what was left unset.

    `config` comes validated from `load_config`, which already enforces every rule among the launch
    settings themselves (counts, ranks, ports, the address several machines need: see
    `zerofit.config.validate`). Only what needs this machine is checked here: its GPU count, and the
    batch triple against the world size that count gives.
    Every problem is reported at once, each naming the flag, the config key, the value and the fix.
    """
    la = config.launch
    problems: list[str] = []
    nnodes = la.num_machines
    use_cpu = bool(la.use_cpu) or gpu_count == 0
    visible = None
    if not use_cpu and la.gpu_ids not in (None, "", "all"):
        ids = [i.strip() for i in str(la.gpu_ids).split(",") if i.strip()]
        bad = [i for i in ids if not i.isdigit() or int(i) >= gpu_count]
        if bad or not ids:
            problems.append(f"launch.gpu_ids is {la.gpu_ids!r} but this machine has GPUs 0..{gpu_count - 1}: "
                            "list GPU indices that exist, comma separated (\"0,1\"), or use \"all\"")
        else:
            visible, gpu_count = ",".join(ids), len(ids)
    per_node = (1 if use_cpu else gpu_count) if la.num_processes is None else la.num_processes // nnodes
    if not use_cpu and per_node > gpu_count:
        problems.append(f"--num_processes (launch.num_processes) asks for {per_node} process(es) per machine "
                        f"but this machine has {gpu_count} GPU(s): set --num_processes to at most "
                        f"{gpu_count * nnodes}, or pass --cpu")
    if problems:
        raise ConfigError(problems, source=config.source)
    port = la.main_process_port
    if port is None:
        port = free_loopback_port() if nnodes == 1 else DEFAULT_MULTI_NODE_PORT
    resolved_launch = dataclasses.replace(
        la, num_processes=per_node * nnodes, main_process_ip=la.main_process_ip or "127.0.0.1",
        main_process_port=port, use_cpu=use_cpu)
    resolved = config.replace(launch=resolved_launch)
    # The batch triple's rule needs the world size, which is known only now when no process count was
    # given: the check every rank's prepare() would make, made once here, so a --dry_run catches it too
    # and a real launch stops with one error instead of one traceback per rank.
    validate_config(resolved, world_size=per_node * nnodes)
    return LaunchPlan(config=resolved, nproc_per_node=per_node,
                      omp_num_threads=max(1, usable_cpus() // per_node), target=target,
                      cuda_visible_devices=visible)


def check_target(target: tuple[str, ...]) -> None:
    """Fail before any process starts when the script or module does not exist."""
    if target[0] == "-m":
        name = target[1]
        sys.path.insert(0, os.getcwd())  # workers run with the working directory on sys.path, as `python -m`
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a parent package is missing
            found = False
        finally:
            sys.path.remove(os.getcwd())
        if not found:
            raise ConfigError(f"-m {name}: no module named {name!r} is importable from {os.getcwd()}: "
                              "check the name, install its package, or run from the directory that holds it")
    elif os.path.isdir(target[0]):
        raise ConfigError(f"script {target[0]!r} is a directory, not a Python file: pass the script inside it "
                          "(e.g. DIR/train.py), or -m NAME for a module")
    elif not os.path.isfile(target[0]):
        raise ConfigError(f"script {target[0]!r} does not exist (from {os.getcwd()}): pass the path of a "
                          "Python file, or -m NAME for a module")


def config_yaml(config: RunConfig) -> str:
    """The config exactly as the workers will read it."""
    with tempfile.TemporaryDirectory(prefix="zerofit-") as tmp:
        path = os.path.join(tmp, "config.yaml")
        save_config(config, path)
        with open(path, encoding="utf-8") as f:
            return f.read()


def describe(plan: LaunchPlan, origin: str | None = None) -> str:
    """The dry-run report: the plan as YAML comments (with `origin`, where the config came from, see
    `config_file_of`), then the resolved config as YAML."""
    la = plan.config.launch
    lines = [
        f"# zerofit launch plan: {plan.world_size} rank(s) = {la.num_machines} machine(s) x "
        f"{plan.nproc_per_node} process(es); this is machine {la.machine_rank}",
        *([f"# {origin}"] if origin else []),
        f"# backend {plan.backend} on {'cpu' if la.use_cpu else 'one GPU per process'}; "
        f"rendezvous {plan.rendezvous()}",
        f"# each rank runs: {' '.join(plan.target)}",
        f"# torchrun {' '.join(plan.torchrun_argv())}",
    ]
    return "\n".join(lines) + "\n" + config_yaml(plan.config)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the workers (torchrun hands them this process's environment)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


RUN_DIR_PREFIX = "zerofit-run-"
"""A launch's temporary directory (its resolved config, torchrun's logs) is `<tmp>/zerofit-run-<pid>-*`."""
TRACE_DIR_PREFIX = "zerofit-nccl-trace-"
"""An NCCL launch's flight-recorder dumps go to `<tmp>/zerofit-nccl-trace-<pid>-*`: removed after a run that
left no dump, kept (and named in the summary) after one that did."""


def remove_orphaned_run_dirs() -> None:
    """Delete the run directories of launchers that were killed (their pid no longer runs), so a SIGKILL
    leaves nothing behind for long: the next launch on this machine clears it. A killed launcher's trace
    folder goes only when empty: dumps in it are the evidence of a failure."""
    for prefix in (RUN_DIR_PREFIX, TRACE_DIR_PREFIX):
        for path in Path(tempfile.gettempdir()).glob(f"{prefix}*-*"):
            pid = path.name[len(prefix):].split("-", 1)[0]
            if not pid.isdigit() or not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                if prefix == RUN_DIR_PREFIX:
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        path.rmdir()
            except PermissionError:  # a live process of another user
                continue


@contextlib.contextmanager
def nccl_tracing(plan: LaunchPlan) -> Iterator[tuple[dict[str, str], failure_report.NcclRun | None]]:
    """For an NCCL run: the flight-recorder variables for the workers and what the failure summary needs to
    read their dumps; the launcher's dump folder is removed afterwards unless a rank dumped into it."""
    if plan.backend != "nccl":
        yield {}, None
        return
    folder = tempfile.mkdtemp(prefix=f"{TRACE_DIR_PREFIX}{os.getpid()}-")
    env = flight_recorder.env(folder)
    nccl = failure_report.NcclRun(timeout_s=plan.config.launch.process_group_timeout,
                                  dump_prefix=flight_recorder.dump_prefix({**os.environ, **env}), since=time.time())
    try:
        yield env, nccl
    finally:
        if not any(Path(folder).iterdir()):
            shutil.rmtree(folder, ignore_errors=True)


def execute(plan: LaunchPlan) -> int:
    """Run the plan through torchrun; return the exit code (the first failing rank's, else 0)."""
    # Imported here: torch.distributed.run is slow to import and `--dry-run` does not need it.
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    remove_orphaned_run_dirs()
    with tempfile.TemporaryDirectory(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-") as run_dir:
        config_path = os.path.join(run_dir, "config.json")  # JSON: exact and fast for every worker to read
        save_config(plan.config, config_path)
        env = {CONFIG_FILE_ENV: config_path, RUN_ID_ENV: uuid.uuid4().hex}  # restarts keep this launch's id
        if plan.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = plan.cuda_visible_devices
        if "OMP_NUM_THREADS" not in os.environ:  # else torchrun sets 1 and prints a warning about it
            env["OMP_NUM_THREADS"] = str(plan.omp_num_threads)
        env.update(network_env(plan))
        env.update(device_env(plan))
        warning = exposure_warning(plan)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        rendezvous.register()
        with nccl_tracing(plan) as (trace_env, nccl), _environ({**env, **trace_env}), \
                failure_report.torchrun_stop_lines_hidden():
            try:
                torchrun.run(plan.torchrun_args(torchrun, os.path.join(run_dir, "logs")))
            except ChildFailedError as e:
                # Each rank printed its traceback as it failed; one summary names them (zerofit.cli.failure_report).
                name = " ".join(plan.target[:2] if plan.target[0] == "-m" else plan.target[:1])
                first_rank = failure_report.first_failure(e.failures)
                first = e.failures[first_rank]
                print(failure_report.summary(name, e.failures, first_rank, nccl), file=sys.stderr, flush=True)
                for hint in (failure_report.engine_argument_hint(plan.target),
                             failure_report.segfault_hint(e.failures, plan.config.zero.stage)):
                    if hint:
                        print(hint, file=sys.stderr, flush=True)
                code = first.exitcode
                return 128 - code if code < 0 else (code or 1)  # killed by signal s: 128 + s, as shells do
            except SignalException as e:
                print(f"zerofit launch: stopped by {e.sigval.name}; the workers were terminated", file=sys.stderr)
                return 128 + int(e.sigval)
            except KeyboardInterrupt:  # Ctrl-C before torchrun's own handler was in place
                print("zerofit launch: stopped by SIGINT; the workers were terminated", file=sys.stderr)
                return 128 + signal.SIGINT
            except rendezvous.PortInUse as e:
                print(f"zerofit launch: error: {e}", file=sys.stderr)
                return 1
            except RendezvousError as e:
                print(f"zerofit launch: rendezvous {plan.rendezvous()} failed: {e}\n"
                      "  check that machine 0 is started, that --main_process_ip/--main_process_port match on "
                      "every machine, and that the port is reachable", file=sys.stderr)
                return 1
    return 0


def accelerate_default_config() -> Path | None:
    """The file `accelerate config` writes when given no path, if it exists: `default_config.yaml` in
    `$HF_HOME/accelerate`, where HF_HOME defaults to `$XDG_CACHE_HOME/huggingface` and XDG_CACHE_HOME
    to `~/.cache` (Accelerate's rule, `accelerate/commands/config/config_args.py`)."""
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    path = Path(os.path.expanduser(hf_home)) / "accelerate" / "default_config.yaml"
    return path if path.is_file() else None


def config_file_of(args: argparse.Namespace) -> tuple[str | os.PathLike[str] | None, str]:
    """The config file the launch reads and how to name where it came from.

    As `accelerate launch` does, a launch given no --config_file and no --cpu reads the default config
    `accelerate config` wrote (`accelerate_default_config`), so a machine set up for Accelerate runs the
    same way under zerofit; --cpu skips it (it is a GPU machine's setting), which keeps `zerofit demo` the
    same everywhere.
    """
    if args.config_file is not None:
        return args.config_file, f"config: {args.config_file}"
    found = None if args.cpu else accelerate_default_config()
    if found is not None:
        return found, f"config: {found} (accelerate's default config; --config_file FILE reads another)"
    return None, "config: built-in defaults"


def launch_argv(args: argparse.Namespace, config_file: str | os.PathLike[str] | None) -> list[str]:
    """This launch's arguments (after `launch`) as the other machines of a hostfile run get them: without
    --hostfile_print, and naming the config file this machine read when the command line did not."""
    argv = list(getattr(args, "argv", None) or sys.argv[1:])[1:]
    head, tail = argv[: len(argv) - 1 - len(args.target_args)], argv[len(argv) - 1 - len(args.target_args):]
    head = [a for a in head if a not in ("--hostfile_print", "--hostfile-print")]
    if args.config_file is None and config_file is not None:
        head = ["--config_file", os.path.abspath(config_file), *head]
    return [*head, *tail]


def run(args: argparse.Namespace) -> int:
    target = ("-m", args.target, *args.target_args) if args.module else (args.target, *args.target_args)
    config_file, origin = config_file_of(args)
    flags = overrides_from_args(args)
    if args.hostfile_print and args.dry_run:
        raise ConfigError("--hostfile_print and --dry_run both print instead of running: pass one of them")
    machines = MachineSettings(flags, slurm.launch_values(os.environ) if "launch.hostfile" not in flags else None)
    with flags_named(flag_value_problems(args, FLAG_TO_KEY)):
        config = load_config(config_file, overrides=flags, settle=machines)
    hosts = machines.hosts
    if args.hostfile_print and not hosts:
        raise ConfigError("--hostfile_print prints the command of each machine of a hostfile, and there is none: "
                          "pass --hostfile PATH (or set deepspeed_config.deepspeed_hostfile)")
    if hosts and args.hostfile_print:
        sys.stdout.write(hostfile.print_lines(hosts, launch_argv(args, config_file)))
        return 0
    import torch

    plan = plan_launch(config, target, gpu_count=torch.cuda.device_count())
    check_target(target)
    preflight.check(plan.config)  # what every worker would refuse after loading the model and data
    if args.dry_run:
        sys.stdout.write(describe(plan, origin))
        return 0
    if config_file is not None and args.config_file is None:  # a file nobody named on this command line
        print(f"zerofit launch: {origin}", file=sys.stderr, flush=True)
    if not hosts or args.machine_rank is not None or len(hosts) == 1:
        return execute(plan)
    print(f"zerofit launch: starting machines 1..{len(hosts) - 1} over ssh: "
          f"{', '.join(h.name for h in hosts[1:])}", file=sys.stderr, flush=True)
    fleet = hostfile.Fleet(hosts, launch_argv(args, config_file))
    code = 128 + signal.SIGINT
    try:
        code = execute(plan)
    finally:
        code = fleet.finish(code)
    return code
