"""What a GPU-stepped group streams: runs of optimizer pieces, chunked, with one host home per state.

[Note: runs]
The optimizer steps one tensor per parameter part (a piece: see [Note: flat layout]), each with a
state of its own. Streamed piece by piece, a group of small parameters (biases, norms) would cost a
round of copies, events and a kernel per piece. So `GpuStep` streams a *run* - the consecutive
pieces of one param group, one contiguous range of the shard (alignment gaps between pieces included)
- in chunks of up to `STREAM_CHUNK` elements, and steps the pieces a chunk holds with one call of the
script's optimizer class, one tensor each. Pieces are packed whole into chunks; only a piece longer
than a chunk is cut, into chunks of its own. Per run, every per-element state
(Adam's moments) lives in one host tensor (its *home*) that each piece's state entry views, so a chunk
travels as one copy per state. State made elsewhere - a checkpoint load, in pageable memory - is moved
into a home once, at the run's next step. With NVMe the swapper's slot is the home (it binds every
piece at its shard offset).

A chunk of whole pieces starts at a piece, so every piece in it starts on a 16-element boundary in its
slot buffer, as on the device (pieces start at multiples of 16 of the shard): each is one tensor of
the same length at the same alignment there and here, and the vectorised kernels treat every element
alike. A long piece's chunks are aligned, or not, as the old one-piece chunks were (see [Note: chunk
alignment]).

[Note: chunk size]
Copies reach the link's full bandwidth from a few M elements on, but every chunk costs the issuing thread a
fixed round of Python and kernel launches (~60 aten ops with 8-bit state, ~30 with fp32: benchmarks/issue_cost.py),
and that thread, not the link, was what the next forward waited for: GPT-2 XL's ZeRO-2 offload step with 8-bit
state took 0.527 s in 16 M chunks and 0.261 s in 64 M ones (one H100, same call, before issue #39's cuts). A slot
holds at most the largest run, so a model whose layers are smaller than 64 M elements pays only for its largest
layer (`STREAM_CHUNK` in zerofit.engine.offload.gpu).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.optim import member_of_group

ALIGN = 16
"""Chunk lengths are multiples of this (elements): see the module note."""
VECTOR = 4
"""Elements of 16 bytes (fp32): the vectorised kernels' unit (see [Note: chunk alignment])."""
"""[Note: chunk alignment] torch's multi-tensor kernels take a vectorised path only for a tensor that
starts on a 16-byte boundary and whose length is a multiple of 4 elements, else an element-by-element
one, and the two may round differently (contracted multiply-adds: seen with fused SGD). On the device a
piece is one tensor at its shard offset, a multiple of 16 elements. In a slot, a chunk of whole
pieces starts each of them on a 16-element boundary too, and a piece longer than a chunk is cut into
chunks of its own, multiples of 16 long, whose master and upcast gradient start on a boundary exactly
when the piece would take the vectorised path, and off one otherwise (`ChunkSpan.shift`). So every
element takes the path it takes on the device, and the result stays bit for bit the same."""


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk of a group's shard: `length` elements from `start`, inside run (or piece) `piece`."""

    piece: int
    start: int
    """Offset in the group's shard."""
    length: int
    shift: int = 0
    """Elements past a 16-byte boundary the chunk starts at in its slot (see [Note: chunk alignment])."""


