"""The step time model (`zerofit.plan.step_time`) and the planner's ranking on it."""

from __future__ import annotations

import dataclasses

import pytest
from test_bandwidth import H200

from zerofit.plan import bandwidth
from zerofit.plan.choose import Budget, plan, traces_for
from zerofit.plan.memory import GIB, ModelCounts, Setting, Workload, all_settings
from zerofit.plan.step_time import RECOMPUTE_EFFICIENCY, added_seconds

# a root unit (embeddings, head) and two layers
COUNTS = ModelCounts(units=(("", 100_000, 0), ("h.0", 1_000_000, 0), ("h.1", 1_000_000, 0)), buffer_bytes=0)
WORK = Workload(micro_batch=8, seq=512)


def test_each_part_is_priced_on_the_rates():
    assert added_seconds(H200, COUNTS, Setting(stage=0), WORK) == 0.0
    streamed = Setting(stage=2, offload_optimizer="cpu", step_on="device")
    # bf16 parameters on the GPU: the master travels split; in fp32 it crosses whole
    assert added_seconds(H200, COUNTS, streamed, WORK) == pytest.approx(
        bandwidth.streamed_seconds(H200, 2_100_000, master_bytes=bandwidth.SPLIT_MASTER_BYTES))
    fp32 = dataclasses.replace(WORK, mixed_precision="no")
    assert added_seconds(H200, COUNTS, streamed, fp32) == pytest.approx(bandwidth.streamed_seconds(H200, 2_100_000))
    host = Setting(stage=2, offload_optimizer="cpu")
    assert added_seconds(H200, COUNTS, host, WORK) == pytest.approx(bandwidth.host_seconds(H200, 2_100_000))
    uploads = 2 * 2 * 2_100_000 / (H200.h2d_gbs * 1e9)  # bf16 shard up for the forward and the backward
    full = Setting(stage=3, offload_optimizer="cpu", offload_param="cpu", step_on="device")
    # with parameter offload the master travels split too, the host's bf16 parameter going up beside it
    split_up = bandwidth.SPLIT_MASTER_BYTES + 2
    assert added_seconds(H200, COUNTS, full, WORK) == pytest.approx(
        bandwidth.streamed_seconds(H200, 2_100_000, master_bytes=split_up) + uploads)
    recompute = 2 * 2_000_000 * 8 * 512 / (H200.gpu_tflops * 1e12 * RECOMPUTE_EFFICIENCY)  # the layers, not the root
    assert added_seconds(H200, COUNTS, Setting(stage=0, checkpointing=True), WORK) == pytest.approx(recompute)


def test_micro_steps_repeat_what_each_forward_pays_and_ranks_share_the_state():
    full_ck = Setting(stage=3, offload_optimizer="cpu", offload_param="cpu", step_on="device", checkpointing=True)
    one = added_seconds(H200, COUNTS, full_ck, WORK)
    four = added_seconds(H200, COUNTS, full_ck, dataclasses.replace(WORK, gradient_accumulation_steps=4))
    offload = bandwidth.streamed_seconds(H200, 2_100_000, master_bytes=bandwidth.SPLIT_MASTER_BYTES + 2)
    assert four - offload == pytest.approx(4 * (one - offload))  # the update once, uploads and recompute 4 times
    two_ranks = dataclasses.replace(WORK, world=2)
    streamed = Setting(stage=2, offload_optimizer="cpu", step_on="device")
    assert added_seconds(H200, COUNTS, streamed, two_ranks) == pytest.approx(
        bandwidth.streamed_seconds(H200, 1_050_000, master_bytes=bandwidth.SPLIT_MASTER_BYTES))


def test_the_stream_is_priced_at_the_bytes_the_state_is_stored_in():
    streamed = Setting(stage=2, offload_optimizer="cpu", step_on="device")
    split = bandwidth.SPLIT_MASTER_BYTES
    for kind, state_bytes in (("fp32", 4), ("bf16", 2), ("8bit", 1.25)):
        work = dataclasses.replace(WORK, optimizer_state=kind)
        assert added_seconds(H200, COUNTS, streamed, work) == pytest.approx(
            bandwidth.streamed_seconds(H200, 2_100_000, master_bytes=split, state_bytes=state_bytes))
    assert bandwidth._stream_bytes(10, 2, split, 1.25) == pytest.approx(10 * (split + 2.5))


def test_what_cannot_be_priced_is_none():
    assert added_seconds(dataclasses.replace(H200, gpu_tflops=None), COUNTS, Setting(stage=0, checkpointing=True),
                         WORK) is None
    assert added_seconds(H200, COUNTS, Setting(stage=3, offload_optimizer="nvme", offload_param="cpu"), WORK) is None


@pytest.mark.slow  # traces GPT-2 XL on fake tensors, with and without checkpointing
def test_measured_rates_trade_offloading_against_recomputing_on_gpt2_xl():
    """GPT-2 XL 16 x 128 in 24 GiB: the fixed order keeps checkpointing off and streams 81 % of the state;
    on the H200's rates a recomputed forward (about 0.02 s) is far cheaper than streaming 47 % more of the
    state, so checkpointing with 34 % streamed is chosen (the 64 M-element stream slots take GPU memory that
    16 M ones left to state: 77 % / 30 % / 37 % with those)."""
    from zerofit.plan.sources import build_fake_model

    fake = build_fake_model("GPT2Config:n_layer=48,n_embd=1600,n_head=25", dtype=__import__("torch").bfloat16,
                            task="causal-lm")
    work = Workload(micro_batch=16, seq=128)
    counts = ModelCounts.of(fake.model)
    traces = traces_for(fake, work, (False, True))
    budget = Budget(gpu_bytes=24 * GIB, host_bytes=125 * GIB)
    settings = all_settings(1, step_on="device")
    fixed = plan(counts, work, budget, traces, settings=settings, open_ratio=True)
    assert fixed.choice.setting.label == "ZeRO-2 + opt cpu 81% (GPU-stepped)"
    timed = plan(counts, work, budget, traces, settings=settings, open_ratio=True, rates=H200)
    assert timed.choice.setting.label == "ZeRO-2 + opt cpu 34% (GPU-stepped) + ckpt"
    assert timed.seconds[timed.choice.setting] < timed.seconds[fixed.choice.setting]
    assert "it adds 0.12" in timed.reason and "faster ones do not fit (DDP (stage 0) + ckpt needs" in timed.reason
    # batch 32 in the same memory: nothing fits without checkpointing but parameter offload, which checkpointing beats
    work32 = dataclasses.replace(work, micro_batch=32)
    capped = plan(counts, work32, budget, traces_for(fake, work32, (False, True)), settings=settings, open_ratio=True)
    assert capped.choice.setting.label == "ZeRO-2 + opt cpu 41% (GPU-stepped) + ckpt"
