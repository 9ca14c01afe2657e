"""The fused kernels ([Note: fused kernels]) against the torch ops they replace, bit for bit.

On a CUDA device with Triton (the device machine) the compiled kernels run in this process. On a machine without
CUDA, where Triton is installed (`./run.sh` installs it beside the CPU torch), one test runs this file again in a
fresh process under Triton's interpreter (`TRITON_INTERPRET=1` must be set before anything imports Triton, and
torch imports it in some other tests), which runs the same kernels on the CPU. Skipped where Triton is not
installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from zerofit.engine import fused_kernels
from zerofit.engine.state_codec import _MAPS, BLOCK, Codec

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
"""The kernels run in this process (compiled, or interpreted when this process was started for it)."""
here = pytest.mark.skipif(not HERE, reason="no CUDA: test_the_kernels_in_the_interpreter runs these")


def test_the_kernels_in_the_interpreter():
    if HERE:
        pytest.skip("the kernels run in this process")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "8 passed, 2 skipped" in proc.stdout, proc.stdout[-2000:]


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _cases(signed: bool) -> dict[str, torch.Tensor]:
    """Inputs that probe every branch: scales across the fp32 range (subnormal absmaxes included), zero blocks,
    a partial last block, values exactly on the midpoints and on the absmax, signed zeros."""
    g = torch.Generator().manual_seed(0)
    # Triton's interpreter runs each block in Python, its time in proportion to the length: 4096 values (256
    # blocks) on CPU still hold every case below (whole zero blocks, the spread of scales); CUDA runs 65536.
    n = 1 << 16 if DEVICE.type == "cuda" else 1 << 12
    base = torch.randn(n, generator=g)
    out = {f"randn*{s:g}": base * s for s in (1.0, 1e-3, 1e-20, 1e-30, 1e-39, 1e-44)}
    out["odd length"] = torch.randn(1000003 if DEVICE.type == "cuda" else 4099, generator=g) * 1e-4
    zeros = base.clone()
    zeros[:BLOCK * 7] = 0.0  # whole zero blocks
    zeros[BLOCK * 9:BLOCK * 10] = -0.0
    out["zero blocks"] = zeros
    _, mids = _MAPS.get(signed, torch.device("cpu"))
    picks = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 2.0))])  # on each midpoint, just above
    rows = -(-picks.numel() // (BLOCK - 1))
    on_mids = torch.ones(rows, BLOCK)  # absmax 1: each value divided by it is itself, a midpoint exactly
    on_mids[:, 1:] = picks.repeat(2)[:rows * (BLOCK - 1)].view(rows, BLOCK - 1)
    out["on the midpoints"] = on_mids.view(-1)
    out["spread"] = base * torch.logspace(-30, 10, n)
    if not signed:
        out = {k: v.abs() for k, v in out.items()}
    return out


@here
@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_the_kernels_store_and_widen_exactly_as_the_torch_ops(key, monkeypatch):
    codec = Codec("8bit")
    for name, x in _cases(key == "exp_avg").items():
        x = x.to(DEVICE)
        fused, plain = codec.empty(x.numel(), DEVICE), codec.empty(x.numel(), DEVICE)
        codec.encode(x.clone(), fused, key)
        with monkeypatch.context() as m:
            m.setattr(fused_kernels, "ENABLED", False)
            codec.encode(x.clone(), plain, key)
        assert torch.equal(fused.codes, plain.codes), f"{key} {name}: codes differ"
        assert torch.equal(fused.scale.view(torch.int32), plain.scale.view(torch.int32)), f"{key} {name}: absmax"
        wide_fused, wide_plain = torch.empty_like(x), torch.empty_like(x)
        codec.decode(plain, wide_fused, key)
        with monkeypatch.context() as m:
            m.setattr(fused_kernels, "ENABLED", False)
            codec.decode(plain, wide_plain, key)
        assert torch.equal(wide_fused.view(torch.int32), wide_plain.view(torch.int32)), f"{key} {name}: widened"


@here
def test_the_kernels_run_on_slices_of_a_larger_buffer_and_leave_the_rest():
    """A chunk of a slot's buffers: offsets into the flat state, the elements around it untouched."""
    codec = Codec("8bit")
    x = torch.randn(BLOCK * 100, device=DEVICE)
    stored = codec.empty(x.numel(), DEVICE)
    stored.codes.fill_(7)
    stored.scale.fill_(3.0)
    part = stored.slice(BLOCK * 10, BLOCK * 20 + 5)
    codec.encode(x[BLOCK * 10:BLOCK * 30 + 5], part, "exp_avg")
    assert (stored.codes[:BLOCK * 10] == 7).all() and (stored.codes[BLOCK * 30 + 5:] == 7).all()
    assert (stored.scale[:10] == 3.0).all() and (stored.scale[31:] == 3.0).all()
    whole = torch.full_like(x, -1.0)
    codec.decode(part, whole[BLOCK * 10:BLOCK * 30 + 5], "exp_avg")
    assert (whole[:BLOCK * 10] == -1.0).all() and (whole[BLOCK * 30 + 5:] == -1.0).all()
    err = (whole[BLOCK * 10:BLOCK * 30 + 5] - x[BLOCK * 10:BLOCK * 30 + 5]).abs().max()
    assert err <= 0.05 * x.abs().max()


