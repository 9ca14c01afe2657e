"""Host optimizer steps that start during backward stay exact, or stop starting early, loudly.

See [Note: host steps during backward] in zerofit.engine.engine. Parity of the early path with
on-device training is covered by tests/test_engine_offload.py; these are the script behaviours that could
change a step after the engine started it.
"""

from __future__ import annotations

import warnings

import torch
from engine_cases import Case, batches, loss_fn, make_model_and_optim

from zerofit.config.schema import OffloadConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.errors import EngineError
from zerofit.testing.distributed import run_distributed


def _engine(stage: int = 2):
    model, opt = make_model_and_optim(Case())
    zero = ZeroConfig(stage=stage, offload_optimizer=OffloadConfig(device="cpu"))
    return model, opt, ZeroEngine(model, opt, zero=zero, device=torch.device("cpu"))


def _backward(model, engine, x, y, rank, world):
    micro = x.shape[0] // world
    engine.backward(loss_fn(model(x[rank * micro:(rank + 1) * micro]), y[rank * micro:(rank + 1) * micro]))


def _late_clip(rank, world, max_norm):
    model, _, engine = _engine()
    data = batches(Case(steps=3))
    for x, y in data[:2]:
        _backward(model, engine, x, y, rank, world)
        engine.step()
    _backward(model, engine, *data[2], rank, world)
    early = engine.times.host_steps_in_backward
    try:
        norm = float(engine.clip_grad_norm_(max_norm))
    except EngineError as e:
        return early, str(e)
    engine.step()
    return early, norm


def test_first_clip_after_an_early_step_raises_when_it_would_bite():
    for early, msg in run_distributed(_late_clip, 2, 1e-3):
        assert early > 0
        assert isinstance(msg, str)
        assert "set gradient_clipping: 0.001 in the config" in msg and "optimizer step 3" in msg


def test_first_clip_after_an_early_step_that_does_not_bite_returns_the_norm():
    (e0, n0), (e1, n1) = run_distributed(_late_clip, 2, 1e6)
    assert e0 > 0 and n0 == n1 and n0 > 0


def _clipping_script(rank, world):
    """A script that clips every step: never early, so clipping stays exact."""
    model, _, engine = _engine(stage=3)
    for x, y in batches(Case(steps=3)):
        _backward(model, engine, x, y, rank, world)
        engine.clip_grad_norm_(1.0)
        engine.step()
    return engine.times.host_steps_in_backward


def test_a_script_that_clips_never_starts_early():
    assert run_distributed(_clipping_script, 2) == [0, 0]


def _lr_between_backward_and_step(rank, world):
    model, opt, engine = _engine()
    data = batches(Case(steps=4))
    caught = []
    for i, (x, y) in enumerate(data):
        _backward(model, engine, x, y, rank, world)
        if i == 2:
            for g in opt.param_groups:
                g["lr"] = g["lr"] / 2
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            engine.step()
        caught += [str(m.message) for m in w]
    return engine.times.host_steps_in_backward, caught, engine.early_off


def test_settings_changed_after_backward_stop_early_steps_with_a_warning():
    early, caught, off = run_distributed(_lr_between_backward_and_step, 1)[0]
    assert early > 0
    assert any("changed between backward and step()" in m for m in caught)
    assert off is not None and "lr" in off