def plan_chunks(runs: list[tuple[int, int]], chunk: int) -> list[list[ChunkSpan]]:
    """The chunks of each run (given as (shard offset, length)), in order: each inside its run, at most
    `chunk` elements, covering the run exactly once."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 element (got {chunk})")
    return [[ChunkSpan(i, offset + lo, min(chunk, length - lo)) for lo in range(0, length, chunk)]
            for i, (offset, length) in enumerate(runs)]


def _shift(piece: Piece, chunk_start: int) -> int:
    """Where a chunk of a piece longer than a chunk starts past a 16-byte boundary: on one exactly when the
    piece, one tensor on the device, takes the vectorised path (see [Note: chunk alignment])."""
    if piece.offset % VECTOR == 0 and piece.length % VECTOR == 0:
        return 0
    return chunk_start % VECTOR or 1


def run_chunks(index: int, pieces: list[Piece], chunk: int) -> list[ChunkSpan]:
    """The chunks of run `index`: pieces of at most `chunk` elements packed whole, in order, into chunks of
    at most `chunk` (gaps between them included); a longer piece in chunks of its own (see the note)."""
    out: list[ChunkSpan] = []
    start = end = None
    for p in pieces:
        if p.length > chunk:
            if start is not None:
                out.append(ChunkSpan(index, start, end - start))
                start = None
            out += [ChunkSpan(index, c.start, c.length, _shift(p, c.start))
                    for c in plan_chunks([(p.offset, p.length)], chunk)[0]]
        elif start is not None and p.offset + p.length - start <= chunk:
            end = p.offset + p.length
        else:
            if start is not None:
                out.append(ChunkSpan(index, start, end - start))
            start, end = p.offset, p.offset + p.length
    if start is not None:
        out.append(ChunkSpan(index, start, end - start))
    return out


def aligned_chunk(chunk: int) -> int:
    """`chunk` rounded down to a multiple of `ALIGN` (at least `ALIGN`)."""
    return max(ALIGN, chunk // ALIGN * ALIGN)


@dataclass(frozen=True)
class Piece:
    """One optimizer piece of a group: its master tensor (the optimizer's key) and where it lies."""

    master: torch.Tensor
    offset: int
    """Shard offset."""
    length: int
    param: int
    """Layout position of the parameter the piece is part of."""


@dataclass(frozen=True)
class Run:
    """Consecutive pieces of one param group: streamed as one range [start, end) of the shard."""

    group: int
    start: int
    end: int
    pieces: tuple[Piece, ...]
    chunks: tuple[ChunkSpan, ...]

    def parts(self, span: ChunkSpan) -> list[tuple[Piece, int, int]]:
        """(piece, first, last + 1) of every piece in chunk `span`, in shard offsets."""
        lo, hi = span.start, span.start + span.length
        return [(p, max(lo, p.offset), min(hi, p.offset + p.length)) for p in self.pieces
                if p.offset < hi and p.offset + p.length > lo]

    def local_parts(self, span: ChunkSpan) -> tuple[tuple[int, Piece, int, int], ...]:
        """(index of the piece in the run, piece, first, last + 1) of every piece in chunk `span`, in offsets
        from the chunk's start: the same every step, so worked out once per chunk."""
        return self._local_parts[span.start]

    @cached_property
    def _local_parts(self) -> dict[int, tuple[tuple[int, Piece, int, int], ...]]:
        index = {id(p): i for i, p in enumerate(self.pieces)}
        return {span.start: tuple((index[id(p)], p, a - span.start, b - span.start) for p, a, b in self.parts(span))
                for span in self.chunks}


def plan_runs(g: FlatGroup, optimizer: torch.optim.Optimizer, chunk: int) -> list[Run]:
    """`g`'s runs, each with its chunks (`chunk` elements at most, a multiple of `ALIGN`)."""
    by_ptr = {t.data_ptr(): (i, t) for i, pg in enumerate(optimizer.param_groups) for t in pg["params"]}
    grouped: list[tuple[int, list[Piece]]] = []
    for p in g.layout.pieces(g.placement.rank):
        index, master = by_ptr[g.master[p.shard_offset:].data_ptr()]
        piece = Piece(master, p.shard_offset, p.length, p.index)
        if grouped and grouped[-1][0] == index:
            grouped[-1][1].append(piece)
        else:
            grouped.append((index, [piece]))
    return [Run(index, pieces[0].offset, pieces[-1].offset + pieces[-1].length, tuple(pieces),
                tuple(run_chunks(i, pieces, chunk))) for i, (index, pieces) in enumerate(grouped)]


def is_streamed(value, numel: int) -> bool:
    """A per-element state tensor (streamed with the master), as opposed to scalar state."""
    return isinstance(value, torch.Tensor) and value.ndim == 1 and value.numel() == numel


def state_keys(run: Run, state: dict) -> dict[str, torch.dtype]:
    """The per-element state keys some piece of `run` has, with their dtypes."""
    keys: dict[str, torch.dtype] = {}
    for p in run.pieces:
        for k, v in state.get(p.master, {}).items():
            if is_streamed(v, p.length):
                keys.setdefault(k, v.dtype)
    return keys


def home_of(run: Run, state: dict, key: str, *, pinned) -> torch.Tensor | None:
    """The one host tensor over [run.start, run.end) every piece's `key` state views, if they all view one
    (`pinned(t)`: whether `t` is page-locked enough for the device's copies); else None."""
    views = [(p, state[p.master][key]) for p in run.pieces if key in state.get(p.master, {})]
    first_piece, first = views[0]
    origin = first.storage_offset() - (first_piece.offset - run.start)
    storage = first.untyped_storage()
    for p, v in views:
        if (v.untyped_storage().data_ptr() != storage.data_ptr() or v.dtype != first.dtype
                or v.storage_offset() - (p.offset - run.start) != origin):
            return None
    length = run.end - run.start
    if origin < 0 or (origin + length) * first.element_size() > storage.nbytes() or not pinned(first):
        return None
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, origin, (length,), (1,))


def bind(run: Run, state: dict, key: str, home: torch.Tensor, pieces) -> None:
    """Make `pieces`' `key` state views of `home` (their values are written there by the caller)."""
    for p in pieces:
        state.setdefault(p.master, {})[key] = home[p.offset - run.start:p.offset - run.start + p.length]


def rehome(run: Run, state: dict, key: str, home: torch.Tensor) -> None:
    """Copy every piece's `key` state into `home` and make it a view there."""
    have = [p for p in run.pieces if key in state.get(p.master, {})]
    for p in have:
        home[p.offset - run.start:p.offset - run.start + p.length].copy_(state[p.master][key])
    bind(run, state, key, home, have)


def probe_state_keys(optimizer: torch.optim.Optimizer, index: int) -> dict[str, torch.dtype]:
    """The per-element state (key -> dtype) the optimizer of param group `index` creates for an fp32 tensor, found
    by stepping one of its class, with the group's settings, on a 16-element tensor on the CPU; {} when that
    cannot run (the keys are then found at the first step)."""
    settings = {k: v for k, v in optimizer.param_groups[index].items() if k != "params"}
    cls = type(member_of_group(optimizer, index))
    for extra in ({}, {"fused": None, "foreach": False}):
        p = torch.zeros(16)
        p.grad = torch.zeros(16)
        try:
            probe = cls([{**settings, **{k: v for k, v in extra.items() if k in settings}, "params": [p]}],
                        lr=settings.get("lr", 1e-3))
            probe.step()
        except Exception:  # noqa: BLE001 - any failure: fall back to finding the keys at the first step
            continue
        return {k: v.dtype for k, v in probe.state[p].items() if is_streamed(v, 16)}
    return {}