@here
def test_a_host_absmax_or_strided_input_takes_the_torch_ops():
    codec = Codec("8bit")
    x = torch.randn(BLOCK * 8, device=DEVICE)
    _, mids = _MAPS.get(True, DEVICE)
    stored = codec.empty(x.numel(), DEVICE)
    assert fused_kernels.usable(x, stored.codes, stored.scale, mids)
    assert not fused_kernels.usable(x[::2], stored.codes[:x.numel() // 2], stored.scale, mids)
    if DEVICE.type == "cuda":
        assert not fused_kernels.usable(x, stored.codes, stored.scale.cpu(), mids)


def _masters(n: int) -> torch.Tensor:
    """fp32 masters whose bits probe the split: ties (low half 0x8000, odd and even high halves), infinities,
    NaNs, values that round up to infinity, zeros of both signs, subnormals, random bits."""
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0x3F808000, 0x3F818000, 0x7F800000, -0x00800000, 0x7FC00000, 0x7F7FFFFF, 0x7F7F8000,
                            0, -2**31, 1, 0x00008000, 0x3F800000, -0x40800000], dtype=torch.int32)
    k = min(n, special.numel())
    bits[:k] = special[:k]
    return bits.view(torch.float32)


@here
@pytest.mark.parametrize("n", [8 * 4096, 8 * 1000 + 5, 3])
def test_split_and_join_match_the_torch_ops_bit_for_bit(n, monkeypatch):
    from zerofit.engine.offload import master_split

    master = _masters(n).to(DEVICE)
    param = master.to(torch.bfloat16)
    scratch = torch.empty(master_split.scratch_bytes(n), dtype=torch.uint8, device=DEVICE)
    fused = torch.full((master_split.packed_bytes(n),), 0xAB, dtype=torch.uint8, device=DEVICE)
    plain = fused.clone()
    master_split.split(master, param, fused, scratch)
    with monkeypatch.context() as m:
        m.setattr(fused_kernels, "ENABLED", False)
        master_split.split(master, param, plain, scratch)
    assert torch.equal(fused, plain)
    back_fused = torch.empty_like(master)
    back_plain = torch.empty_like(master)
    master_split.join(plain, param, back_fused, scratch)
    with monkeypatch.context() as m:
        m.setattr(fused_kernels, "ENABLED", False)
        master_split.join(plain, param, back_plain, scratch)
    assert torch.equal(back_fused.view(torch.int32), back_plain.view(torch.int32))
    nan = torch.isnan(master)
    assert torch.equal(back_fused.view(torch.int32)[~nan], master.view(torch.int32)[~nan])  # every bit back
    # a parameter that is not the master's rounding (a join of other bits): still what the torch ops make
    other = (param.view(torch.int16) ^ 0x1).view(torch.bfloat16)
    master_split.join(plain, other, back_fused, scratch)
    with monkeypatch.context() as m:
        m.setattr(fused_kernels, "ENABLED", False)
        master_split.join(plain, other, back_plain, scratch)
    assert torch.equal(back_fused.view(torch.int32), back_plain.view(torch.int32))


