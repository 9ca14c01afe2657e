"""DeepSpeed JSON configs, as people write them, read into zerofit keys.

Every key DeepSpeed documents falls into one of four groups, and this module is mostly the lists:

* `TABLE`: keys with a zerofit home, converted to the schema type (`"5e8"` and `1e9` are integers,
  `"true"` is a boolean, `"auto"` is AUTO where the schema allows it);
* keys read by hand: `fp16.enabled` / `bf16.enabled` become `precision.mixed_precision`, deprecated
  spellings map onto their successors with a warning, monitors become trackers,
  `communication_data_type` becomes `precision.communication_data_type` (null: zerofit's fp32);
* knobs of mechanisms zerofit does not have, accepted and type-checked, with one warning when the value
  asks for something zerofit does not do (the table in `zerofit.config.ignored`; a key whose every value
  is what zerofit does anyway is only type-checked);
* keys that switch on a feature zerofit lacks (`_NEEDS_FEATURE`): an error naming the key.

Anything else, at any depth, is an unknown key (typos are silently ignored by DeepSpeed itself at the
top level; here they are errors with the closest spelling).

DeepSpeed's `"type": "Adam"` runs AdamW (decoupled weight decay) unless `adam_w_mode` is false, so it
is read as AdamW; `torch_adam` only picks DeepSpeed's kernel and is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from . import ignored
from .coerce import is_auto_text, to_bool, to_choice, to_int
from .reading import INVALID, Reading, dig, has, walk
from .schema import AUTO, is_auto

_ZERO = "zero_optimization"
_OPT = f"{_ZERO}.offload_optimizer"
_PARAM = f"{_ZERO}.offload_param"

TABLE: dict[str, str] = {
    "train_batch_size": "batch.train_batch_size",
    "train_micro_batch_size_per_gpu": "batch.train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "batch.gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "optimizer.type": "optimizer.type",
    "optimizer.params": "optimizer.params",
    "scheduler.type": "scheduler.type",
    "scheduler.params": "scheduler.params",
    f"{_ZERO}.stage": "zero.stage",
    f"{_ZERO}.stage3_param_persistence_threshold": "zero.param_persistence_threshold",
    f"{_ZERO}.stage3_max_live_parameters": "zero.max_live_parameters",
    f"{_ZERO}.gradient_checkpointing": "zero.gradient_checkpointing",  # zerofit's own
    f"{_ZERO}.optimizer_state": "precision.optimizer_state",  # zerofit's own (DeepSpeed has no 8-bit state)
    **{
        f"{_OPT}.{k}": f"zero.offload_optimizer.{k}"
        for k in (
            "device",
            "nvme_path",
            "pin_memory",
            "buffer_count",
            "ratio",
            "step_on",  # zerofit's own (DeepSpeed has no such key)
            "host_share",  # zerofit's own
        )
    },
    **{
        f"{_PARAM}.{k}": f"zero.offload_param.{k}"
        for k in ("device", "nvme_path", "pin_memory", "buffer_count")
    },
    **{
        f"fp16.{k}": f"precision.loss_scale.{k}"
        for k in (
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "consecutive_hysteresis",
            "min_loss_scale",
        )
    },
    **{
        f"aio.{k}": f"zero.aio.{k}"
        for k in ("block_size", "queue_depth", "thread_count")
    },
}
"""DeepSpeed key -> zerofit key, for every key that maps one to one."""

SECTION_NAMES = {
    "zero.offload_optimizer": _OPT,
    "zero.offload_param": _PARAM,
    "precision.mixed_precision": "fp16.enabled / bf16.enabled",
    "precision.communication_data_type": "communication_data_type",
}
"""Names of zerofit sections and derived keys, for messages (see `naming`)."""

# Launch-time values Accelerate substitutes for "auto" before the script runs (its plugin defaults).
_AUTO_MEANS = {
    "zero.offload_optimizer.device": "none",
    "zero.offload_param.device": "none",
    "zero.offload_optimizer.nvme_path": None,
    "zero.offload_param.nvme_path": None,
}

_BF16_STATES = "bf16.bf16_optimizer_states"

_NO = "zerofit does not provide it: remove the key or set it off"
# Keys whose value switches on a feature zerofit lacks: key -> (the largest value that is fine, what to say).
_NEEDS_FEATURE: dict[str, tuple[Any, str]] = {
    f"{_ZERO}.zero_quantized_weights": (False, f"ZeRO++ quantized weights; {_NO}"),
    f"{_ZERO}.zero_quantized_gradients": (False, f"ZeRO++ quantized gradients; {_NO}"),
    f"{_ZERO}.zero_quantized_nontrainable_weights": (False, f"quantized frozen weights; {_NO}"),
    f"{_ZERO}.zero_hpz_partition_size": (1, f"ZeRO++ hierarchical partitioning; {_NO} (1)"),
    f"{_ZERO}.mics_shard_size": (0, f"MiCS sharding; {_NO} (-1)"),
    f"{_ZERO}.mics_hierarchical_params_gather": (False, f"MiCS; {_NO}"),
    f"{_ZERO}.legacy_stage1": (False, f"the legacy stage 1 implementation; {_NO}"),
    f"{_ZERO}.elastic_checkpoint": (False, f"elastic checkpoints; {_NO}"),
    f"{_OPT}.super_offload": (False, f"SuperOffload; {_NO}"),
    "fp16.fp16_master_weights_and_grads": (
        False,
        "16-bit master weights; zerofit keeps master weights in fp32: set it to false",
    ),
    "sparse_gradients": (False, f"sparse gradients; {_NO}"),
    "disable_allgather": (False, f"disabling the parameter all-gather; {_NO}"),
    "prescale_gradients": (
        False,
        "gradient prescaling; zerofit averages after the reduction: set it to false",
    ),
    "checkpoint.load_universal": (
        False,
        f"universal checkpoint loading; {_NO} (zerofit checkpoints re-shard on load)",
    ),
}

# Sections that only matter when they are on; their other keys are not read. Value: (whether a section
# without an `enabled` key is on, what to say).
_FEATURE_SECTIONS = {
    "amp": (
        False,
        "Apex AMP, which is not compatible with ZeRO: remove it and use fp16.enabled or bf16.enabled",
    ),
    "torch_autocast": (False, "torch autocast: remove it and use bf16.enabled or fp16.enabled instead"),
    "elasticity": (False, f"elastic training; {_NO}"),
    "autotuning": (False, f"the autotuner; {_NO}"),
    "curriculum_learning": (False, f"curriculum learning; {_NO}"),
    "data_efficiency": (False, f"data efficiency; {_NO}"),
    "hybrid_engine": (False, f"the hybrid engine; {_NO}"),
    "eigenvalue": (False, f"eigenvalue computation; {_NO}"),
    "progressive_layer_drop": (False, f"progressive layer drop; {_NO}"),
    "quantize_training": (False, f"quantized training; {_NO}"),
    "nebula": (False, f"Nebula checkpointing; {_NO}"),
    "sparse_attention": (True, f"sparse attention; {_NO}"),
    "compression_training": (True, f"compression training; {_NO}"),
    "weight_quantization": (True, f"weight quantization; {_NO}"),
    f"{_ZERO}.zenflow": (True, f"ZenFlow; {_NO}"),
    f"{_ZERO}.zeropp_loco_param": (True, f"LoCo ZeRO++; {_NO}"),
}
# Sections that zerofit does not act on even when enabled; a warning says so.
_WARN_SECTIONS = {
    "flops_profiler": "the flops profiler is not part of zerofit; use torch.profiler",
    "comms_logger": "the communication logger is not part of zerofit; use torch.profiler",
    "compile": "DeepSpeed compile is not part of zerofit; call torch.compile in the script if wanted",
    "tensor_parallel": "tensor parallelism is not part of zerofit; the section is ignored",
}

_MONITORS = {
    "tensorboard": ("enabled", "output_path", "job_name"),
    "csv_monitor": ("enabled", "output_path", "job_name"),
    "wandb": ("enabled", "group", "team", "project"),
    "comet": (
        "enabled",
        "samples_log_interval",
        "project",
        "workspace",
        "api_key",
        "experiment_name",
        "experiment_key",
        "online",
        "mode",
    ),
}

_MONITOR_TRACKERS = {"wandb": "wandb", "comet": "comet_ml"}
"""DeepSpeed's monitors of a tracking service, and the zerofit tracker each becomes."""

