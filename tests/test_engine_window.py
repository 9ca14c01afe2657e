"""The accumulation window: one object the engine, `GradientState` and the back-off share."""

from __future__ import annotations

import pytest
import torch
from engine_cases import Case, make_model_and_optim
from torch import nn

from zerofit.config.schema import OffloadConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.window import AccumulationWindow
from zerofit.errors import EngineError
from zerofit.frontend.state import GradientState
from zerofit.testing.distributed import run_distributed


def _engine(steps):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, ZeroEngine(model, opt, gradient_accumulation_steps=steps, device=torch.device("cpu"))


def _loss(model):
    return model(torch.ones(3, 4)).square().mean()


@pytest.mark.parametrize("steps", [0, -1, 1.5, None, True])
def test_steps_must_be_a_whole_number_of_at_least_one(steps):
    with pytest.raises(EngineError, match=r"gradient_accumulation_steps must be a whole number >= 1 \(got "):
        AccumulationWindow(steps)
    window = AccumulationWindow(2)
    with pytest.raises(EngineError, match="must be a whole number >= 1"):
        window.steps = steps
    assert window.steps == 2


def test_the_engine_counts_micro_steps_when_no_one_passes_sync():
    model, engine = _engine(2)
    assert engine.at_boundary and engine.window.micro_step == 0
    engine.backward(_loss(model))
    assert not engine.at_boundary and engine.window.micro_step == 1
    engine.backward(_loss(model))
    assert engine.at_boundary and engine.window.micro_step == 0
    engine.gradient_accumulation_steps = 3
    assert engine.window.steps == 3


def test_a_given_sync_leaves_the_shared_counter_to_its_owner():
    state = GradientState(2)
    assert isinstance(state.window, AccumulationWindow) and state.gradient_accumulation_steps == 2
    model, engine = _engine(state.window)
    assert engine.window is state.window
    state.micro_step = 1
    engine.backward(_loss(model), sync=False)
    assert not engine.at_boundary and state.micro_step == 1
    engine.backward(_loss(model), sync=True)
    assert engine.at_boundary and state.micro_step == 1
    state.gradient_accumulation_steps = 4  # what the out-of-memory back-off does
    assert engine.gradient_accumulation_steps == 4


def test_discard_window_forgets_the_partial_window():
    model, engine = _engine(2)
    engine.backward(_loss(model))
    engine.discard_window()
    assert engine.at_boundary and engine.window.micro_step == 0
    assert all(float(g.grad_shard.abs().sum()) == 0.0 for g in engine.groups if g.trainable)
    assert not engine.forward_communicates and not engine.shards_parameters  # one rank, stage 0


def _forward_facts(rank, world):
    out = {}
    for name, zero in (("stage0", ZeroConfig(stage=0)), ("stage2", ZeroConfig(stage=2)),
                       ("stage3", ZeroConfig(stage=3, param_persistence_threshold=0)),
                       ("offload", ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu")))):
        model, opt = make_model_and_optim(Case())
        engine = ZeroEngine(model, opt, zero=zero, device=torch.device("cpu"))
        out[name] = (engine.forward_communicates, engine.shards_parameters)
    return out


def test_forward_communicates_under_stage_3_or_host_steps_on_several_ranks():
    facts = run_distributed(_forward_facts, 2)[0]
    assert facts == {"stage0": (False, False), "stage2": (False, False), "stage3": (True, True),
                     "offload": (True, False)}
