"""What `zerofit launch` prints when ranks fail or the run is stopped: one short summary, nothing twice.

Each failing worker prints its own traceback as it dies, from the user's first frame, its lines
prefixed `[rankN]:` (zerofit.cli.worker). torchelastic's own summary would
print every recorded traceback again - the first failure twice - so the launcher prints this
instead: which rank failed first and with what error, and how each other rank ended (often a
`CollectiveError` that names the collective it was waiting in when the first rank left).

Stopping the workers, torchrun's agent also logs a line for the signal it got and one per worker it
signals; the launcher's summary (`stopped by SIGINT`, or the failure summary) says that already, so
`torchrun_stop_lines_hidden` leaves those lines out, and a worker stopped by Ctrl-C exits without a
traceback (zerofit.cli.worker). Every other line torchrun logs still shows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

TORCHRUN_STOP_LINES = {
    "torch.distributed.elastic.agent.server.api": "Received %s death signal, shutting down workers",
    "torch.distributed.elastic.multiprocessing.api": "Sending process %s closing signal %s",
}
"""logger -> the message template of the lines torchrun logs while it stops its workers (torch 2.4-2.13)."""


class _WithoutStopLines(logging.Filter):
    def __init__(self, template: str):
        super().__init__()
        self.template = template

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.template


@contextlib.contextmanager
def torchrun_stop_lines_hidden() -> Iterator[None]:
    """While inside, torchrun does not log the lines in TORCHRUN_STOP_LINES (see the module doc)."""
    installed = [(logging.getLogger(name), _WithoutStopLines(template)) for name, template in TORCHRUN_STOP_LINES.items()]
    for logger, hide in installed:
        logger.addFilter(hide)
    try:
        yield
    finally:
        for logger, hide in installed:
            logger.removeFilter(hide)

_MAX_LINE = 400


def _recorded(failure: Any) -> bool:
    """The rank left a Python exception in its error file (zerofit.cli.worker records uncaught ones)."""
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


def summary(name: str, failures: dict[int, Any], first_rank: int) -> str:
    """The lines printed after a failed run of `name` (`failures`: global rank -> torchelastic's ProcessFailure)."""
    first = failures[first_rank]
    lines = [f"zerofit launch: {name} failed: rank {first_rank} first (local rank {first.local_rank}, exit code "
             f"{first.exitcode}): {_error_line(first)}"]
    if _recorded(first):
        lines.append(f"  its traceback is above, its lines prefixed [rank{first_rank}]")
    for rank in sorted(failures):
        if rank != first_rank:
            f = failures[rank]
            lines.append(f"  then rank {rank} (exit code {f.exitcode}): {_error_line(f)}")
    return "\n".join(lines)


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
