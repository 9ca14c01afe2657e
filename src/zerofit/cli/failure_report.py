"""What `zerofit launch` prints when ranks fail or the run is stopped: one short summary, nothing twice.

Each failing worker prints its own traceback as it dies, from the user's first frame, its lines
prefixed `[rankN]:` (zerofit.cli.worker_entry). torchelastic's own summary would
print every recorded traceback again - the first failure twice - so the launcher prints this
instead: which rank failed first and with what error, and how each other rank ended (often a
`CollectiveError` that names the collective it was waiting in when the first rank left). "First" is the
rank whose error is its own (`first_failure`), never one that failed because that rank left.

Stopping the workers, torchrun's agent also logs a line for the signal it got and one per worker it
signals, and when a worker fails an `E... failed (exitcode: 1) local_rank: ...` line that came before
the summary; the launcher's summary (`stopped by SIGINT`, or the failure summary) says all of that, so
`torchrun_stop_lines_hidden` leaves those lines out, and a worker stopped by Ctrl-C exits without a
traceback (zerofit.cli.worker_entry). Every other line torchrun logs still shows.

A rank stopped by SIGABRT under NCCL, or one whose error has the NCCL watchdog's words, most likely met
the watchdog's timeout: the summary says so, with what the flight recorder's dumps show ([Note: failures
under NCCL] in zerofit.cli.flight_recorder).
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from zerofit.cli import flight_recorder
from zerofit.distributed.arrival import EXITED
from zerofit.distributed.failures import PEER_LEFT, TIMEOUT_FLAG, TIMEOUT_KEY

TORCHRUN_STOP_LINES = {
    "torch.distributed.elastic.agent.server.api": ("Received %s death signal, shutting down workers",),
    "torch.distributed.elastic.multiprocessing.api": ("Sending process %s closing signal %s", "failed (exitcode: "),
}
"""logger -> how the message templates start of the lines torchrun logs while it stops its workers or
after one failed (torch 2.4-2.13; the failure line's tail differs between a binary and a function)."""


class _WithoutStopLines(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.starts))


@contextlib.contextmanager
def torchrun_stop_lines_hidden() -> Iterator[None]:
    """While inside, torchrun does not log the lines in TORCHRUN_STOP_LINES (see the module doc)."""
    installed = [(logging.getLogger(name), _WithoutStopLines(starts))
                 for name, starts in TORCHRUN_STOP_LINES.items()]
    for logger, hide in installed:
        logger.addFilter(hide)
    try:
        yield
    finally:
        for logger, hide in installed:
            logger.removeFilter(hide)

_MAX_LINE = 400


def _recorded(failure: Any) -> bool:
    """The rank left a Python exception in its error file (zerofit.cli.worker_entry records uncaught ones)."""
    data = getattr(failure, "error_file_data", None) or {}
    return isinstance(data, dict) and isinstance(data.get("message"), dict)


def _error_line(failure: Any) -> str:
    """The exception line of a failed rank (`Type: message`), or how it ended when it left no record."""
    if not _recorded(failure):
        if failure.exitcode < 0:
            return f"stopped by {failure.signal_name()}"
        return (f"exited with code {failure.exitcode} without an exception (the script called sys.exit, or "
                "rejected its arguments): see its output above")
    message = failure.error_file_data["message"]
    text = str(message.get("message") or "")
    if not text:
        lines = [line for line in str(getattr(failure, "message", "") or "").strip().splitlines() if line.strip()]
        text = lines[-1].strip() if lines else ""
    text = " ".join(text.split())
    return text[:_MAX_LINE] + (" ..." if len(text) > _MAX_LINE else "") if text else f"exit code {failure.exitcode}"


PEER_GONE = (PEER_LEFT, EXITED.doing)
"""Words of errors raised because another rank had already ended: a collective whose peer left
(zerofit.distributed.failures), a checked place where another rank "has left the script"
(zerofit.distributed.arrival). A rank's own exit never raises the second: its error is what made it exit."""


def _peer_left(failure: Any) -> bool:
    """The rank's recorded error is a consequence of another rank's end, not an error of its own."""
    text = str(failure.error_file_data["message"].get("message") or "") if _recorded(failure) else ""
    return any(words in text for words in PEER_GONE)


def first_failure(failures: dict[int, Any]) -> int:
    """The rank the summary names first: one whose recorded error is its own, then one that left without a
    record (a signal, sys.exit: nothing says it followed a peer), then one whose collective failed because
    another rank left the run; the earliest within each. torchelastic's own choice (`get_first_failure`)
    goes by the error files' timestamps, whole seconds, so a rank that failed because of its peer's error
    in the same second often came first."""
    def order(rank: int) -> tuple[int, float, int]:
        failure = failures[rank]
        kind = 2 if _peer_left(failure) else 0 if _recorded(failure) else 1
        return kind, getattr(failure, "timestamp", 0), rank
    return min(failures, key=order)


