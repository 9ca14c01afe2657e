"""Compiling the fused kernels before the first step needs them.

[Note: kernel warm-up]
Triton compiles a kernel on its first launch for each specialization of its arguments: whether each pointer
is 16-byte aligned and whether each integer is a multiple of 16. The GPU-stepped stream's first launches
come when the first `step()` is issued, so the compiles (tenths of a second each without Triton's disk
cache) landed in the second step, which waits for that stream (a 9 B model's step 2 took ~1.7x the steady
one, the stream idle for ~0.4 s at its start). `warm` launches the 8-bit codec and the split master on
small tensors with every specialization the stream gives them: the codes and fp32 chunks start aligned (chunks
start on multiples of 16 elements, slot buffers on their own), the block scales at a chunk's block offset may
not; the split master's chunk may start off a boundary ([Note: chunk alignment] in
zerofit.engine.offload.gpu_runs) and its carries follow `2n` bytes of low halves; a chunk's length is a
multiple of 16, of 8 only, or neither: 20 specializations at most, seconds with a cold cache, a fraction of one
with Triton's disk cache. `GpuStep` runs it when it is built (at `prepare()`). Run on its issuing thread instead,
during the first forward and backward, it was not done by the first `step()` on an H200 and its compiles (which
hold the GIL) slowed the main thread's first step 2.5x.
"""

from __future__ import annotations

import warnings

import torch

from zerofit.engine import fused_kernels
from zerofit.engine.offload import master_split
from zerofit.engine.state_codec import BLOCK, Codec, Stored, blocks

_LENGTHS = (16 * BLOCK, 16 * BLOCK + 8, 16 * BLOCK + 4)
"""A multiple of 16; of 8 only; neither."""


def warm(device: torch.device, codec: Codec, split: bool) -> None:
    """Compile what the stream will launch on `device`: the codec's kernels when `codec` is 8-bit, the split
    master's when `split` (nothing where the fused kernels do not serve the device). A failure is a warning:
    the step that needs the kernel raises it where it happens."""
    if not fused_kernels.serves(device) or not (codec.scaled or split):
        return
    try:
        with torch.no_grad():
            if codec.scaled:
                _codec(codec, device)
            if split:
                _split(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - compiled again (and raised) where the stream needs it
        warnings.warn(f"zerofit: compiling the fused optimizer-state kernels ahead of the first step failed "
                      f"({type(e).__name__}: {e}); the step compiles them when it needs them", stacklevel=2)


def _codec(codec: Codec, device: torch.device) -> None:
    for n in _LENGTHS:
        values = torch.zeros(n, device=device)
        codes = torch.empty(n, dtype=torch.uint8, device=device)
        scales = torch.empty(blocks(n) + 1, device=device)
        for lo in (0, 1):  # the block scales on a 16-byte boundary, and off one
            stored = Stored(codes, scales[lo:lo + blocks(n)])
            codec.encode(values, stored, "exp_avg")
            codec.decode(stored, values, "exp_avg")


def _split(device: torch.device) -> None:
    for n in _LENGTHS:
        master = torch.zeros(n + 1, device=device)
        param = torch.zeros(n, dtype=torch.bfloat16, device=device)
        packed = torch.empty(master_split.packed_bytes(n), dtype=torch.uint8, device=device)
        for lo in (0, 1):  # the master on a 16-byte boundary, and off one
            master_split.split(master[lo:lo + n], param, packed, None)
            master_split.join(packed, param, master[lo:lo + n], None)
