"""The fp32 master as the bf16 parameter plus what rounding dropped: 17 bits instead of 32 on the link.

[Note: split master]
With bf16 compute the parameter shard on the device is always the fp32 master rounded to nearest even
(the step writes it so). Of the master's 32 bits, that parameter already holds the high 16 up to one
carry: rounding either kept them (`high = param`) or added one to them (`high = param - 1`). So the
master is exactly

    bits(master) = (bits(param) - carry) << 16  |  low16

and GPU-stepped offload need not move the whole master between host and device: it keeps `low16` and
`carry` in host memory (2 bytes and 1 bit per element) and rebuilds the master on the device from the
parameter it holds there. Every element round-trips bit for bit, the infinities and the values that
round to them included; a NaN master comes back as a NaN (its payload may differ). The carry cannot be
read off `low16`: at an exact tie (`low16 == 0x8000`) rounding to even carried for an odd high half and
not for an even one, and both give an even parameter, so one bit per element is kept for it.

Per chunk of n elements the packed form is `packed_bytes(n)` bytes: the n low halves (int16), then the n
carries, eight to a byte, lowest element in the lowest bit. Between steps the host keeps it in a home of its
own and the fp32 host master holds no memory (see [Note: packed master at rest] in
zerofit.engine.offload.packed_master).
"""

from __future__ import annotations

import torch

from zerofit.engine import fused_kernels

_BITS = 8
LINK_BYTES = 2 + 1 / _BITS
"""Bytes per element of the packed form (low half and carry): what a split master moves each way."""


def packed_bytes(n: int) -> int:
    """Bytes of the packed form of `n` elements: low halves, then carries."""
    return 2 * n + (n + _BITS - 1) // _BITS


def scratch_bytes(n: int) -> int:
    """Bytes of the carries' scratch `split` and `join` need for up to `n` elements."""
    return _round_up(n)


def eligible(compute_dtype: torch.dtype, master: torch.Tensor | None, param: torch.Tensor) -> bool:
    """The master can travel split: bf16 compute with a separate fp32 master."""
    return compute_dtype == torch.bfloat16 and master is not None and master is not param \
        and master.dtype == torch.float32 and param.dtype == torch.bfloat16


def _halves(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) 16-bit halves of each fp32 element, as strided int16 views (little-endian)."""
    words = master.view(torch.int16)
    if torch.tensor([1], dtype=torch.int16).view(torch.uint8)[0] != 1:  # pragma: no cover - big-endian host
        return words[1::2], words[0::2]
    return words[0::2], words[1::2]


def split(master: torch.Tensor, param: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """Write the packed form of `master` (fp32, n) whose rounding is `param` (bf16, n) into `out` (uint8,
    `packed_bytes(n)`); `scratch`: uint8, at least `scratch_bytes(n)` (same device), or None (allocated when the
    torch ops need it; the fused kernels need none)."""
    n = master.numel()
    split_parts(master, param, out[:2 * n], out[2 * n:], scratch)


def split_parts(master: torch.Tensor, param: torch.Tensor, low_out: torch.Tensor, carries_out: torch.Tensor,
                scratch: torch.Tensor) -> None:
    """`split` into two places: the low halves (uint8, 2n) and the carries (uint8, ceil(n / 8))."""
    if fused_kernels.usable(master, param, low_out, carries_out):  # one kernel ([Note: fused kernels])
        fused_kernels.split(master, param, low_out, carries_out)
        return
    n = master.numel()
    scratch = _scratch(scratch, n, master.device)
    low, high = _halves(master)
    low_out.view(torch.int16).copy_(low)
    carry = scratch[:_round_up(n)]
    torch.ne(high, param.view(torch.int16), out=carry[:n].view(torch.bool))
    carry[n:].zero_()
    bits = carry.view(-1, _BITS)
    carries_out.copy_(bits[:, 0])
    for j in range(1, _BITS):
        carries_out.bitwise_or_(bits[:, j].bitwise_left_shift(j))


def join(packed: torch.Tensor, param: torch.Tensor, master: torch.Tensor, scratch: torch.Tensor) -> None:
    """Rebuild `master` (fp32, n) from its packed form `packed` (uint8, `packed_bytes(n)`) and its rounding
    `param` (bf16, n); `scratch` as for `split`. `master` must not overlap `packed`."""
    n = master.numel()
    join_parts(packed[:2 * n], packed[2 * n:], param, master, scratch)


def join_parts(low_in: torch.Tensor, carries_in: torch.Tensor, param: torch.Tensor, master: torch.Tensor,
               scratch: torch.Tensor) -> None:
    """`join` from two places: the low halves (uint8, 2n) and the carries (uint8, ceil(n / 8))."""
    if fused_kernels.usable(master, param, low_in, carries_in):  # one kernel ([Note: fused kernels])
        fused_kernels.join(low_in, carries_in, param, master)
        return
    n = master.numel()
    scratch = _scratch(scratch, n, master.device)
    low, high = _halves(master)
    low.copy_(low_in.view(torch.int16))
    carry = scratch[:_round_up(n)].view(-1, _BITS)
    for j in range(_BITS):
        torch.bitwise_and(carries_in.bitwise_right_shift(j), 1, out=carry[:, j])
    torch.sub(param.view(torch.int16), carry.view(-1)[:n], out=high)


def _scratch(given: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """The carries' scratch for `n` elements: `given`, or a new one (a caller on the fused kernels' path keeps none)."""
    return given if given is not None else torch.empty(_round_up(n), dtype=torch.uint8, device=device)


def _round_up(n: int) -> int:
    return (n + _BITS - 1) // _BITS * _BITS
