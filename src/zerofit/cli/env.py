"""`zerofit env`: versions, devices and limits, as one block to paste into a bug report.

The block ends its machine rows with the offload rates cached for this machine's GPU
(`zerofit.plan.bandwidth`); `--probe` measures them first (a few seconds) and caches them. Then comes
torch's own report (`torch.utils.collect_env`, about 1.5 s on a CPU machine: it runs lscpu, pip and
the compilers), timed and bounded (`TORCH_ENV_TIMEOUT_S`); when it fails or runs over, one line says so.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import os
import platform
import sys
import threading
import time

import zerofit
from zerofit.cli.flags import add_flag
from zerofit.plan import bandwidth
from zerofit.plan.host_memory import meminfo

OPTIONAL_PACKAGES = ("transformers", "accelerate", "deepspeed", "safetensors", "numpy")
# Environment variables that change how a run behaves, shown when set.
RELEVANT_ENV = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "ZEROFIT_CONFIG_FILE", "NCCL_DEBUG",
                "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "TORCH_DISTRIBUTED_DEBUG")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("env", allow_abbrev=False, help="print versions and devices for a bug report",
                              description="Print versions, devices and limits as one block to paste into an issue.")
    add_flag(p, "--config_file", metavar="FILE", help="also print this config, resolved")
    add_flag(p, "--probe", action="store_true",
             help="measure this machine's offload rates first (a few seconds on the GPU) and cache them")
    p.set_defaults(func=run)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _host_memory() -> str:
    info = meminfo()
    if "MemTotal" in info:
        return f"{info['MemTotal'] / 2**30:.1f} GiB total, {info.get('MemAvailable', 0) / 2**30:.1f} GiB available"
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return f"{pages * page_size / 2**30:.1f} GiB total"


def _locked_memory_limit() -> str:
    """Pinned (page-locked) host memory allowed; CPU offload pins its buffers."""
    try:
        import resource
    except ImportError:
        return "unknown"
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"


def _cpus() -> str:
    return f"{bandwidth.usable_cpus()} usable of {os.cpu_count() or 0}"


def offload_rates(*, probe: bool = False) -> str:
    """The `offload rates` row: the cached rates for this machine's GPU (measured first with `probe`)."""
    if bandwidth.device_name() is None:
        return "no CUDA device"
    if not probe:
        rates = bandwidth.cached()
        return rates.summary() if rates else "not measured: `zerofit env --probe` measures them (a few seconds)"
    rates = bandwidth.probe(refresh=True)
    saved = "" if bandwidth.cached() == rates else f" (not cached: {bandwidth.cache_path()} could not be written)"
    return rates.summary() + saved


TORCH_ENV_TIMEOUT_S = 30.0
"""How long torch's collect_env may run before the report goes without it."""


@functools.cache
def torch_env_lines(timeout_s: float = TORCH_ENV_TIMEOUT_S) -> tuple[str, ...]:
    """torch.utils.collect_env's report, led by a line with its run time; one line when it fails or runs
    longer than `timeout_s` (it is left running in a daemon thread then). Once per process."""
    found: dict[str, str] = {}

    def work() -> None:
        try:
            from torch.utils import collect_env

            found["text"] = collect_env.get_pretty_env_info()
        except Exception as e:  # noqa: BLE001 - torch's report is a bonus: the rest must print whatever it does
            found["error"] = (f"{type(e).__name__}: {e}".splitlines() or ["?"])[0]

    start = time.perf_counter()
    thread = threading.Thread(target=work, name="zerofit-collect-env", daemon=True)
    thread.start()
    thread.join(timeout_s)
    took = time.perf_counter() - start
    if thread.is_alive():
        return (f"torch.utils.collect_env: not shown: still running after {timeout_s:.0f} s",)
    if "error" in found:
        return (f"torch.utils.collect_env: failed after {took:.1f} s: {found['error']}",)
    return (f"torch.utils.collect_env (took {took:.1f} s):", *found["text"].rstrip().splitlines())


def collect(*, probe: bool = False) -> list[tuple[str, str]]:
    """(name, value) pairs in report order; `probe` measures the offload rates instead of reading the cache."""
    import torch

    rows = [
        ("zerofit", f"{zerofit.__version__} ({os.path.dirname(zerofit.__file__)})"),
        ("python", f"{platform.python_version()} {platform.python_implementation()} ({sys.executable})"),
        ("platform", platform.platform()),
        ("torch", torch.__version__),
        ("CUDA (torch built with)", torch.version.cuda or "none (CPU build)"),
    ]
    nccl = "n/a"
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            nccl = "unavailable"
    rows.append(("NCCL", nccl))
    rows += [(name, _version(name)) for name in OPTIONAL_PACKAGES]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows.append(("GPUs", str(count) if count else "none"))
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        rows.append((f"  GPU {i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB"))
    rows += [("CPUs", _cpus()), ("host memory", _host_memory()),
             ("locked-memory limit (ulimit -l)", _locked_memory_limit()),
             ("offload rates", offload_rates(probe=probe))]
    rows += [(f"${name}", os.environ[name]) for name in RELEVANT_ENV if name in os.environ]
    return rows


def report(config_file: str | None = None, *, probe: bool = False) -> str:
    lines = ["Paste everything below, fences included, into your zerofit issue:", "", "```text"]
    lines += [f"{name}: {value}" for name, value in collect(probe=probe)]
    lines += ["", *torch_env_lines(), "```"]
    if config_file:
        from zerofit.cli.launch import config_yaml
        from zerofit.config import load_config

        lines += ["", f"Resolved config from {config_file}:", "", "```yaml",
                  config_yaml(load_config(config_file)).rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    if args.probe and bandwidth.device_name() is None:
        # Asked to measure what cannot be measured here: a failure, so `zerofit env --probe && ...` stops.
        print("zerofit env: error: --probe measures host<->GPU copies and AdamW on a CUDA device, and torch sees "
              "none here (torch.cuda.is_available() is False): run it on the GPU machine, or drop --probe",
              file=sys.stderr)
        return 2
    if args.probe:
        print("zerofit env: measuring the offload rates (a few seconds)...", file=sys.stderr, flush=True)
    sys.stdout.write(report(args.config_file, probe=args.probe))
    return 0
