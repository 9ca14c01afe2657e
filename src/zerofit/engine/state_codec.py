"""Optimizer state stored in fewer bits: fp32 (as the optimizer made it), bf16, or 8-bit block-wise codes.

[Note: narrow optimizer state]
`precision.optimizer_state` chooses how the per-element optimizer state (Adam's moments, SGD's momentum)
is *stored* between steps; the update itself always runs in fp32 with the script's optimizer class: the
stored state is widened into fp32 buffers, stepped, and narrowed back (`encode` / `decode`). The fp32
master weights are never narrowed.

- `bf16`: each value rounded to the nearest bf16 (2 bytes).
- `8bit`: dynamic quantisation in blocks of `BLOCK` elements: per block the largest magnitude (`absmax`, fp32)
  is kept, and each value divided by it is stored as the index (1 byte) of the nearest entry of a fixed
  256-entry map whose entries are spread over decades (see `dynamic_map`: as in Dettmers et al. 2021, "8-bit
  Optimizers via Block-wise Quantization", with our own construction). State that is never negative (Adam's
  second moment) uses the unsigned map, which spends the sign bit on one more bit of resolution.
  1 + 4 / 16 = 1.25 bytes per element.

Blocks are `BLOCK` = 16 elements, counted from the start of the flat buffer the state lies in. Every
parameter starts at a multiple of 16 of its flat group, and shards and GPU-stepped chunks are cut at
multiples of 16 (see [Note: flat layout] in zerofit.engine.layout), so every block holds the same elements
whatever the stage, world size, state home or chunking - and so does a block counted from the start of the
parameter itself (the unsharded reference). The 8-bit state is therefore the same bit for bit in every
setting, as the fp32 state is. (bitsandbytes and torchao use blocks of 256 counted from the tensor they are
handed: a shard cut elsewhere changes every block of it.) Elements between two parameters (alignment
padding) belong to no parameter; callers zero them before `encode` so they never raise a block's absmax.

[Note: codec scratch]
The GPU-stepped stream encodes and decodes 64 M-element chunks; each call's int32 indices and normalised
values would be 256 MB temporaries from the caching allocator on the step stream - new allocations the first
time a chunk size is seen (step 2 is the first to widen stored state) and, near a full GPU, allocator retries
that wait for the device. So the stream hands the codec one int32 scratch of a chunk's length, allocated when the
step mode is built (one serves every slot: only the step stream uses it, in order), and lets `encode` normalise
the slot's fp32 buffer in place; other callers allocate as before. Same kernels, same values. Where the fused
kernels store and widen (CUDA with Triton: [Note: fused kernels] in zerofit.engine.fused_kernels) there are no
temporaries and the stream keeps no scratch.

Encoding is idempotent: `encode(decode(x)) == x` (the largest element of a block maps to exactly +-1), so
state that travels without being stepped (a parameter with no gradient this window) comes back unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerofit.engine import fused_kernels

BLOCK = 16
"""Elements per 8-bit block (see the note)."""

STATE_DTYPES = ("fp32", "bf16", "8bit")
"""The values of `precision.optimizer_state`."""

_TINY = torch.finfo(torch.float32).tiny
_INF = float("inf")

UNSIGNED_KEYS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf"})
"""Per-element state of torch's optimizers that is never negative (the unsigned map is used for these)."""


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 values (sorted, fp32) an 8-bit code stands for, as a fraction of its block's absmax.

    A magnitude's bits are read as: z leading zeros pick the decade 10**-z, the remaining bits a linear
    step inside (0.1, 1] of that decade - fine steps near the absmax, coarse ones far below it, down to
    10**-6 (signed) or 10**-7 (unsigned). Signed: a sign bit and 7 magnitude bits (127 magnitudes a side,
    zero, and +1 once more so the map has 256 entries); unsigned: 8 magnitude bits (255 and zero).
    """
    bits = 7 if signed else 8
    mags: list[float] = []
    for z in range(bits):
        steps = 1 << (bits - 1 - z)
        scale = 10.0 ** -z
        mags += [scale * (0.1 + 0.9 * (j + 1) / steps) for j in range(steps)]
    values = [0.0] + mags
    if signed:
        values += [-m for m in mags] + [1.0]  # 1 + 127 + 127 + 1: +1 twice keeps the map 256 long
    out = torch.tensor(sorted(values), dtype=torch.float64)
    assert out.numel() == 256
    return out.to(torch.float32)


class _Maps:
    """The maps and their midpoints per device (built once per device)."""

    def __init__(self):
        self._by: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (signed, device)
        found = self._by.get(key)
        if found is None:
            values = dynamic_map(signed)
            mids = (values[1:] + values[:-1]) / 2  # bucketize against these = nearest value
            found = self._by[key] = (values.to(device), mids.to(device))
        return found


_MAPS = _Maps()


@dataclass(frozen=True)
class Codec:
    """How per-element optimizer state is stored: `kind` one of STATE_DTYPES."""

    kind: str = "fp32"

    def __post_init__(self):
        if self.kind not in STATE_DTYPES:
            raise ValueError(f"precision.optimizer_state: {self.kind!r} is not one of {', '.join(STATE_DTYPES)}")

    @property
    def narrow(self) -> bool:
        """The state is stored in fewer bits than the optimizer computes it in."""
        return self.kind != "fp32"

    @property
    def code_dtype(self) -> torch.dtype:
        """The dtype of the stored elements."""
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}[self.kind]

    @property
    def scaled(self) -> bool:
        """Blocks carry an fp32 absmax beside the codes (8-bit)."""
        return self.kind == "8bit"

    def bytes_per_element(self) -> float:
        """Stored bytes per state element (the block's absmax included)."""
        return {"fp32": 4.0, "bf16": 2.0, "8bit": 1.0 + 4.0 / BLOCK}[self.kind]

    def empty(self, n: int, device, *, make=None) -> Stored:
        """Storage for `n` elements (`make(numel, dtype)` allocates, e.g. page-locked; default torch.empty)."""
        make = make or (lambda numel, dtype: torch.empty(numel, dtype=dtype, device=device))
        return Stored(make(n, self.code_dtype), make(blocks(n), torch.float32) if self.scaled else None)

    def encode(self, src: torch.Tensor, dst: Stored, key: str, *, scratch: torch.Tensor | None = None,
               overwrite: bool = False) -> None:
        """Store fp32 `src` (1-D, starting on a block boundary) into `dst` (same length). `scratch`: int32, at least
        `src`'s length, for the codes' indices; `overwrite`: `src` may be divided in place (its values are not
        needed after). With both, nothing is allocated (the GPU-stepped stream: see [Note: codec scratch])."""
        if not self.scaled:
            dst.codes.copy_(src)  # bf16: round to nearest even; fp32: a copy
            return
        _, mids = _MAPS.get(key not in UNSIGNED_KEYS, src.device)
        if fused_kernels.usable(src, dst.codes, dst.scale, mids):  # one kernel ([Note: fused kernels])
            fused_kernels.encode(src, dst.codes, dst.scale, mids, BLOCK)
            return
        # 5 kernels, the fewest torch offers: bucketize writes only int32 or int64 (hence the copy into the
        # uint8 codes), and an all-zero block needs its absmax clamped (kept unclamped in `scale`)
        n = src.numel()
        nb = blocks(n)
        whole = nb * BLOCK == n
        padded = src.view(nb, BLOCK) if whole else _padded(src, nb)
        torch.linalg.vector_norm(padded, _INF, 1, out=dst.scale)  # one pass, no |x| temporary
        # an all-zero block divides by the smallest normal float: its values stay 0 (code of 0)
        divisor = dst.scale.clamp_min(_TINY).unsqueeze(1)
        if overwrite or not whole:  # not whole: `padded` is a copy already
            normed = padded.div_(divisor).view(-1)
        else:
            normed = torch.div(padded, divisor).view(-1)
        normed = normed if whole else normed[:n]
        if scratch is None:
            dst.codes.copy_(torch.bucketize(normed, mids, out_int32=True))
        else:
            dst.codes.copy_(torch.bucketize(normed, mids, out_int32=True, out=scratch[:n]))

    def decode(self, src: Stored, dst: torch.Tensor, key: str, *, scratch: torch.Tensor | None = None) -> None:
        """Widen `src` into fp32 `dst` (1-D, same length); `scratch` as for `encode` (nothing is allocated then)."""
        if not self.scaled:
            dst.copy_(src.codes)
            return
        values, _ = _MAPS.get(key not in UNSIGNED_KEYS, dst.device)
        if fused_kernels.usable(dst, src.codes, src.scale, values):  # one kernel ([Note: fused kernels])
            fused_kernels.decode(src.codes, src.scale, values, dst, BLOCK)
            return
        # the map's values straight into `dst`, then scaled there in place: 3 kernels
        n = dst.numel()
        index = src.codes.int() if scratch is None else scratch[:n].copy_(src.codes)
        torch.index_select(values, 0, index, out=dst)
        scale = src.scale if src.scale.device == dst.device else src.scale.to(dst.device)
        whole = n // BLOCK
        if whole * BLOCK == n:
            dst.view(whole, BLOCK).mul_(scale.unsqueeze(1))
            return
        if whole:
            dst[:whole * BLOCK].view(whole, BLOCK).mul_(scale[:whole].unsqueeze(1))
        dst[whole * BLOCK:].mul_(scale[whole])  # the last, partial block


@dataclass(frozen=True)
class Stored:
    """State of some elements as stored: `codes` (one per element) and, 8-bit, `scale` (one per block)."""

    codes: torch.Tensor
    scale: torch.Tensor | None = None

    def slice(self, lo: int, n: int) -> Stored:
        """Elements [lo, lo + n); `lo` a multiple of `BLOCK` when scaled."""
        if self.scale is None:
            return Stored(self.codes[lo:lo + n])
        assert lo % BLOCK == 0, f"8-bit state sliced at {lo}, not a multiple of {BLOCK}"
        return Stored(self.codes[lo:lo + n], self.scale[lo // BLOCK:lo // BLOCK + blocks(n)])

    def copy_(self, other: Stored, non_blocking: bool = False) -> Stored:
        self.codes.copy_(other.codes, non_blocking=non_blocking)
        if self.scale is not None:
            self.scale.copy_(other.scale, non_blocking=non_blocking)
        return self

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + (self.scale.nbytes if self.scale is not None else 0)


def blocks(n: int) -> int:
    """8-bit blocks covering `n` elements."""
    return -(-n // BLOCK)


def _padded(x: torch.Tensor, nb: int) -> torch.Tensor:
    """`x` as (nb, BLOCK), zero-padded at the end."""
    n = x.numel()
    if nb * BLOCK == n:
        return x.view(nb, BLOCK)
    out = torch.zeros(nb * BLOCK, dtype=x.dtype, device=x.device)
    out[:n] = x
    return out.view(nb, BLOCK)


def round_trip(t: torch.Tensor, codec: Codec, key: str) -> torch.Tensor:
    """`t` (fp32, any shape) stored and widened again, with blocks counted from its first element: what an
    unsharded reference holds for a parameter's state (see the note)."""
    flat = t.detach().reshape(-1).float()
    stored = codec.empty(flat.numel(), flat.device)
    codec.encode(flat, stored, key)
    out = torch.empty_like(flat)
    codec.decode(stored, out, key)
    return out.view_as(t).to(t.dtype)
