"""How SLURM's or a hostfile's machine settings meet the flags and the config file of a launch.

SLURM (`zerofit.cli.slurm`) and a hostfile (`zerofit.cli.hostfile`) derive the machine count, this machine's
rank, the main address and the processes per machine. A flag or the config file that sets one of them wins,
except that one contradicting a machine fact (the count, the rank) is an error naming both.
"""

from __future__ import annotations

from typing import Any

from zerofit.cli import hostfile
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


class MachineSettings:
    """`load_config`'s `settle` for a launch: what SLURM (`from_slurm`) or the hostfile the config names
    derives, applied as `cluster_overrides` says, before the config's rules are checked - some hold only
    with the cluster's values (a --machine_rank 1 beside a hostfile's machine count, a file of several
    machines without the address SLURM gives) - so the file is read, and warns, once. A hostfile wins over
    SLURM ([Note: one launch per node under SLURM], [Note: one command line, every machine])."""

    def __init__(self, flags: dict[str, object], from_slurm: dict[str, tuple[Any, str]] | None):
        self.flags, self.from_slurm = flags, from_slurm
        self.hosts: list[hostfile.Host] | None = None
        """The hostfile's machines, once the config was read (None: it names no hostfile)."""

    def __call__(self, draft: RunConfig) -> dict[str, object]:
        path = draft.launch.hostfile
        self.hosts = hostfile.read(path) if path else None
        derived = hostfile.launch_values(self.hosts, path) if self.hosts else self.from_slurm
        return cluster_overrides(draft, derived, self.flags) if derived else {}
