"""Stage-3 units kept gathered from their backward through the GPU-stepped update into the next forward ([Note:
handover] in zerofit.engine.offload.handover): the same weights, losses and state bit for bit as releasing them.
On CPU the memory rule is replaced by `handover.CPU_BUDGET` (bytes a backward may keep)."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
from engine_cases import Case, batches, loss_fn, max_diff, run_engine

from zerofit.engine.offload import handover
from zerofit.testing.distributed import run_distributed

BASE = Case(stage=3, offload="cpu", offload_param="cpu", step_on="device", chunk=64, clip=0.05, steps=5)
CASES = [BASE, dataclasses.replace(BASE, precision="bf16"), dataclasses.replace(BASE, state="8bit"),
         dataclasses.replace(BASE, precision="bf16", state="8bit", gas=2),
         dataclasses.replace(BASE, clip=0.0),  # updates start during backward: nothing is kept
         dataclasses.replace(BASE, offload="nvme", buffer_count=2)]
BUDGETS = (None, 1 << 40, 3000)
"""Keep nothing (the reference), every eligible unit, a few (the tiny model's units are ~1 KB each)."""


@contextlib.contextmanager
def cpu_budget(budget: int | None):
    """`handover.CPU_BUDGET` set to `budget` inside, None again after."""
    handover.CPU_BUDGET = budget
    try:
        yield
    finally:
        handover.CPU_BUDGET = None


def _runs(rank: int, world: int, nvme_path: str) -> dict:
    out = {}
    for index, case in enumerate(CASES):
        if case.offload == "nvme":
            case = dataclasses.replace(case, nvme_path=nvme_path)
        for budget in BUDGETS:
            with cpu_budget(budget):
                out[index, budget] = run_engine(rank, world, case)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_runs, 1, str(tmp_path_factory.mktemp("nvme")), timeout=600)[0]


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: str(CASES[i]))
def test_kept_units_train_bit_for_bit_as_released_ones(runs, index):
    ref = runs[index, None]
    assert ref["handed_over"] == 0
    for budget in BUDGETS[1:]:
        got = runs[index, budget]
        assert got["losses"] == ref["losses"], budget
        assert max_diff(got["params"], ref["params"]) == 0.0, budget
        assert got["param_offloaded"] > 0 and got["streamed"] > 0
    everything, few = runs[index, BUDGETS[1]]["handed_over"], runs[index, BUDGETS[2]]["handed_over"]
    if CASES[index].clip == 0.0:  # the updates start during backward: a unit kept could be stepped past
        assert everything == few == 0
    else:  # from the second step on, in every backward that closes a window
        windows = CASES[index].steps - 1
        assert everything >= windows * 2 and 0 < few < everything, (everything, few)


def _cuda_runs(rank: int, world: int) -> list[dict]:
    # a batch whose activations outweigh the parameters, so backward frees room for units to stay gathered
    case = dataclasses.replace(BASE, precision="bf16", state="8bit", batch=512, steps=4)
    return [run_engine(rank, world, case, device="cuda"),
            run_engine(rank, world, dataclasses.replace(case, offload_param="none"), device="cuda")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_units_are_kept_within_the_room_backward_freed_and_train_the_same():
    """The memory rule on a GPU: units are kept (from the second step), and training equals parameter offload
    without them bit for bit, as parameter offload equals no parameter offload (tests/test_engine_gpu.py)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    kept, plain = run_distributed(_cuda_runs, 1, timeout=600)[0]
    assert kept["param_offloaded"] > 0 and plain["param_offloaded"] == 0
    assert kept["handed_over"] > 0
    assert kept["losses"] == plain["losses"]
    assert max_diff(kept["params"], plain["params"]) == 0.0


def _around_the_loop(rank: int, world: int, root: str) -> dict:
    """Between steps a script evaluates, saves, trains on and loads the checkpoint back, then trains again: with
    units kept, each of these sees the weights of the last update (a load writes the parameters and releases every
    gathered unit)."""
    from test_checkpoint_support import build

    from zerofit.checkpoint import load_state, save_state

    def train(engine, model, case, steps):  # clipped: the updates wait for step()
        data, losses = batches(case), []
        for step in steps:
            x, y = data[step]
            loss = loss_fn(model(x), y)
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            losses.append(loss.item())
        return losses

    out = {}
    for budget in (None, 1 << 40):
        with cpu_budget(budget):
            case, model, _, engine = build(3, precision="bf16", offload=True, step_on="device", chunk=64,
                                           optimizer_state="8bit", steps=8)
            losses = train(engine, model, case, range(3))
            x = torch.randint(0, 37, (4, 5), generator=torch.Generator().manual_seed(7))
            with torch.no_grad():
                evaluated = model(x).float()
            path = os.path.join(root, str(budget))
            save_state(path, engine, update_latest=False)
            losses += train(engine, model, case, range(3, 5))
            load_state(path, engine)
            losses += train(engine, model, case, range(3, 8))
            out[budget] = {"losses": losses, "evaluated": evaluated, "kept": engine.offload.gpu.handover.kept,
                           "masters": {k: v.clone() for k, v in engine.named_full_tensors("master").items()}}
    return out


def test_kept_units_are_what_evaluation_checkpoints_and_loads_see(tmp_path):
    out = run_distributed(_around_the_loop, 1, str(tmp_path), timeout=600)[0]
    ref, kept = out[None], out[1 << 40]
    assert ref["kept"] == 0 and kept["kept"] > 0
    assert kept["losses"] == ref["losses"]
    assert torch.equal(kept["evaluated"], ref["evaluated"])
    assert max_diff(kept["masters"], ref["masters"]) == 0.0
    # the run after the load repeats the two steps taken after the save
    assert kept["losses"][5:7] == kept["losses"][3:5]


def _checkpointed(rank: int, world: int) -> dict:
    """A transformers model with activation checkpointing (its blocks run forward again inside backward, gathering
    themselves there): kept units or not, the same training."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from zerofit.config.schema import OffloadConfig, PrecisionConfig, ZeroConfig
    from zerofit.engine import ZeroEngine
    out = {}
    for budget in (None, 1 << 40):
        with cpu_budget(budget):
            torch.manual_seed(0)
            model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
            model.gradient_checkpointing_enable()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            offload = OffloadConfig(device="cpu", step_on="device")
            engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=3, param_persistence_threshold=0,
                                                            offload_optimizer=offload,
                                                            offload_param=OffloadConfig(device="cpu")),
                                precision=PrecisionConfig(mixed_precision="bf16"), gradient_clipping=1.0,
                                device=torch.device("cpu"))  # CPU_BUDGET's rule, on a GPU machine too
            model.train()
            g = torch.Generator().manual_seed(3)
            losses = []
            for _ in range(5):
                ids = torch.randint(0, 64, (4, 16), generator=g)
                loss = model(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[budget] = {"losses": losses, "kept": engine.offload.gpu.handover.kept,
                           "masters": {k: v.clone() for k, v in engine.named_full_tensors("master").items()}}
    return out


def test_kept_units_with_activation_checkpointing_train_the_same():
    out = run_distributed(_checkpointed, 1, timeout=600)[0]
    ref, kept = out[None], out[1 << 40]
    assert ref["kept"] == 0 and kept["kept"] > 0
    assert kept["losses"] == ref["losses"]
    assert max_diff(kept["masters"], ref["masters"]) == 0.0
