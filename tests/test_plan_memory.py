"""The planner's arithmetic on models small enough to count every byte by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from zerofit.engine import fused_kernels
from zerofit.engine.offload.gpu import home_slot_bytes, stream_pool_bytes
from zerofit.plan.activations import trace_step
from zerofit.plan.choose import GPU_RESERVE_BYTES, Budget, plan
from zerofit.plan.memory import ModelCounts, Setting, Workload, all_settings, estimate
from zerofit.plan.sources import FakeModel, ModelSpecError, build_fake_model, fake_mode, parse_overrides


class Blocks(nn.Module):
    """Root unit: head (10*3 + 3 = 33 elements); three repeated blocks of 10*10 + 10 = 110 elements."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(10, 10) for _ in range(3))
        self.head = nn.Linear(10, 3)


def counts() -> ModelCounts:
    return ModelCounts.of(Blocks())


def test_units_follow_the_engine():
    c = counts()
    assert [(t, f) for _, t, f in c.units] == [(33, 0), (110, 0), (110, 0), (110, 0)]
    assert c.numel == 363 and c.buffer_bytes == 0


def test_stage0_one_rank_bf16():
    # Each parameter from a multiple of 16, padded to 16: root 30 + 3 -> 48; a block 100 + 10 -> 112 + 16 = 128;
    # flat total 48 + 3 * 128 = 432 elements.
    e = estimate(counts(), Setting(stage=0), Workload(mixed_precision="bf16"), None)
    assert e.params == 432 * 2
    assert e.grads == 432 * 2  # one rank, no accumulation: the gradient is kept in bf16 (compact)
    accumulating = estimate(counts(), Setting(stage=0), Workload(mixed_precision="bf16", gradient_accumulation_steps=2),
                            None)
    assert accumulating.grads == 432 * 4  # fp32 where micro-steps add up
    assert e.optimizer == 432 * 4 + 2 * 432 * 4  # fp32 master + Adam's two states
    assert e.buffers == 0 and e.host_total == 0
    assert e.activations == 128 * 4  # no trace: only the largest unit's fp32 upcast while it steps


def test_stage0_fp32_master_is_the_parameter():
    e = estimate(counts(), Setting(stage=0), Workload(mixed_precision="no"), None)
    assert e.params == 432 * 4 and e.optimizer == 2 * 432 * 4


def test_stage1_two_ranks_keeps_full_gradients():
    # Shards: ceil(33 / 2) = 17 -> 32 (padded 64); ceil(110 / 2) = 55 -> 64 (padded 128).
    e = estimate(counts(), Setting(stage=1), Workload(world=2), None)
    assert e.params == (64 + 3 * 128) * 2
    assert e.grads == (32 + 3 * 64) * 4
    assert e.optimizer == 3 * (32 + 3 * 64) * 4
    assert e.buffers == (64 + 3 * 128) * 4  # full fp32 gradients persist until the step's reduce-scatter


def test_stage3_two_ranks_shards_parameters_and_counts_gathered_units():
    e = estimate(counts(), Setting(stage=3), Workload(world=2, persistence_threshold=0), None)
    assert e.params == (32 + 3 * 64) * 2
    assert e.buffers == 64 * 2 + 2 * 128 * 2  # the gathered root + two gathered blocks


def test_stage3_generation_keeps_every_gathered_unit_up_to_max_live_parameters():
    work = Workload(world=2, persistence_threshold=0)
    e = estimate(counts(), Setting(stage=3), work, None)
    assert e.kept_gathered == (64 + 3 * 128) * 2  # the root and three blocks, gathered in bf16
    assert e.gpu_while_generating == e.params + e.grads + e.optimizer + e.kept_gathered
    assert e.gpu_total == e.params + e.grads + e.optimizer + e.activations + e.buffers  # training: released
    capped = estimate(counts(), Setting(stage=3), dataclasses.replace(work, max_live_parameters=64 + 128), None)
    assert capped.kept_gathered == (64 + 128) * 2  # the root first, then the units in order while they fit
    assert estimate(counts(), Setting(stage=2), work, None).kept_gathered == 0


