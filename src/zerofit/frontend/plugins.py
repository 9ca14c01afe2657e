"""The configuration objects scripts pass to `Accelerator(...)`, under Accelerate's names and fields.

What each becomes in zerofit:
- `GradientAccumulationPlugin(num_steps=...)`: the accumulation steps, as `gradient_accumulation_steps=`.
- `DataLoaderConfiguration(split_batches=..., use_seedable_sampler=..., data_seed=...)`: how prepared
  dataloaders shard and shuffle (zerofit.frontend.data.sampling); batches are always even.
- `InitProcessGroupKwargs(timeout=...)`: the process group's timeout (`launch.process_group_timeout`)
  when this process creates the group; zerofit picks the backend itself (gloo on CPU, NCCL on GPUs).
- `DeepSpeedPlugin(...)`: the ZeRO settings of the run, read as the `deepspeed_config` section of an
  Accelerate launch YAML would be (`hf_ds_config`: a DeepSpeed JSON path or dict), in place of the
  launcher's - as under Accelerate, a plugin given in code wins over the launch config.
- `ProfileKwargs(...)`: the settings of `accelerator.profile()` (torch.profiler).
- `FullyShardedDataParallelPlugin(...)`: accepted with any fields, so that scripts written for FSDP
  import and run, and ignored: zerofit shards with its own ZeRO engine, as the config's stage says
  (`Accelerator(fsdp_plugin=...)` warns that it is ignored and what to set instead).
- `DistributedDataParallelKwargs`, `GradScalerKwargs`, `AutocastKwargs`: zerofit's engine does not
  use torch DDP, a GradScaler or autocast (it reduces gradients itself, scales fp16 losses as
  DeepSpeed does, and computes in the configured dtype); with default fields they are accepted
  silently, with changed fields a warning names what zerofit does instead.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from zerofit.config import config_from_dict
from zerofit.config.schema import RunConfig


@dataclass
class GradientAccumulationPlugin:
    """Accelerate's accumulation settings; zerofit reads `num_steps` (the rest is how zerofit behaves)."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders shard and shuffle; zerofit reads `split_batches`, `use_seedable_sampler` and
    `data_seed` (its batches are always even: every rank must run the same steps)."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class InitProcessGroupKwargs:
    """Arguments for creating the process group; zerofit applies `timeout` (see the module doc)."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None


class DDPCommunicationHookType(str, enum.Enum):
    """Accelerate's DDP gradient-compression hooks; zerofit's engine reduces in fp32 and takes none."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs:
    """torch DDP's arguments; zerofit's engine reduces gradients itself (see the module doc)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)


@dataclass
class GradScalerKwargs:
    """torch GradScaler's arguments; zerofit's fp16 loss scale comes from the config's `fp16` section."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class AutocastKwargs:
    """torch autocast's arguments; zerofit computes in the configured dtype without autocast."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class DeepSpeedPlugin:
    """Accelerate's DeepSpeed settings, run by zerofit's own ZeRO engine (see the module doc).

    `hf_ds_config` is a DeepSpeed JSON path or dict; without it, the fields below make the settings.
    A field left at None (or "auto") is taken from the script at prepare(), as in a launch YAML.
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | str | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool = False
    msamp_opt_level: str | None = None

    def launch_section(self) -> dict[str, Any]:
        """The `deepspeed_config` section of an Accelerate launch YAML that says the same."""
        if self.hf_ds_config is not None:
            return {"deepspeed_config_file": self.hf_ds_config} if isinstance(self.hf_ds_config, str) else {}
        keys = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path",
                "zero3_init_flag", "zero3_save_16bit_model")
        section = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        section.setdefault("zero_stage", 2)  # Accelerate's DeepSpeedPlugin default
        return section


def unused_fields(handler: Any) -> list[str]:
    """`name=value` for each field of a kwargs handler set away from its default."""
    out = []
    for f in dataclasses.fields(handler):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = getattr(handler, f.name)
        if value != default:
            out.append(f"{f.name}={value!r}")
    return out


_INSTEAD = {
    "DistributedDataParallelKwargs": "zerofit's engine reduces gradients itself (no torch DDP); unused "
                                     "parameters need no flag",
    "GradScalerKwargs": "set the fp16 section of the config (loss_scale, initial_scale_power, loss_scale_window)",
    "AutocastKwargs": "zerofit computes in the configured mixed_precision dtype without autocast",
}