_DEPRECATED = {
    f"{_ZERO}.cpu_offload": f"{_OPT}.device",
    f"{_ZERO}.cpu_offload_param": f"{_PARAM}.device",
    f"{_ZERO}.cpu_offload_use_pin_memory": f"{_OPT}.pin_memory and {_PARAM}.pin_memory",
    f"{_ZERO}.stage3_gather_fp16_weights_on_model_save": f"{_ZERO}.stage3_gather_16bit_weights_on_model_save",
}

_HANDLED = (
    "communication_data_type",
    "fp16.enabled",
    "bf16.enabled",
    _BF16_STATES,
    "steps_per_print",
    "gradient_predivide_factor",
    "gradient_allreduce_op",
    *ignored.handled("deepspeed"),
    *_NEEDS_FEATURE,
    *_FEATURE_SECTIONS,
    *_WARN_SECTIONS,
    *_DEPRECATED,
    *(f"{name}.{key}" for name, keys in _MONITORS.items() for key in keys),
)


KNOWN_PATHS = frozenset((*TABLE, *_HANDLED))
"""Every dotted key (or whole section) a DeepSpeed config may use (for telling formats apart)."""
TOP_LEVEL = frozenset(key.split(".")[0] for key in KNOWN_PATHS)
"""Every top-level name a DeepSpeed config may use (for telling formats apart)."""


