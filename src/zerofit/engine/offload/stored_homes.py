"""Where a GPU-stepped run keeps optimizer state stored in fewer bits (see [Note: narrow optimizer state] in
zerofit.engine.state_codec), and how its pieces' state entries view it.

With `precision.optimizer_state` bf16 or 8bit, a run's per-element state key K has one home of codes over
[run.start, run.end) - and, 8-bit, one of per-block absmax values over the run's blocks - and each piece's
`optimizer.state[piece]` holds views of them: K (codes, piece length) and K + `SCALE_SUFFIX` (absmax, one per
block of the piece). Pieces start at multiples of 16 of the run, so a piece's blocks are whole blocks of the
run. The runs themselves are those of [Note: runs] in zerofit.engine.offload.gpu_runs.
"""

from __future__ import annotations

import torch

from zerofit.engine.offload.gpu_runs import Run, home_of, is_streamed
from zerofit.engine.state_codec import BLOCK, Codec, Stored, blocks

SCALE_SUFFIX = ".absmax"
"""The state key of a per-element key's 8-bit block scales."""


def is_scale_key(key: str) -> bool:
    return key.endswith(SCALE_SUFFIX)


def stored_keys(run: Run, state: dict) -> list[str]:
    """The per-element (code) keys some piece of `run` holds."""
    keys: list[str] = []
    for p in run.pieces:
        for k, v in state.get(p.master, {}).items():
            if not is_scale_key(k) and is_streamed(v, p.length) and k not in keys:
                keys.append(k)
    return keys


def stored_home_of(run: Run, state: dict, key: str, codec: Codec, *, pinned) -> Stored | None:
    """The one home of `run`'s `key` every piece views (codes, and scales when 8-bit), else None."""
    codes = home_of(run, state, key, pinned=pinned)
    if codes is None or codes.dtype != codec.code_dtype:
        return None
    if not codec.scaled:
        return Stored(codes)
    skey = key + SCALE_SUFFIX
    views = [(p, state[p.master].get(skey)) for p in run.pieces if key in state.get(p.master, {})]
    if any(v is None or v.dtype != torch.float32 for _, v in views):
        return None
    first_piece, first = views[0]
    origin = first.storage_offset() - (first_piece.offset - run.start) // BLOCK
    storage = first.untyped_storage()
    for p, v in views:
        if (v.untyped_storage().data_ptr() != storage.data_ptr()
                or v.storage_offset() - (p.offset - run.start) // BLOCK != origin):
            return None
    n = blocks(run.end - run.start)
    if origin < 0 or (origin + n) * 4 > storage.nbytes() or not pinned(first):
        return None
    scale = torch.empty(0, dtype=torch.float32, device=first.device).set_(storage, origin, (n,), (1,))
    return Stored(codes, scale)


def bind_stored(run: Run, state: dict, key: str, home: Stored, pieces) -> None:
    """Make `pieces`' `key` state (and its scales) views of `home`."""
    for p in pieces:
        lo = p.offset - run.start
        view = home.slice(lo, p.length)
        entry = state.setdefault(p.master, {})
        entry[key] = view.codes
        if view.scale is not None:
            entry[key + SCALE_SUFFIX] = view.scale


def rehome_stored(run: Run, state: dict, key: str, home: Stored, codec: Codec) -> None:
    """Move every piece's `key` state into `home`: stored entries as they are, fp32 ones (a checkpoint of another
    state dtype) narrowed once."""
    have = [p for p in run.pieces if key in state.get(p.master, {})]
    for p in have:
        entry = state[p.master]
        dst = home.slice(p.offset - run.start, p.length)
        value = entry[key]
        if value.dtype == codec.code_dtype and (not codec.scaled or key + SCALE_SUFFIX in entry):
            dst.copy_(Stored(value, entry.get(key + SCALE_SUFFIX)))
        else:  # another form: widened, then stored the way this run stores state
            wide = value.float() if value.dtype != torch.uint8 else _decoded(entry, key, value)
            codec.encode(wide.to(dst.codes.device), dst, key)
    bind_stored(run, state, key, home, have)


def _decoded(entry: dict, key: str, codes: torch.Tensor) -> torch.Tensor:
    out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    Codec("8bit").decode(Stored(codes, entry[key + SCALE_SUFFIX]), out, key)
    return out


def gap_index(run: Run, start: int, length: int, device: torch.device) -> torch.Tensor | None:
    """Positions in chunk [start, start + length) that belong to no piece (alignment padding), or None: zeroed
    before the chunk's state is encoded, so they never raise a block's absmax. Found from the pieces' bounds, not
    by marking a chunk-long mask: a stream's first step asks this for every chunk (64 M elements each)."""
    end = start + length
    gaps, at = [], start
    for p in sorted(run.pieces, key=lambda p: p.offset):
        if p.offset + p.length <= at or p.offset >= end:
            continue
        if p.offset > at:
            gaps.append(torch.arange(at - start, p.offset - start))
        at = p.offset + p.length
    if at < end:
        gaps.append(torch.arange(at - start, length))
    return torch.cat(gaps).to(device) if gaps else None
