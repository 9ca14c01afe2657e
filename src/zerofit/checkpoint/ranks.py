"""The few collectives a save or load needs, so that every rank reaches the same verdict.

[Note: agreeing on failure]
A rank that raised while its peers walk into the next collective would hang them. So every phase of
a save or load ends in `agree`: each rank contributes its error text (or None) and all ranks raise the
same `CheckpointError`, naming each failing rank, or all go on. The exchanges themselves are
`zerofit.distributed.collectives.Peers`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zerofit.distributed.collectives import Peers
from zerofit.errors import CheckpointError


class Ranks(Peers):
    """The engine's process group, seen from the checkpoint code: labels start with `checkpoint:`."""

    def __init__(self, group: dist.ProcessGroup | None, *, local: bool = False):
        """`local`: this process alone, even inside a process group (offline tools)."""
        super().__init__(group, local=local, prefix="checkpoint:")

    def all_gather(self, obj: Any) -> list[Any]:
        return self.all_gather_object(obj)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        return self.broadcast_object(obj, label="broadcast")

    def agree(self, error: str | None) -> None:
        """Raise the same CheckpointError on every rank if any rank reports an error."""
        self.raise_any(self.all_gather(error))

    @staticmethod
    def raise_any(errors: list[str | None]) -> None:
        """`agree` for error texts already gathered (each rank's, in rank order): the same verdict everywhere."""
        found = [e for e in errors if e]
        if found:
            raise CheckpointError("\n".join(dict.fromkeys(found)))

    def dst0(self) -> int:
        """Rank 0 of the group as a global rank (what `dist.gather` takes)."""
        return self.src0()
