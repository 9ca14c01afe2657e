"""NCCL's flight recorder, for the launcher: switch its dumps on, then read them into a few lines.

[Note: failures under NCCL]
Under gloo a collective that waits too long raises in the waiting call, and `zerofit.distributed.failures`
turns that into a `CollectiveError` naming the collective. Under NCCL nothing waits on the CPU: the
engine queues its collectives on a side stream, and torch's NCCL watchdog thread notices the one that
outlived `launch.process_group_timeout`, then aborts the process (SIGABRT, exit code -6). What the
launcher can name is what torch's flight recorder saw: every rank keeps a ring buffer of its recent
collectives (operation, sizes, sequence number, state) and, with TORCH_NCCL_DUMP_ON_TIMEOUT, writes it
to `<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>` before it aborts. `zerofit launch` sets those variables
(unless the user did) to a folder of its own, and its failure summary (`zerofit.cli.failure_report`)
reads the dumps: per rank the last collective it completed and the one it is stuck in, and which rank
is behind (issued fewer collectives) or issued a different collective at the same place.

A dump is a pickle of plain dicts, lists and strings, torch 2.11-2.13 alike (`version` "2.10"): it is
read with an unpickler that refuses every class, so a stray file cannot run code, and a dump that
cannot be read becomes one line saying so.
"""

from __future__ import annotations

import glob
import io
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMP_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
"""Where a rank writes its dump (prefix + rank); torch reads the first that is set (2.11 knows the second)."""
BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
BUFFER_ENTRIES = 2000
"""Collectives each rank remembers: the last few steps of a large model (a few hundred bytes each)."""
DUMP_PREFIX = "nccl_trace_rank_"

WATCHDOG_WORDS = ("watchdog caught collective operation timeout", "processgroupnccl's watchdog",
                  "watchdog thread terminated", "nccl watchdog")
"""Lowercase phrases of torch's NCCL watchdog in a rank's error text (torch 2.4-2.13)."""

_PLUMBING = (f"{os.sep}torch{os.sep}", f"zerofit{os.sep}engine{os.sep}comm.py", f"zerofit{os.sep}distributed{os.sep}",
             f"{os.sep}contextlib.py")
"""Frames that issue every collective alike; the caller below them says which collective it was."""


