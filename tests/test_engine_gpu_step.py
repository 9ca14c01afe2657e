"""GPU-stepped offload (`offload_optimizer.step_on: device`) trains exactly as no offload (gloo, CPU).

On CPU the host stands in for both sides: the masters and optimizer state live apart from the
parameters and gradients, are streamed chunk by chunk through the slot pool, stepped there by a
one-tensor optimizer of the script's class and written back - every path of
zerofit.engine.offload.gpu but the CUDA streams. Chunks of 64 elements make every piece several
chunks long and reuse every slot many times; 64 is a multiple of the CPU kernels' vector width, so
the fused CPU kernel's vectorised loop splits a piece where the chunks do. Same kernel on the
same elements: bit for bit.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import sys

import pytest
import torch
from engine_cases import Case, make_model_and_optim, max_diff, run_cases

from zerofit.config import load_config
from zerofit.config.schema import OffloadConfig, PrecisionConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.offload import gpu
from zerofit.engine.offload.gpu import GpuStep, plan_chunks, stream_pool_bytes
from zerofit.engine.offload.nvme import NvmeSwapper
from zerofit.engine.policy import step_on_for
from zerofit.errors import EngineError
from zerofit.testing.distributed import run_distributed

BASE = ([Case(stage=s, gas=g) for s in (1, 2, 3) for g in (1, 4)]
        + [Case(stage=2, clip=0.05), Case(stage=3, clip=0.05, gas=2), Case(stage=2, optim="sgd", clip=0.05),
           Case(stage=3, gas=2, precision="bf16"), Case(stage=3, freeze=True, gas=2), Case(stage=2, sched=True),
           Case(stage=2, precision="fp16", overflow_at=3),
           # bf16: the master travels split (bf16 parameter + low halves + carries, zerofit.engine.offload.master_split)
           Case(stage=1, precision="bf16", gas=4), Case(stage=2, precision="bf16", clip=0.05),
           Case(stage=2, optim="sgd", precision="bf16", clip=0.05, sched=True)])
STREAMED = ([dataclasses.replace(c, offload="cpu", step_on="device", chunk=64) for c in BASE]
            + [dataclasses.replace(c, offload="cpu", offload_param="cpu", step_on="device", chunk=64)
               for c in BASE if c.stage == 3]
            + [dataclasses.replace(BASE[2], offload="cpu", ratio=0.5, step_on="device", chunk=64),
               dataclasses.replace(BASE[2], offload="cpu", step_on="device")])  # one chunk per piece
# Split: the last units host-stepped by the CPU optimizer while the others stream, in one step
SPLIT = [dataclasses.replace(c, offload="cpu", step_on="device", chunk=64, host_share=0.5)
         for c in (BASE[2], BASE[3], BASE[6], BASE[9], BASE[12])] + [
    dataclasses.replace(BASE[5], offload="cpu", offload_param="cpu", step_on="device", chunk=64, host_share=0.3),
    dataclasses.replace(BASE[2], offload="cpu", ratio=0.6, step_on="device", chunk=64, host_share=0.5)]
# NVMe as the state's home: streamed the same way, read from and written back to files around it
# (nvme_path is filled in at run time); a pool of 2 slots for fewer slots than groups.
NVME = ([dataclasses.replace(c, offload="nvme", step_on="device", chunk=64) for c in BASE[:6]]
        + [dataclasses.replace(BASE[i], offload="nvme", step_on="device", chunk=64, buffer_count=2)
           for i in (6, 7, 8, 9, 11, 12)]  # clip, clip + accumulation, SGD, bf16, a scheduler, fp16 overflow
        + [dataclasses.replace(BASE[i], offload="nvme", offload_param="cpu", step_on="device", chunk=64)
           for i in (4, 9)]
        + [dataclasses.replace(BASE[2], offload="nvme", ratio=0.5, step_on="device", chunk=64),
           dataclasses.replace(BASE[3], offload="nvme", step_on="device")])  # one chunk per piece
NVME_SPLIT = [dataclasses.replace(BASE[i], offload="nvme", step_on="device", chunk=64, host_share=0.5) for i in (3, 7)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("nvme"))
    cases = BASE + STREAMED + SPLIT + NVME + NVME_SPLIT
    run = BASE + STREAMED + SPLIT + [dataclasses.replace(c, nvme_path=path) for c in NVME + NVME_SPLIT]
    return dict(zip(cases, run_distributed(run_cases, 2, run, timeout=600)[0]))


def _on_device(case: Case) -> Case:
    return dataclasses.replace(case, offload="none", offload_param="none", ratio=1.0, step_on="auto", chunk=0,
                               host_share=None, buffer_count=4)


def _starts_early(case: Case) -> bool:
    """The step's factor is 1 before backward ends, so updates start during it ([Note: updates during backward])."""
    return case.clip == 0 and case.precision != "fp16" and case.offload != "nvme"


