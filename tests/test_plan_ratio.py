"""`offload_optimizer.ratio` in the memory model: the same units the engine offloads, counted on the right side."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerofit.config.schema import OffloadConfig, PrecisionConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.optim import master_pieces
from zerofit.engine.policy import offloaded_units
from zerofit.plan.memory import ModelCounts, Setting, Workload, all_settings, estimate
from zerofit.testing.distributed import run_distributed


class Blocks(nn.Module):
    """Root unit: head (10*3 + 3 = 33 elements); three repeated blocks of 10*10 + 10 = 110 elements."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(10, 10) for _ in range(3))
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize(("ratio", "expected"), [
    (1.0, {0, 1, 2, 3}), (0.9, {1, 2, 3}), (0.95, {0, 1, 2, 3}), (0.5, {2, 3}), (0.3, {3}), (0.01, {3}),
])
def test_offloaded_units_take_whole_units_from_the_last(ratio, expected):
    numels = [33, 110, 110, 110]  # 363 in all
    chosen = offloaded_units(numels, ratio)
    assert chosen == expected
    assert sum(numels[i] for i in chosen) >= ratio * sum(numels)
    # minimal: without the earliest unit taken, the share would fall short
    assert sum(numels[i] for i in chosen if i != min(chosen)) < ratio * sum(numels)


def test_ratio_splits_the_state_by_hand():
    # ratio 0.5 of 363 elements: blocks 1 and 2 (220 elements) go to the host; padded sizes 48 and 112.
    counts = ModelCounts.of(Blocks())
    e = estimate(counts, Setting(stage=2, offload_optimizer="cpu", offload_ratio=0.5),
                 Workload(mixed_precision="bf16", gradient_accumulation_steps=2), None)
    on_gpu, on_host = 48 + 112, 2 * 112
    assert e.params == (on_gpu + on_host) * 2  # parameters stay on the GPU either way
    assert e.grads == on_gpu * 4 and e.optimizer == on_gpu * (4 + 2 * 4)  # fp32 master + Adam's two states
    assert e.host_grads == on_host * 4 and e.host_optimizer == on_host * (4 + 2 * 4)
    assert e.host_buffers == on_host * 4  # only offloaded groups stage accumulated downloads
    full = estimate(counts, Setting(stage=2, offload_optimizer="cpu"), Workload(mixed_precision="bf16"), None)
    assert (full.grads, full.optimizer) == (0, 0) and full.host_grads == (on_gpu + on_host) * 4


def test_ratio_with_nvme_spills_only_the_offloaded_units():
    counts = ModelCounts.of(Blocks())
    work = Workload(world=2, mixed_precision="bf16", persistence_threshold=0)
    e = estimate(counts, Setting(stage=3, offload_optimizer="nvme", offload_param="cpu", offload_ratio=0.3),
                 work, None)
    # block 2 alone (110 -> shard 64 of 128 on 2 ranks) is offloaded: master + 2 states in its file
    assert e.nvme == 3 * 64 * 4
    assert e.grads == (32 + 2 * 64) * 4 and e.optimizer == 3 * (32 + 2 * 64) * 4


def test_settings_and_labels_carry_the_ratio():
    labels = [s.label for s in all_settings(2, checkpointing=(False,), offload_ratio=0.25)]
    assert "ZeRO-2 + opt cpu 25%" in labels and "ZeRO-1" in labels
    assert all(s.offload_ratio == (0.25 if s.offload_optimizer != "none" else 1.0)
               for s in all_settings(2, offload_ratio=0.25))
    with pytest.raises(ValueError, match=r"offload_ratio 0.5 needs offload_optimizer cpu or nvme"):
        Setting(stage=2, offload_ratio=0.5)
    with pytest.raises(ValueError, match=r"offload_ratio must be in \(0, 1\] \(got 0\)"):
        Setting(stage=2, offload_optimizer="cpu", offload_ratio=0)


def _engine_state_bytes(rank: int, world: int, ratio: float) -> dict:
    """Bytes of the fp32 master, gradient shard and optimizer state of a real engine, by where they live."""
    torch.manual_seed(0)
    model = Blocks()
    counts = ModelCounts.of(model)
    opt = torch.optim.AdamW(model.parameters())
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu", ratio=ratio)),
                        precision=PrecisionConfig(mixed_precision="bf16"), device=torch.device("cpu"))
    engine.backward(model(torch.randn(4, 10)).float().sum())
    engine.step()
    engine.settle()
    state_of = {p.data_ptr(): opt.state[p] for group in opt.param_groups for p in group["params"]}
    out = {"device": 0, "host": 0, "padding": 0}
    for g in engine._trainable:
        side = "host" if g.placement.offload_state else "device"
        pieces = master_pieces(g)
        states = [t for q in pieces for t in state_of[q.data_ptr()].values() if t.dim() > 0]
        out[side] += g.master.nbytes + g.grad_shard.nbytes + sum(t.nbytes for t in states)
        out["padding"] += 2 * 4 * (g.layout.shard_numel - sum(q.numel() for q in pieces))
    e = estimate(counts, Setting(stage=2, offload_optimizer="cpu", offload_ratio=ratio), Workload(world=world), None)
    return {"engine": out, "model": {"device": e.grads + e.optimizer, "host": e.host_grads + e.host_optimizer}}


def _check(result: dict) -> None:
    engine, model = result["engine"], result["model"]
    # The model counts optimizer state on the padded shard; the engine keeps it per parameter piece.
    for side in ("device", "host"):
        assert engine[side] <= model[side] <= engine[side] + engine["padding"], (side, result)
    assert engine["host"] > 0


@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.2])
def test_model_matches_the_engine_on_one_rank(ratio):
    _check(_engine_state_bytes(0, 1, ratio))


def test_model_matches_the_engine_on_two_ranks():
    for result in run_distributed(_engine_state_bytes, 2, 0.5, timeout=120):
        _check(result)
