"""Replicas start equal: every rank takes rank 0's initial weights and buffers, as DDP does.

[Note: equal replicas at the start]
Each rank builds its own copy of the model. With an unseeded (or per-rank seeded) initialisation the
copies differ, and nothing later makes them equal again: stage-0 replicas would train apart, a sharded
master would mix the ranks' values, BatchNorm statistics would drift. So when the engine lays a unit
out (after materialising it, if it was built on the meta device), the ranks compare a fingerprint of
the unit's tensors - sums that a different value or order would change - with one small all-reduce,
and only where some rank differs is rank 0's copy broadcast. Pretrained weights, loaded alike on every
rank, cost the fingerprint alone. Persistent buffers are checked the same way, all at once.
"""

from __future__ import annotations

import torch

from zerofit.engine.comm import Collectives


def _fingerprint(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[sum, sum of every 7th element] of all `tensors`, accumulated in float64 where each tensor lives (no
    copy, no upload), on `device`. A changed value moves the first, a reordering the second."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for t in tensors:
        flat = t.detach().reshape(-1)
        total += torch.stack([flat.sum(dtype=torch.float64), flat[::7].sum(dtype=torch.float64)]).to(device)
    return total


def agree(tensors: list[torch.Tensor], comm: Collectives, label: str) -> bool:
    """Make `tensors` rank 0's on every rank if any rank's differ; True when they did (a collective: every
    rank calls it with the same tensors)."""
    if comm.world == 1 or not tensors:
        return False
    mine = _fingerprint(tensors, comm.device)
    both = comm.max_now(torch.cat([mine, -mine]), f"fingerprint:{label}")
    if torch.equal(both[:2], -both[2:]):  # every rank's fingerprint is the largest and the smallest
        return False
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in group]).to(comm.device)
            comm.broadcast_now(flat, f"replica:{label}")
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
    return True