@dataclass(frozen=True)
class NcclRun:
    """What the summary of an NCCL run needs to name a watchdog timeout."""

    timeout_s: float
    """launch.process_group_timeout as the launcher gave it (a script may set its own)."""
    dump_prefix: str | None
    """Where the ranks' flight-recorder dumps go (`<prefix><rank>`), None when nowhere known."""
    since: float = 0.0
    """When the run started (time.time()): an older dump under the prefix is another run's."""


def _watchdog_words(failure: Any) -> bool:
    text = f"{_error_line(failure)} {getattr(failure, 'message', '') or ''}".lower()
    return any(words in text for words in flight_recorder.WATCHDOG_WORDS)


def watchdog_lines(failures: dict[int, Any], nccl: NcclRun | None) -> list[str]:
    """The likely cause of an NCCL watchdog abort and what the dumps show, or nothing when no rank ended so."""
    aborted = nccl is not None and any(f.exitcode == -signal.SIGABRT for f in failures.values())
    if not aborted and not any(_watchdog_words(f) for f in failures.values()):
        return []
    dumps, timeout_s = ([], None) if nccl is None or nccl.dump_prefix is None else \
        flight_recorder.report(nccl.dump_prefix, since=nccl.since)
    timeout_s = timeout_s or (nccl.timeout_s if nccl is not None else None)
    limit = f"{timeout_s:g} s, " if timeout_s else ""
    lines = [f"  likely cause: NCCL's watchdog ended a collective that waited longer than the process-group timeout "
             f"({limit}{TIMEOUT_KEY}, {TIMEOUT_FLAG} SECONDS) and aborted the process (SIGABRT): a rank is hung or "
             "slow outside collectives, or the ranks issued different collectives"]
    if dumps:
        lines += dumps
    else:
        lines.append("  no NCCL flight-recorder dump was found (TORCH_NCCL_DUMP_ON_TIMEOUT and "
                     "TORCH_NCCL_DEBUG_INFO_TEMP_FILE name where the ranks write them)")
    lines.append("  for a first run, TORCH_DISTRIBUTED_DEBUG=DETAIL checks before every collective that all ranks "
                 "issue the same one and names the first that differs (slower); a short "
                 f"{TIMEOUT_FLAG} (e.g. 300) finds a hang sooner")
    return lines


def summary(name: str, failures: dict[int, Any], first_rank: int, nccl: NcclRun | None = None) -> str:
    """The lines printed after a failed run of `name` (`failures`: global rank -> torchelastic's ProcessFailure;
    `nccl`: set for an NCCL run, so a SIGABRT is read as the watchdog's)."""
    first = failures[first_rank]
    lines = [f"zerofit launch: {name} failed: rank {first_rank} first (local rank {first.local_rank}, exit code "
             f"{first.exitcode}): {_error_line(first)}"]
    if _recorded(first):
        lines.append(f"  its traceback is above, its lines prefixed [rank{first_rank}]")
    for rank in sorted(failures):
        if rank != first_rank:
            f = failures[rank]
            lines.append(f"  then rank {rank} (exit code {f.exitcode}): {_error_line(f)}")
    return "\n".join(lines + watchdog_lines(failures, nccl))


def segfault_hint(failures: dict[int, Any], stage: Any) -> str | None:
    """A line for a run at ZeRO-3 (or `stage: auto`, which may choose it) that a rank left by SIGSEGV: between
    uses a stage-3 weight keeps its shape over an empty storage, and reading it (`p.norm()`, an EMA copy, a
    weight printed or merged) makes torch read freed memory ([Note: gathered parameters] in
    zerofit.engine.full_state)."""
    if not any(f.exitcode == -signal.SIGSEGV for f in failures.values()) or str(stage) not in ("3", "auto"):
        return None
    return ("zerofit launch: under ZeRO-3 a SIGSEGV in the script is most often code that reads a weight outside the "
            "model's forward (p.norm(), an EMA or reference copy, printing or merging weights): a sharded weight holds "
            "no data between uses. Run such code inside `with accelerator.gathered_parameters(model):` (every process "
            "enters it), or read the weights from accelerator.get_state_dict(model)")


def engine_argument_hint(target: tuple[str, ...] | list[str]) -> str | None:
    """A line for a failed script given `--deepspeed FILE` or `--fsdp ...`: transformers' TrainingArguments
    hands the run to that engine (and without DeepSpeed installed fails before zerofit's Trainer can say
    so), where under `zerofit launch` the file belongs to the launcher (docs/transformers.md)."""
    args = list(target)
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag == "--deepspeed":
            value = value or (args[i + 1] if i + 1 < len(args) else "ds.json")
            return (f"zerofit launch: the script was given --deepspeed {value}, which hands a transformers Trainer "
                    f"to DeepSpeed: drop it and pass the file to the launcher (zerofit launch --config_file {value} "
                    "...), with `from zerofit.integrations.transformers import Trainer` in the script")
        if flag == "--fsdp":
            return ("zerofit launch: the script was given --fsdp, which hands a transformers Trainer to FSDP: drop "
                    "it; zerofit's ZeRO stage 3 (zero_optimization.stage: 3) shards parameters as FSDP does")
    return None
