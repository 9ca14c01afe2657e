"""Optimizer state stored in bf16 or 8 bits (`precision.optimizer_state`) trains as plain PyTorch storing its
state the same way, and every stage and state home holds the same state bit for bit (gloo, CPU).

The reference is one plain-PyTorch process on the whole global batch whose optimizer state is stored and
widened again after every step, blocks counted from each parameter's first element (engine_cases.store_state).
zerofit stores it in flat buffers with blocks counted from the buffer's start; parameters start at multiples of
the block there, so the blocks are the same elements. The only difference from the reference is then the order
in which the ranks' gradients are summed (fp32 rounding: TOL). Between zerofit's own settings - stages 0-3, on
the device, GPU-stepped (the CPU standing in for the GPU, 64-element chunks), host-stepped by the CPU optimizer
(also during backward), parameter offload, part of the state offloaded, NVMe files read by either - nothing
differs: bit for bit.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from engine_cases import DEFAULT_CHUNK, Case, make_model_and_optim, max_diff, reference, run_cases

from zerofit.config.schema import OffloadConfig, PrecisionConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.state_codec import BLOCK, Codec, Stored, dynamic_map, round_trip
from zerofit.testing.distributed import run_distributed

TOL = {"bf16": 1e-4, "8bit": 1e-4}
"""Max |weight - reference| after the run. The ranks' gradients are summed in another order than the whole
batch's (1 ulp apart), which can move a state element across a rounding boundary of its stored form: one
bf16 step (2**-8 relative) or one step of the 8-bit map in that element, which moves its weight by about lr
times that much in that step (seen: 2.4e-5 with bf16 state, Adam lr 1e-2; 1.2e-7, no crossing, with 8-bit).
Between zerofit's own settings the sums are the same and so is everything else (the bit-for-bit test)."""

TRAININGS = [Case(stage=0, steps=6), Case(stage=0, gas=2, clip=0.05, steps=5), Case(stage=0, optim="sgd", steps=5),
             Case(stage=0, freeze=True, sched=True, steps=5)]
"""What is trained; each at every stage and home below, in both narrow state dtypes."""
NVME = [dict(stage=2, offload="nvme", step_on="host"), dict(stage=1, offload="nvme", step_on="device", chunk=64),
        dict(stage=3, offload="nvme", offload_param="cpu", step_on="device", chunk=64, buffer_count=2),
        dict(stage=3, offload="nvme", step_on="device", host_share=0.5, chunk=64)]
"""State homed in NVMe files (nvme_path is filled in at run time, in a temporary directory)."""
SETTINGS = ([dict(stage=s) for s in (1, 2, 3)]
            + [dict(stage=s, offload="cpu", step_on="device", chunk=64) for s in (1, 2, 3)]
            + [dict(stage=3, offload="cpu", offload_param="cpu", step_on="device", chunk=64),
               dict(stage=2, offload="cpu", ratio=0.5, step_on="device", chunk=64),  # part on the device
               dict(stage=3, offload="cpu", offload_param="cpu", ratio=0.5, step_on="device", chunk=64),
               dict(stage=3, persistence=100, offload="cpu", step_on="device")]  # one chunk per piece
            + [dict(stage=s, offload="cpu", step_on="host") for s in (1, 2, 3)]  # the CPU optimizer steps it
            + [dict(stage=3, offload="cpu", offload_param="cpu", step_on="host"),
               dict(stage=2, offload="cpu", ratio=0.5, step_on="host"),
               dict(stage=2, offload="cpu", step_on="device", host_share=0.5, chunk=64)]  # host and GPU-stepped
            + NVME)
BASES = [dataclasses.replace(t, state=s) for s in ("bf16", "8bit") for t in TRAININGS]
CORE = [dict(stage=2), dict(stage=3, offload="cpu", step_on="device", chunk=64),
        dict(stage=2, offload="cpu", step_on="host"), NVME[0]]
"""SGD's momentum and the frozen / scheduled training go through one setting of each home (the suite's time);
AdamW's two trainings through every setting."""
VARIANTS = [dataclasses.replace(b, **kw) for b in BASES
            for kw in (SETTINGS if b.optim == "adamw" and not b.freeze else CORE)]
MIXED = [Case(stage=2, precision="bf16", state=s, steps=5) for s in ("bf16", "8bit")]
"""bf16 compute (the master travels split when GPU-stepped): compared between settings only."""
MIXED_VARIANTS = [dataclasses.replace(m, stage=3, offload="cpu", step_on="device", chunk=64) for m in MIXED]


