"""Filling "auto" from the script (Accelerate's rules) and completing the batch triple (DeepSpeed's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerofit.config import AUTO, ScriptFacts, config_from_dict, load_config, resolve_auto
from zerofit.config.schema import RunConfig, is_auto, to_dict
from zerofit.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "configs"


# Choices named "auto" (decided at run time by the engine), not placeholders for prepare() to fill.
_AUTO_CHOICES = {"zero.offload_optimizer.step_on", "zero.offload_param.step_on", "checkpoint.resume"}


def _no_auto_left(cfg: RunConfig) -> bool:
    def walk(value, path):
        if isinstance(value, dict):
            return all(walk(v, f"{path}.{k}".lstrip(".")) for k, v in value.items())
        if isinstance(value, list):
            return all(walk(v, path) for v in value)
        return value != "auto" or path in _AUTO_CHOICES

    return walk(to_dict(cfg), "")


def test_accelerate_plugin_yaml_resolves():
    cfg = resolve_auto(
        load_config(FIXTURES / "accelerate_zero2.yaml"), ScriptFacts(micro_batch_size=8, num_processes=2)
    )
    assert (
        cfg.batch.train_batch_size,
        cfg.batch.train_micro_batch_size_per_gpu,
        cfg.batch.gradient_accumulation_steps,
    ) == (16, 8, 1)
    assert cfg.gradient_clipping == 1.0  # not in the plugin: Accelerate's 1.0
    assert cfg.precision.mixed_precision == "fp16"
    assert _no_auto_left(cfg)


def test_accelerate_yaml_with_deepspeed_file_resolves():
    facts = ScriptFacts(
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        hidden_size=1024,
        num_processes=4,
    )
    cfg = resolve_auto(load_config(FIXTURES / "accelerate_ds_file.yaml"), facts)
    assert (
        cfg.batch.train_batch_size,
        cfg.batch.train_micro_batch_size_per_gpu,
        cfg.batch.gradient_accumulation_steps,
    ) == (32, 4, 2)
    assert cfg.zero.param_persistence_threshold == 10 * 1024
    assert cfg.gradient_clipping == 1.0  # "auto" (see [Note: gradient_clipping "auto"])
    assert cfg.precision.mixed_precision == "bf16"
    assert _no_auto_left(cfg)


@pytest.mark.parametrize(("world", "accumulation"), [(1, 2), (2, 1)])
def test_zero2_offload_json_derives_accumulation_like_deepspeed(world, accumulation):
    cfg = resolve_auto(load_config(FIXTURES / "ds_zero2_offload.json"), ScriptFacts(num_processes=world))
    assert (cfg.batch.train_batch_size, cfg.batch.train_micro_batch_size_per_gpu) == (40, 20)
    assert cfg.batch.gradient_accumulation_steps == accumulation
    assert cfg.precision.mixed_precision == "fp16" and cfg.zero.offload_optimizer.device == "cpu"


def test_zero2_offload_json_with_a_world_size_that_does_not_divide():
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "train_batch_size (40) is not a multiple of train_micro_batch_size_per_gpu (20) * world size (3) = 60, "
            "so gradient_accumulation_steps cannot be derived: set gradient_accumulation_steps"
        ),
    ):
        resolve_auto(load_config(FIXTURES / "ds_zero2_offload.json"), ScriptFacts(num_processes=3))


ALL_FACTS = ScriptFacts(
    micro_batch_size=16,
    gradient_accumulation_steps=2,
    mixed_precision="fp16",
    num_processes=2,
    lr=5e-5,
    weight_decay=0.01,
    total_num_steps=1000,
    warmup_num_steps=100,
    hidden_size=768,
)


def test_zero2_all_auto_json_resolves_every_key():
    cfg = resolve_auto(load_config(FIXTURES / "ds_zero2_auto.json"), ALL_FACTS)
    assert (
        cfg.batch.train_batch_size,
        cfg.batch.train_micro_batch_size_per_gpu,
        cfg.batch.gradient_accumulation_steps,
    ) == (64, 16, 2)
    assert cfg.precision.mixed_precision == "fp16"
    assert cfg.gradient_clipping == 1.0
    assert cfg.optimizer.params == {"lr": 5e-5, "weight_decay": 0.01}
    assert cfg.scheduler.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 5e-5,
        "warmup_num_steps": 100,
        "total_num_steps": 1000,
    }
    assert _no_auto_left(cfg)


def test_zero3_offload_json_resolves():
    cfg = resolve_auto(
        load_config(FIXTURES / "ds_zero3_offload.json"),
        ALL_FACTS.__class__(
            micro_batch_size=2,
            gradient_accumulation_steps=8,
            mixed_precision="bf16",
            num_processes=8,
            hidden_size=4096,
        ),
    )
    assert cfg.batch.train_batch_size == 2 * 8 * 8
    assert cfg.zero.param_persistence_threshold == 40960
    assert cfg.precision.mixed_precision == "bf16"
    assert _no_auto_left(cfg)


@pytest.mark.parametrize(
    ("name", "facts", "batch"),
    [
        ("zerofit_stage0.yaml", ScriptFacts(micro_batch_size=4), (16, 4, 2)),
        (
            "zerofit_stage1.yaml",
            ScriptFacts(gradient_accumulation_steps=3, num_processes=2, lr=1e-4, hidden_size=64),
            (48, 8, 3),
        ),
        (
            "zerofit_stage2.yaml",
            ScriptFacts(mixed_precision="bf16", num_processes=2, warmup_num_steps=10),
            (64, 8, 4),
        ),
        ("zerofit_stage3.yaml", ScriptFacts(micro_batch_size=1, hidden_size=8), (8, 1, 1)),
    ],
)
def test_zerofit_yaml_resolves(name, facts, batch):
    cfg = resolve_auto(load_config(FIXTURES / name), facts)
    assert (
        cfg.batch.train_batch_size,
        cfg.batch.train_micro_batch_size_per_gpu,
        cfg.batch.gradient_accumulation_steps,
    ) == batch
    assert _no_auto_left(cfg)


def test_zerofit_stage2_scheduler_takes_the_optimizer_lr():
    cfg = resolve_auto(
        load_config(FIXTURES / "zerofit_stage2.yaml"),
        ScriptFacts(mixed_precision="no", num_processes=2, warmup_num_steps=10),
    )
    assert cfg.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10}


def test_unresolved_auto_lists_every_key_and_its_source():
    with pytest.raises(ConfigError) as caught:
        resolve_auto(load_config(FIXTURES / "ds_zero2_auto.json"), ScriptFacts(num_processes=2))
    text = str(caught.value)
    expected = {
        "train_micro_batch_size_per_gpu": "the batch_size of the training DataLoader passed to prepare()",
        "fp16.enabled / bf16.enabled": "Accelerator(mixed_precision=...) or --mixed_precision",
        "optimizer.params.lr": "DummyOptim(lr=...)",
        "optimizer.params.weight_decay": "DummyOptim(weight_decay=...)",
        "scheduler.params.warmup_max_lr": "the optimizer's lr",
        "scheduler.params.warmup_num_steps": "DummyScheduler(warmup_num_steps=...)",
        "scheduler.params.total_num_steps": "DummyScheduler(total_num_steps=...)",
    }
    assert len(caught.value.problems) == len(expected), caught.value.problems
    assert "gradient_accumulation_steps" not in text  # like Accelerator(), it defaults to 1
    for key, origin in expected.items():
        assert f'{key} is "auto" but the script did not supply it: it comes from {origin}' in text


def test_auto_in_an_unfillable_place_says_so():
    cfg = config_from_dict(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": "auto"}},
            "train_micro_batch_size_per_gpu": 2,
        }
    )
    with pytest.raises(
        ConfigError,
        match=re.escape(
            'optimizer.params.eps is "auto" but the script did not supply it: it comes from nothing: '
            "zerofit fills only lr, weight_decay"
        ),
    ):
        resolve_auto(cfg, ScriptFacts(num_processes=1))


def test_stage3_only_auto_takes_the_default_below_stage_3():
    cfg = config_from_dict(
        {
            "zero_optimization": {
                "stage": 2,
                "reduce_bucket_size": 5e8,
                "stage3_param_persistence_threshold": "auto",
            },
            "train_batch_size": 8,
        }
    )
    resolved = resolve_auto(cfg, ScriptFacts(num_processes=1))
    assert resolved.zero.param_persistence_threshold == 100_000


def test_resolution_validates_with_the_world_size():
    cfg = load_config(FIXTURES / "zerofit_stage2.yaml")  # 64 = 8 * 4 * 2
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "batch.train_batch_size (64) != batch.train_micro_batch_size_per_gpu (8) * "
            "batch.gradient_accumulation_steps (4) * world size (4) = 128"
        ),
    ):
        resolve_auto(cfg, ScriptFacts(mixed_precision="bf16", num_processes=4, warmup_num_steps=10))
    with pytest.raises(ConfigError, match="precision.mixed_precision must be no, fp16 or bf16 .got 'fp32'."):
        resolve_auto(cfg, ScriptFacts(mixed_precision="fp32", num_processes=2, warmup_num_steps=10))


@pytest.mark.parametrize(
    ("batch", "world", "expected"),
    [
        ({"train_batch_size": 32}, 4, (32, 8, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 4, (16, 4, 1)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 4, (32, 2, 4)),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 2, (12, 2, 3)),
    ],
)
def test_batch_triple_is_completed_like_deepspeed(batch, world, expected):
    cfg = resolve_auto(config_from_dict(batch), ScriptFacts(num_processes=world))
    assert (
        cfg.batch.train_batch_size,
        cfg.batch.train_micro_batch_size_per_gpu,
        cfg.batch.gradient_accumulation_steps,
    ) == expected


def test_defaults_take_the_micro_batch_from_the_dataloader():
    cfg = resolve_auto(RunConfig(), ScriptFacts(micro_batch_size=3, num_processes=2))
    assert (
        cfg.batch.train_batch_size,
        cfg.batch.train_micro_batch_size_per_gpu,
        cfg.batch.gradient_accumulation_steps,
    ) == (6, 3, 1)
    with pytest.raises(
        ConfigError, match="batch.train_batch_size and batch.train_micro_batch_size_per_gpu are both unset"
    ):
        resolve_auto(RunConfig(), ScriptFacts(num_processes=2))
    with pytest.raises(ConfigError, match="the world size is unknown"):
        resolve_auto(RunConfig(), ScriptFacts(micro_batch_size=3))


def test_resolved_config_round_trips_and_stays_resolved():
    cfg = resolve_auto(load_config(FIXTURES / "ds_zero2_auto.json"), ALL_FACTS)
    again = config_from_dict(to_dict(cfg))
    assert again == cfg and again.source_format == "deepspeed"
    assert resolve_auto(again, ALL_FACTS) == cfg
    assert not is_auto(again.batch.train_batch_size) and AUTO not in again.optimizer.params.values()


def test_complete_triple_needs_no_world_size():
    cfg = config_from_dict(
        {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    )
    assert resolve_auto(cfg, ScriptFacts()).batch.train_batch_size == 8
