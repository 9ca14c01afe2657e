"""A split of GPU-stepped offload: some offloaded units stepped on the host while the others stream.

Which units (`host_stepped_units`), how the config spells it (`offload_optimizer.host_share`), how the
memory model and the planner treat it, and how a machine's measured rates become the planner's
choice. That a split trains exactly as no offload is in tests/test_engine_gpu_step.py (CPU) and
tests/test_engine_gpu.py (GPU).
"""

from __future__ import annotations

import dataclasses
import json
import socket
from types import SimpleNamespace

import pytest
import torch
from test_plan_ratio import Blocks

from zerofit.config import load_config
from zerofit.config.schema import AUTO, OffloadConfig, RunConfig, ZeroConfig
from zerofit.engine.policy import StateHome, host_share_for, host_stepped_units, offloaded_units, state_homes
from zerofit.errors import ConfigError
from zerofit.frontend.planning import auto_plan
from zerofit.plan import bandwidth
from zerofit.plan.auto import candidates, choose, describe
from zerofit.plan.choose import GPU_RESERVE_BYTES, Budget
from zerofit.plan.memory import ModelCounts, Setting, Workload, estimate


@pytest.mark.parametrize(("share", "expected"), [(0.0, set()), (0.01, {5}), (0.5, {4, 5}), (0.51, {3, 4, 5}),
                                                 (1.0, {2, 3, 4, 5})])
def test_host_stepped_units_are_the_last_of_the_offloaded_ones(share, expected):
    numels = [10, 10, 10, 10, 10, 10]
    offloaded = offloaded_units(numels, 0.6)  # units 2-5
    assert offloaded == {2, 3, 4, 5}
    assert host_stepped_units(numels, offloaded, share) == expected


@pytest.mark.parametrize(("step_on", "share", "cuda", "nvme", "expected"), [
    ("auto", None, True, False, 0.0), ("auto", 0.4, True, False, 0.4), ("auto", 0.4, False, False, 1.0),
    ("auto", 0.4, True, True, 1.0), ("device", 0.3, False, False, 0.3), ("host", None, True, False, 1.0),
])
def test_host_share_for(step_on, share, cuda, nvme, expected):
    assert host_share_for(step_on, share, cuda=cuda, nvme=nvme) == expected


def _load(tmp_path, offload: dict) -> RunConfig:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", **offload}}}))
    return load_config(str(path))


def test_the_config_key_reads_and_defaults_to_auto(tmp_path):
    assert _load(tmp_path, {}).zero.offload_optimizer.host_share is None  # unset: the machine's rates decide
    assert _load(tmp_path, {"host_share": "auto"}).zero.offload_optimizer.host_share is AUTO
    assert _load(tmp_path, {"host_share": 0.25}).zero.offload_optimizer.host_share == 0.25
    assert _load(tmp_path, {"step_on": "host", "host_share": 1}).zero.offload_optimizer.host_share == 1


@pytest.mark.parametrize(("offload", "match"), [
    ({"host_share": 1.5}, r"offload_optimizer\.host_share must be in \[0, 1\] \(got 1\.5\)"),
    ({"step_on": "host", "host_share": 0.5}, r"host_share 0\.5 contradicts .*step_on 'host'.*remove one of them"),
])
def test_bad_host_shares_name_the_key_the_value_and_the_fix(tmp_path, offload, match):
    with pytest.raises(ConfigError, match=match):
        _load(tmp_path, offload)


def test_the_memory_model_counts_the_host_stepped_part_on_the_host():
    counts = ModelCounts.of(Blocks())
    work = Workload(mixed_precision="bf16")
    streamed, split = (estimate(counts, Setting(stage=2, offload_optimizer="cpu", step_on="device", host_share=h),
                                work, None) for h in (0.0, 0.5))
    assert split.host_grads > 0 == streamed.host_grads  # host-stepped gradients live on the host
    assert split.grads < streamed.grads
    # the host-stepped part's masters are fp32 in host memory; GPU-stepped ones are kept packed between steps
    assert split.host_optimizer > streamed.host_optimizer
    assert "(GPU-stepped, 50% on the CPU)" in split.setting.label
    with pytest.raises(ValueError, match="host_share must be in"):
        Setting(stage=2, offload_optimizer="cpu", step_on="host", host_share=0.5)