def process_group_timeout(handlers: list[Any] | tuple[Any, ...] | None) -> float | None:
    """The timeout in seconds an `InitProcessGroupKwargs` among `handlers` asks for; warns on handlers
    zerofit does not apply (see the module doc). A `ProfileKwargs` is read by `accelerator.profile()`."""
    timeout = None
    for handler in handlers or ():
        name = type(handler).__name__
        if isinstance(handler, ProfileKwargs):
            continue
        if isinstance(handler, InitProcessGroupKwargs):
            if handler.timeout is not None:
                timeout = handler.timeout.total_seconds()
        elif dataclasses.is_dataclass(handler) and name in _INSTEAD:
            changed = unused_fields(handler)
            if changed:
                warnings.warn(f"Accelerator(kwargs_handlers=[{name}({', '.join(changed)})]) is ignored by zerofit: "
                              f"{_INSTEAD[name]}", stacklevel=3)
        else:
            warnings.warn(f"Accelerator(kwargs_handlers=[{name}(...)]) is not used by zerofit: remove it",
                          stacklevel=3)
    return timeout


def with_deepspeed_plugin(config: RunConfig, plugin: DeepSpeedPlugin) -> RunConfig:
    """`config` with the ZeRO, batch, clipping, optimizer and scheduler settings `plugin` gives (the launch
    settings - processes, machines, timeouts - stay the launcher's). Errors name the plugin's fields."""
    if not isinstance(plugin, DeepSpeedPlugin):
        raise TypeError(f"Accelerator(deepspeed_plugin=...) takes a zerofit.DeepSpeedPlugin (got "
                        f"{type(plugin).__name__}): build it with zerofit.DeepSpeedPlugin(zero_stage=..., ...)")
    if isinstance(plugin.hf_ds_config, Mapping):
        given = config_from_dict(plugin.hf_ds_config, source="DeepSpeedPlugin(hf_ds_config={...})")
    else:
        data = {"distributed_type": "DEEPSPEED", "deepspeed_config": plugin.launch_section(),
                "mixed_precision": config.precision.mixed_precision}
        given = config_from_dict(data, source="DeepSpeedPlugin(...)")
    precision = given.precision if isinstance(plugin.hf_ds_config, Mapping) else config.precision
    return config.replace(zero=given.zero, batch=given.batch, precision=precision,
                          gradient_clipping=given.gradient_clipping, optimizer=given.optimizer,
                          scheduler=given.scheduler, source_format=given.source_format, source=given.source)


class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP settings, kept but not applied (see the module doc): zero.stage 3 shards
    parameters, gradients and optimizer state as FSDP's FULL_SHARD does."""

    def __init__(self, **settings: Any):
        self.settings = dict(settings)
        """The fields the script gave, as given."""

    def __repr__(self) -> str:
        return f"FullyShardedDataParallelPlugin({', '.join(f'{k}={v!r}' for k, v in self.settings.items())})"


@dataclass
class ProfileKwargs:
    """torch.profiler's settings for `accelerator.profile()` (Accelerate's fields)."""

    activities: list[str] | None = None
    """"cpu", "cuda" (default: the CPU, and CUDA when there is a GPU)."""
    schedule_option: dict[str, int] | None = None
    """`torch.profiler.schedule` arguments (wait, warmup, active, repeat, skip_first)."""
    on_trace_ready: Any = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None
    """Where each process writes its Chrome trace (`<dir>/trace_rank_<i>.json`) when profiling ends."""

    def build(self) -> Any:
        """The `torch.profiler.profile` these settings describe (not started)."""
        import torch

        names = self.activities or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
        kinds = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
        unknown = [a for a in names if a not in kinds]
        if unknown:
            raise ValueError(f"ProfileKwargs(activities={names}): {unknown} not known: use 'cpu' and/or 'cuda'")
        schedule = torch.profiler.schedule(**self.schedule_option) if self.schedule_option else None
        return torch.profiler.profile(activities=[kinds[a] for a in names], schedule=schedule,
                                      on_trace_ready=self.on_trace_ready, record_shapes=self.record_shapes,
                                      profile_memory=self.profile_memory, with_stack=self.with_stack,
                                      with_flops=self.with_flops, with_modules=self.with_modules)