HOMES = {"device": {}, "gpu-stepped": dict(offload_optimizer=OffloadConfig(device="cpu", step_on="device")),
         "host-stepped": dict(offload_optimizer=OffloadConfig(device="cpu", step_on="host")),
         "nvme host-stepped": dict(offload_optimizer=OffloadConfig(device="nvme", step_on="host")),
         "nvme gpu-stepped": dict(offload_optimizer=OffloadConfig(device="nvme", step_on="device"))}


def _storage(rank: int, world: int, nvme_path: str) -> dict:
    """Per state dtype and home: what one engine keeps per state key after two steps (read after `settle`), and
    the bytes of its NVMe files."""
    out = {}
    for kind in ("fp32", "bf16", "8bit"):
        for home, zero in HOMES.items():
            if "offload_optimizer" in zero and zero["offload_optimizer"].device == "nvme":
                zero = dict(offload_optimizer=dataclasses.replace(zero["offload_optimizer"], nvme_path=nvme_path))
            case = Case(stage=2, state=kind)
            model, opt = make_model_and_optim(case)
            engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=2, **zero),
                                precision=PrecisionConfig(optimizer_state=kind))
            x = torch.randint(0, 37, (4, 5))
            for _ in range(2):
                engine.backward(model(x).float().square().mean())
                engine.step()
            swapper = engine.offload.swapper
            files = (sum(os.path.getsize(os.path.join(swapper.dir, f)) for f in os.listdir(swapper.dir))
                     if swapper is not None else 0)
            engine.settle()
            entries = {}
            for piece, st in opt.state.items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.ndim == 1:
                        entries.setdefault(k, set()).add(str(v.dtype))
                        if k.endswith(".absmax"):
                            assert v.numel() == -(-piece.numel() // BLOCK)
                        elif v.numel() > 1:
                            assert v.numel() == piece.numel()
            out[kind, home] = ({k: sorted(v) for k, v in entries.items()}, files)
            del engine
    return out


def _run(rank: int, world: int, cases: list[Case], nvme_path: str) -> tuple[list[dict], dict]:
    return run_cases(rank, world, cases), _storage(rank, world, nvme_path)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = BASES + VARIANTS + MIXED + MIXED_VARIANTS
    path = str(tmp_path_factory.mktemp("nvme"))
    run = [dataclasses.replace(c, nvme_path=path) if c.offload == "nvme" else c for c in cases]
    runs, storage = run_distributed(_run, 2, run, path, timeout=900)[0]
    return dict(zip(cases, runs)), storage


@pytest.mark.parametrize("case", BASES, ids=str)
def test_narrow_state_trains_as_pytorch_storing_its_state_the_same_way(results, case):
    got = results[0][case]
    losses, _, params = reference(case)
    trained = {k: v for k, v in params.items() if k in got["params"]}
    assert max_diff(got["params"], trained) <= TOL[case.state]
    assert got["losses"] == pytest.approx(losses, rel=1e-5)


@pytest.mark.parametrize("case", VARIANTS + MIXED_VARIANTS, ids=str)
def test_every_stage_and_home_holds_the_same_narrow_state_bit_for_bit(results, case):
    got = results[0][case]
    # with accumulation, stages 0-1 sum a window's micro-steps before reducing and stages 2-3 after (another
    # order: engine.md), so those compare with stage 2 on the device, as the fp32 parity tests do; host-stepped
    # groups are reduced per micro-step at every stage (their sums are those of stage 2)
    host_stepped = case.step_on == "host" or case.host_share is not None
    same_sums = 0 if case.precision == "no" and (case.gas == 1 or (case.stage < 2 and not host_stepped)) else 2
    if case.clip and case.stage == 1 and same_sums == 0:
        # clipping: stage 1 sums the gradient's squares shard by shard, stage 0 over the whole buffer - norms one
        # rounding apart, which a block's scale or code can carry into the weights (seen: 1.2e-7 with 8-bit state
        # whose block scales were bf16, a variant tried on 2026-12-06): the exact base is stage 1 on the device
        same_sums = 1
        stage0 = results[0][dataclasses.replace(case, stage=0, offload="none", step_on="auto", chunk=0)]
        assert got["losses"] == pytest.approx(stage0["losses"], rel=1e-5)
        assert max_diff(got["params"], stage0["params"]) <= TOL[case.state]
    base = results[0][dataclasses.replace(case, stage=same_sums, offload="none", offload_param="none", ratio=1.0,
                                          step_on="auto", chunk=0, persistence=0, host_share=None, buffer_count=4)]
    assert got["losses"] == base["losses"]
    assert max_diff(got["params"], base["params"]) == 0.0
    if case.offload != "none":
        assert got["streamed"] > 0 if case.step_on == "device" else got["offloaded"] > 0
    if case.step_on == "host" and case.offload == "cpu" and not case.clip:  # stepped during backward too
        assert got["early"] > 0
    if case.offload == "nvme":
        assert got["nvme_files"] > 0


def test_the_state_is_stored_narrow_in_every_home(results):
    storage = results[1]
    for home in HOMES:
        assert storage["bf16", home][0] == {"exp_avg": ["torch.bfloat16"], "exp_avg_sq": ["torch.bfloat16"]}, home
        assert storage["8bit", home][0] == {"exp_avg": ["torch.uint8"], "exp_avg_sq": ["torch.uint8"],
                                            "exp_avg.absmax": ["torch.float32"],
                                            "exp_avg_sq.absmax": ["torch.float32"]}, home
    for home in ("nvme host-stepped", "nvme gpu-stepped"):  # the files hold the stored form: master + 2 states
        fp32, bf16, eight = (storage[kind, home][1] for kind in ("fp32", "bf16", "8bit"))
        # per element of a shard (a multiple of 16 long): 4 + 2 * 4 bytes, 4 + 2 * 2, 4 + 2 * (1 + 4 / 16)
        assert bf16 * 12 == fp32 * 8 and eight * 12 == fp32 * 6.5, (home, fp32, bf16, eight)


def test_the_maps_and_blocks():
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    assert signed.numel() == unsigned.numel() == 256
    assert signed.min() == -1 and signed.max() == 1 and unsigned.min() == 0 and unsigned.max() == 1
    assert 0 < unsigned[1] < 1e-6 and (unsigned[1:] > unsigned[:-1]).all()
    codec = Codec("8bit")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-6, 0, 1000)
    x = torch.cat([x, torch.randn(24, generator=g)])  # 1024: whole blocks
    y = round_trip(x, codec, "exp_avg")
    assert torch.equal(round_trip(y, codec, "exp_avg"), y)  # idempotent: untouched state comes back unchanged
    # the error of each element is at most half a step of the map at its block's scale
    half_step = (dynamic_map(True).diff().max() / 2).item()  # ~0.007, near the block's absmax
    assert ((x - y).abs().view(-1, BLOCK) <= half_step * x.view(-1, BLOCK).abs().amax(1, keepdim=True) * 1.0001).all()
    # blocks are counted from the buffer's start: a slice at a multiple of BLOCK stores the same codes
    whole = codec.empty(1024, "cpu")
    codec.encode(x, whole, "exp_avg")
    part = codec.empty(1024 - 160, "cpu")
    codec.encode(x[160:], part, "exp_avg")
    assert torch.equal(part.codes, whole.codes[160:]) and torch.equal(part.scale, whole.scale[10:])
    # bf16: nearest rounding
    bf = Codec("bf16").empty(1024, "cpu")
    Codec("bf16").encode(x, bf, "exp_avg")
    assert torch.equal(bf.codes, x.to(torch.bfloat16))
    out = torch.empty(1024)
    Codec("8bit").decode(Stored(whole.codes, whole.scale), out, "exp_avg")
    assert torch.equal(out, y)


