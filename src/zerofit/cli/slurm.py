"""What a SLURM allocation tells `zerofit launch`: this machine's rank, machine 0's address, the GPU count.

[Note: one launch per node under SLURM] `srun --ntasks-per-node=1 zerofit launch ...` runs one launcher
on every node of the step; each one reads SLURM's variables (`launch_values`) instead of needing its
own `--machine_rank`, and torchrun (the launcher) starts that node's processes. SLURM starting several
tasks per node would start several launchers per node, each with a full set of processes, so that is
refused with the fix. A launch run straight from a batch script on a multi-node allocation is the
batch step, on the first node only: it would wait for the other nodes forever, so that is refused too.

The values feed `zerofit.cli.launch` as derived settings, under the user's flags and config file (the
launcher's rule for which wins). Host lists are expanded here (`expand_hostlist`), without calling
`scontrol`, which is not always on the compute nodes' PATH.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

from zerofit.errors import ConfigError

SRUN_LINE = "srun --ntasks-per-node=1 zerofit launch ..."

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """`text` split at `sep` outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _expand_ranges(body: str, whole: str) -> list[str]:
    """The values of one bracket's body, "01-03,07" -> 01 02 03 07 (zero padding kept, as SLURM does)."""
    out = []
    for item in body.split(","):
        m = _RANGE.fullmatch(item.strip())
        if not m:
            raise ValueError(f"host list {whole!r}: {item!r} in [{body}] is not a number or a range N-M")
        lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"host list {whole!r}: range {item!r} runs backwards")
        width = len(lo)
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compact host list in full, in order: "gpu[01-03,07],cpu5" -> gpu01 gpu02 gpu03 gpu07 cpu5.

    Takes SLURM's documented forms: plain names, comma-separated lists, bracketed ranges and lists with
    zero padding kept ("tux[009-011]"), and several bracket groups in one name ("rack[1-2]-n[1-2]",
    every combination, the first group slowest).
    """
    if text.count("[") != text.count("]"):
        raise ValueError(f"host list {text!r}: unbalanced brackets")
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        part = part.strip()
        if not part:
            continue
        pieces = re.split(r"(\[[^\[\]]*\])", part)  # literal text and bracket groups, alternating
        choices = [_expand_ranges(p[1:-1], text) if p.startswith("[") else [p] for p in pieces if p]
        if any("[" in c or "]" in c for group in choices for c in group):
            raise ValueError(f"host list {text!r}: nested brackets")
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def _first(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of `names` that is set: (name, value)."""
    return next(((n, environ[n]) for n in names if environ.get(n)), None)


def _count(spec: str) -> list[int]:
    """SLURM's tasks-per-node form, "2(x3),1" -> [2, 2, 2, 1]."""
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m:
            out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def launch_values(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]] | None:
    """Launch settings from SLURM's variables: dotted key -> (value, the variable it came from); None when
    this is no SLURM job. On one node only the process count is derived (the run stays on loopback).

    Reads the step's variables (`SLURM_STEP_*`, set by srun) before the job's. Raises ConfigError for what
    cannot work: several tasks per node, a multi-node launch outside srun, a node id outside the node list.
    """
    if not environ.get("SLURM_JOB_ID"):
        return None
    nodes_var = _first(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    list_var = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    tasks_var = _first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    problems = []
    try:
        hosts = expand_hostlist(list_var[1]) if list_var else []
    except ValueError as e:
        raise ConfigError(f"{list_var[0]}: {e}") from None
    nnodes = int(nodes_var[1]) if nodes_var and nodes_var[1].isdigit() else len(hosts) or 1
    out: dict[str, tuple[Any, str]] = {}
    per_node = _count(tasks_var[1]) if tasks_var else []
    if any(n > 1 for n in per_node):
        problems.append(
            f"SLURM starts {tasks_var[1]} tasks per node ({tasks_var[0]}={tasks_var[1]}), so every node would run "
            "several launchers, each starting all its processes: zerofit launch starts a node's processes itself "
            f"(torchrun), so start one task per node: {SRUN_LINE} (GPUs per node set the process count)")
    if nnodes > 1:
        if not environ.get("SLURM_STEP_ID") and not environ.get("SLURM_STEPID"):
            problems.append(
                f"this is a {nnodes}-node SLURM job (SLURM_JOB_ID={environ['SLURM_JOB_ID']}) but no srun step: "
                f"launched from the batch script, only the first node would run: start it on every node with "
                f"{SRUN_LINE}")
        if len(hosts) != nnodes:
            problems.append(f"{nodes_var[0] if nodes_var else 'SLURM'} says {nnodes} nodes but "
                            f"{list_var[0] if list_var else 'SLURM_JOB_NODELIST'} lists {len(hosts)}: "
                            f"{list_var[1] if list_var else '(unset)'}")
        node_id = environ.get("SLURM_NODEID", "")
        if not node_id.isdigit() or int(node_id) >= nnodes:
            problems.append(f"SLURM_NODEID is {node_id!r}, not a node index 0..{nnodes - 1}: run under srun")
        if problems:
            raise ConfigError(problems)
        out["launch.num_machines"] = (nnodes, f"{nodes_var[0]}={nodes_var[1]}")
        out["launch.machine_rank"] = (int(node_id), f"SLURM_NODEID={node_id}")
        out["launch.main_process_ip"] = (hosts[0], f"the first host of {list_var[0]}={list_var[1]}")
    elif problems:
        raise ConfigError(problems)
    gpus = environ.get("SLURM_GPUS_ON_NODE", "")
    if gpus.isdigit() and int(gpus) > 0:
        out["launch.num_processes"] = (int(gpus) * nnodes, f"SLURM_GPUS_ON_NODE={gpus} x {nnodes} node(s)")
    return out
