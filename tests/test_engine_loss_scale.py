"""fp16 loss scaling follows DeepSpeed's rules: hysteresis, window, minimum, static scale."""

from __future__ import annotations

import pytest

from zerofit.config.schema import LossScaleConfig
from zerofit.engine.loss_scale import LossScaler
from zerofit.errors import LossScaleError


def run(config, overflows):
    s = LossScaler(config, enabled=True)
    out = []
    for o in overflows:
        s.update(o)
        out.append(s.scale)
    return out


def test_dynamic_starts_at_initial_power_and_grows_after_window():
    c = LossScaleConfig(initial_scale_power=4, loss_scale_window=3)
    assert run(c, [False] * 7) == [16, 16, 16, 32, 32, 32, 64]


def test_hysteresis_delays_the_first_halving():
    c = LossScaleConfig(initial_scale_power=4, hysteresis=2, loss_scale_window=100)
    assert run(c, [True, True, True]) == [16, 8, 4]


def test_window_counts_from_the_last_overflow_and_refills_hysteresis():
    c = LossScaleConfig(initial_scale_power=4, hysteresis=2, loss_scale_window=2)
    # overflow at 0 spends hysteresis; growth after two clean steps refills it; next overflow spends again
    assert run(c, [True, False, False, False, True, True]) == [16, 16, 16, 32, 32, 16]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    c = LossScaleConfig(initial_scale_power=4, hysteresis=2, loss_scale_window=100, consecutive_hysteresis=True)
    assert run(c, [True, False, True, False, True]) == [16, 16, 16, 16, 16]


def test_minimum_is_respected_then_an_error():
    c = LossScaleConfig(initial_scale_power=2, hysteresis=1, min_loss_scale=1)
    s = LossScaler(c, enabled=True)
    s.update(True)
    s.update(True)
    assert s.scale == 1
    with pytest.raises(LossScaleError, match="minimum loss scale 1.*bf16"):
        s.update(True)


def test_static_scale_never_changes_and_disabled_is_one():
    assert run(LossScaleConfig(loss_scale=128.0), [True, False, True]) == [128.0] * 3
    s = LossScaler(LossScaleConfig(), enabled=False)
    s.update(True)
    assert s.scale == 1.0 and not s.dynamic


def test_state_round_trip():
    a = LossScaler(LossScaleConfig(initial_scale_power=5), enabled=True)
    a.update(True)
    a.update(True)
    b = LossScaler(LossScaleConfig(initial_scale_power=5), enabled=True)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
