"""Offloaded updates that start during backward stay exact, or stop starting early, loudly: host-stepped
(the CPU worker) and GPU-stepped (the issuing thread; on CPU the host stands in for the device).

See [Note: updates during backward] in zerofit.engine.offload.early. Parity of the early path with
on-device training is covered by tests/test_engine_offload.py; these are the script behaviours that could
change a step after the engine started it.
"""

from __future__ import annotations

import warnings

import torch
from engine_cases import Case, batches, loss_fn, make_model_and_optim, max_diff

from zerofit.config.schema import OffloadConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.errors import EngineError
from zerofit.testing.distributed import run_distributed

STEP_ON = ("host", "device")


def _engine(stage: int = 2, step_on: str = "host"):
    model, opt = make_model_and_optim(Case())
    zero = ZeroConfig(stage=stage, offload_optimizer=OffloadConfig(device="cpu", step_on=step_on))
    return model, opt, ZeroEngine(model, opt, zero=zero, device=torch.device("cpu"))


def _early(engine) -> int:
    return engine.times.host_steps_in_backward + engine.times.gpu_steps_in_backward


def _backward(model, engine, x, y, rank, world):
    micro = x.shape[0] // world
    engine.backward(loss_fn(model(x[rank * micro:(rank + 1) * micro]), y[rank * micro:(rank + 1) * micro]))


def _late_clip(rank, world, max_norm):
    """Per part: (updates started in the last window, the norm or the error, the masters after the step)."""
    out = {}
    for step_on in STEP_ON:
        model, _, engine = _engine(step_on=step_on)
        data = batches(Case(steps=3))
        for x, y in data[:2]:
            _backward(model, engine, x, y, rank, world)
            engine.step()
        _backward(model, engine, *data[2], rank, world)
        early = _early(engine)
        try:
            norm = float(engine.clip_grad_norm_(max_norm))
        except EngineError as e:
            out[step_on] = (early, str(e), None)
            continue
        engine.step()
        out[step_on] = (early, norm, engine.named_full_tensors("master"))
    return out


def _plain(rank, world):
    """The same three steps without offload: the norm of the last window and the masters after it."""
    model, opt = make_model_and_optim(Case())
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=2), device=torch.device("cpu"))
    data = batches(Case(steps=3))
    for x, y in data[:2]:
        _backward(model, engine, x, y, rank, world)
        engine.step()
    _backward(model, engine, *data[2], rank, world)
    norm = float(engine.clip_grad_norm_(1e6))
    engine.step()
    return norm, engine.named_full_tensors("master")


def test_first_clip_after_an_early_step_raises_when_it_would_bite():
    for per_part in run_distributed(_late_clip, 2, 1e-3):
        for step_on, (early, msg, _) in per_part.items():
            assert early > 0, step_on
            assert isinstance(msg, str)
            assert "set gradient_clipping: 0.001 in the config" in msg and "optimizer step 3" in msg


def test_first_clip_after_an_early_step_that_does_not_bite_returns_the_norm_and_steps_exactly():
    ranks = run_distributed(_late_clip, 2, 1e6)
    plain_norm, plain_masters = run_distributed(_plain, 2)[0]
    for step_on in STEP_ON:
        (e0, n0, m0), (_, n1, _) = ranks[0][step_on], ranks[1][step_on]
        assert e0 > 0 and n0 == n1 == plain_norm, step_on
        assert max_diff(m0, plain_masters) == 0.0, step_on


def _clipping_script(rank, world):
    """A script that clips every step: never early, so clipping stays exact."""
    out = []
    for step_on in STEP_ON:
        model, _, engine = _engine(stage=3, step_on=step_on)
        for x, y in batches(Case(steps=3)):
            _backward(model, engine, x, y, rank, world)
            engine.clip_grad_norm_(1.0)
            engine.step()
        out.append(_early(engine))
    return out


def test_a_script_that_clips_never_starts_early():
    assert run_distributed(_clipping_script, 2) == [[0, 0], [0, 0]]


def _lr_between_backward_and_step(rank, world):
    out = {}
    for step_on in STEP_ON:
        model, opt, engine = _engine(step_on=step_on)
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
        out[step_on] = (_early(engine), caught, engine.early_off)
    return out


def test_settings_changed_after_backward_stop_early_steps_with_a_warning():
    for step_on, (early, caught, off) in run_distributed(_lr_between_backward_and_step, 1)[0].items():
        assert early > 0, step_on
        assert any("changed between backward and step()" in m for m in caught), step_on
        assert off is not None and "lr" in off


