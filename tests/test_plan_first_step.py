"""The probe: the first optimizer step of a planned run, measured against the estimate and the headroom."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from zerofit import Accelerator
from zerofit.config.naming import key_name
from zerofit.config.schema import AUTO, OffloadConfig, RunConfig, ZeroConfig
from zerofit.frontend.optimizers import AcceleratedOptimizer
from zerofit.frontend.state import GradientState
from zerofit.plan.choose import GPU_RESERVE_BYTES, Budget, plan
from zerofit.plan.first_step_verdict import judge
from zerofit.plan.memory import GIB, ModelCounts, Setting, Workload, all_settings, estimate

# One rank, 300 M parameters in three units: stage 0 needs about 5 GiB, optimizer offload about 0.6 GiB.
COUNTS = ModelCounts(units=(("root", 10_000_000, 0), ("a", 145_000_000, 0), ("b", 145_000_000, 0)), buffer_bytes=0)
WORK = Workload(mixed_precision="bf16")
SETTINGS = all_settings(1, checkpointing=(False,))


def _plan(budget: Budget):
    return plan(COUNTS, WORK, budget, {False: None}, settings=SETTINGS)


def _stage0_fits() -> Budget:
    need = estimate(COUNTS, Setting(stage=0), WORK, None).gpu_total
    return Budget(gpu_bytes=int((need + GPU_RESERVE_BYTES) / 0.9) + GIB, host_bytes=None)


def test_a_peak_within_the_budget_prints_one_line():
    budget = _stage0_fits()
    result = _plan(budget)
    assert result.choice.setting == Setting(stage=0)
    peak = result.choice.gpu_total + GIB // 2
    verdict = judge(peak, result, budget)
    allowance = budget.gpu_allowance(result.choice)
    assert verdict.line == (f"zerofit: probe: measured peak {peak / GIB:.2f} GiB vs estimate "
                            f"{result.choice.gpu_total / GIB:.2f} GiB without activations (budget "
                            f"{allowance / GIB:.2f} GiB) after the first optimizer step under DDP (stage 0)")
    assert verdict.warning is None and verdict.next_setting is None


def test_a_peak_over_the_headroom_names_the_next_setting_in_the_users_keys():
    budget = _stage0_fits()
    result = _plan(budget)
    peak = budget.gpu_allowance(result.choice) + 1
    verdict = judge(peak, result, budget, spell=lambda key: key_name("deepspeed", key))
    assert verdict.next_setting == Setting(stage=2, offload_optimizer="cpu")
    assert verdict.warning.startswith("zerofit: WARNING: probe: DDP (stage 0) leaves less than the 10% headroom the "
                                      "planner demanded")
    assert ("write the next setting instead of auto: zero_optimization.stage: 2, "
            "zero_optimization.offload_optimizer.device: cpu, zero_optimization.offload_param.device: none "
            "(ZeRO-2 + opt cpu") in verdict.warning


def test_when_nothing_slower_fits_either_the_warning_says_what_to_lower():
    budget = _stage0_fits()
    result = _plan(budget)
    verdict = judge(budget.gpu_bytes * 2, result, budget)
    assert verdict.next_setting is None
    assert "No slower setting fits" in verdict.warning and "lower the micro-batch" in verdict.warning


def test_an_unknown_budget_is_never_a_warning():
    result = _plan(Budget(gpu_bytes=None, host_bytes=None))
    verdict = judge(100 * GIB, result, Budget(gpu_bytes=None, host_bytes=None))
    assert "(budget unknown)" in verdict.line and verdict.warning is None


def test_without_a_gpu_the_allowance_is_what_the_host_leaves():
    budget = Budget(gpu_bytes=None, host_bytes=64 * GIB, ranks_per_host=2, unified=True)
    e = _plan(budget).choice
    # the host rule of a unified budget, solved for the device total
    assert budget.gpu_allowance(e) == int(0.9 * 64 * GIB / 2) - 3 * GIB // 2 - e.host_total
    assert budget.host_fits(estimate(COUNTS, e.setting, WORK, None))


# --- end to end, on CPU, with the measured peak injected -------------------------------------------------
AUTO_ZERO = ZeroConfig(stage=AUTO, offload_optimizer=OffloadConfig(device=AUTO),
                       offload_param=OffloadConfig(device=AUTO))


def _train(acc, peak: int | None, steps: int = 3) -> list[int]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = [{"input_ids": torch.randint(0, 64, (16,))} for _ in range(4 * steps)]
    model, opt, dl = acc.prepare(model, opt, DataLoader(rows, batch_size=4))
    assert acc._probe.measure is None  # no CUDA: nothing to measure unless a test says what was measured
    calls = []
    if peak is not None:
        acc._probe.measure = lambda: calls.append(peak) or peak  # the test hook
    for batch in dl:
        with acc.accumulate(model):
            acc.backward(model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss)
            opt.step()
            opt.zero_grad()
    return calls


def test_first_step_prints_the_probe_line_once(monkeypatch, capsys):
    monkeypatch.setenv("ZEROFIT_HOST_MEMORY_GIB", "64")
    acc = Accelerator(config=RunConfig(zero=AUTO_ZERO), cpu=True)
    assert _train(acc, peak=GIB) == [GIB]  # measured once, on the first step only
    out, err = capsys.readouterr()
    assert out.count("zerofit: probe: measured peak 1.00 GiB vs estimate ") == 1
    assert "after the first optimizer step under DDP (stage 0)" in out and "WARNING" not in err
    assert acc._probe.verdict.warning is None


def test_a_peak_beyond_the_headroom_is_a_loud_warning(monkeypatch, capsys):
    monkeypatch.setenv("ZEROFIT_HOST_MEMORY_GIB", "64")
    acc = Accelerator(config=RunConfig(zero=AUTO_ZERO), cpu=True)
    _train(acc, peak=63 * GIB)
    out, err = capsys.readouterr()
    assert "zerofit: probe: measured peak 63.00 GiB" in out
    assert "zerofit: WARNING: probe: DDP (stage 0) leaves less than the 10% headroom" in err
    assert acc.config.zero.stage == 0  # reported, never switched mid-run


def test_without_auto_there_is_no_probe():
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=0)), cpu=True)
    model = torch.nn.Linear(4, 4)
    _, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    assert acc._probe is None and opt.after_step is None


class _Engine:
    backward_in_window = True

    def __init__(self, results):
        self.results = list(results)

    def step(self) -> bool:
        return self.results.pop(0)


def test_the_hook_waits_for_a_step_that_is_not_skipped():
    """An fp16 step skipped on overflow allocates no optimizer state: the probe waits for a real one."""
    calls = []
    opt = AcceleratedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), _Engine([False, True, True]),
                               GradientState(1))
    opt.after_step = lambda: calls.append(opt.steps_taken)
    for _ in range(3):
        opt.step()
    assert calls == [2] and opt.after_step is None
