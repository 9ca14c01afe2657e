"""GPU-stepped offload (`offload_optimizer.step_on: device`) trains exactly as no offload (gloo, CPU).

On CPU the host stands in for both sides: the masters and optimizer state live apart from the
parameters and gradients, are streamed chunk by chunk through the slot pool, stepped there by a
one-tensor optimizer of the script's class and written back - every path of
zerofit.engine.stream_step but the CUDA streams. Chunks of 64 elements make every piece several
chunks long and reuse every slot many times; 64 is a multiple of the CPU kernels' vector width, so
the fused CPU kernel's vectorised loop splits a piece where the chunks do. Same kernel on the
same elements: bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_cases import Case, make_model_and_optim, max_diff, run_cases

from zerofit.config.schema import OffloadConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.stream_step import StreamStep, plan_chunks, stream_pool_bytes
from zerofit.testing.distributed import run_distributed

BASE = ([Case(stage=s, gas=g) for s in (1, 2, 3) for g in (1, 4)]
        + [Case(stage=2, clip=0.05), Case(stage=3, clip=0.05, gas=2), Case(stage=2, optim="sgd", clip=0.05),
           Case(stage=3, gas=2, precision="bf16"), Case(stage=3, freeze=True, gas=2), Case(stage=2, sched=True),
           Case(stage=2, precision="fp16", overflow_at=3)])
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




@pytest.fixture(scope="module")
def results():
    cases = BASE + STREAMED + SPLIT
    return dict(zip(cases, run_distributed(run_cases, 2, cases, timeout=600)[0]))


def _on_device(case: Case) -> Case:
    return dataclasses.replace(case, offload="none", offload_param="none", ratio=1.0, step_on="auto", chunk=0,
                               host_share=None)


@pytest.mark.parametrize("case", SPLIT, ids=repr)
def test_a_split_between_host_and_gpu_steps_equals_on_device(results, case):
    got, base = results[case], results[_on_device(case)]
    assert got["streamed"] > 0 and got["offloaded"] > 0  # both ways in the same step
    assert got["losses"] == base["losses"] and got["skipped"] == base["skipped"]
    assert max_diff(got["params"], base["params"]) == 0.0
    for g1, g2 in zip(got["grads"], base["grads"]):
        assert max_diff(g1, g2) == 0.0


@pytest.mark.parametrize("case", STREAMED, ids=repr)
def test_gpu_stepped_equals_on_device(results, case):
    got, base = results[case], results[_on_device(case)]
    assert got["streamed"] > 0 and got["offloaded"] == 0
    if case.offload_param != "none":
        assert got["param_offloaded"] > 0
    assert got["losses"] == base["losses"]
    assert got["skipped"] == base["skipped"]
    assert max_diff(got["params"], base["params"]) == 0.0
    for g1, g2 in zip(got["grads"], base["grads"]):
        assert max_diff(g1, g2) == 0.0


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


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        plan_chunks([(0, 4)], 0)


def test_pool_bytes_count_every_buffer_of_every_slot():
    # Adam (2 states), bf16 compact gradients, parameter offload: master + 2 states + upcast in fp32, + bf16 param
    assert stream_pool_bytes(10, state_tensors=2, compact=True, offload_params=True, compute_bytes=2) == 3 * 10 * (16 + 2)
    assert stream_pool_bytes(1 << 30, state_tensors=1, compact=False, offload_params=False, compute_bytes=2) == \
        3 * (1 << 24) * 8


def _engine(step_on: str, stage: int = 2, device: str = "cpu") -> ZeroEngine:
    model, opt = make_model_and_optim(Case(stage=stage))
    return ZeroEngine(model, opt, zero=ZeroConfig(stage=stage, offload_optimizer=OffloadConfig(
        device="cpu", step_on=step_on)), device=torch.device(device))


def test_auto_steps_on_the_host_without_cuda_and_device_when_asked():
    assert _engine("auto").step_on == "host" and not isinstance(_engine("auto").mode, StreamStep)
    streamed = _engine("device")
    assert streamed.step_on == "device" and isinstance(streamed.mode, StreamStep)
    assert all(g.placement.stream_state and not g.placement.offload_state for g in streamed.groups if g.trainable)
    # the state lives apart from the parameters; the gradient stays with them
    g = streamed.groups[0]
    assert g.master.data_ptr() != g.param_shard.data_ptr()


def test_state_written_by_a_checkpoint_load_is_what_the_next_step_streams(tmp_path):
    """Save after 2 steps, train 2 more; a fresh engine loading the checkpoint and training the same 2
    steps ends bit for bit where the first did (state found in host memory, scalars included)."""
    first, resumed = run_distributed(_checkpoint_rank, 1, str(tmp_path))[0]
    assert max_diff(first, resumed) == 0.0


def _checkpoint_rank(rank, world, directory, device="cpu"):
    """Train, save, train; load into a fresh engine and train the same: both masters (on the CPU)."""
    from zerofit.checkpoint.sharded import load_state, save_state

    def train(engine, seed, steps):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randint(0, 37, (4, 5), generator=g).to(device)
            engine.backward(engine.model(x).float().pow(2).mean())
            engine.step()

    a = _engine("device", device=device)
    train(a, 1, 2)
    save_state(directory + "/ck", a)
    train(a, 2, 2)
    b = _engine("device", device=device)
    load_state(directory + "/ck", b)
    train(b, 2, 2)
    return ({k: v.cpu() for k, v in a.named_full_tensors("master").items()},
            {k: v.cpu() for k, v in b.named_full_tensors("master").items()})