def _tensor_lr(rank: int, world: int) -> dict:
    """A tensor lr that a scheduler fills in place right after each step, stepped on the device and GPU-stepped."""
    from zerofit.engine.offload import gpu

    out = {}
    for name, zero, state in (("device", ZeroConfig(stage=2), "fp32"),
                              ("streamed", ZeroConfig(stage=2, offload_optimizer=OffloadConfig(
                                  device="cpu", step_on="device")), "fp32"),
                              ("8bit", ZeroConfig(stage=2), "8bit"), ("8bit-again", ZeroConfig(stage=2), "8bit")):
        case = Case(stage=2)
        model, _ = make_model_and_optim(case)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))
        gpu.STREAM_CHUNK = 64
        try:
            engine = ZeroEngine(model, opt, zero=zero, precision=PrecisionConfig(optimizer_state=state))
        finally:
            gpu.STREAM_CHUNK = DEFAULT_CHUNK
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 10 * s))
        g = torch.Generator().manual_seed(5)
        for _ in range(6):
            x = torch.randint(0, 37, (8, 5), generator=g)
            engine.backward(model(x).float().square().mean())
            engine.step()
            sched.step()  # fills the lr tensor while the step's groups may still be issued
        out[name] = {k: v.clone() for k, v in engine.named_full_tensors("master").items()}
    return out


def test_a_tensor_lr_filled_by_a_scheduler_is_read_as_it_was_at_the_step():
    got = run_distributed(_tensor_lr, 1, timeout=300)[0]
    assert max_diff(got["streamed"], got["device"]) == 0.0
    assert max_diff(got["8bit"], got["8bit-again"]) == 0.0
