"""The few collectives a save or load needs, so that every rank reaches the same verdict.

[Note: agreeing on failure]
A rank that raised while its peers walk into the next collective would hang them. So every phase of
a save or load ends in `agree`: each rank contributes its error text (or None) and all ranks raise the
same `CheckpointError`, naming each failing rank, or all go on. The objects exchanged here travel
between the ranks of one job (the trust domain of the process group), never from a file.
With one process, or no process group, every call is local.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zerofit.errors import CheckpointError
from zerofit.failures import named


class Ranks:
    """The engine's process group, seen from the checkpoint code."""

    def __init__(self, group: dist.ProcessGroup | None, *, local: bool = False):
        """`local`: this process alone, even inside a process group (offline tools)."""
        self.group = group
        self.distributed = not local and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        with named("checkpoint:all_gather_object", self.rank):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with named("checkpoint:broadcast", self.rank):
            dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def agree(self, error: str | None) -> None:
        """Raise the same CheckpointError on every rank if any rank reports an error."""
        errors = [e for e in self.all_gather(error) if e]
        if errors:
            raise CheckpointError("\n".join(dict.fromkeys(errors)))

    def barrier(self) -> None:
        if self.world > 1:
            with named("checkpoint:barrier", self.rank):
                dist.barrier(group=self.group)

    def dst0(self) -> int:
        """Rank 0 of the group as a global rank (what `dist.gather` takes)."""
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0
