"""Every way a config can be wrong gives a ConfigError naming the key (in the user's spelling) and the fix."""

from __future__ import annotations

import json
import re

import pytest

from zerofit.config import config_from_dict, load_config, validate_config
from zerofit.config.schema import OffloadConfig, RunConfig, ZeroConfig
from zerofit.errors import ConfigError

ACCEL = {"distributed_type": "DEEPSPEED", "num_processes": 2}


def _accel(**plugin):
    return {**ACCEL, "deepspeed_config": plugin}


BAD = [
    # --- DeepSpeed JSON ---
    (
        "ds-offload-param-stage2",
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        "zero_optimization.offload_param requires stage 3 (got stage 2): "
        "set zero_optimization.stage to 3 or remove zero_optimization.offload_param",
    ),
    (
        "ds-offload-optimizer-stage0",
        {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
        "zero_optimization.offload_optimizer requires stage 1 or higher (got stage 0): "
        "set zero_optimization.stage to 1, 2 or 3",
    ),
    (
        "ds-nvme-optimizer-stage2",
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}},
        "zero_optimization.offload_optimizer to nvme requires stage 3 (got stage 2)",
    ),
    (
        "ds-nvme-without-path",
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
        "zero_optimization.offload_optimizer.nvme_path is required when "
        "zero_optimization.offload_optimizer.device is nvme: set it",
    ),
    (
        "ds-nvme-param",  # refused at load, not at prepare(): only the optimizer state goes to NVMe
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/n"}}},
        "zero_optimization.offload_param.device 'nvme' is not supported: zerofit offloads parameters to the CPU "
        "only; set it to cpu (NVMe offload is supported for zero_optimization.offload_optimizer.device)",
    ),
    (
        "ds-bad-device",
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
        "zero_optimization.offload_param.device must be one of 'none', 'cpu', 'nvme' (got 'gpu')",
    ),
    (
        "ds-stage-4",
        {"zero_optimization": {"stage": 4}},
        "zero_optimization.stage must be 0, 1, 2 or 3 (got 4): pick one",
    ),
    (
        "ds-stage-word",  # "auto" is a stage now (the planner picks it); other words are not
        {"zero_optimization": {"stage": "fastest"}},
        "zero_optimization.stage must be a whole number (got 'fastest')",
    ),
    (
        "ds-offload-auto-fixed-stage",  # without a planned stage, "auto" offload keeps Accelerate's meaning
        {"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}},
        "zero_optimization.offload_param requires stage 3 (got stage 1)",
    ),
    (
        "ds-ratio",
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}},
        "zero_optimization.offload_optimizer.ratio must be in (0, 1] (got 1.5)",
    ),
    (
        "ds-fractional-int",
        {"zero_optimization": {"sub_group_size": 1.5}},
        "zero_optimization.sub_group_size must be a whole number (got 1.5): write it like",
    ),
    (
        "ds-text-int",
        {"train_micro_batch_size_per_gpu": "eight"},
        "train_micro_batch_size_per_gpu must be a whole number (got 'eight')",
    ),
    (
        "ds-bool-text",
        {"zero_optimization": {"overlap_comm": "maybe"}},
        "zero_optimization.overlap_comm must be true or false (got 'maybe')",
    ),
    (
        "ds-both-precisions",
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "fp16.enabled and bf16.enabled are both true: enable only one",
    ),
    (
        "ds-quantized-weights",
        {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
        "zero_optimization.zero_quantized_weights = True asks for ZeRO++ quantized weights; "
        "zerofit does not provide it",
    ),
    (
        "ds-amp",
        {"amp": {"enabled": True, "opt_level": "O1"}},
        "amp is enabled, which asks for Apex AMP, which is not compatible with ZeRO: remove it and use fp16.enabled",
    ),
    (
        "ds-hpz",
        {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}},
        "zero_optimization.zero_hpz_partition_size = 8 asks for ZeRO++ hierarchical partitioning",
    ),
    (
        "ds-sum-allreduce",
        {"train_batch_size": 8, "gradient_allreduce_op": "sum"},
        'gradient_allreduce_op "sum" is not supported',
    ),
    (
        "ds-unknown-top",
        {"train_batch_size": 8, "gradient_cliping": 1.0},
        "gradient_cliping is not a known key: did you mean gradient_clipping? Fix the spelling",
    ),
    (
        "ds-unknown-nested",
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}},
        "zero_optimization.offload_param.pin_memroy is not a known key: "
        "did you mean zero_optimization.offload_param.pin_memory?",
    ),
    (
        "ds-unknown-fp16",
        {"fp16": {"enabled": True, "loss_scale_windows": 100}},
        "fp16.loss_scale_windows is not a known key: did you mean fp16.loss_scale_window?",
    ),
    (
        "ds-section-not-mapping",
        {"zero_optimization": {"offload_optimizer": "cpu"}},
        "zero_optimization.offload_optimizer must be a mapping of keys to values",
    ),
    (
        "ds-negative-clip",
        {"train_batch_size": 8, "gradient_clipping": -1},
        "gradient_clipping must be 0 (off) or a positive norm (got -1.0)",
    ),
    (
        "ds-loss-scale-window",
        {"fp16": {"enabled": True, "loss_scale_window": 0}},
        "fp16.loss_scale_window must be positive (got 0): set it to 1 or more",
    ),
    (
        "ds-min-loss-scale",
        {"fp16": {"enabled": True, "min_loss_scale": 0}},
        "fp16.min_loss_scale must be positive (got 0.0)",
    ),
    (
        "ds-negative-loss-scale",
        {"fp16": {"enabled": True, "loss_scale": -2}},
        "fp16.loss_scale must be 0 (dynamic) or a positive static scale",
    ),
    (
        "ds-batch-zero",
        {"train_micro_batch_size_per_gpu": 0},
        "train_micro_batch_size_per_gpu must be positive (got 0)",
    ),
    (
        "ds-unknown-scheduler",
        {"scheduler": {"type": "WarmupDecay", "params": {}}},
        "scheduler.type 'WarmupDecay' is not a known schedule (did you mean WarmupDecayLR?): use one of WarmupLR",
    ),
    (
        "ds-decay-needs-total",
        {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
        "scheduler.params.total_num_steps is required by WarmupDecayLR: set it",
    ),
    (
        "ds-onecycle-needs-lrs",
        {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5}}},
        "scheduler.params.cycle_max_lr is required by OneCycle",
    ),
    (
        "ds-scheduler-param-typo",
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}},
        "scheduler.params.warmup_num_step is not a parameter of WarmupLR: "
        "did you mean scheduler.params.warmup_num_steps?",
    ),
    (
        "ds-warmup-steps-negative",
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}}},
        "scheduler.params.warmup_num_steps must be a whole number >= 0 (got -1)",
    ),
    (
        "ds-total-steps-zero",
        {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}},
        "scheduler.params.total_num_steps must be a whole number >= 1 (got 0)",
    ),
    (
        "ds-deepspeed-only-optimizer",
        {"optimizer": {"type": "OneBitAdam", "params": {}}},
        "optimizer.type 'OneBitAdam' is a DeepSpeed optimizer zerofit does not provide: use AdamW, Adam, SGD",
    ),
    (
        "ds-unknown-optimizer",
        {"optimizer": {"type": "AdamX", "params": {}}},
        "optimizer.type 'AdamX' is not a known optimizer (did you mean Adam",
    ),
    (
        "ds-optimizer-param-typo",
        {"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}},
        "optimizer.params.weight_decy is not an argument of torch.optim.AdamW: "
        "did you mean optimizer.params.weight_decay?",
    ),
    (
        "ds-optimizer-without-type",
        {"optimizer": {"params": {"lr": 1}}, "train_batch_size": 8},
        "optimizer.type is missing: name the optimizer",
    ),
    (
        "ds-communication-type",
        {"communication_data_type": "fp8"},
        "communication_data_type must be one of 'fp32', 'bf16', 'fp16' (got 'fp8')",
    ),
    (
        "ds-state-bf16-and-8bit",
        {"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"optimizer_state": "8bit"}},
        "bf16.bf16_optimizer_states = true asks for bf16 optimizer state but zero_optimization.optimizer_state is "
        "'8bit': keep one of them",
    ),
    (
        "ds-batch-contradiction",
        {"train_batch_size": 40, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2},
        None,
    ),  # checked with a world size below
    # --- Accelerate YAML ---
    (
        "acc-offload-param-stage2",
        _accel(zero_stage=2, offload_param_device="cpu"),
        "deepspeed_config.offload_param_device requires stage 3 (got stage 2): "
        "set deepspeed_config.zero_stage to 3 or set deepspeed_config.offload_param_device to none",
    ),
    (
        "acc-nvme-without-path",
        _accel(zero_stage=3, offload_optimizer_device="nvme"),
        "deepspeed_config.offload_optimizer_nvme_path is required when "
        "deepspeed_config.offload_optimizer_device is nvme",
    ),
    (
        "acc-nvme-param",
        _accel(zero_stage=3, offload_param_device="nvme", offload_param_nvme_path="/n"),
        "deepspeed_config.offload_param_device 'nvme' is not supported: zerofit offloads parameters to the CPU "
        "only; set it to cpu (NVMe offload is supported for deepspeed_config.offload_optimizer_device)",
    ),
    (
        "acc-fsdp",
        {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}},
        "distributed_type FSDP is not supported (zerofit shards with ZeRO): "
        "set distributed_type to DEEPSPEED with deepspeed_config.zero_stage 3",
    ),
    (
        "acc-fsdp-shard-grad-op",
        {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP"}},
        "deepspeed_config.zero_stage 2 (what SHARD_GRAD_OP does)",
    ),
    ("acc-megatron", {"distributed_type": "MEGATRON_LM"}, "distributed_type MEGATRON_LM is not supported"),
    (
        "acc-xla",
        {"distributed_type": "XLA"},
        "distributed_type XLA is not supported (zerofit runs on CUDA GPUs and CPUs)",
    ),
    (
        "acc-unknown-top",
        {**ACCEL, "num_proceses": 2},
        "num_proceses is not a known key: did you mean num_processes?",
    ),
    (
        "acc-unknown-plugin",
        _accel(zero_stag=2),
        "deepspeed_config.zero_stag is not a known key: did you mean deepspeed_config.zero_stage?",
    ),
    (
        "acc-fp8",
        {**ACCEL, "mixed_precision": "fp8"},
        "mixed_precision fp8 is not supported: set mixed_precision to bf16",
    ),
    (
        "acc-bad-precision",
        {**ACCEL, "mixed_precision": "fp32"},
        "mixed_precision must be one of 'no', 'fp16', 'bf16' (got 'fp32')",
    ),
    (
        "acc-rdzv",
        {**ACCEL, "rdzv_backend": "etcd"},
        "rdzv_backend must be one of 'static', 'c10d' (got 'etcd')",
    ),
    (
        "acc-machine-rank",
        {**ACCEL, "num_machines": 2, "machine_rank": 2, "main_process_ip": "h"},
        "machine_rank (2) must be below num_machines (2): machines are numbered 0 to 1",
    ),
    ("acc-multinode-ip", {**ACCEL, "num_machines": 2}, "main_process_ip is required when num_machines > 1"),
    (
        "acc-uneven-processes",
        {**ACCEL, "num_processes": 3, "num_machines": 2, "main_process_ip": "h"},
        "num_processes (3) must be a multiple of num_machines (2)",
    ),
    (
        "acc-missing-type",
        {"compute_environment": "LOCAL_MACHINE"},
        "distributed_type is missing: set it to DEEPSPEED",
    ),
    (
        "acc-sagemake",
        {"compute_environment": "AMAZON_SAGEMAKER", "distributed_type": "DEEPSPEED"},
        "compute_environment 'AMAZON_SAGEMAKER' is not supported",
    ),
    (
        "acc-tp-size",
        {**ACCEL, "parallelism_config": {"parallelism_config_tp_size": 2}},
        "parallelism_config.tp_size = 2 asks for a kind of parallelism zerofit lacks: set it to 1",
    ),
    (
        "acc-port",
        {**ACCEL, "main_process_port": 70000},
        "main_process_port must be a port number up to 65535",
    ),
    # --- zerofit YAML ---
    (
        "zf-offload-param-stage1",
        {"zero": {"stage": 1, "offload_param": {"device": "cpu"}}},
        "zero.offload_param requires stage 3 (got stage 1): set zero.stage to 3 or remove zero.offload_param",
    ),
    (
        "zf-nvme-param",
        {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/n"}}},
        "zero.offload_param.device 'nvme' is not supported: zerofit offloads parameters to the CPU only; set it "
        "to cpu (NVMe offload is supported for zero.offload_optimizer.device)",
    ),
    (
        "zf-old-field-wrong-type",  # a field older versions had is still type-checked
        {"zero": {"stage": 1, "overlap_comm": "maybe"}},
        "zero.overlap_comm must be true or false (got 'maybe')",
    ),
    (
        "zf-steps-per-print-zero",
        {"logging": {"steps_per_print": 0}},
        "logging.steps_per_print must be positive (got 0): set it to 1 or more",
    ),
    (
        "zf-total-limit-zero",
        {"checkpoint": {"total_limit": 0}},
        "checkpoint.total_limit must be positive (got 0): set it to 1 or more",
    ),
    (
        "zf-unknown-section",
        {"zero": {"stage": 1}, "precison": {}},
        "precison is not a known key: did you mean precision?",
    ),
    (
        "zf-unknown-nested",
        {"zero": {"stage": 3, "offload_param": {"devce": "cpu"}}},
        "zero.offload_param.devce is not a known key: did you mean zero.offload_param.device?",
    ),
    (
        "zf-null-not-allowed",
        {"zero": {"stage": None}},
        "zero.stage must not be empty (null): write a value or remove the key",
    ),
    (
        "zf-bad-precision",
        {"precision": {"mixed_precision": "fp64"}},
        "precision.mixed_precision must be one of 'no', 'fp16', 'bf16'",
    ),
    (
        "zf-negative-buffe",
        {"zero": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0}}},
        "zero.offload_param.buffer_count must be positive (got 0)",
    ),
    ("zf-bad-log-with", {"logging": {"log_with": 3}}, "logging.log_with must be a list of names"),
    ("zf-scheduler-without-type", {"scheduler": {"params": {}}}, "scheduler.type is missing"),
    ("zf-override-typo", {"zero": {"stage": 1}}, None),  # override checked below
    (
        "zf-timeout-below-a-second",
        {"launch": {"process_group_timeout": 0.5}},
        "launch.process_group_timeout must be at least 1 (got 0.5): set it to 1 or more",
    ),
    ("zf-timeout-not-a-number", {"launch": {"process_group_timeout": "soon"}},
     "launch.process_group_timeout must be a number (got 'soon')"),
    (
        "zf-unknown-resume-mode",
        {"checkpoint": {"resume": "sometimes"}},
        "checkpoint.resume must be one of 'restart', 'auto', 'must', 'never' (got 'sometimes')",
    ),
]