def _fused_and_plain(rank: int, world: int, cases: list) -> list[tuple[dict, dict]]:
    """Each case trained with the fused kernels and again with the torch ops: (masters, losses) of both."""
    from engine_cases import run_engine

    out = []
    for case in cases:
        runs = []
        for enabled in (True, False):
            fused_kernels.ENABLED = enabled
            try:
                r = run_engine(rank, world, case, record_grads=False, device=DEVICE.type)
            finally:
                fused_kernels.ENABLED = True
            runs.append((r["params"], r["losses"], r["streamed"]))
        out.append(tuple(runs))
    return out


@here
def test_the_engine_steps_the_same_bits_through_the_kernels():
    """GPU-stepped offload with 8-bit state and the split master (the CPU standing in for the GPU under the
    interpreter; CUDA on the device), part of the state kept on the device: the kernels in the stream give every
    master and loss the torch ops give."""
    from engine_cases import Case

    from zerofit.testing.distributed import run_distributed

    cases = [Case(stage=2, precision="bf16", offload="cpu", step_on="device", state="8bit", clip=0.05, steps=3,
                  ratio=0.5, chunk=64),
             Case(stage=3, precision="bf16", offload="cpu", offload_param="cpu", step_on="device", state="8bit",
                  steps=3, chunk=64)]
    for case, (fused, plain) in zip(cases, run_distributed(_fused_and_plain, 2, cases, timeout=900)[0]):
        assert fused[2] > 0, f"{case}: nothing was GPU-stepped"
        assert fused[1] == plain[1], f"{case}: losses differ"
        assert fused[0].keys() == plain[0].keys()
        for name in fused[0]:
            assert torch.equal(fused[0][name].view(torch.int32), plain[0][name].view(torch.int32)), f"{case}: {name}"


def _warmed_then_trained(rank: int, world: int, cases: list) -> tuple[int, int]:
    """Kernels compiled in this fresh process after `warm`, and after training `cases` on the GPU."""
    from engine_cases import run_engine

    from zerofit.engine.offload.warm_kernels import warm

    warm(DEVICE, Codec("8bit"), True)
    warmed = fused_kernels.compiled()
    for case in cases:
        run_engine(rank, world, case, record_grads=False, device="cuda")
    return warmed, fused_kernels.compiled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles kernels only for a CUDA device")
def test_the_warm_up_compiles_every_specialization_the_stream_launches():
    """[Note: kernel warm-up]: after `warm`, GPU-stepped training with 8-bit state and the split master (chunks of
    every length class, parts kept on the device, parameters offloaded) compiles nothing more."""
    from engine_cases import Case

    from zerofit.testing.distributed import run_distributed

    cases = [Case(stage=2, precision="bf16", offload="cpu", step_on="device", state="8bit", clip=0.05, steps=2,
                  ratio=0.5, chunk=64),
             Case(stage=3, precision="bf16", offload="cpu", offload_param="cpu", step_on="device", state="8bit",
                  steps=2, chunk=64),
             Case(stage=3, persistence=100, precision="bf16", offload="cpu", step_on="device", state="8bit", steps=2)]
    warmed, trained = run_distributed(_warmed_then_trained, 1, cases, timeout=600)[0]
    assert warmed is not None and warmed > 0
    assert trained == warmed
