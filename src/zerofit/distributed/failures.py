"""A collective that fails names itself: which collective, on which rank, and what to change.

torch reports a peer that hangs as gloo's "Timed out waiting 10000ms for recv operation" (or NCCL's
watchdog timeout), and a peer that died as "Connection closed by peer": neither says which of the
engine's collectives was waiting, nor which setting bounds the wait. `named(label, rank)` wraps the
issue and the wait of a collective (the engine's, the script-facing ones in `zerofit.frontend.ops`, the
checkpoint's and `wait_for_everyone`) and turns torch's error into a `CollectiveError` that does (the
original stays chained as its cause). The rank that raises exits, and the launcher then stops every
other rank of the run.

That needs an error raised in the call, which gloo gives (a collective waits on the CPU). Under NCCL
the engine only queues its collectives; one that never completes is ended by torch's NCCL watchdog
after the process-group timeout, which aborts the process (SIGABRT): the launcher's summary names it
([Note: failures under NCCL] in zerofit.cli.flight_recorder). An out-of-memory error raised while a
collective is issued (an offloaded shard's upload) is not a communication failure and passes through
unchanged, so the out-of-memory back-off (zerofit.frontend.planning.backoff) sees it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from zerofit.distributed import arrival, process_group
from zerofit.errors import CollectiveError

TIMEOUT_KEY = "launch.process_group_timeout"
PEER_LEFT = "because another rank left the run"
"""Words of every error raised because a peer had already failed: the launcher's summary reads them so as to
name the rank whose error is its own first (zerofit.cli.failure_report.first_failure)."""
TIMEOUT_FLAG = "--process_group_timeout"


def describe(label: str, rank: int, error: BaseException) -> str:
    """The message of the CollectiveError that replaces torch's `error` for collective `label`."""
    text = str(error)
    apart = arrival.known_apart()
    if apart is not None:  # this rank found the others at another call: that is why its collective failed
        return f"rank {rank}: collective {label} failed: {apart} [{_first_line(text)}]"
    seconds = process_group.current_timeout_s()
    limit = f"{seconds:g} s" if seconds is not None else "its timeout"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return (f"rank {rank}: collective {label} did not complete within {limit} ({TIMEOUT_KEY}): another rank "
                f"is hung or is running a different collective (ranks that run different numbers of steps, "
                f"e.g. a DataLoader not passed to prepare() that gives ranks different numbers of batches). "
                f"Check the other ranks' logs (under NCCL a rank stuck this way is aborted by the watchdog, "
                f"SIGABRT, and the launcher's summary says where it was); if the step is only slow, raise "
                f"{TIMEOUT_KEY} ({TIMEOUT_FLAG} SECONDS). [{_first_line(text)}]")
    return (f"rank {rank}: collective {label} failed {PEER_LEFT} (it crashed, was "
            f"killed, or finished early, e.g. it ran out of batches of a DataLoader not passed to prepare()): "
            f"check the other ranks' logs. [{_first_line(text)}]")


@contextlib.contextmanager
def named(label: str, rank: int, *, wait: bool = False) -> Iterator[None]:
    """Run a collective's issue, or with `wait` the wait on an issued one; a communication failure becomes a
    CollectiveError naming `label`. Issues are counted for [Note: a rank that went on training]; waits
    are not, since a rank may leave a handle unread that another rank waits on (the engine reads the
    unused-parameter flags only where a parameter went unused), and the counts must agree across ranks."""
    if not wait:
        arrival.note_collective()
    try:
        yield
    except (CollectiveError, torch.OutOfMemoryError):
        raise  # already named; an OOM is this rank's own (module doc), for the back-off to see
    except RuntimeError as e:  # gloo raises RuntimeError, NCCL DistBackendError (a RuntimeError)
        raise CollectiveError(describe(label, rank, e), label=label, rank=rank) from e


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300]