def _assert_bit_equal(got: dict, base: dict) -> None:
    """Losses, skipped steps, every step's gradients and the final masters: equal bit for bit."""
    assert got["losses"] == base["losses"]
    assert got["skipped"] == base["skipped"]
    assert max_diff(got["params"], base["params"]) == 0.0
    assert len(got["grads"]) == len(base["grads"])
    for g1, g2 in zip(got["grads"], base["grads"]):
        assert max_diff(g1, g2) == 0.0


@pytest.mark.parametrize("case", SPLIT, ids=repr)
def test_a_split_between_host_and_gpu_steps_equals_on_device(results, case):
    got, base = results[case], results[_on_device(case)]
    assert got["streamed"] > 0 and got["offloaded"] > 0  # both ways in the same step
    assert (got["gpu_early"] > 0 and got["early"] > 0) == _starts_early(case)
    _assert_bit_equal(got, base)


@pytest.mark.parametrize("case", STREAMED, ids=repr)
def test_gpu_stepped_equals_on_device(results, case):
    got, base = results[case], results[_on_device(case)]
    assert got["streamed"] > 0 and got["offloaded"] == 0
    if case.offload_param != "none":
        assert got["param_offloaded"] > 0
    assert (got["gpu_early"] > 0) == _starts_early(case)  # the windows after the first stream during backward
    _assert_bit_equal(got, base)


@pytest.mark.parametrize("case", NVME, ids=repr)
def test_gpu_stepped_from_nvme_equals_on_device(results, case):
    got, base = results[case], results[_on_device(case)]
    assert got["streamed"] > 0 and got["offloaded"] == 0
    assert got["nvme_files"] == got["streamed"]  # every GPU-stepped group has its file
    if case.offload_param != "none":
        assert got["param_offloaded"] > 0
    if case.ratio < 1:
        assert got["streamed"] < results[NVME[2]]["streamed"]
    _assert_bit_equal(got, base)


@pytest.mark.parametrize("case", NVME_SPLIT, ids=repr)
def test_a_split_with_nvme_streams_and_host_steps_from_files(results, case):
    """Each part has its own swapper over its own groups' files (the host mode's is `nvme_files`)."""
    got, base = results[case], results[_on_device(case)]
    assert got["streamed"] > 0 and got["offloaded"] > 0 and got["nvme_files"] == got["offloaded"]
    _assert_bit_equal(got, base)


def test_partial_ratio_streams_only_some_units(results):
    full = results[STREAMED[-1]]["streamed"]
    half = results[STREAMED[-2]]["streamed"]
    assert 0 < half < full


@pytest.mark.parametrize("pieces,chunk", [([(0, 10)], 3), ([(0, 16), (16, 5)], 16), ([(0, 1), (1, 40), (41, 7)], 7),
                                          ([(3, 100)], 1000)])
def test_chunks_cover_each_piece_once_and_stay_inside_it(pieces, chunk):
    plan = plan_chunks(pieces, chunk)
    assert len(plan) == len(pieces)
    for (offset, length), chunks in zip(pieces, plan):
        covered = [i for c in chunks for i in range(c.start, c.start + c.length)]
        assert covered == list(range(offset, offset + length))
        assert all(1 <= c.length <= chunk for c in chunks)


