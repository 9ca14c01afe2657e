"""The line `prepare()` prints: which stage, what is sharded over how many ranks, what is offloaded and
where it is stepped, the precision and the process count (zerofit.frontend.banner)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_cases import TinyLM

from zerofit import Accelerator
from zerofit.config import config_from_dict
from zerofit.config.naming import key_name
from zerofit.config.schema import OffloadConfig, RunConfig, ZeroConfig
from zerofit.demo.train import DEMO_PERSISTENCE_THRESHOLD, TinyCharLM, demo_config
from zerofit.engine import ZeroEngine
from zerofit.frontend.banner import describe_engine
from zerofit.testing.distributed import run_distributed


def _prepare(config: RunConfig, *, optimizer: bool = True) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    accelerator = Accelerator(config=config, cpu=True)
    if optimizer:
        accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    else:
        accelerator.prepare(model)


def test_prepare_prints_the_setting_once_on_the_main_process(capsys):
    zero = ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu"))
    _prepare(RunConfig(zero=zero))
    assert capsys.readouterr().out.splitlines() == [
        "zerofit: ZeRO-2 (one process: nothing to shard over), optimizer state offloaded to cpu (host-stepped), "
        "fp32, 1 process"]


def test_optimizer_state_stored_in_fewer_bits_is_said(capsys):
    from zerofit.config.schema import PrecisionConfig

    _prepare(RunConfig(zero=ZeroConfig(stage=2), precision=PrecisionConfig(optimizer_state="8bit")))
    assert capsys.readouterr().out.splitlines() == [
        "zerofit: ZeRO-2 (one process: nothing to shard over), fp32, optimizer state stored in 8bit, 1 process"]


def test_a_frozen_model_is_said_to_be_frozen(capsys):
    zero = ZeroConfig(stage=3, param_persistence_threshold=0, offload_param=OffloadConfig(device="cpu"))
    _prepare(RunConfig(zero=zero), optimizer=False)
    # offload_param shards even on one process: the shards live in host memory
    assert capsys.readouterr().out.splitlines() == [
        "zerofit: ZeRO-3, 4 of 4 units sharded over 1 rank, no optimizer (frozen), parameters offloaded to cpu, "
        "fp32, 1 process"]
    _prepare(RunConfig(zero=ZeroConfig(stage=2)), optimizer=False)  # DPO's reference model at ZeRO-2
    assert capsys.readouterr().out.splitlines() == [
        "zerofit: ZeRO-2, a model without an optimizer (frozen): nothing of it is sharded below stage 3, fp32, "
        "1 process"]


def test_a_planned_run_prints_the_planners_line_only(capsys):
    """`stage: auto`: the planner's line says what it chose; the setting line is not printed a second time."""
    _prepare(config_from_dict({"zero": {"stage": "auto"}}))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerofit: zero.stage, ") and " auto -> " in lines[0], lines


def _describe_on_two_ranks(rank: int, world: int, cases: list[tuple[ZeroConfig, str]]) -> list[str]:
    lines = []
    for zero, source_format in cases:
        torch.manual_seed(0)
        model = TinyCharLM(vocab=40)
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero=zero,
                            device=torch.device("cpu"))
        lines.append(describe_engine(engine, num_processes=world, backend="gloo",
                                     spell=lambda key, fmt=source_format: key_name(fmt, key)))
    return lines


def test_stage_3_says_how_many_units_it_shards_and_how_to_shard_small_ones():
    """The demo's model: 4 blocks of ~50,000 parameters and a small root unit. The default persistence
    threshold (100,000) keeps every unit whole, and the line says so, naming the key in the user's format;
    the demo's threshold shards the 4 blocks."""
    demo = ZeroConfig(stage=3, param_persistence_threshold=DEMO_PERSISTENCE_THRESHOLD,
                      offload_optimizer=OffloadConfig(device="cpu"))
    cases = [(demo, "zerofit"), (ZeroConfig(stage=3), "zerofit"), (ZeroConfig(stage=3), "deepspeed")]
    shards, whole, whole_ds = run_distributed(_describe_on_two_ranks, 2, cases)[0]
    assert shards == ("zerofit: ZeRO-3, 4 of 5 units sharded over 2 ranks, optimizer state offloaded to cpu "
                      "(host-stepped), fp32, 2 processes (gloo)")
    assert whole == ("zerofit: ZeRO-3, 0 of 5 units sharded (each holds fewer than zero.param_persistence_threshold "
                     "= 100,000 elements: lower it to shard them), fp32, 2 processes (gloo)")
    assert "zero_optimization.stage3_param_persistence_threshold = 100,000" in whole_ds


@pytest.mark.parametrize(("threshold", "expected"), [
    (ZeroConfig().param_persistence_threshold, DEMO_PERSISTENCE_THRESHOLD),  # the default: the demo's
    (500, 500),  # written by the user: kept
])
def test_the_demo_lowers_only_a_default_persistence_threshold(threshold, expected):
    config = RunConfig(zero=dataclasses.replace(ZeroConfig(), param_persistence_threshold=threshold))
    zero = demo_config(config, 3).zero
    assert (zero.stage, zero.param_persistence_threshold) == (3, expected)
    assert demo_config(config, None).zero.stage == 0
