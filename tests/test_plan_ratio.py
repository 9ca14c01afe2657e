"""`offload_optimizer.ratio` in the memory model: the same units the engine offloads, counted on the right side."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from zerofit.config import load_config
from zerofit.config.schema import AUTO, OffloadConfig, PrecisionConfig, RunConfig, ZeroConfig, is_auto
from zerofit.engine import ZeroEngine
from zerofit.engine.optim import master_pieces
from zerofit.engine.policy import offload_ratios, offloaded_units
from zerofit.errors import EngineError
from zerofit.plan.auto import choose, describe, needs_planning
from zerofit.plan.choose import GPU_RESERVE_BYTES, HOST_BASELINE_BYTES, Budget, least_offload
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
    # ratio 0.5 of 363 elements: blocks 1 and 2 (220 elements) go to the host. Padded sizes: the root's
    # weight (30) then its bias from 32, 35 in all -> 48; a block's weight (100) then its bias from 112,
    # 122 -> 128 (each parameter starts at a multiple of 16, see [Note: flat layout]).
    counts = ModelCounts.of(Blocks())
    e = estimate(counts, Setting(stage=2, offload_optimizer="cpu", offload_ratio=0.5),
                 Workload(mixed_precision="bf16", gradient_accumulation_steps=2), None)
    on_gpu, on_host = 48 + 128, 2 * 128
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


def _engine_state_bytes(rank: int, world: int, ratio: float, step_on: str = "host") -> dict:
    """Bytes of the fp32 master, gradient shard and optimizer state of a real engine, by where they live."""
    torch.manual_seed(0)
    model = Blocks()
    counts = ModelCounts.of(model)
    opt = torch.optim.AdamW(model.parameters())
    off = OffloadConfig(device="cpu", ratio=ratio, step_on=step_on)
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=2, offload_optimizer=off),
                        precision=PrecisionConfig(mixed_precision="bf16"), device=torch.device("cpu"))
    engine.backward(model(torch.randn(4, 10)).float().sum())
    engine.step()
    engine.settle()
    state_of = {p.data_ptr(): opt.state[p] for group in opt.param_groups for p in group["params"]}
    out = {"device": 0, "host": 0, "padding": 0}
    for g in engine.trainable_groups:
        # GPU-stepped groups keep master and state on the host but the gradient shard on the device
        state_side = "host" if g.placement.offloaded else "device"
        pieces = master_pieces(g)
        states = [t for q in pieces for t in state_of[q.data_ptr()].values() if t.dim() > 0]
        master = g.packed_master if g.packed_master is not None else g.master  # [Note: packed master at rest]
        out[state_side] += master.nbytes + sum(t.nbytes for t in states)
        out["host" if g.placement.host_stepped else "device"] += g.grad_shard.nbytes
        out["padding"] += 2 * 4 * (g.layout.shard_numel - sum(q.numel() for q in pieces))
    e = estimate(counts, Setting(stage=2, offload_optimizer="cpu", offload_ratio=ratio, step_on=step_on),
                 Workload(world=world), None)
    return {"engine": out, "model": {"device": e.grads + e.optimizer, "host": e.host_grads + e.host_optimizer}}


def _check(result: dict) -> None:
    engine, model = result["engine"], result["model"]
    # The model counts optimizer state on the padded shard; the engine keeps it per parameter piece.
    for side in ("device", "host"):
        assert engine[side] <= model[side] <= engine[side] + engine["padding"], (side, result)
    assert engine["host"] > 0


@pytest.mark.parametrize("step_on", ["host", "device"])
@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.2])
def test_model_matches_the_engine_on_one_rank(ratio, step_on):
    _check(_engine_state_bytes(0, 1, ratio, step_on))


def test_model_matches_the_engine_on_two_ranks():
    for step_on in ("host", "device"):
        for result in run_distributed(_engine_state_bytes, 2, 0.5, step_on, timeout=120):
            _check(result)


# --- offload_optimizer.ratio: auto (see [Note: open ratio] in zerofit.plan.choose) -----------------

def test_offload_ratios_are_the_shares_of_the_last_units():
    numels = [33, 110, 0, 110, 110]
    ratios = offload_ratios(numels)
    assert ratios == pytest.approx([110 / 363, 220 / 363, 330 / 363, 1.0])
    # each selects one more unit than the one before (the empty unit adds no new ratio)
    assert [len(offloaded_units(numels, r)) for r in ratios] == [1, 2, 4, 5]


def _budget_for_gpu(gpu_total: int) -> Budget:
    """A budget whose GPU allowance is exactly `gpu_total` bytes (no headroom), host unlimited."""
    return Budget(gpu_bytes=gpu_total + GPU_RESERVE_BYTES, host_bytes=None, headroom=0.0)


@pytest.mark.parametrize("step_on", ["host", "device"])
def test_least_offload_keeps_the_most_on_the_gpu_that_fits(step_on):
    counts = ModelCounts.of(Blocks())
    work = Workload(mixed_precision="bf16")
    setting = Setting(stage=2, offload_optimizer="cpu", step_on=step_on)
    by_ratio = {r: estimate(counts, Setting(stage=2, offload_optimizer="cpu", offload_ratio=r, step_on=step_on),
                            work, None) for r in offload_ratios([t + f for _, t, f in counts.units])}
    needs = [e.gpu_total for e in by_ratio.values()]
    assert needs == sorted(needs, reverse=True)  # more offloaded, less GPU
    for ratio, e in by_ratio.items():
        chosen = least_offload(counts, setting, work, _budget_for_gpu(e.gpu_total), None)
        assert chosen.setting.offload_ratio == ratio and chosen.gpu_total == e.gpu_total
        # one byte less and the next ratio up is needed
        tighter = least_offload(counts, setting, work, _budget_for_gpu(e.gpu_total - 1), None)
        assert tighter.setting.offload_ratio > ratio or ratio == 1.0


def test_least_offload_stops_where_the_host_runs_out():
    counts = ModelCounts.of(Blocks())
    work = Workload(mixed_precision="bf16")
    setting = Setting(stage=2, offload_optimizer="cpu")
    none_fit = Budget(gpu_bytes=GPU_RESERVE_BYTES + 1, host_bytes=HOST_BASELINE_BYTES + 1, headroom=0.0)
    e = least_offload(counts, setting, work, none_fit, None)
    assert e.setting.offload_ratio == 1.0 and not none_fit.fits(e)  # nothing fits: everything offloaded


def test_auto_ratio_is_planned_and_written_into_the_config():
    zero = ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu", ratio=AUTO))
    model = Blocks()
    counts = ModelCounts.of(model)
    half = estimate(counts, Setting(stage=2, offload_optimizer="cpu", offload_ratio=220 / 363),
                    Workload(mixed_precision="no"), None)
    config, result = choose(RunConfig(zero=zero), model, world=1, shape=None, budget=_budget_for_gpu(half.gpu_total))
    assert config.zero.offload_optimizer.ratio == pytest.approx(220 / 363) and config.zero.stage == 2
    assert "opt cpu 61%" in result.reason
    assert "zero.offload_optimizer.ratio" in describe(RunConfig(zero=zero), result)


@pytest.mark.parametrize(("text", "expected"), [
    ({"stage": "auto"}, AUTO),  # a planned stage plans the ratio
    ({"stage": "auto", "offload_optimizer": {"device": "cpu"}}, AUTO),
    ({"stage": "auto", "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, 0.5),  # written: kept
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, 1.0),  # a written offload is all of it
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": "auto"}}, AUTO),
])
def test_which_configs_leave_the_ratio_to_the_planner(tmp_path, text, expected):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": text}))
    ratio = load_config(str(path)).zero.offload_optimizer.ratio
    assert ratio is expected if expected is AUTO else ratio == expected
    assert needs_planning(load_config(str(path))) == (is_auto(ratio) or text["stage"] == "auto")


def test_an_engine_built_directly_refuses_an_auto_ratio():
    with pytest.raises(EngineError, match=r'ratio "auto" is resolved by the planner.*write a number'):
        model = Blocks()
        ZeroEngine(model, torch.optim.AdamW(model.parameters()), device=torch.device("cpu"),
                   zero=ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu", ratio=AUTO)))