def test_a_run_packs_small_pieces_whole_and_cuts_only_long_ones_into_chunks_of_their_own():
    from zerofit.engine.offload.gpu_runs import Piece, run_chunks

    # offsets at multiples of 16, as the flat layout puts them; lengths: 5, 40 (> chunk), 12, 7, 13, 3
    spans = [(0, 5), (16, 40), (64, 12), (80, 7), (96, 13), (112, 3)]
    pieces = [Piece(None, offset, length, i) for i, (offset, length) in enumerate(spans)]
    chunks = run_chunks(0, pieces, 32)
    assert [(c.start, c.length) for c in chunks] == [(0, 5), (16, 32), (48, 8), (64, 23), (96, 19)]
    assert [c.shift for c in chunks] == [0, 0, 0, 0, 0]  # 40 is a multiple of 4: the long piece vectorises
    for p in pieces:  # every piece lies in chunks that cover it exactly once; only the long one is cut
        inside = [c for c in chunks if c.start < p.offset + p.length and c.start + c.length > p.offset]
        assert sum(min(c.start + c.length, p.offset + p.length) - max(c.start, p.offset) for c in inside) == p.length
        assert len(inside) == (2 if p.length > 32 else 1)
    odd = run_chunks(0, [Piece(None, 0, 70, 0)], 32)  # 70 is not: every chunk of it starts off a boundary
    assert [(c.start, c.length) for c in odd] == [(0, 32), (32, 32), (64, 6)] and all(c.shift for c in odd)


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        plan_chunks([(0, 4)], 0)


def test_pool_bytes_count_every_buffer_of_every_slot():
    # Adam (2 states), bf16 compact gradients, parameter offload: master + 2 states + upcast in fp32, + bf16 param
    assert (stream_pool_bytes(10, state_tensors=2, compact=True, offload_params=True, compute_bytes=2)
            == 3 * 10 * (16 + 2))
    assert stream_pool_bytes(1 << 30, state_tensors=1, compact=False, offload_params=False, compute_bytes=2) == \
        3 * gpu.STREAM_CHUNK * 8
    # the split master: its packed form (2 bytes + a bit per element), and without the fused kernels the carries'
    # scratch (a byte per element)
    plain = stream_pool_bytes(64, state_tensors=2, compact=False, offload_params=False, compute_bytes=2)
    assert stream_pool_bytes(64, state_tensors=2, compact=False, offload_params=False, compute_bytes=2, split=True,
                             fused=True) == plain + 3 * (2 * 64 + 8)
    assert stream_pool_bytes(64, state_tensors=2, compact=False, offload_params=False, compute_bytes=2, split=True,
                             fused=False) == plain + 3 * (2 * 64 + 8 + 64)
    # the slot of chunks kept on the device: master + states (+ the upcast gradient when compact)
    assert gpu.home_slot_bytes(64, state_tensors=2, compact=True) == 64 * 4 * 4


def _engine(step_on: str, stage: int = 2, device: str = "cpu", nvme_path: str | None = None,
            buffer_count: int = 4, precision: str = "no") -> ZeroEngine:
    model, opt = make_model_and_optim(Case(stage=stage))
    offload = OffloadConfig(device="nvme" if nvme_path else "cpu", nvme_path=nvme_path, step_on=step_on,
                            buffer_count=buffer_count)
    return ZeroEngine(model, opt, zero=ZeroConfig(stage=stage, offload_optimizer=offload), device=torch.device(device),
                      precision=PrecisionConfig(mixed_precision=precision))


def test_auto_steps_on_the_host_without_cuda_and_device_when_asked():
    assert _engine("auto").step_on == "host" and not isinstance(_engine("auto").mode, GpuStep)
    streamed = _engine("device")
    assert streamed.step_on == "device" and isinstance(streamed.mode, GpuStep)
    assert all(g.placement.gpu_stepped and not g.placement.host_stepped for g in streamed.groups if g.trainable)
    # the state lives apart from the parameters; the gradient stays with them
    g = streamed.groups[0]
    assert g.master.data_ptr() != g.param_shard.data_ptr()


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_state_written_by_a_checkpoint_load_is_what_the_next_step_streams(tmp_path, precision):
    """Save after 2 steps, train 2 more; a fresh engine loading the checkpoint and training the same 2
    steps ends bit for bit where the first did (state found in host memory, scalars included; in bf16
    the saved masters are joined from their split form first)."""
    first, resumed = run_distributed(_checkpoint_rank, 1, str(tmp_path), "cpu", None, precision)[0]
    assert max_diff(first, resumed) == 0.0


