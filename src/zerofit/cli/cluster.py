"""How SLURM's or a hostfile's machine settings meet the flags and the config file of a launch.

SLURM (`zerofit.cli.slurm`) and a hostfile (`zerofit.cli.hostfile`) derive the machine count, this machine's
rank, the main address and the processes per machine. A flag or the config file that sets one of them wins,
except that one contradicting a machine fact (the count, the rank) is an error naming both.
"""

from __future__ import annotations

import os
from typing import Any

from zerofit.config import load_config
from zerofit.config.schema import LaunchConfig, RunConfig
from zerofit.errors import ConfigError

CLUSTER_KEYS = ("launch.num_machines", "launch.machine_rank", "launch.main_process_ip", "launch.num_processes")
"""The settings SLURM or a hostfile can derive (`cluster_overrides`)."""
MACHINE_FACTS = CLUSTER_KEYS[:2]
"""Settings SLURM or a hostfile states as facts: a flag that disagrees is an error, not a choice."""


def cluster_overrides(config: RunConfig, derived: dict[str, tuple[Any, str]],
                      flags: dict[str, object]) -> dict[str, object]:
    """The settings SLURM or a hostfile derived (`derived`: key -> (value, origin)) that apply: not where a
    flag or the config file set the key, which win, except that a flag or file value contradicting a
    machine fact (`MACHINE_FACTS`) is an error naming both."""
    out, problems, defaults = {}, [], LaunchConfig()
    for key, (value, origin) in derived.items():
        field = key.split(".", 1)[1]
        if key == "launch.num_processes" and config.launch.use_cpu and origin.startswith("SLURM_GPUS"):
            continue  # a GPU count says nothing about CPU processes
        if key in flags:
            if flags[key] != value and key in MACHINE_FACTS:
                problems.append(f"--{field} {flags[key]} contradicts {origin}: drop --{field} (it is derived)")
            continue
        current = getattr(config.launch, field)
        if current not in (getattr(defaults, field), value):
            if key in MACHINE_FACTS:
                problems.append(f"{key} is {current} in {config.source} but {origin}: remove {field} from the file "
                                "(it is derived)")
            continue
        out[key] = value
    if problems:
        raise ConfigError(problems, source=config.source)
    return out


def load_without_machine_flags(config_file: str | os.PathLike[str] | None, flags: dict[str, object],
                                from_slurm: dict[str, tuple[Any, str]] | None) -> RunConfig:
    """The config without the machine flags (`CLUSTER_KEYS`), which may hold only with the cluster's values (a
    --machine_rank 1 beside a hostfile's machine count); with SLURM's address where the file needs one."""
    base = {k: v for k, v in flags.items() if k not in CLUSTER_KEYS}
    if from_slurm and "launch.main_process_ip" in from_slurm:
        try:
            return load_config(config_file, overrides=base)
        except ConfigError:  # the one rule SLURM's values settle: a file of several machines without an address
            base["launch.main_process_ip"] = from_slurm["launch.main_process_ip"][0]
    return load_config(config_file, overrides=base)
