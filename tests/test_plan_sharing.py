"""Offload priced at one process's share of the host ([Note: rates shared on one host], #30 item 6): the
same measured rates, N processes per host, host work N times slower; the GPU's own work unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_bandwidth import H200
from test_plan_step_time import COUNTS, WORK

from zerofit.frontend.planning import auto_plan
from zerofit.plan import bandwidth
from zerofit.plan.choose import Budget, plan
from zerofit.plan.memory import Setting
from zerofit.plan.sharing import CPU_ADAM_BYTES, host_memory_gbs, shared_rates, sharing_said

HOST = Setting(stage=2, offload_optimizer="cpu")  # host-stepped: CPU AdamW, gradients down, parameters up
STREAMED = Setting(stage=2, offload_optimizer="cpu", step_on="device")
RECOMPUTE = Setting(stage=0, checkpointing=True)
BUSY = dataclasses.replace(H200, both_busy_gbs=34.0)  # the link beside CPU AdamW measured too


def test_one_process_keeps_the_measured_rates():
    assert shared_rates(H200, 1) is H200
    assert sharing_said(H200, 1) == "on this machine's measured rates"


@pytest.mark.parametrize("rates", [H200, BUSY, dataclasses.replace(BUSY, host_copy_gbs=300.0)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_cpu_and_host_memory_are_divided_and_each_link_capped_by_its_share(rates, n):
    own = shared_rates(rates, n)
    assert own.cpu_adam_s == pytest.approx(n * rates.cpu_adam_s)
    assert own.cpu_adam_busy_s == pytest.approx(n * rates.cpu_adam_busy_s)
    share = host_memory_gbs(rates) / n
    assert own.h2d_gbs == pytest.approx(min(rates.h2d_gbs, share))
    assert own.d2h_gbs == pytest.approx(min(rates.d2h_gbs, share))
    assert own.both_gbs == pytest.approx(min(rates.both_gbs, share / 2))
    assert (own.both_busy_gbs is None) == (rates.both_busy_gbs is None)
    # the N processes together draw no more host memory than one process was seen to draw
    assert n * (2 * own.both_gbs) <= host_memory_gbs(rates) * (1 + 1e-9)
    assert (own.gpu_adam_s, own.gpu_tflops, own.key) == (rates.gpu_adam_s, rates.gpu_tflops, rates.key)


def test_host_memory_is_the_most_traffic_the_probe_saw():
    assert host_memory_gbs(H200) == pytest.approx(max(2 * 49.0, CPU_ADAM_BYTES / 0.252))
    assert host_memory_gbs(BUSY) == pytest.approx(2 * 34.0 + CPU_ADAM_BYTES / 0.388)
    assert host_memory_gbs(dataclasses.replace(BUSY, host_copy_gbs=400.0)) == 400.0  # a copy on every CPU
    assert host_memory_gbs(dataclasses.replace(BUSY, host_copy_gbs=50.0)) == host_memory_gbs(BUSY)


def test_a_host_with_more_memory_bandwidth_keeps_more_of_each_link():
    wide = dataclasses.replace(BUSY, host_copy_gbs=800.0)  # 8 processes: 100 GB/s each, 50 each way
    assert shared_rates(wide, 8).both_gbs == 49.0 and shared_rates(wide, 8).both_busy_gbs == 34.0
    assert shared_rates(wide, 8).cpu_adam_s == pytest.approx(8 * 0.252)  # the cores are shared all the same


def test_bad_process_counts_name_the_value_and_the_fix():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"processes_per_host must be an integer >= 1 \(got {bad!r}\).*"
                                             "LOCAL_WORLD_SIZE"):
            shared_rates(H200, bad)


def _plan(processes_per_host: int):
    budget = Budget(gpu_bytes=None, host_bytes=None, ranks_per_host=processes_per_host)
    return plan(COUNTS, WORK, budget, {False: None, True: None}, settings=[HOST, STREAMED, RECOMPUTE], rates=H200)


def test_four_processes_per_host_price_the_host_work_four_times_slower():
    one, four = _plan(1).seconds, _plan(4).seconds
    # on the H200's figures host stepping waits on the CPU: exactly 4x
    assert four[HOST] == pytest.approx(4 * one[HOST]) and one[HOST] > 0
    # GPU-stepped state streams over a link capped at 1/4 of the host memory the probe saw
    assert one[STREAMED] < four[STREAMED] <= 4 * one[STREAMED] * (1 + 1e-9)
    assert four[RECOMPUTE] == one[RECOMPUTE]  # the GPU's own work is not shared


def test_the_plan_says_its_rates_are_per_process():
    forced = Budget(gpu_bytes=None, host_bytes=None, ranks_per_host=4)
    alone = dataclasses.replace(forced, ranks_per_host=1)
    settings = [HOST]  # the only one listed: its price is in the reason
    text = plan(COUNTS, WORK, forced, {False: None}, settings=settings, rates=H200).reason
    assert ("s a step on this machine's measured rates shared by 4 processes per host (each: CPU AdamW 1.01 s per "
            "1e9 params, link 13.9 GB/s each way)") in text
    assert "s a step on this machine's measured rates;" in plan(COUNTS, WORK, alone, {False: None},
                                                                 settings=settings, rates=H200).reason


def test_processes_per_host_reads_the_launchers_local_world_size(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert auto_plan.processes_per_host(4) == 4  # one machine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert auto_plan.processes_per_host(16) == 8
    assert auto_plan.processes_per_host(1) == 1  # never more than the run's processes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    assert auto_plan.processes_per_host(2) == 2


def test_the_machines_host_share_is_one_processes_share(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    want = bandwidth.best_host_share(shared_rates(BUSY, 8), 10**9, param_bytes=2)
    assert auto_plan.host_share_of(BUSY, 8, 2) == (want if want > 0 else None)
    alone = bandwidth.best_host_share(BUSY, 10**9, param_bytes=2)
    assert auto_plan.host_share_of(BUSY, 1, 2) == (alone if alone > 0 else None)


def test_the_probe_steps_cpu_adamw_on_every_usable_cpu_and_gives_the_threads_back():
    before = torch.get_num_threads()
    with bandwidth._threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