def test_a_bf16_master_travels_split_and_every_host_reader_gets_it_whole():
    """Between steps a bf16 group's host master is kept packed in a home of its own (low halves and carries) and
    the fp32 master holds no memory ([Note: packed master at rest]: read as zeros, its pages given back); a host
    reader (`settle(state=True)`: inspection) gets the fp32 master rebuilt, bit for bit what state on the device
    gives, and the next step uploads it whole and packs it again."""
    def train(engine, steps):
        g = torch.Generator().manual_seed(3)
        for _ in range(steps):
            x = torch.randint(0, 37, (4, 5), generator=g)
            engine.backward(engine.model(x).float().pow(2).mean())
            engine.step()

    streamed = _engine("device", precision="bf16")
    model, opt = make_model_and_optim(Case(stage=2))
    on_device = ZeroEngine(model, opt, zero=ZeroConfig(stage=2), device=torch.device("cpu"),
                           precision=PrecisionConfig(mixed_precision="bf16"))
    trainable = [g for g in streamed.groups if g.trainable]
    mode = streamed.mode
    assert {id(g) for g in trainable} == mode.packed.packed  # packed when the engine built them
    assert all(g.packed_master.numel() == -(-g.master.numel() * 17 // 8) for g in trainable)
    for engine in (streamed, on_device):
        train(engine, 2)
    mode.issuer.wait_all()  # the groups are issued on the issuing thread
    assert {id(g) for g in trainable} == mode.packed.packed
    masters = streamed.named_full_tensors("master")  # settles: every group joined
    assert not mode.packed.packed
    assert max_diff(masters, on_device.named_full_tensors("master")) == 0.0
    for engine in (streamed, on_device):
        train(engine, 1)  # uploaded whole, packed again
    mode.issuer.wait_all()
    assert {id(g) for g in trainable} == mode.packed.packed
    assert max_diff(streamed.named_full_tensors("master"), on_device.named_full_tensors("master")) == 0.0


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(pages in memory, whole pages) under host tensor `t` (Linux mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = 4096
    begin = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    vec = (ctypes.c_ubyte * ((end - begin) // page))()
    assert libc.mincore(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), vec) == 0
    return sum(v & 1 for v in vec), len(vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts pages with Linux's mincore")
@pytest.mark.parametrize("stage", [2, 3])  # 3: with parameter offload, the host's bf16 parameter is the high half
def test_a_packed_master_holds_no_host_memory_between_steps(tmp_path, stage):
    """[Note: packed master at rest]: a GPU-stepped bf16 group keeps 2.125 bytes per element of host memory
    between steps (its packed home), not 4 more for the fp32 master: none of the master's pages is in memory
    after the engine is built, after steps, and after a checkpoint save, which reads one group at a time."""
    from zerofit.checkpoint import load_state, save_state
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zero = ZeroConfig(stage=stage, unit_size_threshold=100_000, param_persistence_threshold=0,
                      offload_optimizer=OffloadConfig(device="cpu", step_on="device"),
                      offload_param=OffloadConfig(device="cpu" if stage == 3 else "none"))
    engine = ZeroEngine(model, opt, zero=zero, device=torch.device("cpu"),
                        precision=PrecisionConfig(mixed_precision="bf16"))
    trainable = [g for g in engine.groups if g.trainable]
    assert len(trainable) == 3 and all(g.master.numel() > 100_000 for g in trainable)
    assert all(g.placement.offload_params == (stage == 3) for g in trainable)

    def in_memory() -> list[int]:
        return [_resident_pages(g.master)[0] for g in trainable]

    assert in_memory() == [0, 0, 0]  # packed when built: the fp32 master never held at once
    for _ in range(2):
        engine.backward(model(torch.randn(4, 512).bfloat16()).float().square().mean())
        engine.step()
    engine.mode.issuer.wait_all()
    assert in_memory() == [0, 0, 0]
    seen = []
    from zerofit.checkpoint import sharded
    write = sharded.write_shard
    sharded.write_shard = lambda path, chunks: (seen.append(in_memory()), write(path, chunks))[1]
    try:
        save_state(str(tmp_path / "ckpt"), engine)
    finally:
        sharded.write_shard = write
    whole = [_resident_pages(g.master)[1] for g in trainable]
    assert seen == [[w if i == j else 0 for j, w in enumerate(whole)] for i in range(3)], seen  # one at a time
    assert in_memory() == [0, 0, 0]
    want = engine.named_full_tensors("master")  # every group joined: inspection reads them all
    assert min(in_memory()) > 0
    model2 = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])
    again = ZeroEngine(model2, torch.optim.AdamW(model2.parameters(), lr=1e-3), zero=zero,
                       device=torch.device("cpu"), precision=PrecisionConfig(mixed_precision="bf16"))
    load_state(str(tmp_path / "ckpt"), again)  # written back packed, one group at a time
    assert [_resident_pages(g.master)[0] for g in again.groups if g.trainable] == [0, 0, 0]
    assert max_diff(again.named_full_tensors("master"), want) == 0.0
    # `load_state_dict` of full values on the prepared model: the same, and the masters hold the values given
    again.backward(model2(torch.randn(4, 512).bfloat16()).float().square().mean())
    again.step()  # packed again after the inspection above joined every group
    again.mode.issuer.wait_all()
    assert [_resident_pages(g.master)[0] for g in again.groups if g.trainable] == [0, 0, 0]
    given = {k: torch.randn(v.shape) for k, v in model2.state_dict().items()}
    model2.load_state_dict(given)
    assert [_resident_pages(g.master)[0] for g in again.groups if g.trainable] == [0, 0, 0]
    masters = again.named_full_tensors("master")
    assert masters.keys() == given.keys() and all(torch.equal(masters[k], given[k]) for k in given)
    assert all(torch.equal(p, given[k].bfloat16()) for k, p in model2.state_dict().items())


def _checkpoint_rank(rank, world, directory, device="cpu", nvme_path=None, precision="no"):
    """Train, save, train; load into a fresh engine and train the same: both masters (on the CPU).
    `nvme_path`: both engines keep the state in files there."""
    from zerofit.checkpoint.sharded import load_state, save_state

    def train(engine, seed, steps):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randint(0, 37, (4, 5), generator=g).to(device)
            engine.backward(engine.model(x).float().pow(2).mean())
            engine.step()

    a = _engine("device", device=device, nvme_path=nvme_path, precision=precision)
    train(a, 1, 2)
    save_state(directory + "/ck", a)
    train(a, 2, 2)
    b = _engine("device", device=device, nvme_path=nvme_path, precision=precision)
    load_state(directory + "/ck", b)
    train(b, 2, 2)
    return ({k: v.cpu() for k, v in a.named_full_tensors("master").items()},
            {k: v.cpu() for k, v in b.named_full_tensors("master").items()})


# --- NVMe as the home of GPU-stepped state ---------------------------------------------------------

def _train_breaking(engine, g, break_files):
    """Four steps; after the second (its files written) `break_files(engine)`; None, or (step, message) of
    the EngineError raised."""
    step = 0
    try:
        for step in range(4):
            x = torch.randint(0, 37, (4, 5), generator=g)
            engine.backward(engine.model(x).float().pow(2).mean())
            engine.step()
            if step == 1:
                engine.offload.gpu.issuer.wait_all()
                engine.offload.swapper.flush()
                break_files(engine)
        return None
    except EngineError as e:
        return (step, str(e))


def _nvme_rank(rank, world, root):
    """One launch for the NVMe checks that are not parity sweeps: memory, checkpoints, a failing file."""
    import os

    swap = os.path.join(root, "swap")
    out = {}
    # memory: a pool of 2 slots, more groups than that; between steps every group is on file
    engine = _engine("device", nvme_path=swap, buffer_count=2)
    swapper, issuer = engine.offload.swapper, engine.offload.gpu.issuer
    out["files"] = len(os.listdir(swapper.dir))
    out["groups"] = sum(g.placement.gpu_stepped for g in engine.groups)
    resident = []
    for seed in range(3):
        x = torch.randint(0, 37, (4, 5), generator=torch.Generator().manual_seed(seed))
        engine.backward(engine.model(x).float().pow(2).mean())
        engine.step()
        resident.append(swapper.resident())  # right after step(): some groups may still be in a slot
        issuer.wait_all()
        swapper.flush()
        resident.append(swapper.resident())
    out["resident"] = resident
    out["allocated"] = swapper.pool.allocated
    out["state_numel"] = [v.numel() for st in engine.optimizer.state.values() for v in st.values()
                          if isinstance(v, torch.Tensor) and v.ndim == 1]
    directory = swapper.dir
    engine.offload.gpu.close()  # what collecting the engine (or the process exiting) does
    out["removed"] = not os.path.exists(directory)
    # checkpoints: NVMe -> NVMe resumes bit for bit, and ends where the host-memory GPU-stepped run ends
    out["nvme"] = _checkpoint_rank(rank, world, os.path.join(root, "ck-nvme"), nvme_path=swap)
    out["host"] = _checkpoint_rank(rank, world, os.path.join(root, "ck-host"))
    # a group's file that can no longer be read: the next forward raises it, on every rank, no hang
    def unreadable(engine):
        broken = os.path.join(root, f"empty-{rank}")
        open(broken, "w").close()
        fd = os.open(broken, os.O_RDONLY)  # reads come back short, writes fail
        os.dup2(fd, engine.offload.swapper._infos[0].fd)
        os.close(fd)

    def read_only(engine):
        for name, info in zip(sorted(os.listdir(engine.offload.swapper.dir)), engine.offload.swapper._infos):
            fd = os.open(os.path.join(engine.offload.swapper.dir, name), os.O_RDONLY)
            os.dup2(fd, info.fd)
            os.close(fd)

    engine = _engine("device", nvme_path=swap)
    g = torch.Generator().manual_seed(5)
    out["error"] = _train_breaking(engine, g, unreadable)
    engine.offload.gpu.close()
    # every write fails (the files turn read-only), with fewer slots than groups: raised, no hang
    engine = _engine("device", nvme_path=swap, buffer_count=2)
    out["write_error"] = _train_breaking(engine, g, read_only)
    return out


@pytest.fixture(scope="module")
def nvme_checks(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvme-checks")
    (root / "swap").mkdir()
    return run_distributed(_nvme_rank, 2, str(root), timeout=300)


def test_gpu_stepped_nvme_keeps_host_memory_bounded_and_removes_its_files(nvme_checks):
    for out in nvme_checks:
        assert out["groups"] > 2 and out["files"] == out["groups"]
        assert max(out["resident"]) <= 2 and out["resident"][1::2] == [0, 0, 0]
        assert out["allocated"] <= 2
        assert out["state_numel"] and not any(out["state_numel"])  # on file: the tensors stay, empty
        assert out["removed"]


def test_gpu_stepped_nvme_checkpoint_resumes_bit_for_bit(nvme_checks):
    for out in nvme_checks:
        first, resumed = out["nvme"]
        assert max_diff(first, resumed) == 0.0
        assert max_diff(first, out["host"][0]) == 0.0  # the files change nothing


def test_gpu_stepped_nvme_io_failures_surface_at_the_next_forward(nvme_checks):
    for out in nvme_checks:
        assert out["error"] is not None
        step, message = out["error"]
        assert step == 3  # step 2 failed on the issuing thread; step 3's forward raised it
        assert "NVMe swap file" in message and "is shorter than zerofit wrote it (short read" in message
    # Step 2's writes failed, and so did its later reads (no slot would come back). When that happens
    # is a race, so one rank may raise at an earlier unit than the other, which then sees it leave.
    writes = [out["write_error"] for out in nvme_checks]
    assert all(w is not None and w[0] == 3 for w in writes)
    assert any("an NVMe write failed" in m for _, m in writes)  # the pool's EngineError, raised as itself
    assert all("NVMe write failed" in m or "another rank left the run" in m for _, m in writes)


def test_step_on_device_with_nvme_is_accepted_and_auto_still_means_host(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path), "step_on": "device"}}}))
    assert load_config(str(config)).zero.offload_optimizer.step_on == "device"
    assert step_on_for("device", cuda=True, nvme=True) == "device"
    assert step_on_for("auto", cuda=True, nvme=True) == "host"  # the default is unchanged
    model, opt = make_model_and_optim(Case(stage=3))
    offload = OffloadConfig(device="nvme", nvme_path=str(tmp_path), step_on="auto")
    engine = ZeroEngine(model, opt, device=torch.device("cpu"), zero=ZeroConfig(stage=3, offload_optimizer=offload))
    assert engine.step_on == "host" and isinstance(engine.offload.stepper.swap, NvmeSwapper)
    assert engine.offload.gpu is None
