"""Where every element of a flat buffer lives: pure functions over sizes, no tensors, no process group.

[Note: flat layout]
A flat buffer holds a list of parameters in a fixed order, each starting at a multiple of `align`
elements (the gaps are zeros no one steps), followed by padding so that it splits into `world` shards
of equal size `shard_numel`, also a multiple of `align`. Rank r owns the flat range
[r * shard_numel, (r + 1) * shard_numel). A parameter may straddle shards; `overlaps(rank)` says which
slice of which parameter lands where in a rank's shard. Parameters are grouped by optimizer param group
(their order in the flat follows the group order), so each rank's shard meets each group in one
contiguous range. The optimizer steps one tensor per piece - the part of one parameter in the shard -
with its group's settings and a state of its own (Adam's `step` included), as torch does per
parameter: so a parameter that gets no gradient in a step can be left out of it alone (see [Note:
parameters without a gradient] in zerofit.engine.unused_params). Because parameters and shards both start
at multiples of `align` (16), a parameter cut by a shard boundary is cut after a multiple of 16 of its
elements: the vectorised optimizer kernels (CPU and CUDA) then treat every element of its pieces as
they treat it in the whole parameter - the same body, the same tail - so every stage and world size
updates it bit for bit as torch updates the unsharded parameter.
"""

from __future__ import annotations

from dataclasses import dataclass


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Overlap:
    """The part of parameter `index` that lies in one rank's shard."""

    index: int
    """Position of the parameter in the layout."""
    param_start: int
    """First element of the parameter (flattened) inside the shard."""
    length: int
    """Number of elements."""
    shard_offset: int
    """Where they start inside the shard."""


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside one rank's shard: what the optimizer steps as one tensor."""

    group: int
    """Optimizer param group of the parameter."""
    shard_offset: int
    length: int
    index: int = 0
    """Position of the parameter in the layout."""


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of parameters in a flat buffer and its split into equal shards."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    groups: tuple[int, ...]
    """Optimizer param group of each parameter (non-decreasing)."""
    world: int
    shard_numel: int

    @property
    def numel(self) -> int:
        """Elements up to the end of the last parameter (the alignment gaps between parameters included)."""
        return self.offsets[-1] + self.numels[-1] if self.numels else 0

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def overlaps(self, rank: int) -> tuple[Overlap, ...]:
        lo, hi = self.shard_range(rank)
        found = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                found.append(Overlap(index=i, param_start=a - off, length=b - a, shard_offset=a - lo))
        return tuple(found)

    def group_ranges(self) -> tuple[tuple[int, int, int], ...]:
        """(group, start, end) in flat coordinates, one entry per group present, in flat order."""
        ranges: list[list[int]] = []
        for g, off, n in zip(self.groups, self.offsets, self.numels):
            if ranges and ranges[-1][0] == g:
                ranges[-1][2] = off + n
            else:
                ranges.append([g, off, off + n])
        return tuple((g, a, b) for g, a, b in ranges)

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """The non-empty intersections of this rank's shard with each parameter, in flat order."""
        return tuple(Piece(group=self.groups[o.index], shard_offset=o.shard_offset, length=o.length, index=o.index)
                     for o in self.overlaps(rank))


def plan_layout(numels: list[int] | tuple[int, ...], world: int, *, groups: list[int] | None = None,
                align: int = 1) -> FlatLayout:
    """Lay `numels` out in order, each from a multiple of `align`, and split into `world` equal shards of
    a multiple of `align`.

    `groups` gives each parameter's optimizer group; it must be non-decreasing (callers order the
    parameters by group first), so every group occupies one contiguous range.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1 (got {world})")
    if align < 1:
        raise ValueError(f"align must be >= 1 (got {align})")
    groups = list(groups) if groups is not None else [0] * len(numels)
    if len(groups) != len(numels):
        raise ValueError(f"{len(groups)} group ids for {len(numels)} parameters")
    if any(b < a for a, b in zip(groups, groups[1:])):
        raise ValueError(f"parameters must be ordered by group (got groups {groups})")
    offsets, total = [], 0
    for n in numels:
        if n < 0:
            raise ValueError(f"negative parameter size {n}")
        total = _ceil_div(total, align) * align
        offsets.append(total)
        total += n
    shard = _ceil_div(max(total, 1), world)
    shard = _ceil_div(shard, align) * align
    return FlatLayout(numels=tuple(numels), offsets=tuple(offsets), groups=tuple(groups), world=world,
                      shard_numel=shard)