def read(data: Mapping[str, Any], source: str | None = None) -> Reading:
    """Every key of a DeepSpeed config, converted to zerofit keys; problems are collected, not raised."""
    reading = Reading(source=source, source_format="deepspeed")
    if "bfloat16" in data and "bf16" not in data:
        data = {("bf16" if k == "bfloat16" else k): v for k, v in data.items()}  # DeepSpeed's alias
    walk(reading, data, table=TABLE, handled=_HANDLED, auto_means=_AUTO_MEANS)
    if is_auto(reading.values.get("zero.stage")):  # with the stage planned, "auto" offload is planned too
        for kind, path in (("offload_optimizer", _OPT), ("offload_param", _PARAM)):
            if is_auto_text(dig(data, f"{path}.device")):
                reading.set(f"zero.{kind}.device", AUTO)
    _read_precision(reading, data)
    _read_optimizer_state(reading, data)
    _read_communication(reading, data)
    _read_deprecated(reading, data)
    ignored.check(reading, data, "deepspeed")
    _read_features(reading, data)
    _read_monitors(reading, data)
    _read_top_level(reading, data)
    _read_optimizer(reading)
    if not has(data, "gradient_accumulation_steps"):
        reading.set(
            "batch.gradient_accumulation_steps", None
        )  # derived from the other two (DeepSpeed's rule)
    return reading


def _enabled(reading: Reading, data: Mapping[str, Any], path: str) -> Any:
    """The value of a `<section>.enabled` flag: True, False, AUTO, or INVALID after an error."""
    value = dig(data, path, False)
    if is_auto_text(value):
        return AUTO
    return reading.coerce(path, value, to_bool, key="precision.mixed_precision")