@pytest.mark.parametrize(("data", "match"), [(d, m) for _, d, m in BAD if m], ids=[i for i, _, m in BAD if m])
def test_bad_config_names_key_and_fix(data, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        config_from_dict(data)


def test_there_are_at_least_thirty_bad_inputs():
    assert len([m for _, _, m in BAD if m]) >= 30


def test_batch_triple_contradiction_with_world_size():
    cfg = config_from_dict(
        {"train_batch_size": 40, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}
    )
    message = (
        "train_batch_size (40) != train_micro_batch_size_per_gpu (8) * gradient_accumulation_steps (2) * "
        'world size (2) = 32: set train_batch_size to 32 or to "auto"'
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(cfg, world_size=2)
    validate_config(
        cfg.replace(
            batch=cfg.batch.__class__(
                train_batch_size=32, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=2
            )
        ),
        world_size=2,
    )
    # at load time, num_processes from the command line is the world size
    with pytest.raises(ConfigError, match=re.escape("world size (2) = 32")):
        config_from_dict(
            {"train_batch_size": 40, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2},
            overrides={"launch.num_processes": 2},
        )


def test_unknown_override_key_suggests_the_right_one():
    with pytest.raises(
        ConfigError,
        match=r"command-line override launch.num_process is not a zerofit key: did you mean launch.num_processes\?",
    ):
        config_from_dict({"zero": {"stage": 1}}, overrides={"launch.num_process": 2})
    with pytest.raises(
        ConfigError, match="command-line value for launch.num_processes must be a whole number"
    ):
        config_from_dict({}, overrides={"launch.num_processes": "two"})


def test_every_problem_comes_back_in_one_error():
    data = {
        "train_batch_size": "many",
        "gradient_cliping": 1.0,
        "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}, "overlap_comm": "sometimes"},
        "fp16": {"enabled": True, "min_loss_scale": -1},
        "scheduler": {"type": "WarmupDecayLR", "params": {}},
    }
    with pytest.raises(ConfigError) as caught:
        config_from_dict(data, source="ds.json")
    problems = caught.value.problems
    assert len(problems) == 6, problems
    text = str(caught.value)
    assert text.startswith("6 problem(s) in ds.json:")
    for needle in (
        "train_batch_size must be a whole number",
        "did you mean gradient_clipping?",
        "zero_optimization.offload_param requires stage 3",
        "zero_optimization.overlap_comm must be true or false",
        "fp16.min_loss_scale must be positive",
        "scheduler.params.total_num_steps is required by WarmupDecayLR",
    ):
        assert needle in text


def test_rejected_value_is_not_reported_again_by_cross_field_rules():
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"zero_optimization": {"stage": "two", "offload_optimizer": {"device": "cpu"}}})
    assert caught.value.problems == [
        "zero_optimization.stage must be a whole number (got 'two'): write it like 500000000 or 5e8; "
        'or "auto" to let zerofit fill it'
    ]


