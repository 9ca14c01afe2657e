"""`zerofit env`: versions, devices and limits, as one block to paste into a bug report."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

import zerofit
from zerofit.cli.flags import add_flag

OPTIONAL_PACKAGES = ("transformers", "accelerate", "deepspeed", "safetensors", "numpy")
# Environment variables that change how a run behaves, shown when set.
RELEVANT_ENV = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "ZEROFIT_CONFIG_FILE", "NCCL_DEBUG",
                "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "TORCH_DISTRIBUTED_DEBUG")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("env", allow_abbrev=False, help="print versions and devices for a bug report",
                              description="Print versions, devices and limits as one block to paste into an issue.")
    add_flag(p, "--config_file", metavar="FILE", help="also print this config, resolved")
    p.set_defaults(func=run)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _host_memory() -> str:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[1:2]}
        return f"{info['MemTotal'] / 2**20:.1f} GiB total, {info.get('MemAvailable', 0) / 2**20:.1f} GiB available"
    except (OSError, KeyError, ValueError):
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
    total = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = total
    return f"{usable} usable of {total}"


def collect() -> list[tuple[str, str]]:
    """(name, value) pairs in report order."""
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
             ("locked-memory limit (ulimit -l)", _locked_memory_limit())]
    rows += [(f"${name}", os.environ[name]) for name in RELEVANT_ENV if name in os.environ]
    return rows


def report(config_file: str | None = None) -> str:
    lines = ["Paste everything below, fences included, into your zerofit issue:", "", "```text"]
    lines += [f"{name}: {value}" for name, value in collect()]
    lines.append("```")
    if config_file:
        from zerofit.cli.launch import config_yaml
        from zerofit.config import load_config

        lines += ["", f"Resolved config from {config_file}:", "", "```yaml",
                  config_yaml(load_config(config_file)).rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(report(args.config_file))
    return 0