def _read_precision(reading: Reading, data: Mapping[str, Any]) -> None:
    if "fp16" not in data and "bf16" not in data:
        return  # neither named: zerofit's default ("no"), or the Accelerate YAML's mixed_precision
    fp16_on = _enabled(reading, data, "fp16.enabled")
    bf16_on = _enabled(reading, data, "bf16.enabled")
    if fp16_on is INVALID or bf16_on is INVALID:
        return
    if fp16_on is True and bf16_on is True:
        reading.error(
            "fp16.enabled and bf16.enabled are both true: enable only one of them "
            "(bf16 needs no loss scaling and is the usual choice on Ampere or newer GPUs)",
            key="precision.mixed_precision",
        )
    elif fp16_on is True:
        reading.set("precision.mixed_precision", "fp16")
    elif bf16_on is True:
        reading.set("precision.mixed_precision", "bf16")
    elif fp16_on is AUTO or bf16_on is AUTO:
        reading.set("precision.mixed_precision", AUTO)
    else:
        reading.set("precision.mixed_precision", "no")


def _read_optimizer_state(reading: Reading, data: Mapping[str, Any]) -> None:
    """DeepSpeed's `bf16.bf16_optimizer_states: true` is `precision.optimizer_state` bf16 (zerofit keeps the master
    fp32 whatever `bf16_master_weights_and_grads` says, which DeepSpeed requires beside it); 8-bit state has no
    DeepSpeed key, so it is zerofit's own `zero_optimization.optimizer_state`, which the table reads."""
    if not has(data, _BF16_STATES):
        return
    wants_bf16 = reading.coerce(_BF16_STATES, dig(data, _BF16_STATES), to_bool, key="precision.optimizer_state")
    if wants_bf16 is not True:
        return  # false: DeepSpeed's default, fp32 state (or what zero_optimization.optimizer_state says)
    own = f"{_ZERO}.optimizer_state"
    written = reading.values.get("precision.optimizer_state")
    if has(data, own) and written not in (None, "bf16"):
        reading.error(f"{_BF16_STATES} = true asks for bf16 optimizer state but {own} is {written!r}: keep one of "
                      f"them (remove {_BF16_STATES} for {written!r}, or set {own} to \"bf16\")",
                      key="precision.optimizer_state")
        return
    reading.set("precision.optimizer_state", "bf16")
    reading.written.add("precision.optimizer_state")


def _read_communication(reading: Reading, data: Mapping[str, Any]) -> None:
    """`communication_data_type`: the dtype gradients are reduced in. DeepSpeed's null (its default, meaning
    the compute dtype) keeps zerofit's default, fp32: 16-bit reduction is asked for by name only."""
    value = data.get("communication_data_type")
    if value is not None:
        reading.put("precision.communication_data_type", "communication_data_type", value)


def _read_deprecated(reading: Reading, data: Mapping[str, Any]) -> None:
    for old, new in _DEPRECATED.items():
        if not has(data, old):
            continue
        reading.warn(f"{old} is deprecated: write {new} instead")
        value = reading.coerce(old, dig(data, old), to_bool)
        if value is INVALID:
            continue
        if old.endswith("cpu_offload_use_pin_memory"):
            for kind in ("offload_optimizer", "offload_param"):
                if not has(data, f"{_ZERO}.{kind}.pin_memory"):
                    reading.set(f"zero.{kind}.pin_memory", value)
        elif old.endswith("on_model_save"):
            continue  # ignored, as its successor is (zerofit.config.ignored)
        elif value and not has(data, new):
            kind = "offload_optimizer" if old.endswith("cpu_offload") else "offload_param"
            reading.set(f"zero.{kind}.device", "cpu")


def _check_feature(
    reading: Reading, data: Mapping[str, Any], key: str, name: str, fine: Any, why: str
) -> None:
    if key not in data:
        return
    value = data[key]
    if isinstance(fine, bool):
        value = reading.coerce(name, value, to_bool)
    elif isinstance(fine, int):
        value = reading.coerce(name, value, to_int)
    if value is not INVALID and value > fine:
        reading.error(f"{name} = {value!r} asks for {why}")


