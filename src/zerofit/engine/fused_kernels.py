"""CUDA kernels (Triton) for the optimizer step's elementwise plumbing: the 8-bit state codec and the split
master, each one pass where torch's ops take five to twenty, the same values bit for bit.

[Note: fused kernels]
`Codec.encode` in torch ops is five passes over a chunk (the blocks' absmax, the division, the
bucketize into int32, the copy into uint8 codes) and `decode` three (widen the codes, gather the map's
values, scale them). On an H100 that was ~0.37 ms and ~0.15 ms per 16 M elements: for a model whose
whole 8-bit state is stepped on the device every step (a 9 B model's 18 G state elements: ~0.55 s a
step) it was most of the optimizer's time, more than the link's. The split master's `split` and `join`
(zerofit.engine.offload.master_split) were ~20 strided integer kernels per chunk, packing and unpacking
the carries bit plane by bit plane. The kernels here read each element once and write it once:

- `encode`: a program takes `ROWS` blocks of `BLOCK` elements, finds each block's absmax, divides by it
  (IEEE round to nearest, as torch's division) and finds the code by a binary search of the 255
  midpoints (8 probes: the code is the count of midpoints strictly below the value, what
  `torch.bucketize(..., right=False)` returns), then writes the codes and absmaxes.
- `decode`: the map's value for each code times its block's absmax (one IEEE multiplication, as torch's).
- `split`: each element's low 16 bits, and its carry (high half != the bf16 parameter's bits) packed
  eight to a byte, lowest element in the lowest bit; `join`: `(param - carry) << 16 | low`.

Each is the torch path's arithmetic step for step (max of magnitudes, one division, comparisons, one
multiplication, integer bit operations: no sums of floats, no fused multiply-adds), so they agree bit for
bit (tests/test_fused_kernels.py: every code and absmax, zero blocks, subnormal values, values on the
midpoints, partial last blocks; every bit of a split and a join). The torch path stays what the CPU (and a
GPU without Triton) runs. Callers use these only for contiguous tensors of one CUDA device (`usable`);
`TRITON_INTERPRET=1` runs them on the CPU (the tests' check without a GPU).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

ROWS = 64
"""Blocks per program (1024 elements at BLOCK 16)."""

SPLIT_ROWS = 256
"""Bytes of carries per program of `split` and `join` (2048 elements)."""

ENABLED = True
"""False: `Codec` runs its torch ops everywhere (the tests and benchmarks/codec_speed.py compare the two)."""


@functools.cache
def _kernels():
    """The jitted kernels, or None without Triton (imported on first use: a CPU run never needs it)."""
    try:
        from zerofit.engine import fused_kernels_triton as k
    except ImportError:
        return None
    return k.encode_kernel, k.decode_kernel, k.split_kernel, k.join_kernel


def available() -> bool:
    """The kernels would serve a CUDA device here (Triton is installed; not imported: the memory model asks)."""
    return ENABLED and importlib.util.find_spec("triton") is not None


def compiled() -> int | None:
    """The kernels' specializations Triton has compiled in this process, all devices (None: no Triton, or a Triton
    that keeps them elsewhere). Benchmarks record it per step: a count that grows in a steady step means a
    compile inside it ([Note: kernel warm-up] in zerofit.engine.offload.warm_kernels)."""
    kernels = _kernels() if available() else None
    if kernels is None:
        return None
    try:
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())
    except (AttributeError, IndexError):
        return None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def serves(device: torch.device) -> bool:
    """The kernels run for this device's tensors (so the torch ops' scratch buffers need not be kept for it): a
    CUDA device (any device under the interpreter), and Triton imports."""
    return ENABLED and (device.type == "cuda" or _interpreting()) and _kernels() is not None


def usable(*tensors: torch.Tensor) -> bool:
    """The kernels can run on these: contiguous, on one device they serve."""
    first = tensors[0].device
    return all(t.device == first and t.is_contiguous() for t in tensors) and serves(first)


def encode(src: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, mids: torch.Tensor, block: int) -> None:
    """`src` (fp32, n) into `codes` (uint8, n) and `scale` (fp32, ceil(n / block)) against the sorted
    255 `mids`."""
    _launch(0, src, block * ROWS, src, codes, scale, mids, BLOCK=block, ROWS=ROWS, TINY=torch.finfo(torch.float32).tiny)


def decode(codes: torch.Tensor, scale: torch.Tensor, values: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """`codes` (uint8, n) and `scale` (fp32, ceil(n / block)) widened into `out` (fp32, n) by the 256 `values`."""
    _launch(1, out, block * ROWS, codes, scale, values, out, BLOCK=block, ROWS=ROWS)


def split(master: torch.Tensor, param: torch.Tensor, low: torch.Tensor, carries: torch.Tensor) -> None:
    """`master` (fp32, n) whose bf16 rounding is `param` (n) into its low halves `low` (2n bytes) and carries
    `carries` (uint8, ceil(n / 8)): [Note: split master] in zerofit.engine.offload.master_split."""
    _launch(2, master, 8 * SPLIT_ROWS, master.view(torch.int32), param.view(torch.int16), low.view(torch.int16),
            carries, ROWS=SPLIT_ROWS)


def join(low: torch.Tensor, carries: torch.Tensor, param: torch.Tensor, master: torch.Tensor) -> None:
    """The inverse of `split`: `master` (fp32, n) rebuilt from `low`, `carries` and `param`."""
    _launch(3, master, 8 * SPLIT_ROWS, low.view(torch.int16), carries, param.view(torch.int16),
            master.view(torch.int32), ROWS=SPLIT_ROWS)


def _launch(which: int, full: torch.Tensor, per_program: int, *args, **meta) -> None:
    """Kernel `which` of `_kernels()` over the `full.numel()` elements, `per_program` to a program, on `full`'s
    device (Triton launches on that device's current stream)."""
    n = full.numel()
    if n == 0:
        return
    with torch.cuda.device(full.device) if full.is_cuda else contextlib.nullcontext():
        _kernels()[which][(-(-n // per_program),)](*args, n, **meta)
