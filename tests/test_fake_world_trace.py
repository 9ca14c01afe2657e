"""Eight ranks whose data differ issue the same collectives in the same order (#30 item 2), in one process.

NCCL pairs the collectives of a group by the order each rank issues them and checks neither sizes nor
kinds, so a rank that issues another sequence hangs the run or corrupts memory. Each rank r = 0..7 of a
fake world of 8 (tests/fake_world.py: collectives return at once, outputs unwritten) trains the same
model in turn on data of its own, and the traces `Collectives.trace` records - every entry whole,
whatever it holds - must be equal: a plain block stack; a second head only even ranks put in the loss;
and a block each rank skips on odd steps (rank r skips block r % 3, LayerDrop-like). See [Note: one
collective order] in zerofit.engine.engine and [Note: one gather order] in zerofit.engine.gather_order.

tests/test_engine_torch_semantics.py checks the same on 2 real gloo ranks (with values); this adds a
world of 8, where each skipped block is a different one on different ranks, at no process cost.
"""

from __future__ import annotations

import pytest
import torch
from engine_cases import SEQ, VOCAB, TwoHeads, loss_fn
from fake_world import CASES, STEPS, fake_world, run_case

from zerofit.config.schema import OffloadConfig, PrecisionConfig, ZeroConfig
from zerofit.engine import ZeroEngine

WORLD, GAS, MICRO = 8, 2, 2


def plan(model: str, rank: int, step: int) -> tuple[int | None, bool]:
    """(block skipped, head b used) by `rank` at `step`."""
    if model == "head_on_some_ranks":
        return None, rank % 2 == 0
    if model == "rank_skips_a_block":
        return (rank % 3 if step % 2 else None), True
    return None, True


def trace(model: str, rank: int, stage: int, offload: str, step_on: str) -> list:
    """The collectives rank `rank` of a fake world of 8 issues in STEPS steps of its own data."""
    with fake_world(rank, WORLD):
        torch.manual_seed(0)
        net = TwoHeads()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        zero = ZeroConfig(stage=stage, param_persistence_threshold=0,
                          offload_optimizer=OffloadConfig(device=offload, step_on=step_on))
        engine = ZeroEngine(net, opt, zero=zero, precision=PrecisionConfig(mixed_precision="no"),
                            gradient_accumulation_steps=GAS, device=torch.device("cpu"))
        engine.comm.trace = []
        data = torch.Generator().manual_seed(1000 + rank)
        for step in range(STEPS):
            skip, use_b = plan(model, rank, step)
            for _ in range(GAS):
                x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=data)
                a, b = net(x, () if skip is None else (skip,))
                engine.backward(loss_fn(a + b if use_b else a, torch.roll(x, 1, dims=1)))
            engine.step()
        engine.settle()
        return engine.comm.trace


CONFIGS = [(0, "none", "auto"), (1, "none", "auto"), (2, "none", "auto"), (3, "none", "auto"),
           (2, "cpu", "host"), (2, "cpu", "device"), (3, "cpu", "host"), (3, "cpu", "device")]
MODELS = ["block_stack", "head_on_some_ranks", "rank_skips_a_block"]


def _params():
    for model in MODELS:
        for config in CONFIGS:
            yield pytest.param(model, *config, id=f"{model}-stage{config[0]}-{config[1]}-{config[2]}")


@pytest.mark.parametrize("model,stage,offload,step_on", list(_params()))
def test_every_rank_of_eight_issues_the_same_collectives(model, stage, offload, step_on):
    traces = [trace(model, r, stage, offload, step_on) for r in range(WORLD)]
    assert traces[0], "no collective recorded: the fake world did not take the world > 1 paths"
    for r in range(1, WORLD):
        first = next((i for i, (a, b) in enumerate(zip(traces[0], traces[r])) if a != b),
                     min(len(traces[0]), len(traces[r])))
        assert traces[r] == traces[0], (f"rank {r} departs from rank 0 at collective {first}: "
                                        f"{traces[r][first:first + 3]} vs {traces[0][first:first + 3]}")


@pytest.mark.parametrize("world", [2, 8])
def test_the_sanitized_gpu_run_s_cases_run_on_the_cpu(world, tmp_path):
    """The cases tests/test_fake_world_gpu.py runs under the sanitizer, here on the CPU without it, so
    that a change breaking them shows in every run, not only on the device."""
    for case in CASES:
        got = run_case(case, world, "cpu", str(tmp_path))
        assert got["calls"] > 0 and got["stepped"] == STEPS, (str(case), got)
