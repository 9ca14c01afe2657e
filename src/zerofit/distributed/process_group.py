"""Joining the run's process group: a bounded wait, and a key space of its own for every restart.

[Note: one store namespace per attempt]
torchrun's launcher process hosts the TCPStore that workers rendezvous through, and it keeps that
store across elastic restarts (`--max_restarts`). The keys a process group writes while it forms
(each rank's gloo address, the init counters) carry no attempt number, so the workers of a restarted
attempt found the dead attempt's keys still there: rank 0 dialled the killed rank's old address
("connectFullMesh ... Connection refused") or waited on counters already past their target (a hung
init). Prefixing the store with the attempt number (`TORCHELASTIC_RESTART_COUNT`) gives every
attempt fresh keys; the launcher's own single-machine rendezvous also starts a new store per attempt
(`zerofit.cli.rendezvous`), so scripts that create the process group themselves are covered there.

`launch.process_group_timeout` bounds joining and every collective, so a peer that hangs makes the
others fail within it: gloo's waiting call raises (see `zerofit.distributed.failures`), NCCL's watchdog aborts
the process (see [Note: failures under NCCL] in zerofit.cli.flight_recorder).
"""

from __future__ import annotations

import atexit
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from zerofit.config.schema import RunConfig


def restart_count() -> int:
    """Which attempt of an elastic run this process belongs to: 0 first, then 1, 2, ... after restarts."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def attempt_prefix() -> str:
    """The key space of this attempt in the launcher's store (see the module note)."""
    return f"zerofit/attempt-{restart_count()}"


def launched() -> bool:
    """True when a launcher announced a world to join (torchrun sets WORLD_SIZE and MASTER_ADDR)."""
    return int(os.environ.get("WORLD_SIZE", "0") or 0) >= 1 and "MASTER_ADDR" in os.environ


_joined_timeout_s: float | None = None
"""The timeout `join` gave the process group (None: zerofit did not create it)."""

_joined_store: dist.Store | None = None
"""The store `join` formed the group through (torchrun's agent store, this attempt's key space), kept for
`zerofit.distributed.arrival`; None when rank 0 hosted the store itself or zerofit did not create the group."""


def timeout_of(config: RunConfig) -> timedelta:
    return timedelta(seconds=float(config.launch.process_group_timeout))


def current_timeout_s() -> float | None:
    """Seconds a collective of the default group waits before it raises, when zerofit set it."""
    return _joined_timeout_s


def joined_store() -> dist.Store | None:
    """This attempt's key space in the agent store that `join` formed the group through, if it did."""
    return _joined_store


def agent_store(timeout: timedelta, world_size: int | None = None) -> dist.Store:
    """A client of the store at MASTER_ADDR:MASTER_PORT (torchrun's agent store, or rank 0's), in this
    attempt's key space (see the module note). `world_size`: count this client among the store's workers.
    Raises what TCPStore raises (RuntimeError, ValueError) where the store cannot be reached."""
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                           is_master=False, timeout=timeout)
    return dist.PrefixStore(attempt_prefix(), client)


def join(config: RunConfig, backend: str, device: torch.device) -> None:
    """Create the default process group from the launcher's environment (see the module note)."""
    global _joined_timeout_s, _joined_store
    timeout = timeout_of(config)
    _joined_timeout_s = timeout.total_seconds()
    _joined_store = None
    device_id = device if device.type == "cuda" else None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        # Not started by torchrun's agent (e.g. MASTER_ADDR set by hand): rank 0 hosts the store itself
        # and there are no earlier attempts whose keys could collide.
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = agent_store(timeout, world)
    _joined_store = store
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=device_id)


_end_registered = False


def destroy_at_exit() -> None:
    """[Note: end of training] Destroy the default process group when the script ends normally.

    Accelerate's `end_training` destroys the group at once. Scripts written for it save after
    `end_training` (Accelerate's and transformers' no_trainer examples: `wait_for_everyone`, then
    `save_pretrained`, which gathers at stage 3), and those would fail on a group that is gone; so the
    group is destroyed at the script's end instead, before the interpreter tears down (which is what the
    destroy is for: NCCL's communicators end cleanly and torch does not warn). A script that destroys or
    replaces the group itself is left to it; an exit by an uncaught error or Ctrl-C destroys nothing, since
    a peer may still be inside a collective with this rank and a destroy could wait on it.
    """
    global _end_registered
    if _end_registered or not dist.is_initialized():
        return
    _end_registered = True
    atexit.register(_destroy_if_unchanged, dist.group.WORLD)


def _destroy_if_unchanged(group: dist.ProcessGroup) -> None:
    failed = getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
    if dist.is_initialized() and dist.group.WORLD is group and not failed:
        dist.destroy_process_group()
