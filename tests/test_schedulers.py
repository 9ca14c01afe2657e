"""The config-named schedules against closed forms of DeepSpeed's formulas, and the scheduler wrapper's rules.

`lrs[t]` is the lr after construction (t = 0) and after t `step()` calls; DeepSpeed's iteration is t - 1.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from zerofit.config import load_config
from zerofit.config.schema import SchedulerConfig
from zerofit.errors import ConfigError
from zerofit.frontend.schedulers import (
    AcceleratedScheduler,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

STEPS = 40


def _optim(lr: float = 0.1, kind=torch.optim.SGD, groups: int = 1):
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return kind(params, lr=lr)


def _curve(sched, steps: int = STEPS, key: str = "lr") -> list:
    opt = sched.optimizer
    values = [opt.param_groups[0][key]]
    for _ in range(steps):
        opt.step()
        sched.step()
        values.append(opt.param_groups[0][key])
    return values


def _warm(i: int, n: int, kind: str) -> float:
    return math.log(i + 1) / math.log(n) if kind == "log" else i / n


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_rises_from_min_to_max_then_stays(kind):
    lo, hi, n = 0.01, 0.5, 10
    got = _curve(WarmupLR(_optim(), warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=n, warmup_type=kind))
    want = [lo] + [lo + (hi - lo) * (_warm(i, n, kind) if i < n else 1.0) for i in range(STEPS)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[-1] == pytest.approx(hi)


def test_warmup_lr_max_defaults_to_the_optimizers_lr_and_warmup_floor_is_two_steps():
    got = _curve(WarmupLR(_optim(lr=0.3), warmup_num_steps=1, warmup_type="linear"), steps=4)
    assert got == pytest.approx([0.0, 0.0, 0.15, 0.3, 0.3])


def test_warmup_decay_lr_decays_linearly_to_zero_at_total_num_steps():
    lo, hi, n, total = 0.0, 0.2, 5, 30
    got = _curve(WarmupDecayLR(_optim(), total_num_steps=total, warmup_min_lr=lo, warmup_max_lr=hi,
                               warmup_num_steps=n, warmup_type="linear"))
    want = [lo]
    for i in range(STEPS):
        gamma = i / n if i < n else max(0.0, (total - i) / max(1.0, total - n))
        want.append(lo + (hi - lo) * gamma)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert got[total + 1] == 0.0 and got[-1] == 0.0


def test_warmup_cosine_lr_is_a_ratio_of_each_groups_lr():
    n, total, floor, start = 8, 30, 0.01, 0.1
    opt = _optim(lr=0.4, groups=2)
    opt.param_groups[1]["lr"] = 0.2
    sched = WarmupCosineLR(opt, total_num_steps=total, warmup_min_ratio=start, warmup_num_steps=n,
                           cos_min_ratio=floor)
    got = _curve(sched)

    def ratio(i):
        if i < n:
            return start + _warm(i, n, "log") * (1 - start)
        progress = min(1.0, (i - n + 1) / (total - n))
        return max(0.0, floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)

    assert got == pytest.approx([0.0] + [0.4 * ratio(i) for i in range(STEPS)], rel=1e-12)
    assert opt.param_groups[1]["lr"] == pytest.approx(0.2 * floor)  # second group: its own lr times the ratio


def test_one_cycle_lr_and_momentum_then_decay():
    lo, hi, up, down, decay_every, rate = 0.01, 0.1, 6, 4, 2, 0.5
    opt = _optim(kind=torch.optim.Adam)
    sched = OneCycle(opt, cycle_min_lr=lo, cycle_max_lr=hi, cycle_first_step_size=up, cycle_second_step_size=down,
                     decay_step_size=decay_every, decay_lr_rate=rate, cycle_min_mom=0.85, cycle_max_mom=0.95)
    lrs, betas = [opt.param_groups[0]["lr"]], [opt.param_groups[0]["betas"]]
    for _ in range(STEPS):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        betas.append(opt.param_groups[0]["betas"])
    total = up + down

    def scale(i):
        pos = (i + 1) % total
        return pos / up if pos <= up else (total - pos) / down

    for t in range(STEPS + 1):
        i = t - 1
        if i < total:
            want_lr, want_mom = lo + (hi - lo) * scale(i), 0.95 - 0.1 * scale(i)
        else:
            want_lr, want_mom = lo / (1 + rate * (i - total + 1) / decay_every), 0.95
        assert lrs[t] == pytest.approx(want_lr, rel=1e-12), t
        assert betas[t][0] == pytest.approx(want_mom, rel=1e-12) and betas[t][1] == 0.999  # keeps beta2


def test_one_cycle_stairs_hold_the_lr_flat():
    sched = OneCycle(_optim(), cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_first_stair_count=2)
    got = _curve(sched, steps=8)
    assert got == pytest.approx([0.0, 0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0])


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_grows_from_the_min_lr(staircase):
    lo, size, rate = 0.001, 5, 2.0
    got = _curve(LRRangeTest(_optim(), lr_range_test_min_lr=lo, lr_range_test_step_size=size,
                             lr_range_test_step_rate=rate, lr_range_test_staircase=staircase))
    f = math.floor if staircase else (lambda v: v)
    assert got == pytest.approx([lo * (1 + rate * f(t / size)) for t in range(STEPS + 1)], rel=1e-12)


def test_schedule_state_round_trips_and_resumes_mid_run():
    a = WarmupDecayLR(_optim(), total_num_steps=20, warmup_num_steps=4, warmup_max_lr=0.1)
    for _ in range(7):
        a.step()
    b = WarmupDecayLR(_optim(), total_num_steps=20, warmup_num_steps=4, warmup_max_lr=0.1)
    b.load_state_dict(a.state_dict())
    a.step()
    b.step()
    assert a.get_last_lr() == b.get_last_lr()
    c = WarmupDecayLR(_optim(), total_num_steps=20, warmup_num_steps=4, warmup_max_lr=0.1, last_batch_iteration=7)
    assert c.get_last_lr() == pytest.approx(a.get_last_lr())


def test_zero_warmup_steps_load_and_warm_up_over_deepspeeds_floor_of_two(tmp_path):
    """The blog's ZeRO-3 JSON writes warmup_num_steps 0; DeepSpeed floors warm-up at 2 steps."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                                "scheduler": {"type": "WarmupDecayLR", "params": {
                                    "warmup_min_lr": 0, "warmup_max_lr": 0.1, "warmup_num_steps": 0,
                                    "total_num_steps": 10}}}))
    named = load_config(path).scheduler
    sched = build_scheduler(named, _optim())
    assert named.params["warmup_num_steps"] == 0 and sched.warmup_num_steps == 2
    floor = WarmupDecayLR(_optim(), warmup_min_lr=0, warmup_max_lr=0.1, warmup_num_steps=2, total_num_steps=10)
    for _ in range(4):
        assert sched.get_last_lr() == floor.get_last_lr()
        for s in (sched, floor):
            s.optimizer.step()
            s.step()