def test_offload_moves_state_to_the_host():
    e = estimate(counts(), Setting(stage=2, offload_optimizer="cpu"), Workload(gradient_accumulation_steps=2), None)
    assert (e.grads, e.optimizer) == (0, 0)
    assert e.host_grads == 432 * 4 and e.host_optimizer == 3 * 432 * 4
    assert e.host_buffers == 432 * 4  # the staging buffer of accumulated downloads
    p = estimate(counts(), Setting(stage=3, offload_optimizer="cpu", offload_param="cpu"),
                 Workload(persistence_threshold=0), None)
    assert p.params == 0 and p.host_params == 432 * 2


def test_a_per_parameter_optimizers_parameters_keep_their_state_on_the_gpu():
    # Muon over the blocks' weights (100 elements each, laid out as 112), AdamW over the rest: the whole
    # groups' master and state stay on the GPU under offload; sharded, their step needs 3 full fp32 buffers
    model = Blocks()
    whole = frozenset(id(b.weight) for b in model.blocks)
    c = ModelCounts.of(model, whole=whole)
    assert c.whole == (0, 112, 112, 112)
    work = Workload(world=2, gradient_accumulation_steps=2)
    plain = estimate(ModelCounts.of(model), Setting(stage=2, offload_optimizer="cpu"), work, None)
    mixed = estimate(c, Setting(stage=2, offload_optimizer="cpu"), work, None)
    # per block: whole group 112 -> shard 64 (padded 128); the bias group 10 -> shard 16 (padded 32)
    assert mixed.optimizer == 3 * (3 * 64 * 4)  # master + two states of each block's weights, 1/2 per rank
    assert mixed.host_optimizer == 3 * (32 + 3 * 16) * 4  # root and the biases: offloaded as before
    assert plain.optimizer == 0
    assert mixed.activations == 3 * 4 * 128  # the whole step's transient buffers of one block
    one_rank = estimate(c, Setting(stage=2, offload_optimizer="cpu"), Workload(gradient_accumulation_steps=2), None)
    assert one_rank.activations < 3 * 4 * 112  # unsharded: stepped in place, no gathered copies


class Toy(nn.Module):
    def __init__(self, dropout: bool):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.drop = nn.Dropout(0.5) if dropout else nn.Identity()

    def forward(self, input_ids, labels):
        h = self.drop(self.emb(input_ids))
        return (h * h).sum()


def _toy(dropout: bool) -> FakeModel:
    mode = fake_mode()
    with mode:
        model = Toy(dropout)
    return FakeModel(model=model, mode=mode, vocab_size=50, num_labels=None, description="toy")


def test_trace_counts_saved_tensors_by_hand():
    b, s, d = 2, 4, 8
    plain = trace_step(_toy(False), batch=b, seq=s)
    assert plain.forward_end_bytes == b * s * d * 4 + 4  # h saved by the square, and the loss
    assert plain.peak_bytes >= 2 * b * s * d * 4  # h and h * h before the sum
    dropped = trace_step(_toy(True), batch=b, seq=s)
    # the embedding output is freed; the mask (one byte per element) and dropout's output are saved
    assert dropped.forward_end_bytes == b * s * d * 1 + b * s * d * 4 + 4


def test_trace_replays_gradient_buffers():
    trace = trace_step(_toy(False), batch=2, seq=4)
    assert trace.peak([1000]) >= trace.peak_bytes + 1000 - 4 * 50 * 8  # held while backward runs
    assert trace.peak(None) == trace.peak_bytes


