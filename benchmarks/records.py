"""What the benchmark scripts share about their records: the fields every record carries (versions, hardware,
memory peaks, a median after warmup), writing one, and reading a device call's runs back into a table.

The timed scripts (grpo_bench.py, trainer_clm.py, muon.py) import it as `records` (their folder is on
`sys.path`: they run as scripts, or grpo_bench from the copied grpo.py with benchmarks/ on PYTHONPATH);
the summaries inlined in grpo_gpu.sh and trainer_gpu.sh put benchmarks/ on `sys.path` first. torch is
imported only where a GPU is asked about, so a summary starts in a fraction of a second.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import resource
import statistics
import sys

# ---- a record's fields ----------------------------------------------------------------------------------------


def versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """Python's version and each of `names`' `__version__`, None for a package this process never imported."""
    out = {"python": platform.python_version()}
    for name in names:
        module = sys.modules.get(name)
        out[name] = getattr(module, "__version__", None) if module else None
    return out


def hardware() -> dict[str, object]:
    """CPU count, host memory and, with CUDA, the first GPU's name and memory and CUDA's version."""
    import torch

    out: dict[str, object] = {"cpus": os.cpu_count(),
                              "host_memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    return out


def gpu_peak_gib() -> float | None:
    """The allocator's peak since its last reset, None without CUDA."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def gpu_reserved_peak_gib() -> float | None:
    import torch

    return torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None


def host_rss_peak_gib() -> float:
    """This process's peak resident set (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def median_after(xs: list[float], warmup: int) -> float | None:
    """The median of `xs` past the first `warmup` (all of them when there are no more), None for none."""
    xs = xs[warmup:] if len(xs) > warmup else xs
    return statistics.median(xs) if xs else None


def strict_json(value):
    """`value` with non-finite floats as strings (Trainer sets DeepSpeed's steps_per_print to inf)."""
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def emit(record: dict, path: str | None, prefix: str, indent: int | None = 1) -> None:
    """`record` as JSON to `path` (when given) and as one `PREFIX: {...}` line on stdout, the resolved config
    left out of the line (it is long; the file has it)."""
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=indent, default=str)
            if indent is None:
                f.write("\n")
    print(f"{prefix}: " + json.dumps({k: v for k, v in record.items() if k != "resolved_config"}, default=str),
          flush=True)


# ---- a device call's runs, back into a table ------------------------------------------------------------------


def read(path: str, default: str | None = None) -> str | None:
    """The file's text, stripped; `default` when it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def first_error(log: str) -> str:
    """The first exception a rank raised (torchrun's ChildFailedError only repeats it), else the last
    line that says what went wrong."""
    lines = log.splitlines()
    raised = [line for line in lines if re.match(r"(\[rank\d+\]: )?[\w.]*(Error|Exception): ", line)
              and "ChildFailedError" not in line]
    other = [line for line in lines if re.search(r"Killed|out of memory|failed|Error", line)]
    return (raised[:1] or other[-1:] or lines[-1:] or [""])[0][-300:]


def run_rows(runs_dir: str, names: list[str]) -> list[dict]:
    """One row a run from RUNS_DIR/NAME.{status,json,log,wall} (what the shell scripts' `run` leaves): the
    status ("not run" without one), the record (None without one), the wall seconds and, for a run that
    failed or timed out (not one skipped), the first error in its log."""
    rows = []
    for name in names:
        base = os.path.join(runs_dir, name)
        status = read(base + ".status", "not run")
        record = json.loads(read(base + ".json") or "null")
        failed = status != "ok" and not status.startswith("skipped")
        error = first_error(read(base + ".log", "")) if failed else None
        rows.append({"run": name, "status": status, "wall_s": read(base + ".wall"), "error": error or None,
                     "record": record})
    return rows


def settings(rows: list[dict], keys: tuple[str, ...]) -> dict | None:
    """`keys` of the first run that has a record: what every run shares (model, batch, versions, hardware)."""
    first = next((r["record"] for r in rows if r["record"]), None)
    return {k: first.get(k) for k in keys} if first else None


def cell(rec: dict | None, key: str, fmt: str) -> str:
    """`rec[key]` formatted with `fmt`, "-" when there is no record or no value."""
    return fmt.format(rec[key]) if rec and rec.get(key) is not None else "-"


def peak_cell(rec: dict | None, phase_key: str) -> str:
    """The GPU peak, and in parentheses the peak in one phase (`phase_key`: generating, training) when recorded."""
    peak = cell(rec, "gpu_peak_gib", "{:.1f}")
    if rec and rec.get(phase_key) is not None:
        peak += f" ({rec[phase_key]:.1f})"
    return peak


def table(header: list[str], body: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in body]


def write_results(out: str, results: dict, md: list[str]) -> None:
    """OUT/results.json and OUT/results.md; the markdown on stdout."""
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