def env(folder: str, environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """The flight-recorder variables the launcher adds for an NCCL run, dumps going to `folder` (each one the
    user set is left as it is)."""
    out = {}
    if not any(v in environ for v in BUFFER_VARS):
        out["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(BUFFER_ENTRIES)
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ:
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if not any(v in environ for v in TEMP_FILE_VARS):
        out["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(folder, DUMP_PREFIX)
    return out


def dump_prefix(environ: dict[str, str] | os._Environ[str]) -> str | None:
    """The prefix the workers write their dumps under (the first of TEMP_FILE_VARS set), None if unset."""
    return next((environ[v] for v in TEMP_FILE_VARS if environ.get(v)), None)


@dataclass(frozen=True)
class Call:
    """One collective as a rank's flight recorder saw it."""

    seq: int
    """`collective_seq_id`: the same collective has the same number on every rank of its group."""
    op: str
    """The operation (`all_gather`, `reduce_scatter`, ...), without the backend's `nccl:`."""
    sizes: str
    """Input (and output, when they differ) tensor shapes and dtypes."""
    state: str
    """`scheduled`, `started` or `completed`."""
    group: str
    caller: str | None = None
    """The innermost frame outside torch and the engine's collective plumbing (when the dump has frames)."""
    timeout_s: float | None = None

    def text(self) -> str:
        where = f", called from {self.caller}" if self.caller else ""
        return f"#{self.seq} {self.op} {self.sizes}{where}"

    def same_as(self, other: Call) -> bool:
        return (self.op, self.sizes) == (other.op, other.sizes)


@dataclass(frozen=True)
class RankTrace:
    rank: int
    completed: Call | None
    """The last collective this rank finished."""
    stuck: Call | None
    """The first collective it issued that never finished (None: every recorded one finished)."""
    issued: int
    """The sequence number of the last collective it issued in that group."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a flight-recorder dump holds only plain values, not {module}.{name}")


def _load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = _PlainUnpickler(io.BytesIO(f.read())).load()
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError("no 'entries' list")
    return data


def _shapes(sizes: Any, dtypes: Any) -> str:
    dtypes = list(dtypes or [])
    parts = [f"{list(s)}" + (f" {dtypes[i]}" if i < len(dtypes) else "") for i, s in enumerate(sizes or [])]
    return ", ".join(parts) or "[]"


def _caller(frames: Any) -> str | None:
    for frame in frames or []:  # innermost first
        filename = str(frame.get("filename", ""))
        if filename and not any(p in filename for p in _PLUMBING):
            short = os.sep.join(Path(filename).parts[-3:])
            return f"{frame.get('name', '?')} ({short}:{frame.get('line', '?')})"
    return None


def _call(entry: dict[str, Any]) -> Call:
    inputs = _shapes(entry.get("input_sizes"), entry.get("input_dtypes"))
    outputs = _shapes(entry.get("output_sizes"), entry.get("output_dtypes"))
    group = entry.get("process_group")
    timeout_ms = entry.get("timeout_ms")
    return Call(
        seq=int(entry.get("collective_seq_id", -1)),
        op=str(entry.get("profiling_name", "?")).split(":", 1)[-1],
        sizes=inputs if outputs == inputs else f"in {inputs} out {outputs}",
        state=str(entry.get("state", "?")),
        group=str(group[0] if isinstance(group, (list, tuple)) and group else group),
        caller=_caller(entry.get("frames")),
        timeout_s=timeout_ms / 1000 if isinstance(timeout_ms, (int, float)) and timeout_ms > 0 else None)


def _collectives(data: dict[str, Any]) -> list[Call]:
    entries = [e for e in data["entries"] if isinstance(e, dict) and not e.get("is_p2p", False)]
    entries.sort(key=lambda e: e.get("record_id", 0))
    return [_call(e) for e in entries]


def _trace(rank: int, calls: list[Call], group: str) -> RankTrace:
    mine = [c for c in calls if c.group == group]
    done = [c for c in mine if c.state == "completed"]
    open_ = [c for c in mine if c.state != "completed"]
    return RankTrace(rank, done[-1] if done else None, open_[0] if open_ else None,
                     max((c.seq for c in mine), default=-1))


def read(prefix: str, *, since: float = 0.0) -> tuple[dict[int, list[Call]], list[str]]:
    """Every rank's recorded collectives from the dumps `<prefix><rank>` written at or after `since` (a
    dump from an earlier run is not this run's), and one line per dump that could not be read."""
    folder, stem = os.path.split(prefix)
    calls: dict[int, list[Call]] = {}
    problems = []
    try:
        paths = sorted(Path(folder or ".").glob(f"{glob.escape(stem)}*"))
    except OSError as e:
        return {}, [f"could not list the flight-recorder dumps in {folder}: {e}"]
    for path in paths:
        suffix = path.name[len(stem):]
        if not suffix.isdigit():
            continue
        try:
            if path.stat().st_mtime < since:
                continue
            calls[int(suffix)] = _collectives(_load(path))
        except Exception as e:  # noqa: BLE001 - a damaged dump must not hide the failure summary
            problems.append(f"could not read the flight-recorder dump {path} ({type(e).__name__}: {e})")
    return calls, problems


def traces(calls: dict[int, list[Call]]) -> list[RankTrace]:
    """Per rank, in the group where a collective got stuck (the first rank's, else any), what it finished
    last and where it is stuck."""
    stuck = [c for rank in sorted(calls) for c in calls[rank] if c.state != "completed"]
    seen = [c for rank in sorted(calls) for c in calls[rank]]
    if not seen:
        return []
    group = (stuck or seen)[0].group
    return [_trace(rank, calls[rank], group) for rank in sorted(calls)]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def verdict(found: list[RankTrace]) -> str | None:
    """Which rank is behind (issued fewer collectives than the others), or which ranks issued different
    collectives under the same sequence number; None when the dumps show neither."""
    if len(found) < 2:
        return None
    issued = {t.rank: t.issued for t in found}
    low, high = min(issued.values()), max(issued.values())
    if low != high:
        behind = [r for r, n in issued.items() if n == low]
        ahead = [r for r, n in issued.items() if n != low]
        verb = "is" if len(behind) == 1 else "are"
        return (f"{_ranks(behind)} {verb} behind: issued collectives up to #{low}, {_ranks(ahead)} up to #{high}; "
                f"{_ranks(behind)} never reached collective #{low + 1} (hung, or still working outside "
                "collectives, or its data took a path that issues fewer collectives)")
    stuck = [t for t in found if t.stuck is not None]
    if stuck and any(not t.stuck.same_as(stuck[0].stuck) or t.stuck.seq != stuck[0].stuck.seq for t in stuck):
        per_rank = "; ".join(f"rank {t.rank} {t.stuck.text()}" for t in stuck)
        return f"the ranks are stuck in different collectives (they issued them in a different order): {per_rank}"
    return None


def report(prefix: str, *, since: float = 0.0) -> tuple[list[str], float | None]:
    """The summary's lines for the dumps under `prefix` (empty when there are none), and the timeout the
    stuck collectives had (None when no dump says)."""
    calls, problems = read(prefix, since=since)
    found = traces(calls)
    lines = []
    if found:
        lines.append(f"  NCCL flight recorder ({len(found)} rank(s) dumped, kept in {os.path.dirname(prefix)}; "
                     "torch's analyser: python -m torch.distributed.flight_recorder.fr_trace "
                     f"{os.path.dirname(prefix)} --prefix {os.path.basename(prefix)}):")
    for t in found:
        done = t.completed.text() if t.completed else "none recorded"
        stuck = f"stuck in {t.stuck.text()}" if t.stuck else f"nothing pending (issued up to #{t.issued})"
        lines.append(f"    rank {t.rank}: last completed {done}; {stuck}")
    said = verdict(found)
    if said:
        lines.append(f"  {said}")
    lines += [f"  {p}" for p in problems]
    timeouts = [t.stuck.timeout_s for t in found if t.stuck and t.stuck.timeout_s]
    return lines, (timeouts[0] if timeouts else None)
