"""8-bit state codec against a plain reference (issue #39): `Codec.encode` / `decode` were rewritten into fewer
kernels (no temporaries, no padded copy on decode) for the GPU-stepped stream's per-chunk cost; the codes and
block scales they store, and the values they widen to, must stay bit for bit what the straightforward
definition gives ([Note: narrow optimizer state] in zerofit.engine.state_codec)."""

from __future__ import annotations

import pytest
import torch

from zerofit.engine.state_codec import BLOCK, UNSIGNED_KEYS, Codec, Stored, blocks, dynamic_map

LENGTHS = (1, 7, 15, 16, 17, 33, 160, 1000, 1024, 1041)
"""Odd lengths (a last partial block) and whole blocks."""


def _reference_encode(x: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales by the definition: per block of 16 (zero-padded) its absmax, each value divided by the
    absmax clamped to the smallest normal float, stored as the index of the nearest midpoint-separated map value."""
    n = x.numel()
    nb = -(-n // BLOCK)
    padded = torch.zeros(nb * BLOCK)
    padded[:n] = x
    rows = padded.view(nb, BLOCK)
    scale = rows.abs().amax(dim=1)
    normed = (rows / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).reshape(-1)[:n]
    values = dynamic_map(key not in UNSIGNED_KEYS)
    mids = (values[1:] + values[:-1]) / 2
    codes = torch.searchsorted(mids, normed, right=False).to(torch.uint8)
    return codes, scale


def _reference_decode(codes: torch.Tensor, scale: torch.Tensor, key: str) -> torch.Tensor:
    values = dynamic_map(key not in UNSIGNED_KEYS)
    n = codes.numel()
    wide = values[codes.long()]
    per_element = scale.repeat_interleave(BLOCK)[:n]
    return wide * per_element


def _data(n: int, kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randn(n, generator=g) * torch.logspace(-8, 2, n)
    if kind == "zero":
        return torch.zeros(n)
    if kind == "denormal":  # below the smallest normal float, some blocks entirely
        return torch.randn(n, generator=g) * 1e-40
    x = torch.randn(n, generator=g)  # mixed: zero blocks, denormal blocks and normal ones
    x[: n // 3] = 0.0
    x[n // 3: 2 * n // 3] *= 1e-41
    return x


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_encode_and_decode_match_the_reference_bit_for_bit(key):
    codec = Codec("8bit")
    g = torch.Generator().manual_seed(3)
    for n in LENGTHS:
        for kind in ("random", "zero", "denormal", "mixed"):
            x = _data(n, kind, g)
            if key in UNSIGNED_KEYS:
                x = x.abs()
            stored = codec.empty(n, "cpu")
            codec.encode(x, stored, key)
            codes, scale = _reference_encode(x, key)
            assert stored.scale.numel() == blocks(n)
            assert torch.equal(stored.scale, scale), (n, kind)
            assert torch.equal(stored.codes, codes), (n, kind)
            out = torch.full((n,), float("nan"))
            codec.decode(Stored(stored.codes, stored.scale), out, key)
            assert torch.equal(out, _reference_decode(codes, scale, key)), (n, kind)
            # decoding into a slice of a larger buffer (a slot's) writes exactly its own elements
            room = torch.full((n + 8,), 7.0)
            codec.decode(Stored(stored.codes, stored.scale), room[4:4 + n], key)
            assert torch.equal(room[4:4 + n], out) and (room[:4] == 7).all() and (room[4 + n:] == 7).all()


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_the_streams_scratch_path_stores_and_widens_the_same_and_leaves_the_indices_there(key):
    """With a slot's int32 scratch and `overwrite` (the GPU-stepped stream's way: [Note: codec scratch]) the codes,
    scales and widened values are the reference's; the scratch holds the indices, `src` its normalised values."""
    codec = Codec("8bit")
    g = torch.Generator().manual_seed(5)
    scratch = torch.full((max(LENGTHS) + 5,), -1, dtype=torch.int32)
    for n in LENGTHS:
        for kind in ("random", "zero", "denormal", "mixed"):
            x = _data(n, kind, g)
            if key in UNSIGNED_KEYS:
                x = x.abs()
            codes, scale = _reference_encode(x, key)
            stored = codec.empty(n, "cpu")
            clobbered = x.clone()
            codec.encode(clobbered, stored, key, scratch=scratch, overwrite=True)
            assert torch.equal(stored.codes, codes) and torch.equal(stored.scale, scale), (n, kind)
            assert torch.equal(scratch[:n], codes.int())
            out = torch.full((n,), float("nan"))
            codec.decode(Stored(stored.codes, stored.scale), out, key, scratch=scratch)
            assert torch.equal(out, _reference_decode(codes, scale, key)), (n, kind)