def _read_features(reading: Reading, data: Mapping[str, Any]) -> None:
    for path, (fine, why) in _NEEDS_FEATURE.items():
        parent, _, key = path.rpartition(".")
        section = dig(data, parent) if parent else data
        if isinstance(section, Mapping):
            _check_feature(reading, section, key, path, fine, why)
    for path, (on_by_default, why) in _FEATURE_SECTIONS.items():
        section = dig(data, path)
        if section is None or section == {}:
            continue
        enabled = section.get("enabled", on_by_default) if isinstance(section, Mapping) else section
        if reading.coerce(f"{path}.enabled", enabled, to_bool) is True:
            reading.error(f"{path} is enabled, which asks for {why}")
    for path, why in _WARN_SECTIONS.items():
        section = data.get(path)
        if isinstance(section, Mapping) and section.get("enabled", False) not in (False, "false"):
            reading.warn(f"{path} is enabled but ignored: {why}")


def _read_monitors(reading: Reading, data: Mapping[str, Any]) -> None:
    """An enabled monitor becomes a tracker of `logging.log_with` (the script's `accelerator.log` reaches it);
    the run settings of wandb and comet are the script's `init_trackers(init_kwargs=...)` in zerofit."""
    trackers: list[str] = []
    for name in _MONITORS:
        if not isinstance(data.get(name), Mapping):
            continue
        if reading.coerce(f"{name}.enabled", data[name].get("enabled", False), to_bool) is not True:
            continue
        if name == "tensorboard":
            trackers.append("tensorboard")
            if data[name].get("output_path"):
                reading.set("logging.logging_dir", str(data[name]["output_path"]))
        elif name == "csv_monitor":
            reading.warn("csv_monitor.enabled is ignored: zerofit has no CSV tracker; the jsonl tracker writes "
                         "one JSON line per accelerator.log call (logging.log_with: [jsonl])")
        else:
            tracker = _MONITOR_TRACKERS[name]
            trackers.append(tracker)
            settings = sorted(k for k in data[name] if k != "enabled")
            if settings:
                reading.warn(f"{name}.{', '.join(settings)} ignored: zerofit starts {tracker} from the script's "
                             f"accelerator.init_trackers(project_name, init_kwargs={{'{tracker}': {{...}}}})")
    if trackers:
        reading.set("logging.log_with", tuple(trackers))


def _read_top_level(reading: Reading, data: Mapping[str, Any]) -> None:
    if "steps_per_print" in data:
        value = data["steps_per_print"]
        if (
            value is None
            or (isinstance(value, float) and math.isinf(value))
            or str(value).lower() in ("inf", "infinity")
        ):
            reading.set("logging.steps_per_print", None)  # Accelerate writes inf to mean "never"
        else:
            reading.put("logging.steps_per_print", "steps_per_print", value)
    if "gradient_predivide_factor" in data and data["gradient_predivide_factor"] not in (1, 1.0, "1", "1.0"):
        reading.warn(
            "gradient_predivide_factor is ignored: zerofit averages gradients once, after the reduction"
        )
    if "gradient_allreduce_op" in data:
        op = reading.coerce(
            "gradient_allreduce_op", data["gradient_allreduce_op"], lambda v: to_choice(v, ("mean", "sum"))
        )
        if op == "sum":
            reading.error(
                'gradient_allreduce_op "sum" is not supported: zerofit averages gradients; set it to "mean"'
            )


def _read_optimizer(reading: Reading) -> None:
    """DeepSpeed's Adam is AdamW unless `adam_w_mode` is false; its kernel switches are not arguments."""
    kind = reading.values.get("optimizer.type")
    if not isinstance(kind, str):
        return
    params = dict(reading.values.get("optimizer.params", {}))
    params.pop("torch_adam", None)
    adam_w_mode = reading.coerce("optimizer.params.adam_w_mode", params.pop("adam_w_mode", True), to_bool)
    if kind.lower() == "adam" and adam_w_mode is True:
        reading.set("optimizer.type", "AdamW")
    if "optimizer.params" in reading.values:
        reading.set("optimizer.params", params)