def _backward_twice(rank, world):
    """Step 1 as usual; in window 2 a second backward after the one that closed it."""
    out = {}
    for step_on in STEP_ON:
        model, _, engine = _engine(step_on=step_on)
        data = batches(Case(steps=2))
        _backward(model, engine, *data[0], rank, world)
        engine.step()
        x, y = data[1]
        micro = x.shape[0] // world
        loss = loss_fn(model(x[rank * micro:(rank + 1) * micro]), y[rank * micro:(rank + 1) * micro])
        engine.backward(loss, retain_graph=True)
        try:
            engine.backward(loss * 0.5)  # no forward between: the graph is kept
            out[step_on] = "no error"
        except EngineError as e:
            out[step_on] = str(e)
    return out


def test_a_second_backward_after_an_early_start_raises():
    for step_on, msg in run_distributed(_backward_twice, 1)[0].items():
        assert "backward ran again after the backward that closed accumulation window 2" in msg, step_on
        assert "call backward once per optimizer step" in msg


def _forward_between(rank, world, always):
    """A no-grad forward between backward and step(): every step (`always`), else only in window 3. Per part:
    (updates started early, the error if any, the masters at the end)."""
    out = {}
    for step_on in STEP_ON:
        model, _, engine = _engine(step_on=step_on)
        error = None
        for i, (x, y) in enumerate(batches(Case(steps=3))):
            _backward(model, engine, x, y, rank, world)
            try:
                if always or i == 2:
                    with torch.no_grad():
                        model(x)
            except EngineError as e:
                error = str(e)
                break
            engine.step()
        out[step_on] = (_early(engine), error, None if error else engine.named_full_tensors("master"))
    return out


def _plain_steps(rank, world):
    model, opt = make_model_and_optim(Case())
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=2), device=torch.device("cpu"))
    for x, y in batches(Case(steps=3)):
        _backward(model, engine, x, y, rank, world)
        engine.step()
    return engine.named_full_tensors("master")


def test_a_forward_between_backward_and_step_keeps_updates_out_of_backward_and_stays_exact():
    plain = run_distributed(_plain_steps, 1)[0]
    for step_on, (early, error, masters) in run_distributed(_forward_between, 1, True)[0].items():
        assert early == 0 and error is None, step_on
        assert max_diff(masters, plain) == 0.0, step_on


def test_a_forward_between_backward_and_step_after_an_early_start_raises():
    for step_on, (early, error, _) in run_distributed(_forward_between, 1, False)[0].items():
        assert early > 0, step_on
        assert "run or read between backward and optimizer.step() in accumulation window 3" in error, step_on
        assert "set gradient_clipping" in error


def _measured_norms(rank, world):
    """clip_grad_norm_(inf) every step (Trainer's way of logging the norm without clipping): per part, (updates
    started early, the norms, the masters)."""
    out = {}
    for step_on in STEP_ON + ("none",):
        model, opt = make_model_and_optim(Case())
        offload = OffloadConfig(device="cpu", step_on=step_on) if step_on != "none" else OffloadConfig()
        engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=2, offload_optimizer=offload), device=torch.device("cpu"))
        norms = []
        for x, y in batches(Case(steps=3)):
            _backward(model, engine, x, y, rank, world)
            norms.append(float(engine.clip_grad_norm_(float("inf"))))
            engine.step()
        out[step_on] = (_early(engine), norms, engine.named_full_tensors("master"))
    return out


def test_measuring_the_norm_with_an_infinite_max_norm_keeps_updates_in_backward_and_exact():
    per_part = run_distributed(_measured_norms, 2)[0]
    _, plain_norms, plain = per_part.pop("none")
    for step_on, (early, norms, masters) in per_part.items():
        assert early > 0, step_on
        assert norms == plain_norms, step_on
        assert max_diff(masters, plain) == 0.0, step_on


def _plain_backward_then_forward(rank, world):
    """The plain-PyTorch habit, `loss.backward()`, with a forward between backward and step() in window 4."""
    out = {}
    for step_on in STEP_ON:
        model, _, engine = _engine(step_on=step_on)
        error = None
        for i, (x, y) in enumerate(batches(Case(steps=4))):
            loss_fn(model(x), y).backward()
            if i == 3:
                try:
                    with torch.no_grad():
                        model(x)
                except EngineError as e:
                    error = str(e)
            engine.step()
        out[step_on] = (_early(engine), error)
    return out


def test_a_plain_loss_backward_starts_early_and_a_forward_after_it_raises():
    for step_on, (early, error) in run_distributed(_plain_backward_then_forward, 1)[0].items():
        assert early > 0, step_on
        assert error is not None and "between backward and optimizer.step() in accumulation window 4" in error