def test_deepspeed_config_file_excludes_plugin_keys(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    yaml_path = tmp_path / "accel.yaml"
    yaml_path.write_text(
        "distributed_type: DEEPSPEED\n"
        "deepspeed_config:\n"
        "  deepspeed_config_file: ds.json\n"
        "  zero_stage: 2\n"
        "  gradient_accumulation_steps: 4\n"
        "  zero3_init_flag: true\n"
        "  deepspeed_multinode_launcher: standard\n"
    )
    message = (
        "deepspeed_config.deepspeed_config_file is set, so deepspeed_config.zero_stage, "
        "deepspeed_config.gradient_accumulation_steps must not be: move these settings into the DeepSpeed config file"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(yaml_path)


def test_deepspeed_config_file_problems_name_the_file(tmp_path):
    (tmp_path / "ds.json").write_text(
        json.dumps(
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}, "bf16": {"enabled": True}}
        )
    )
    (tmp_path / "a.yaml").write_text(
        "distributed_type: DEEPSPEED\nmixed_precision: fp16\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "a.yaml")
    text = str(caught.value)
    assert "zero_optimization.offload_param requires stage 3" in text
    assert (
        "mixed_precision fp16 conflicts with ds.json, which sets fp16.enabled / bf16.enabled to bf16" in text
    )
    (tmp_path / "b.yaml").write_text(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: nope.json\n"
    )
    with pytest.raises(
        ConfigError, match="deepspeed_config.deepspeed_config_file 'nope.json' does not exist"
    ):
        load_config(tmp_path / "b.yaml")


def test_validate_config_on_a_config_built_in_python():
    cfg = RunConfig(zero=ZeroConfig(stage=1, offload_param=OffloadConfig(device="cpu")))
    with pytest.raises(
        ConfigError, match=re.escape("zero.offload_param requires stage 3 (got stage 1): set zero.stage to 3")
    ):
        validate_config(cfg)
    validate_config(RunConfig())


@pytest.mark.parametrize(("data", "message"), [
    ({"gradient_clipping": float("nan"), "zero_optimization": {"stage": 2}},
     "gradient_clipping must be a finite number (got nan)"),
    ({"launch": {"process_group_timeout": float("inf")}}, "launch.process_group_timeout must be a finite number"),
    ({"launch": {"process_group_timeout": float("nan")}}, "launch.process_group_timeout must be a finite number"),
    ({"launch": {"process_group_timeout": 1e300}},
     "launch.process_group_timeout is 1e+300, more than the 2592000 zerofit accepts"),
    ({"gradient_accumulation_steps": 1e308, "train_micro_batch_size_per_gpu": 1},
     "gradient_accumulation_steps is 1e+308, more than the 1048576 zerofit accepts"),
    ({"launch": {"num_processes": 100_000_000}}, "launch.num_processes is 100000000, more than the 1048576"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "optimizer.params.lr must be 0 or more (got -1)"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 2]}}},
     "optimizer.params.betas must be two numbers in [0, 1) (got [0.9, 2])"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": float("nan")}}}, "optimizer.params.lr must be a finite number"),
], ids=["clip-nan", "timeout-inf", "timeout-nan", "timeout-huge", "accumulation-huge", "processes-huge", "lr-negative",
        "betas", "lr-nan"])
def test_values_out_of_range_are_errors(data, message):
    """#18: these passed validation and then crashed every worker, or silently turned clipping off."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict(data)