def test_build_scheduler_from_config_and_its_errors():
    opt = _optim()
    sched = build_scheduler(SchedulerConfig(type="warmupdecaylr", params={"total_num_steps": 10,
                                                                          "warmup_num_steps": 2}), opt)
    assert isinstance(sched, WarmupDecayLR) and sched.total_num_steps == 10
    with pytest.raises(ConfigError, match="scheduler.type 'Cosine' is not a known schedule"):
        build_scheduler(SchedulerConfig(type="Cosine"), opt)
    with pytest.raises(ConfigError, match="warmup_type must be 'log' or 'linear'"):
        build_scheduler(SchedulerConfig(type="WarmupLR", params={"warmup_type": "cosine"}), opt)
    with pytest.raises(ValueError, match="warmup_min_lr has 3 values but the optimizer has 1 param groups"):
        WarmupLR(opt, warmup_min_lr=[0.0, 0.0, 0.0])


class _Opt:
    def __init__(self):
        self.step_was_skipped = False


def test_wrapper_steps_only_on_sync_steps_not_after_skips_and_steps_per_call_times():
    sched = torch.optim.lr_scheduler.LambdaLR(_optim(), lambda s: 1.0 / (1 + s))
    sync, opt = [False], _Opt()
    wrapped = AcceleratedScheduler(sched, lambda: [opt], sync_gradients=lambda: sync[0], steps_per_call=3)
    wrapped.step()
    assert sched.last_epoch == 0  # accumulating: no step
    sync[0] = True
    wrapped.step()
    assert sched.last_epoch == 3  # one optimizer step = num_processes scheduler steps
    opt.step_was_skipped = True
    wrapped.step()
    assert sched.last_epoch == 3  # fp16 overflow skipped the optimizer step
    free = AcceleratedScheduler(sched, lambda: [opt], sync_gradients=lambda: False, step_with_optimizer=False)
    free.step()
    assert sched.last_epoch == 4 and free.get_last_lr() == sched.get_last_lr()


def test_wrapper_never_steps_one_cycle_lr_past_its_total_steps():
    sched = torch.optim.lr_scheduler.OneCycleLR(_optim(), max_lr=1.0, total_steps=5)
    wrapped = AcceleratedScheduler(sched, lambda: [], sync_gradients=lambda: True, steps_per_call=2)
    for _ in range(5):
        wrapped.step()  # would raise inside OneCycleLR past step 5
    assert sched._step_count == 6
