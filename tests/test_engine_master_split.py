"""The split master (`zerofit.engine.offload.master_split`): fp32 = bf16 rounding + low halves + carries, exactly."""

from __future__ import annotations

import pytest
import torch

from zerofit.engine.offload.master_split import eligible, join, packed_bytes, split


def _round_trip(master: torch.Tensor) -> torch.Tensor:
    n = master.numel()
    param = master.to(torch.bfloat16)  # round to nearest even, as the step publishes it
    packed = torch.full((packed_bytes(n),), 0xAB, dtype=torch.uint8)
    scratch = torch.full((n + 8,), 0xCD, dtype=torch.uint8)
    split(master, param, packed, scratch)
    out = torch.full((n,), float("nan"))
    join(packed, param, out, torch.empty_like(scratch))
    return out


@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64, 1000, 4099])
def test_every_bit_pattern_comes_back(n):
    g = torch.Generator().manual_seed(n)
    bits = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    bits[::3] = (bits[::3] & ~0xFFFF) | 0x8000  # exact ties: rounding to even carries for odd high halves only
    master = bits.view(torch.float32)
    finite = torch.isfinite(master)
    master = torch.where(finite, master, torch.zeros_like(master))  # NaNs: see the next test
    assert torch.equal(_round_trip(master).view(torch.int32), master.view(torch.int32))


def test_edge_values_come_back_and_a_nan_stays_a_nan():
    specials = torch.tensor([0x7F7FFFFF, -0x00800001, 0x7F800000, -0x00800000, 0, -2**31, 1, 0x00018000,
                             0x3F808000, 0x3F818000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    # largest finite (rounds up to inf), -largest, +-inf, +-0, the smallest subnormal, ties either way
    assert torch.equal(_round_trip(specials).view(torch.int32), specials.view(torch.int32))
    nan = torch.tensor([float("nan"), -float("nan")])
    assert torch.isnan(_round_trip(nan)).all()


def test_the_packed_form_fits_in_the_masters_own_bytes():
    for n in (1, 8, 9, 2**24):
        assert packed_bytes(n) == 2 * n + (n + 7) // 8 <= 4 * n


def test_only_a_bf16_run_with_a_separate_master_splits():
    master, param = torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)
    assert eligible(torch.bfloat16, master, param)
    assert not eligible(torch.float16, master, torch.zeros(4, dtype=torch.float16))
    assert not eligible(torch.float32, master, master)  # fp32 compute: the parameter is the master
    assert not eligible(torch.bfloat16, None, param)


def test_without_a_scratch_the_torch_ops_make_their_own():
    """A caller on the fused kernels' path keeps no carries' scratch; the torch ops then allocate one."""
    n = 1003
    bits = torch.randint(-2**31, 2**31 - 1, (n,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    master = torch.where(torch.isfinite(m := bits.to(torch.int32).view(torch.float32)), m, torch.zeros_like(m))
    param = master.to(torch.bfloat16)
    given, none = (torch.full((packed_bytes(n),), 0xAB, dtype=torch.uint8) for _ in range(2))
    split(master, param, given, torch.empty(n + 8, dtype=torch.uint8))
    split(master, param, none, None)
    assert torch.equal(given, none)
    out = torch.full((n,), float("nan"))
    join(none, param, out, None)
    assert torch.equal(out.view(torch.int32), master.view(torch.int32))