class Wide(nn.Module):
    """nn.Linear's forward transposes its weight: a view of the parameter, which autograd saves for the
    gradient of the layer's input."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 1000)
        self.proj = nn.Linear(1000, 10, bias=False)

    def forward(self, input_ids, labels=None):
        return self.proj(self.emb(input_ids)).sum()


def test_views_of_parameters_are_not_activations():
    mode = fake_mode()
    with mode:
        model = Wide()
    trace = trace_step(FakeModel(model=model, mode=mode, vocab_size=5, num_labels=None, description="wide"),
                       batch=1, seq=1)
    # the embedding's output (4,000 B) is saved; the weight's transpose (40,000 B) is the parameter itself
    assert trace.forward_end_bytes < 10_000, trace.forward_end_bytes


def test_gathered_parameters_follow_the_stage3_schedule():
    from zerofit.plan.activations import ActivationTrace

    # units 1 and 2 run forward, the loss peaks at 50 with neither gathered, backward visits 2 then 1
    F, E, B, LAST = 3, 4, 5, 2
    timeline = ((10, F, 1), (20, 0, -1), (20, E, 1), (20, F, 2), (30, 0, -1), (30, E, 2), (50, 0, -1),
                (40, B, 2), (40, LAST, 2), (20, B, 1), (20, LAST, 1), (0, 0, -1))
    trace = ActivationTrace(forward_end_bytes=30, peak_bytes=50, timeline=timeline, units=3)
    assert trace.peak_parts(None, None) == (50, 0)
    # unit 1 starts gathered (prefetched at the step's start) and prefetches 2: 20 + 200 in its forward;
    # backward reaching unit 2 gathers it and prefetches 1: 40 + 200, the peak
    assert trace.peak_parts(None, [0, 100, 100]) == (240, 200)
    assert trace.peak_parts(None, [0, 100, 0]) == (140, 100)  # only unit 1 sharded: 40 + 100 at unit 2's backward
    # small units: the loss is the peak, with nothing gathered
    assert trace.peak_parts(None, [0, 5, 5]) == (50, 0)
    with pytest.raises(ValueError, match="same unit_size_threshold"):
        trace.peak_parts(None, [1, 2])


@pytest.fixture(scope="module")
def tiny_gpt2():
    return build_fake_model("GPT2Config:n_layer=2,n_embd=32,n_head=2,vocab_size=96,n_positions=64",
                            dtype=torch.bfloat16)


def test_checkpointing_lowers_the_activation_peak(tiny_gpt2):
    off = trace_step(tiny_gpt2, batch=4, seq=16)
    on = trace_step(tiny_gpt2, batch=4, seq=16, checkpointing=True)
    logits = 4 * 16 * 96 * 2
    assert off.forward_end_bytes > logits
    assert on.forward_end_bytes < off.forward_end_bytes


def test_plan_picks_the_fastest_that_fits(tiny_gpt2):
    work = Workload(micro_batch=4, seq=16)
    c = ModelCounts.of(tiny_gpt2.model)
    traces = {False: trace_step(tiny_gpt2, batch=4, seq=16)}
    settings = all_settings(1, checkpointing=(False,))
    big = Budget(gpu_bytes=64 << 30, host_bytes=64 << 30)
    assert plan(c, work, big, traces, settings=settings).choice.setting == Setting(stage=0)
    need0 = estimate(c, Setting(stage=0), work, traces[False]).gpu_total
    tight = Budget(gpu_bytes=int((need0 + GPU_RESERVE_BYTES) / 0.9) - 1, host_bytes=64 << 30)
    chosen = plan(c, work, tight, traces, settings=settings)
    assert chosen.choice.setting.offload_optimizer == "cpu"
    assert "faster ones do not fit" in chosen.reason
    none = plan(c, work, Budget(gpu_bytes=1, host_bytes=None), traces, settings=settings)
    assert none.choice is None and "nothing fits" in none.reason
    # the GPU holds the offloading settings, the host does not: the reason names host memory and NVMe
    # (a 15.6 B model on one H200 box said "the smallest GPU need is 34 GiB of 139.8 GiB GPU")
    host_short = plan(c, work, Budget(gpu_bytes=64 << 30, host_bytes=1 << 20), traces,
                      settings=[s for s in settings if s.offload_optimizer != "none"])
    assert host_short.choice is None
    assert "least host memory" in host_short.reason and "nvme" in host_short.reason


def test_spec_errors_name_the_fix(tmp_path):
    with pytest.raises(ModelSpecError, match="no NoSuchConfig"):
        build_fake_model("NoSuchConfig:a=1", dtype=torch.float32)
    with pytest.raises(ModelSpecError, match="local Hugging Face cache"):
        build_fake_model("surely-not-a-cached/model-name", dtype=torch.float32)
    with pytest.raises(ModelSpecError, match="without config.json"):
        build_fake_model(str(tmp_path), dtype=torch.float32)
    with pytest.raises(ModelSpecError, match="not key=value"):
        parse_overrides("n_layer", "--model x")
    assert parse_overrides("a=1,b=[1,2],c=gelu", "x") == {"a": 1, "b": [1, 2], "c": "gelu"}


def test_setting_rules():
    with pytest.raises(ValueError, match="stage 1 or higher"):
        Setting(stage=0, offload_optimizer="cpu")
    with pytest.raises(ValueError, match="need stage 3"):
        Setting(stage=2, offload_param="cpu")


def test_trace_and_counts_must_carve_the_same_units():
    trace = trace_step(_toy(False), batch=2, seq=4)
    with pytest.raises(ValueError, match="same unit_size_threshold"):
        trace.peak([1, 2, 3])


def test_budget_from_the_environment_names_the_variable(monkeypatch):
    from zerofit.frontend.planning.auto_plan import budget_for

    monkeypatch.setenv("ZEROFIT_HOST_MEMORY_GIB", "lots")
    with pytest.raises(ValueError, match="ZEROFIT_HOST_MEMORY_GIB='lots' must be a number of GiB"):
        budget_for(torch.device("cpu"), 1)
    monkeypatch.setenv("ZEROFIT_HOST_MEMORY_GIB", "2")
    budget = budget_for(torch.device("cpu"), 1)
    assert budget.unified and budget.host_bytes == 2 << 30 and budget.gpu_bytes is None


def test_gpu_stepped_nvme_keeps_the_gradient_and_pool_on_the_gpu_and_the_state_in_files():
    work = Workload(mixed_precision="bf16", persistence_threshold=0)
    host = estimate(counts(), Setting(stage=3, offload_optimizer="cpu", step_on="device"), work, None)
    nvme = estimate(counts(), Setting(stage=3, offload_optimizer="nvme", step_on="device"), work, None)
    # the GPU holds what GPU-stepped offload from host memory holds: gradient shards, streaming pool (less
    # the split master's buffers: from a file the master travels whole)
    assert (nvme.params, nvme.grads, nvme.optimizer) == (host.params, host.grads, host.optimizer)
    pool = {split: stream_pool_bytes(128, state_tensors=2, compact=True, offload_params=False, compute_bytes=2,
                                     split=split, fused=fused_kernels.available()) for split in (False, True)}
    assert host.buffers - nvme.buffers == pool[True] - pool[False] > 0
    assert nvme.grads == (48 + 3 * 128) * 2 and nvme.optimizer == 0  # bf16 ("compact"): one rank, no accumulation
    # master + 2 Adam states in files; in host memory only the swapper's slots of the largest group
    assert nvme.nvme == (48 + 3 * 128) * 3 * 4
    # from host memory the master is kept packed between steps (2 bytes + a bit per element), and one group's
    # fp32 master at a time while it is packed or read ([Note: packed master at rest])
    assert host.host_optimizer == sum(2 * n + n // 8 for n in (48, 128, 128, 128)) + (48 + 3 * 128) * 2 * 4
    assert host.host_buffers == 128 * 4
    assert nvme.host_optimizer == 4 * 128 * 3 * 4 and nvme.host_grads == 0  # buffer_count 4: a slot per unit here
    two = estimate(counts(), Setting(stage=3, offload_optimizer="nvme", step_on="device"),
                   dataclasses.replace(work, nvme_buffer_count=2), None)
    assert two.host_optimizer == 2 * 128 * 3 * 4
    assert Setting(stage=3, offload_optimizer="nvme", step_on="device").label == "ZeRO-3 + opt nvme (GPU-stepped)"
    with pytest.raises(ValueError, match="step_on device needs offload_optimizer cpu or nvme"):
        Setting(stage=3, step_on="device")


def test_narrow_optimizer_state_counts_its_stored_bytes_in_every_home():
    # Adam's two state tensors of the 432 laid-out elements: 4 bytes each in fp32, 2 in bf16, 1 + 4/16 in 8bit
    # (a code per element and an fp32 scale per 16); the fp32 master is never narrowed
    per = {"fp32": 4, "bf16": 2, "8bit": 1.25}
    for state, b in per.items():
        work = Workload(mixed_precision="bf16", optimizer_state=state, gradient_accumulation_steps=2,
                        persistence_threshold=0)
        device = estimate(counts(), Setting(stage=0), work, None)
        assert device.optimizer == 432 * 4 + 2 * 432 * b
        # narrow state on the device is widened chunk by chunk in the GPU stream's slot of its own (no staging:
        # in place; [Note: resident chunks]); 8-bit without Triton: with the codec's int32 scratch of one chunk
        # ([Note: codec scratch])
        scratch = 128 * 4 if state == "8bit" and not fused_kernels.available() else 0
        assert device.buffers == (0 if state == "fp32" else home_slot_bytes(128, state_tensors=2, compact=False)
                                  + scratch)
        assert home_slot_bytes(128, state_tensors=2, compact=False) == 128 * 4 * 3  # master + 2 states
        host = estimate(counts(), Setting(stage=2, offload_optimizer="cpu"), work, None)
        assert host.host_optimizer == 432 * 4 + 2 * 432 * b and host.optimizer == 0
        # the CPU optimizer steps narrow state from fp32 scratch: both states of the largest group (128), once
        wide = estimate(counts(), Setting(stage=2, offload_optimizer="cpu"),
                        dataclasses.replace(work, optimizer_state="fp32"), None)
        assert host.host_buffers - wide.host_buffers == (0 if state == "fp32" else 2 * 128 * 4)
        nvme = estimate(counts(), Setting(stage=3, offload_optimizer="nvme"), work, None)
        assert nvme.nvme == 432 * 4 + 2 * 432 * b
        assert nvme.host_optimizer == 4 * (128 * 4 + 2 * 128 * b)  # the swapper's slots, the largest group each
        streamed = estimate(counts(), Setting(stage=2, offload_optimizer="cpu", step_on="device"), work, None)
        packed = sum(2 * n + n // 8 for n in (48, 128, 128, 128))  # the master kept packed between steps
        assert streamed.host_optimizer == packed + 2 * 432 * b
        pool = stream_pool_bytes(128, state_tensors=2, compact=False, offload_params=False, compute_bytes=2,
                                 split=True, fused=fused_kernels.available())
        staged = 0 if state == "fp32" else 3 * 2 * 128 * b  # 3 slots: each state chunk in its stored form too
        assert streamed.buffers == pool + staged + scratch


def test_a_per_parameter_optimizers_state_stays_fp32_under_narrow_state():
    model = Blocks()
    c = ModelCounts.of(model, whole=frozenset(id(b.weight) for b in model.blocks))
    work = Workload(world=2, gradient_accumulation_steps=2, optimizer_state="8bit")
    mixed = estimate(c, Setting(stage=2, offload_optimizer="cpu"), work, None)
    assert mixed.optimizer == 3 * (3 * 64 * 4)  # Muon's groups: master + two fp32 states, as without the key
    assert mixed.host_optimizer == (32 + 3 * 16) * 4 + 2 * (32 + 3 * 16) * 1.25  # root and biases: state narrowed


def test_the_planner_lists_every_home_for_narrow_state():
    # bf16 / 8-bit state is stepped wherever it lives: on the GPU, streamed, by the CPU optimizer, from NVMe files
    work = Workload(optimizer_state="8bit")
    budget = Budget(gpu_bytes=10**9, host_bytes=10**9)
    settings = [Setting(stage=2, offload_optimizer="cpu"), Setting(stage=2, offload_optimizer="cpu", step_on="device"),
                Setting(stage=2, offload_optimizer="cpu", step_on="device", host_share=0.5),
                Setting(stage=3, offload_optimizer="nvme", offload_param="cpu"), Setting(stage=0)]
    listed = [e.setting for e in plan(counts(), work, budget, {False: None}, settings=settings).estimates]
    assert sorted(listed, key=repr) == sorted(settings, key=repr)
