"""The Triton source of zerofit.engine.fused_kernels ([Note: fused kernels] there): imported only when a kernel is
first needed, so a run without Triton (the CPU) never imports it."""

import triton
import triton.language as tl


@triton.jit
def encode_kernel(src, codes, scale, mids, n, BLOCK: tl.constexpr, ROWS: tl.constexpr, TINY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    idx = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = idx < n
    x = tl.load(src + idx, mask=inside, other=0.0)
    amax = tl.max(tl.abs(x), axis=1)
    tl.store(scale + row, amax, mask=row * BLOCK < n)
    v = tl.div_rn(x, tl.maximum(amax, TINY)[:, None])
    pos = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
    for k in tl.static_range(8):
        cand = pos + (128 >> k)
        pos = tl.where(tl.load(mids + cand - 1) < v, cand, pos)
    tl.store(codes + idx, pos.to(tl.uint8), mask=inside)


@triton.jit
def decode_kernel(codes, scale, values, out, n, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    idx = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = idx < n
    c = tl.load(codes + idx, mask=inside, other=0).to(tl.int32)
    s = tl.load(scale + row, mask=row * BLOCK < n, other=0.0)
    tl.store(out + idx, tl.load(values + c) * s[:, None], mask=inside)


@triton.jit
def split_kernel(master, param, low, carries, n, ROWS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    bit = tl.arange(0, 8)
    idx = row[:, None] * 8 + bit[None, :]
    inside = idx < n
    m = tl.load(master + idx, mask=inside, other=0).to(tl.uint32, bitcast=True)
    p = tl.load(param + idx, mask=inside, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    tl.store(low + idx, (m & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True), mask=inside)
    carry = ((m >> 16) != p) & inside
    tl.store(carries + row, tl.sum(carry.to(tl.int32) << bit[None, :], axis=1).to(tl.uint8), mask=row * 8 < n)


@triton.jit
def join_kernel(low, carries, param, master, n, ROWS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    bit = tl.arange(0, 8)
    idx = row[:, None] * 8 + bit[None, :]
    inside = idx < n
    lo = tl.load(low + idx, mask=inside, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    byte = tl.load(carries + row, mask=row * 8 < n, other=0).to(tl.uint32)
    carry = (byte[:, None] >> bit[None, :].to(tl.uint32)) & 1
    p = tl.load(param + idx, mask=inside, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    bits = (((p - carry) & 0xFFFF) << 16) | lo
    tl.store(master + idx, bits.to(tl.int32, bitcast=True), mask=inside)
