"""Accelerate launch YAML (what `accelerate config` writes), read into zerofit keys.

`distributed_type` picks the engine policy: DEEPSPEED runs the ZeRO stage of `deepspeed_config`,
MULTI_GPU, MULTI_CPU and NO run stage 0 (plain data parallel). FSDP, MEGATRON_LM and XLA are
refused with the ZeRO setting that comes closest, because silently running something else would be
worse than stopping.

Like Accelerate, the batch sizes and gradient accumulation of a plugin config are "auto" (filled
from the script's DataLoader and `Accelerator(...)` at `prepare()`), and `deepspeed_config_file`
replaces the plugin keys: setting both is an error that lists the keys to move into the JSON file.
`dynamo_config` becomes the `compile` section, which the workers' Accelerator compiles with as Accelerate's
does with what `accelerate launch` hands it (zerofit.frontend.compiling).
Keys Accelerate knows but zerofit has no use for (TPU, SageMaker, IPEX...) are accepted; the few
whose value would change behaviour zerofit does not reproduce give one warning. Unknown keys are
errors, as they are in Accelerate.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import deepspeed_json, files, ignored
from .coerce import to_bool, to_choice, to_int, to_str
from .reading import INVALID, Reading, dig, unknown_key, walk
from .schema import AUTO

_DS = "deepspeed_config"

TABLE: dict[str, str] = {
    "num_machines": "launch.num_machines",
    "machine_rank": "launch.machine_rank",
    "main_process_ip": "launch.main_process_ip",
    "main_process_port": "launch.main_process_port",
    "rdzv_backend": "launch.rdzv_backend",
    "use_cpu": "launch.use_cpu",
    "gpu_ids": "launch.gpu_ids",
    "main_training_function": "launch.main_training_function",
    f"{_DS}.zero_stage": "zero.stage",
    f"{_DS}.offload_optimizer_device": "zero.offload_optimizer.device",
    f"{_DS}.offload_param_device": "zero.offload_param.device",
    f"{_DS}.gradient_accumulation_steps": "batch.gradient_accumulation_steps",
    f"{_DS}.gradient_clipping": "gradient_clipping",
}
"""Accelerate key -> zerofit key, for every key that maps one to one."""

_DYNAMO = "dynamo_config"
DYNAMO_KEYS = {
    "dynamo_backend": "compile.backend",
    "dynamo_mode": "compile.mode",
    "dynamo_use_fullgraph": "compile.fullgraph",
    "dynamo_use_dynamic": "compile.dynamic",
    "dynamo_use_regional_compilation": "compile.regional",
}
"""`dynamo_config` key -> zerofit key (`accelerate launch` also takes each without its `dynamo_` prefix)."""

SECTION_NAMES = {
    "launch.num_processes": "num_processes",
    "precision.mixed_precision": "mixed_precision",
    "zero.offload_optimizer": f"{_DS}.offload_optimizer_device",
    "zero.offload_param": f"{_DS}.offload_param_device",
    "zero.offload_optimizer.nvme_path": f"{_DS}.offload_optimizer_nvme_path",
    "zero.offload_param.nvme_path": f"{_DS}.offload_param_nvme_path",
    **{key: f"{_DYNAMO}.{name}" for name, key in DYNAMO_KEYS.items()},
}
"""Names of keys read by hand and of zerofit sections, for messages (see `naming`)."""

_PLUGIN_KEYS_REPLACED_BY_FILE = (
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero3_save_16bit_model",
)
_MULTINODE_KEYS = ("deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter")
_LAUNCHERS = ("pdsh", "standard", "openmpi", "mvapich", "mpich", "slurm", "nossh")

_QUIET = (
    # Accepted and not acted on: they only matter for hardware or services zerofit does not target.
    "compute_environment",
    "distributed_type",
    "debug",
    "same_network",
    "downcast_bf16",
    "fp8_config",
    "tpu_name",
    "tpu_zone",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "command_file",
    "commands",
    "tpu_vm",
    "tpu_env",
    "ec2_instance_type",
    "iam_role_name",
    "image_uri",
    "profile",
    "region",
    "base_job_name",
    "pytorch_version",
    "transformers_version",
    "py_version",
    "sagemaker_inputs_file",
    "sagemaker_metrics_file",
    "additional_args",
)
_SECTIONS_READ_BY_HAND = (
    "fsdp_config",
    "tp_config",
    "parallelism_config",
    "megatron_lm_config",
    "ipex_config",
    "mpirun_config",
    _DYNAMO,
    "dynamo_backend",
    "fp16",
    "num_processes",
    "mixed_precision",
    "enable_cpu_affinity",
    f"{_DS}.deepspeed_config_file",
    f"{_DS}.zero3_init_flag",
    f"{_DS}.deepspeed_moe_layer_cls_names",
    f"{_DS}.deepspeed_multinode_launcher",
    f"{_DS}.offload_optimizer_nvme_path",
    f"{_DS}.offload_param_nvme_path",
    *ignored.handled("accelerate"),
    *(f"{_DS}.{key}" for key in _MULTINODE_KEYS),
)

_RUNS_AS_DDP = ("MULTI_GPU", "MULTI_CPU", "NO")
_DDP_FIX = "set distributed_type to DEEPSPEED with deepspeed_config.zero_stage"


def _refusal(kind: str, data: Mapping[str, Any]) -> str:
    if kind == "FSDP":
        strategy = str(dig(data, "fsdp_config.fsdp_sharding_strategy", "") or "").upper()
        reshard = dig(data, "fsdp_config.fsdp_reshard_after_forward")
        if "SHARD_GRAD_OP" in strategy or reshard in (False, "false"):
            stage = "2 (what SHARD_GRAD_OP does)"
        elif "NO_SHARD" in strategy:
            return "distributed_type FSDP with NO_SHARD is plain data parallelism: set distributed_type to MULTI_GPU"
        else:
            stage = "3 (what FULL_SHARD does; 2 for SHARD_GRAD_OP)"
        offload = ""
        if dig(data, "fsdp_config.fsdp_offload_params") in (True, "true"):
            offload = ", offload_param_device: cpu and offload_optimizer_device: cpu"
        return (
            f"distributed_type FSDP is not supported (zerofit shards with ZeRO): {_DDP_FIX} {stage}{offload}"
        )
    if kind == "MEGATRON_LM":
        return ("distributed_type MEGATRON_LM is not supported (zerofit has no tensor or pipeline parallelism): "
                f"{_DDP_FIX} 3, or 2")
    if kind == "XLA":
        return f"distributed_type XLA is not supported (zerofit runs on CUDA GPUs and CPUs): {_DDP_FIX} 3 or 2 on GPUs"
    return (
        f"distributed_type {kind} is not supported: use DEEPSPEED (ZeRO, with deepspeed_config.zero_stage), "
        "MULTI_GPU or MULTI_CPU (data parallel) or NO (one process)"
    )


def read(
    data: Mapping[str, Any], source: str | None = None, *, base_dir: str | os.PathLike[str] | None = None
) -> Reading:
    """Every key of an Accelerate launch config, converted; problems are collected, not raised.

    `base_dir` is where a relative `deepspeed_config_file` is looked up (the YAML's directory).
    """
    reading = Reading(source=source, source_format="accelerate")
    kind = _distributed_type(reading, data)
    if data.get("compute_environment", "LOCAL_MACHINE") not in ("LOCAL_MACHINE", None):
        reading.error(
            f"compute_environment {data['compute_environment']!r} is not supported: zerofit launches on the "
            "machines it runs on; set compute_environment to LOCAL_MACHINE"
        )
    plugin = data.get(_DS) if kind == "DEEPSPEED" else None
    ds_file = plugin.get("deepspeed_config_file") if isinstance(plugin, Mapping) else None
    table = dict(TABLE)
    handled = [*_QUIET, *_SECTIONS_READ_BY_HAND]
    if kind != "DEEPSPEED" or ds_file:
        table = {k: v for k, v in table.items() if not k.startswith(f"{_DS}.")}
        handled.append(_DS)
    _set_defaults(reading, kind, uses_file=bool(ds_file))
    walk(reading, data, table=table, handled=handled)
    _read_processes(reading, data)
    _read_mixed_precision(reading, data)
    _read_ignored(reading, data, kind)
    _read_dynamo(reading, data)
    if kind == "DEEPSPEED" and isinstance(plugin, Mapping):
        _read_plugin(reading, plugin, uses_file=bool(ds_file))
        if not ds_file:
            ignored.check(reading, data, "accelerate")
        if ds_file:
            _merge_file(reading, plugin, str(ds_file), base_dir)
        init = reading.coerce(f"{_DS}.zero3_init_flag", plugin.get("zero3_init_flag", False), to_bool)
        if init is True and reading.values.get("zero.stage", 0) != 3:
            reading.warn(f"{_DS}.zero3_init_flag only applies to stage 3 and is ignored here")
    return reading


def _distributed_type(reading: Reading, data: Mapping[str, Any]) -> str:
    if "distributed_type" not in data:
        reading.error(
            "distributed_type is missing: set it to DEEPSPEED (ZeRO), MULTI_GPU or MULTI_CPU (data parallel) "
            "or NO (one process)"
        )
        return "NO"
    kind = str(data["distributed_type"]).upper()
    if kind not in ("DEEPSPEED", *_RUNS_AS_DDP):
        reading.error(_refusal(kind, data), key="zero.stage")
    return kind


def _set_defaults(reading: Reading, kind: str, *, uses_file: bool) -> None:
    """What Accelerate runs with before the file's keys are read."""
    if not uses_file:
        reading.set("zero.stage", 2 if kind == "DEEPSPEED" else 0)  # DeepSpeedPlugin's default stage is 2
    reading.set("launch.use_cpu", kind == "MULTI_CPU")
    if kind == "NO":
        reading.set("launch.num_processes", 1)
    if uses_file:
        return  # the batch keys, clipping and precision come from the DeepSpeed file
    reading.set("batch.train_batch_size", AUTO)
    reading.set("batch.train_micro_batch_size_per_gpu", AUTO)
    reading.set(
        "batch.gradient_accumulation_steps", AUTO
    )  # from Accelerator(gradient_accumulation_steps=...)
    reading.set("gradient_clipping", AUTO if kind == "DEEPSPEED" else 0.0)  # DDP scripts clip by themselves


def _read_processes(reading: Reading, data: Mapping[str, Any]) -> None:
    if "num_processes" not in data or data["num_processes"] is None:
        return
    count = reading.coerce("num_processes", data["num_processes"], to_int, key="launch.num_processes")
    if count is not INVALID:
        reading.set("launch.num_processes", None if count == -1 else count)  # -1: "one per GPU" in Accelerate


def _read_mixed_precision(reading: Reading, data: Mapping[str, Any]) -> None:
    value = data.get("mixed_precision")
    if value is None and data.get("fp16") in (True, "true"):
        value = "fp16"  # the spelling of Accelerate configs before mixed_precision existed
    if value is None:
        return
    if str(value).lower() == "fp8":
        reading.error(
            "mixed_precision fp8 is not supported: set mixed_precision to bf16",
            key="precision.mixed_precision",
        )
        return
    choice = reading.coerce(
        "mixed_precision",
        value,
        lambda v: to_choice(v, ("no", "fp16", "bf16")),
        key="precision.mixed_precision",
    )
    reading.set("precision.mixed_precision", choice)


def _is_off(value: Any) -> bool:
    return value in (None, False, "", {}, [], "NO", "no", "false", "False")


def _read_ignored(reading: Reading, data: Mapping[str, Any], kind: str) -> None:
    """Warn once for settings Accelerate would act on and zerofit does not."""
    if kind != "DEEPSPEED" and not _is_off(data.get(_DS)):
        reading.warn(
            f"{_DS} is ignored because distributed_type is {kind}: set distributed_type to DEEPSPEED to use it"
        )
    if kind != "FSDP" and not _is_off(data.get("fsdp_config")):
        reading.warn(f"fsdp_config is ignored because distributed_type is {kind}")
    for section in ("tp_config", "megatron_lm_config", "ipex_config", "mpirun_config"):
        if not _is_off(data.get(section)):
            reading.warn(f"{section} is ignored: zerofit has no use for it")
    for size in ("tp_size", "cp_size", "sp_size"):
        value = dig(
            data, f"parallelism_config.parallelism_config_{size}", dig(data, f"parallelism_config.{size}", 1)
        )
        if reading.coerce(f"parallelism_config.{size}", value, to_int) not in (1, INVALID):
            reading.error(
                f"parallelism_config.{size} = {value} asks for a kind of parallelism zerofit lacks: set it to 1"
            )
    if reading.coerce("enable_cpu_affinity", data.get("enable_cpu_affinity", False), to_bool) is True:
        reading.warn("enable_cpu_affinity is ignored: zerofit leaves CPU affinity to the system")
    if reading.values.get("launch.main_training_function", "main") != "main":
        reading.warn("main_training_function is ignored: zerofit runs the script as __main__")


def _read_dynamo(reading: Reading, data: Mapping[str, Any]) -> None:
    """`dynamo_config` (and the older top-level `dynamo_backend`) into the `compile` section: what
    `accelerate launch` hands its workers as ACCELERATE_DYNAMO_* for the script's Accelerator to compile with."""
    section = data.get(_DYNAMO)
    if section in (None, {}):
        section = {}
    elif not isinstance(section, Mapping):
        reading.error(f"{_DYNAMO} must be a mapping of dynamo_* keys (got {section!r}): write it as "
                      "`accelerate config` does (dynamo_backend: INDUCTOR, ...) or remove it", key="compile.backend")
        return
    given = {}
    for key, value in section.items():
        name = str(key) if str(key).startswith("dynamo_") else f"dynamo_{key}"
        if name not in DYNAMO_KEYS:
            reading.error(unknown_key(f"{_DYNAMO}.{key}", str(key), DYNAMO_KEYS))
        elif value is not None:
            given[name] = (f"{_DYNAMO}.{key}", value)
    if "dynamo_backend" not in given and data.get("dynamo_backend") is not None:
        given["dynamo_backend"] = ("dynamo_backend", data["dynamo_backend"])  # before dynamo_config existed
    for name, (spelled, value) in given.items():  # a backend as Accelerate spells it (INDUCTOR, NO) stays so
        reading.put(DYNAMO_KEYS[name], spelled, value)


def _read_plugin(reading: Reading, plugin: Mapping[str, Any], *, uses_file: bool) -> None:
    if uses_file:
        known = {
            k.removeprefix(f"{_DS}.") for k in [*TABLE, *_SECTIONS_READ_BY_HAND] if k.startswith(f"{_DS}.")
        }
        for key in plugin:
            if str(key) not in known:
                reading.error(unknown_key(f"{_DS}.{key}", str(key), known))
        given = [f"{_DS}.{key}" for key in _PLUGIN_KEYS_REPLACED_BY_FILE if key in plugin]
        if given:
            reading.error(
                f"{_DS}.deepspeed_config_file is set, so {', '.join(given)} must not be: "
                "move these settings into the DeepSpeed config file or remove deepspeed_config_file"
            )
    else:
        for kind in ("offload_optimizer", "offload_param"):
            name = f"{_DS}.{kind}_nvme_path"
            path = plugin.get(f"{kind}_nvme_path")
            if path is not None and str(path).lower() != "none":  # "none" is the wizard's "not set"
                reading.set(
                    f"zero.{kind}.nvme_path", reading.coerce(name, path, to_str, key=f"zero.{kind}.nvme_path")
                )
    if plugin.get("deepspeed_moe_layer_cls_names"):
        reading.warn(
            f"{_DS}.deepspeed_moe_layer_cls_names is ignored: zerofit picks its own communication units"
        )
    if any(plugin.get(key) for key in _MULTINODE_KEYS[1:]):
        reading.warn(
            f"{_DS}.deepspeed_inclusion_filter and deepspeed_exclusion_filter are ignored: list only the machines "
            "to use in the hostfile"
        )
    launcher = plugin.get("deepspeed_multinode_launcher")
    if launcher is not None:
        launcher = reading.coerce(
            f"{_DS}.deepspeed_multinode_launcher", launcher, lambda v: to_choice(v, _LAUNCHERS)
        )
    hostfile = plugin.get("deepspeed_hostfile")
    if hostfile in (None, "", "none", "None"):
        if launcher not in (None, INVALID, "standard") and reading.values.get("launch.num_machines", 1) > 1:
            reading.warn(
                f"{_DS}.deepspeed_multinode_launcher {launcher} has no deepspeed_hostfile to start machines from: "
                "run `zerofit launch` on every machine with its --machine_rank (under SLURM: srun, docs/cli.md), "
                "or set deepspeed_hostfile"
            )
        return
    if launcher == "standard":  # Accelerate too runs torchrun on each machine then, and reads no hostfile
        reading.warn(
            f"{_DS}.deepspeed_hostfile is ignored with deepspeed_multinode_launcher standard (each machine runs "
            "its own launch, as in Accelerate): remove the launcher key to start the hostfile's machines over ssh"
        )
        return
    reading.put("launch.hostfile", f"{_DS}.deepspeed_hostfile", hostfile)
    if launcher not in (None, INVALID, "pdsh"):
        reading.warn(
            f"{_DS}.deepspeed_multinode_launcher {launcher}: zerofit starts the hostfile's machines over ssh (as "
            "pdsh does); `zerofit launch --hostfile_print` prints each machine's command to run by hand instead"
        )


def _merge_file(
    reading: Reading, plugin: Mapping[str, Any], ds_file: str, base_dir: str | os.PathLike[str] | None
) -> None:
    """Read the DeepSpeed JSON and let it supply everything but the launch keys and unset precision."""
    path = Path(ds_file).expanduser()
    if not path.is_absolute():
        path = Path(base_dir or ".") / path
    name = f"{_DS}.deepspeed_config_file"
    try:
        data = files.load(path, as_json=True)
    except files.BadFile as bad:
        reading.error(f"{name}: {bad}")
        return
    except FileNotFoundError:
        reading.error(
            f"{name} {ds_file!r} does not exist (looked for {path}): "
            "fix the path (relative paths start at the YAML's folder)"
        )
        return
    except (OSError, json.JSONDecodeError) as bad:
        reading.error(f"{name} {str(path)!r} is not readable JSON ({bad}): fix the file")
        return
    if not isinstance(data, Mapping):
        reading.error(f"{name} {str(path)!r} must hold a JSON object")
        return
    inner = deepspeed_json.read(data, source=str(path))
    reading.source_format = "accelerate+deepspeed"
    reading.source = f"{reading.source} + {path.name}" if reading.source else str(path)
    reading.problems.extend(f"{path.name}: {p}" for p in inner.problems)
    reading.warnings.extend(f"{path.name}: {w}" for w in inner.warnings)
    reading.invalid |= inner.invalid
    reading.written |= inner.written
    yaml_precision = reading.values.get("precision.mixed_precision")
    file_precision = inner.values.get("precision.mixed_precision", AUTO)
    for key, value in inner.values.items():
        if not key.startswith("launch."):
            reading.values[key] = value
    if file_precision is AUTO and yaml_precision is not None:
        reading.values["precision.mixed_precision"] = yaml_precision
    elif yaml_precision not in (None, "no", file_precision) and file_precision is not AUTO:
        reading.error(
            f"mixed_precision {yaml_precision} conflicts with {path.name}, which sets "
            f'{"fp16.enabled / bf16.enabled"} to {file_precision}: make them agree, or set them to "auto" in '
            f"{path.name} so the YAML decides",
            key="precision.mixed_precision",
        )
