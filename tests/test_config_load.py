"""Loading the configs people write today: the seed fixtures, zerofit's round trip, loose spellings."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from zerofit.config import (
    AUTO,
    ConfigWarning,
    config_from_dict,
    detect_format,
    load_config,
    save_config,
    to_dict,
)
from zerofit.config.schema import OffloadConfig, OptimizerConfig, RunConfig, SchedulerConfig, ZeroConfig
from zerofit.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "configs"


def test_accelerate_plugin_yaml_zero2():
    cfg = load_config(FIXTURES / "accelerate_zero2.yaml")
    assert cfg.source_format == "accelerate"
    assert cfg.zero.stage == 2
    assert cfg.zero.offload_optimizer.device == "none" and cfg.zero.offload_param.device == "none"
    assert cfg.precision.mixed_precision == "fp16"
    assert (
        cfg.launch.num_processes == 2 and cfg.launch.num_machines == 1 and cfg.launch.rdzv_backend == "static"
    )
    assert cfg.batch.gradient_accumulation_steps == 1
    assert cfg.batch.train_batch_size is AUTO and cfg.batch.train_micro_batch_size_per_gpu is AUTO
    assert cfg.gradient_clipping is AUTO


def test_accelerate_yaml_with_deepspeed_config_file():
    cfg = load_config(FIXTURES / "accelerate_ds_file.yaml")
    assert cfg.source_format == "accelerate+deepspeed"
    assert "ds_zero3_offload.json" in cfg.source
    assert cfg.launch.num_processes == 4
    assert cfg.zero.stage == 3
    assert cfg.zero.offload_param.device == "cpu" and cfg.zero.offload_optimizer.device == "cpu"
    assert cfg.precision.mixed_precision == "bf16"  # the JSON says "auto", the YAML decides


def test_deepspeed_zero2_offload_json():
    with pytest.warns(ConfigWarning, match=r"zero_optimization\.reduce_bucket_size = 200000000 is ignored") as seen:
        cfg = load_config(FIXTURES / "ds_zero2_offload.json")
    assert any("zero_optimization.allgather_bucket_size = 200000000 is ignored" in str(w.message) for w in seen)
    assert cfg.source_format == "deepspeed"
    assert cfg.zero == ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu"))
    assert cfg.precision.mixed_precision == "fp16"
    assert cfg.precision.loss_scale.loss_scale == 0.0 and cfg.precision.loss_scale.initial_scale_power == 16
    assert (cfg.batch.train_batch_size, cfg.batch.train_micro_batch_size_per_gpu) == (40, 20)
    assert cfg.batch.gradient_accumulation_steps is None  # derived at resolve time, as DeepSpeed does
    assert cfg.gradient_clipping == 1.0


def test_deepspeed_zero2_all_auto_json():
    cfg = load_config(FIXTURES / "ds_zero2_auto.json")
    assert cfg.precision.mixed_precision is AUTO
    assert cfg.optimizer == OptimizerConfig(type="AdamW", params={"lr": AUTO, "weight_decay": AUTO})
    assert cfg.scheduler.type == "WarmupDecayLR"
    assert set(cfg.scheduler.params.values()) == {AUTO}
    assert cfg.logging.steps_per_print == 2000


def test_deepspeed_zero3_offload_json():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its ignored knobs all hold DeepSpeed's defaults or "auto"
        cfg = load_config(FIXTURES / "ds_zero3_offload.json")
    assert cfg.zero.stage == 3
    assert cfg.zero.offload_param == OffloadConfig(device="cpu", pin_memory=True)
    assert cfg.zero.param_persistence_threshold is AUTO
    assert cfg.precision.mixed_precision is AUTO


@pytest.mark.parametrize(
    ("name", "stage", "offload_param", "offload_optimizer"),
    [
        ("zerofit_stage0.yaml", 0, "none", "none"),
        ("zerofit_stage1.yaml", 1, "none", "none"),
        ("zerofit_stage2.yaml", 2, "none", "cpu"),
        ("zerofit_stage3.yaml", 3, "cpu", "nvme"),
    ],
)
def test_zerofit_yaml_each_stage(name, stage, offload_param, offload_optimizer):
    cfg = load_config(FIXTURES / name)
    assert cfg.source_format == "zerofit"
    assert cfg.zero.stage == stage
    assert cfg.zero.offload_param.device == offload_param
    assert cfg.zero.offload_optimizer.device == offload_optimizer


def test_zerofit_yaml_details():
    # an older zerofit's field that never acted still loads, with the warning (written as 2e8)
    with pytest.warns(ConfigWarning, match=r"zero\.allgather_bucket_size = 200000000 is ignored"):
        stage2 = load_config(FIXTURES / "zerofit_stage2.yaml")
    assert stage2.zero.offload_optimizer.pin_memory is False  # written as the string "false"
    assert stage2.logging.log_with == ("jsonl",) and stage2.logging.steps_per_print == 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pipeline_read: true is what zerofit's NVMe offload does anyway
        stage3 = load_config(FIXTURES / "zerofit_stage3.yaml")
    assert stage3.zero.offload_param.buffer_count == 5 and stage3.checkpoint.total_limit == 2
    assert stage3.zero.aio.queue_depth == 16
    assert stage3.launch.main_process_ip == "10.0.0.1" and stage3.launch.machine_rank == 1


def _rich_config() -> RunConfig:
    return config_from_dict(
        {
            "zero": {
                "stage": 3,
                "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
            },
            "precision": {"mixed_precision": "fp16"},
            "batch": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": None},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.99]}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
            "logging": {"log_with": ["jsonl", "tensorboard"]},
            "gradient_clipping": "auto",
        }
    )


@pytest.mark.parametrize("config", [RunConfig(), "rich"], ids=["defaults", "rich"])
def test_zerofit_form_round_trips(config):
    cfg = _rich_config() if config == "rich" else config
    assert config_from_dict(to_dict(cfg)) == cfg
    assert config_from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_save_and_load_keep_the_config_and_its_format(tmp_path, suffix):
    cfg = load_config(FIXTURES / "ds_zero2_auto.json")
    path = tmp_path / f"resolved{suffix}"
    save_config(cfg, path)
    again = load_config(path)
    assert again == cfg
    assert again.source_format == "deepspeed" and again.source == cfg.source


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("true", True),
        ("false", False),
        ("True", True),
        ("FALSE", False),
        ("yes", True),
        (1, True),
        (0, False),
    ],
)
def test_string_booleans(written, expected):
    cfg = config_from_dict(
        {
            "zero_optimization": {
                "stage": 3,
                "overlap_comm": written,
                "offload_param": {"device": "cpu", "pin_memory": written},
            }
        }
    )
    assert cfg.zero.offload_param.pin_memory is expected


@pytest.mark.parametrize("written", [1e9, "1e9", "1000000000", 1000000000.0, "1_000_000_000", " 1E9 "])
def test_integers_written_as_floats_or_strings(written):
    cfg = config_from_dict(
        {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": written,
                               "offload_optimizer": {"device": "nvme", "nvme_path": "/n", "buffer_count": written}}}
    )
    assert cfg.zero.param_persistence_threshold == 1_000_000_000
    assert cfg.zero.offload_optimizer.buffer_count == 1_000_000_000
    assert isinstance(cfg.zero.offload_optimizer.buffer_count, int)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an ignored knob at DeepSpeed's default, however it is spelt, is quiet
        config_from_dict({"zero_optimization": {"sub_group_size": written, "stage3_max_live_parameters": written}})


@pytest.mark.parametrize(
    ("data", "fmt"),
    [
        ({"distributed_type": "NO"}, "accelerate"),
        ({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU"}, "accelerate"),
        ({"zero_optimization": {"stage": 1}}, "deepspeed"),
        ({"train_micro_batch_size_per_gpu": 4}, "deepspeed"),
        ({"bf16": {"enabled": True}}, "deepspeed"),
        ({"zero": {"stage": 1}}, "zerofit"),
        ({"launch": {"num_processes": 2}}, "zerofit"),
        ({"optimizer": {"type": "SGD"}}, "zerofit"),
        ({"flops_profiler": {"enabled": False}}, "deepspeed"),
        ({"checkpoint": {"use_node_local_storage": True}, "optimizer": {"type": "SGD"}}, "zerofit"),
    ],
)
def test_format_is_detected_from_content(data, fmt):
    assert detect_format(data) == fmt


def test_overrides_win_over_the_file():
    cfg = load_config(
        FIXTURES / "accelerate_zero2.yaml",
        overrides={
            "launch.num_processes": "4",
            "precision.mixed_precision": "bf16",
            "launch.use_cpu": True,
            "zero.stage": None,
        },
    )
    assert (
        cfg.launch.num_processes == 4
        and cfg.precision.mixed_precision == "bf16"
        and cfg.launch.use_cpu is True
    )
    assert cfg.zero.stage == 2  # None: the flag was not given


def test_no_path_gives_defaults_and_overrides_apply():
    assert load_config(None) == RunConfig()
    assert load_config(None, overrides={"zero.stage": 2}).zero.stage == 2


def test_accelerate_distributed_types_map_to_stage_0():
    ddp = config_from_dict({"distributed_type": "MULTI_GPU", "num_processes": 8, "mixed_precision": "bf16"})
    assert ddp.zero.stage == 0 and ddp.launch.num_processes == 8 and ddp.gradient_clipping == 0.0
    cpu = config_from_dict({"distributed_type": "MULTI_CPU", "num_processes": 2})
    assert cpu.launch.use_cpu is True
    single = config_from_dict({"distributed_type": "NO", "mixed_precision": False})  # unquoted `no` in YAML
    assert single.launch.num_processes == 1 and single.precision.mixed_precision == "no"


def test_accelerate_plugin_nvme_and_defaults():
    cfg = config_from_dict(
        {
            "distributed_type": "DEEPSPEED",
            "num_processes": -1,
            "fsdp_config": {},
            "deepspeed_config": {
                "zero_stage": 3,
                "offload_optimizer_device": "nvme",
                "offload_optimizer_nvme_path": "/nvme",
                "offload_param_device": "cpu",
                "offload_param_nvme_path": "none",
                "gradient_clipping": 0.5,
                "zero3_save_16bit_model": True,  # accepted; zerofit's save_model always consolidates
            },
        }
    )
    assert cfg.launch.num_processes is None
    assert cfg.zero.offload_optimizer == OffloadConfig(device="nvme", nvme_path="/nvme")
    assert cfg.zero.offload_param.nvme_path is None
    assert cfg.gradient_clipping == 0.5
    assert cfg.batch.gradient_accumulation_steps is AUTO
    assert config_from_dict({"distributed_type": "DEEPSPEED"}).zero.stage == 2  # Accelerate's default


def test_deepspeed_spellings_accelerate_and_deepspeed_accept():
    with pytest.warns(ConfigWarning, match="cpu_offload is deprecated"):
        cfg = _loose_deepspeed_config()
    assert cfg.precision.mixed_precision == "bf16"
    assert cfg.optimizer == OptimizerConfig(type="AdamW", params={"lr": 1e-3})  # DeepSpeed's Adam is AdamW
    assert cfg.scheduler == SchedulerConfig(type="WarmupLR")
    assert cfg.logging.steps_per_print is None
    assert cfg.zero.offload_optimizer.device == "cpu"
    assert cfg.logging.log_with == ("tensorboard",) and cfg.logging.logging_dir == "runs/"
    plain_adam = config_from_dict(
        {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}, "fp16": {}}
    )
    assert (
        plain_adam.optimizer == OptimizerConfig(type="Adam") and plain_adam.precision.mixed_precision == "no"
    )


def _loose_deepspeed_config() -> RunConfig:
    return config_from_dict(
        {
            "bfloat16": {"enabled": True},
            "optimizer": {"type": "adam", "params": {"lr": 1e-3, "torch_adam": True}},
            "scheduler": {"type": "warmuplr", "params": {}},
            "steps_per_print": float("inf"),
            "zero_optimization": {"stage": 1, "cpu_offload": True},
            "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "x"},
            "communication_data_type": "FP32",
        }
    )


def test_ignored_keys_warn():
    with pytest.warns(ConfigWarning, match="gradient_predivide_factor is ignored"):
        config_from_dict(
            {"train_batch_size": 8, "gradient_predivide_factor": 2.0, "zero_allow_untested_optimizer": True}
        )
    with pytest.warns(ConfigWarning, match="cpu_offload is deprecated"):
        config_from_dict({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    with pytest.warns(
        ConfigWarning, match="deepspeed_config is ignored because distributed_type is MULTI_GPU"
    ):
        config_from_dict({"distributed_type": "MULTI_GPU", "deepspeed_config": {"zero_stage": 3}})


def test_relative_deepspeed_config_file_is_found_next_to_the_yaml(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "ds.json").write_text(
        json.dumps({"zero_optimization": {"stage": 1}, "fp16": {"enabled": True}})
    )
    yaml_path = tmp_path / "accel.yaml"
    yaml_path.write_text(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: sub/ds.json\n"
    )
    cfg = load_config(yaml_path)
    assert cfg.zero.stage == 1 and cfg.precision.mixed_precision == "fp16"
    absolute = tmp_path / "abs.yaml"
    absolute.write_text(
        f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {tmp_path / 'sub' / 'ds.json'}\n"
    )
    assert load_config(absolute).zero.stage == 1


def test_unreadable_file_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_settle_adds_overrides_before_the_rules_and_only_to_a_file_read_without_problems():
    seen = []

    def settle(draft: RunConfig) -> dict[str, object]:
        seen.append(draft.launch.machine_rank)
        return {"launch.num_machines": 2, "launch.main_process_ip": "10.0.0.1"}

    config = config_from_dict({}, overrides={"launch.machine_rank": 1}, settle=settle)  # alone: rank 1 of 1 machine
    assert (config.launch.num_machines, config.launch.machine_rank, seen) == (2, 1, [1])
    with pytest.raises(ConfigError, match="zero.stag is not a known key"):
        config_from_dict({"zero": {"stag": 2}}, settle=settle)
    assert seen == [1]  # a file with problems is reported as it is, not settled