def test_the_planner_tries_the_split_before_no_split_and_writes_it_down(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPU-stepped offload is listed
    zero = ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu", ratio=AUTO))
    listed = candidates(RunConfig(zero=zero), 1, False, host_share=0.55)
    assert [s.host_share for s in listed] == [0.55, 0.0]
    model = Blocks()
    config, result = choose(RunConfig(zero=zero), model, world=1, shape=None, host_share=0.55,
                            budget=Budget(gpu_bytes=GPU_RESERVE_BYTES + 10**6, host_bytes=None, headroom=0.0))
    assert config.zero.offload_optimizer.host_share == 0.55 and result.choice.setting.host_share == 0.55
    assert "zero.offload_optimizer.host_share" in describe(RunConfig(zero=zero), result)
    written = dataclasses.replace(zero, offload_optimizer=OffloadConfig(device="cpu", ratio=AUTO, host_share=0.2))
    assert [s.host_share for s in candidates(RunConfig(zero=written), 1, False, host_share=0.55)] == [0.2]


H200 = bandwidth.Rates(h2d_gbs=55.3, d2h_gbs=55.4, both_gbs=50.2, cpu_adam_s=0.21, cpu_adam_busy_s=0.29,
                       gpu_adam_s=0.008, device_name="NVIDIA H200", torch_version=torch.__version__,
                       host=socket.gethostname(), cpus=16, measured_at="2026-12-03T18:00:00+00:00")


def test_the_machines_share_comes_from_its_measured_rates():
    assert auto_plan.host_share_of(None, 1, 2) is None  # nothing measured: no split
    share = auto_plan.host_share_of(H200, 1, 2)
    assert share == bandwidth.best_host_share(H200, 10**9, param_bytes=2) and 0 < share < 1
    slow_cpu = dataclasses.replace(H200, cpu_adam_s=50.0, cpu_adam_busy_s=50.0)
    assert auto_plan.host_share_of(slow_cpu, 1, 2) is None  # no split pays


def test_the_rates_are_measured_only_where_planning_needs_them_or_the_cached_ones_are_stale(monkeypatch):
    """machine_rates on a CUDA device (a stand-in: nothing runs on it): nothing cached is measured only with
    `measure`; an entry an older zerofit cached is measured again either way, so the split and the
    planner's ranking read the same current rates."""
    now = dataclasses.replace(H200, gpu_tflops=600.0, host_copy_gbs=20.0)
    measured = []
    monkeypatch.setattr(bandwidth, "probe", lambda device=None, refresh=False: measured.append(device) or now)
    cuda = SimpleNamespace(type="cuda")
    monkeypatch.setattr(bandwidth, "cached", lambda device=None: None)
    assert auto_plan.machine_rates(cuda, 1, measure=False) is None and measured == []
    assert auto_plan.machine_rates(cuda, 1) is now and len(measured) == 1
    assert not H200.current  # no matmul rate: an older zerofit's entry
    monkeypatch.setattr(bandwidth, "cached", lambda device=None: H200)
    assert auto_plan.machine_rates(cuda, 1, measure=False) is now and len(measured) == 2
    monkeypatch.setattr(bandwidth, "cached", lambda device=None: now)
    assert auto_plan.machine_rates(cuda, 1, measure=False) is now and len(measured) == 2


def test_only_an_open_share_of_offload_that_may_be_gpu_stepped_is_planned():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for off, expected in ((OffloadConfig(device="cpu", host_share=AUTO), True),
                          (OffloadConfig(device=AUTO, host_share=AUTO), True),
                          (OffloadConfig(device="cpu"), False),  # unset: no split
                          (OffloadConfig(device="cpu", host_share=0.3), False),
                          (OffloadConfig(device="cpu", step_on="host", host_share=AUTO), False),
                          (OffloadConfig(device="nvme", nvme_path="/tmp"), False), (OffloadConfig(), False)):
        config = RunConfig(zero=ZeroConfig(stage=2, offload_optimizer=off))
        assert auto_plan.wants_host_share(config, cuda) is expected, off
        assert not auto_plan.wants_host_share(config, cpu)


def test_state_homes_is_the_one_rule_for_where_each_units_state_lives():
    numels = [5, 10, 10, 10]
    off = offloaded_units(numels, 0.75)
    hosted = host_stepped_units(numels, off, 0.5)
    homes = state_homes(numels, ratio=0.75, step_on="device", host_share=0.5)
    assert homes == [StateHome.HOST_STEPPED if i in hosted else StateHome.GPU_STEPPED if i in off
                     else StateHome.DEVICE for i in range(4)]
    assert StateHome.GPU_STEPPED in homes and StateHome.HOST_STEPPED in homes and StateHome.DEVICE in homes
    assert state_homes(numels, ratio=0.75, step_on="host", host_share=0.0).count(StateHome.HOST_STEPPED) == len(off)
    assert set(state_homes(numels, ratio=0.0, step_on="device", host_share=0.5)) == {StateHome.DEVICE}
