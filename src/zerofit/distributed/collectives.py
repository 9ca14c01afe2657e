"""The object collectives outside the engine's hot path, each named when it fails.

The front end (`gather_object`, `broadcast_object`, `wait_for_everyone`) and the checkpoint code
exchange small picklable objects between ranks and wait at barriers. `Peers` does each of these
over one process group, inside `failures.named(label)`, so a peer that hangs or dies is reported as
the collective that was waiting (see `zerofit.distributed.failures`). With one process, or no process
group, every call is local. The objects travel between the ranks of one job (the trust domain of
the process group), never from a file.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zerofit.distributed.failures import named


class Peers:
    """The ranks of one process group (None: the default group), seen by code outside the engine."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, local: bool = False, prefix: str = ""):
        """`local`: this process alone, even inside a process group (offline tools); `prefix` starts every label."""
        self.group = group
        self.prefix = prefix
        self.distributed = not local and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def src0(self) -> int:
        """Rank 0 of the group as a global rank (what `broadcast` and `gather` take)."""
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def all_gather_object(self, obj: Any, label: str = "all_gather_object") -> list[Any]:
        """Every rank's `obj`, in rank order."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        with named(self.prefix + label, self.rank):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int | None = None, label: str = "broadcast_object") -> Any:
        """Global rank `src`'s `obj` (default: the group's rank 0) on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        with named(self.prefix + label, self.rank):
            dist.broadcast_object_list(box, src=self.src0() if src is None else src, group=self.group)
        return box[0]

    def barrier(self, label: str = "barrier") -> None:
        if self.world > 1:
            with named(self.prefix + label, self.rank):
                dist.barrier(group=self.group)
