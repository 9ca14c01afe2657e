"""DeepSpeed knobs zerofit accepts and does not act on: the one table, and the warning it gives.

Each of these keys tunes a mechanism zerofit's engine does not have (byte-sized buckets, a parameter
cache with a reuse distance, libaio submission modes) or has in one fixed form (overlap always on,
gradients always in flat buffers). A config may keep them, so DeepSpeed and Accelerate files load
unchanged; the value is still type-checked as DeepSpeed would. When a config asks for something other
than what zerofit does anyway (DeepSpeed's default, or a value in `quiet`), loading gives one
`ConfigWarning` per key: the key, the value, why zerofit ignores it and what to use instead.

Older zerofit versions carried these as schema fields, so zerofit's own YAML still accepts their old
names (`zerofit`) the same way; the Accelerate plugin spelling of a key is `accelerate`. None of
them is in `RunConfig`: the schema holds only what acts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, get_args

from .coerce import BadValue, is_auto_text, to_bool, to_choice, to_float, to_int
from .reading import INVALID, Reading, dig, has
from .schema import CommunicationDataType

_Z = "zero_optimization"
_OPT = f"{_Z}.offload_optimizer"
_UNITS = ("zerofit moves parameters and gradients one communication unit at a time (a repeated block such as "
          "a transformer layer, else zero.unit_size_threshold parameters)")
_NVME_IO = ("zerofit's NVMe offload reads ahead and writes behind on its own I/O threads, double buffered; "
            "tune it with offload_optimizer.buffer_count and aio.block_size / queue_depth / thread_count")
_NO_NVME_PARAM = ("parameters offload to cpu only (offload_param.device nvme is refused), so there is no "
                  "parameter swap buffer to size")


_ACT = ("zerofit has no DeepSpeed activation checkpointing API (deepspeed.checkpointing): turn on the model's own "
        "checkpointing with zero_optimization.gradient_checkpointing (gradient_checkpointing_enable())")
_NO_PIPELINE = "zerofit has no pipeline parallelism (DeepSpeed's PipelineModule engine)"
_NO_ZERO_INIT = "zerofit shards the model at prepare() from the model as built: there is no zero.Init to tune"


def _comm_type(value: Any) -> Any:
    return None if value is None else to_choice(value, get_args(CommunicationDataType))


def _optional_int(value: Any) -> Any:
    return None if value is None else to_int(value)


def _section(value: Any) -> Any:
    """A whole section zerofit does not read: any mapping (its keys are DeepSpeed's business)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadValue(f"must be a mapping of keys to values (got {value!r})")
    return dict(value)


def _tag_validation(value: Any) -> Any:
    return to_choice(value, ("Ignore", "Warn", "Fail"))


@dataclass(frozen=True)
class Ignored:
    """One accepted-and-ignored DeepSpeed key."""

    key: str
    """The DeepSpeed dotted key."""
    default: Any
    """DeepSpeed's default value."""
    why: str
    """Why zerofit does not need it, and what to use instead if anything."""
    convert: Callable[[Any], Any]
    """Type check and conversion, as DeepSpeed reads the value."""
    quiet: tuple[Any, ...] = ()
    """Other values that ask for what zerofit does anyway (no warning)."""
    allows_auto: bool = False
    """DeepSpeed (through Accelerate) accepts "auto" here; it never warns."""
    zerofit: str | None = None
    """The key's name in zerofit's own format, where older versions had it as a schema field."""
    accelerate: str | None = None
    """The key's name in an Accelerate launch YAML, where Accelerate's plugin has one."""

    def name(self, source_format: str) -> str | None:
        return {"deepspeed": self.key, "zerofit": self.zerofit, "accelerate": self.accelerate}[source_format]


TABLE: tuple[Ignored, ...] = (
    Ignored(f"{_Z}.reduce_bucket_size", 500_000_000, f"{_UNITS}, one reduction per unit, so there is no "
            "gradient bucket to size", to_int, allows_auto=True, zerofit="zero.reduce_bucket_size"),
    Ignored(f"{_Z}.allgather_bucket_size", 500_000_000, f"{_UNITS}, one all-gather per unit, so there is no "
            "all-gather bucket to size", to_int, zerofit="zero.allgather_bucket_size"),
    Ignored(f"{_Z}.stage3_prefetch_bucket_size", 50_000_000, f"{_UNITS} and prefetches exactly the next unit "
            "in the recorded order", to_int, allows_auto=True, zerofit="zero.prefetch_bucket_size"),
    Ignored(f"{_Z}.stage3_max_reuse_distance", 1_000_000_000, "zerofit keeps no cache of released units: a "
            "unit is gathered again for its backward", to_int, zerofit="zero.max_reuse_distance"),
    Ignored(f"{_Z}.sub_group_size", 1_000_000_000, "zerofit steps offloaded optimizer state one communication "
            "unit at a time, so the units are the sub-groups", to_int, zerofit="zero.sub_group_size"),
    Ignored(f"{_Z}.overlap_comm", False, "zerofit always runs its collectives on a side stream, overlapped "
            "with compute", to_bool, quiet=(True,), zerofit="zero.overlap_comm"),
    Ignored(f"{_Z}.contiguous_gradients", True, "zerofit always accumulates gradients in each unit's flat, "
            "contiguous buffer", to_bool, zerofit="zero.contiguous_gradients"),
    Ignored(f"{_Z}.stage3_gather_16bit_weights_on_model_save", False, "zerofit's save_model always writes "
            "the consolidated weights, at every stage", to_bool, quiet=(True,), allows_auto=True,
            zerofit="zero.gather_16bit_weights_on_model_save", accelerate="deepspeed_config.zero3_save_16bit_model"),
    Ignored(f"{_Z}.offload_param.buffer_size", 100_000_000, _NO_NVME_PARAM, to_int,
            zerofit="zero.offload_param.buffer_size"),
    Ignored(f"{_Z}.offload_param.max_in_cpu", 1_000_000_000, _NO_NVME_PARAM, to_int,
            zerofit="zero.offload_param.max_in_cpu"),
    Ignored(f"{_Z}.offload_optimizer.fast_init", False, "zerofit writes each group's initial fp32 master to "
            "its file once at prepare() and creates optimizer state at the first step: nothing slow to skip", to_bool,
            zerofit="zero.offload_optimizer.fast_init"),
    Ignored(f"{_Z}.offload_optimizer.pipeline_read", False, _NVME_IO, to_bool, quiet=(True,),
            zerofit="zero.offload_optimizer.pipeline_read"),
    Ignored(f"{_Z}.offload_optimizer.pipeline_write", False, _NVME_IO, to_bool, quiet=(True,),
            zerofit="zero.offload_optimizer.pipeline_write"),
    Ignored(f"{_Z}.offload_optimizer.pipeline", False, _NVME_IO, to_bool, quiet=(True,)),
    Ignored("aio.single_submit", False, "zerofit's NVMe I/O does not go through libaio: its own threads "
            "issue positional reads and writes (aio.thread_count, block_size, queue_depth)", to_bool,
            zerofit="zero.aio.single_submit"),
    Ignored("aio.overlap_events", True, "zerofit's NVMe I/O does not go through libaio: its requests always "
            "overlap on its own threads", to_bool, zerofit="zero.aio.overlap_events"),
    Ignored("checkpoint.use_node_local_storage", False, "zerofit writes no node-local checkpoints: every rank "
            "writes its shards into the one directory given to save_state, and on several machines a save fails "
            "unless that directory is on storage all of them mount (NFS, Lustre, ...)",
            to_bool, zerofit="checkpoint.use_node_local_storage"),
    Ignored("wall_clock_breakdown", False, "zerofit does not time its phases itself: use torch.profiler, "
            "where every zerofit collective is labelled zerofit::<kind>:<unit>", to_bool,
            zerofit="logging.wall_clock_breakdown"),
    # DeepSpeed's own names only (zerofit's format never had them). A value listed in `quiet` (or every
    # value, where all are) asks for what zerofit does anyway, so it is only type-checked.
    Ignored("activation_checkpointing.partition_activations", False, _ACT, to_bool),
    Ignored("activation_checkpointing.cpu_checkpointing", False, _ACT, to_bool),
    Ignored("activation_checkpointing.contiguous_memory_optimization", False, _ACT, to_bool),
    Ignored("activation_checkpointing.number_checkpoints", None, _ACT, _optional_int),
    Ignored("activation_checkpointing.synchronize_checkpoint_boundary", False, _ACT, to_bool),
    Ignored("activation_checkpointing.profile", False, _ACT, to_bool),
    Ignored("pipeline", {}, f"{_NO_PIPELINE}; the section is not read", _section),
    Ignored(f"{_Z}.pipeline_loading_checkpoint", False, _NO_PIPELINE, to_bool),
    Ignored("zero_allow_untested_optimizer", False, "zerofit steps any elementwise torch optimizer", to_bool,
            quiet=(True,)),
    Ignored("zero_force_ds_cpu_optimizer", True, "zerofit steps offloaded state with the script's own torch "
            "optimizer on the CPU", to_bool, quiet=(False,)),
    Ignored(f"{_OPT}.cpuadam_cores_perc", 0.8, "zerofit's host step runs torch's CPU kernels: set their threads "
            "with OMP_NUM_THREADS or torch.set_num_threads", to_float),
    Ignored("dump_state", False, "zerofit prints no engine state at start: `zerofit launch --dry_run` prints the "
            "resolved config", to_bool),
    Ignored("memory_breakdown", False, "zerofit prints no memory breakdown: use torch.cuda.memory_summary() or "
            "torch.profiler with profile_memory", to_bool),
    Ignored("dataloader_drop_last", False, "prepare() keeps each DataLoader's own drop_last: pass drop_last=True "
            "to the DataLoader", to_bool),
    Ignored("data_types.grad_accum_dtype", None, "zerofit accumulates gradients in fp32 buffers", _comm_type,
            quiet=("fp32",)),
    Ignored("timers.throughput.enabled", True, "zerofit keeps no DeepSpeed throughput timer", to_bool,
            quiet=(False,)),
    Ignored("timers.throughput.synchronized", True, "zerofit keeps no DeepSpeed throughput timer", to_bool,
            quiet=(False,)),
    Ignored("seq_parallel_communication_data_type", "fp32", "zerofit has no sequence parallelism", _comm_type,
            quiet=("fp16", "bf16")),
    Ignored("graph_harvesting", False, "zerofit captures no CUDA graphs", to_bool),
    Ignored("use_data_before_expert_parallelism", False, "zerofit has no expert parallelism", to_bool),
    Ignored("checkpoint.tag_validation", "Warn", "zerofit checkpoints have no tags: every rank writes into the "
            "directory the main rank chose", _tag_validation, quiet=("Ignore", "Fail")),
    Ignored("checkpoint.parallel_write.pipeline_stage", False, "every rank writes its own shards, in parallel",
            to_bool, quiet=(True,)),
    Ignored("fp16.auto_cast", False, "zerofit casts floating-point inputs to the compute dtype at the model in "
            "any case", to_bool, quiet=(True,)),
    Ignored("bf16.immediate_grad_update", False, "zerofit accumulates each unit's gradients as backward produces "
            "them, in its own fixed way", to_bool, quiet=(True,)),
    Ignored("bf16.check_grad_overflow", False, "zerofit checks the gradient norm for NaN and inf in every "
            "precision and warns about such a step; to skip it instead set precision.skip_nonfinite_steps in "
            "zerofit's YAML", to_bool),
    Ignored("bf16.bf16_master_weights_and_grads", False, "zerofit keeps the master weights and gradients in fp32 "
            "(bf16.bf16_optimizer_states still stores the optimizer state in bf16)", to_bool),
    Ignored("aio.intra_op_parallelism", 1, _NVME_IO, to_int),
    Ignored("aio.use_gds", False, "zerofit's NVMe offload moves data through host memory; GPUDirect Storage is "
            "not used", to_bool),
    Ignored(f"{_Z}.allgather_partitions", True, "zerofit gathers parameters with all-gather, one per "
            "communication unit", to_bool),
    Ignored(f"{_Z}.reduce_scatter", True, "zerofit picks each unit's gradient reduction from the stage", to_bool),
    Ignored(f"{_Z}.use_multi_rank_bucket_allreduce", True, f"{_UNITS}: there are no buckets to combine",
            to_bool, quiet=(False,)),
    Ignored(f"{_Z}.load_from_fp32_weights", True, "zerofit checkpoints always restore the fp32 master weights",
            to_bool),
    Ignored(f"{_Z}.ignore_unused_parameters", True, "zerofit never stops on parameters without a gradient: "
            "they are stepped with a zero gradient", to_bool),
    Ignored(f"{_Z}.round_robin_gradients", False, "zerofit copies gradients to the CPU one unit at a time",
            to_bool, quiet=(True,)),
    Ignored(f"{_Z}.memory_efficient_linear", True, "zerofit never replaces torch's linear layers", to_bool,
            quiet=(False,)),
    Ignored(f"{_Z}.override_module_apply", True, "zerofit never overrides nn.Module.apply", to_bool,
            quiet=(False,)),
    Ignored(f"{_Z}.log_trace_cache_warnings", False, "zerofit records the unit order once and keeps no trace "
            "cache", to_bool, quiet=(True,)),
    Ignored(f"{_Z}.enable_sanity_checks", False, "zerofit's own checks always run", to_bool, quiet=(True,)),
    Ignored(f"{_Z}.leaf_module", {}, _UNITS, _section),
    Ignored(f"{_Z}.save_muon_momentum_buffer_in_memory", False, "zerofit's NVMe offload swaps every state "
            "tensor of the optimizer", to_bool),
    Ignored(f"{_Z}.stage3_model_persistence_threshold", sys.maxsize, "zerofit keeps every parameter under "
            "stage3_param_persistence_threshold whole, without a cap on their total", to_int),
    Ignored(f"{_Z}.stage3_module_granularity_threshold", 0, _UNITS, to_int),
    Ignored(f"{_Z}.stage3_use_all_reduce_for_fetch_params", False, "zerofit gathers parameters with all-gather",
            to_bool),
    Ignored(f"{_Z}.stage3_allgather_sequential", False, "zerofit gathers a unit's parameters in one flat "
            "all-gather", to_bool),
    Ignored(f"{_Z}.stage3_partition_stream_chunk_size", 0, _NO_ZERO_INIT, to_int),
)
"""Every accepted-and-ignored DeepSpeed knob (see the module docstring)."""


def _entries(source_format: str) -> Iterator[tuple[Ignored, str]]:
    for entry in TABLE:
        name = entry.name(source_format)
        if name is not None:
            yield entry, name


def handled(source_format: str) -> tuple[str, ...]:
    """The keys of `source_format` this module reads (for `reading.walk`'s `handled`)."""
    return tuple(name for _, name in _entries(source_format))


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def check(reading: Reading, data: Mapping[str, Any], source_format: str) -> None:
    """Type-check every ignored key `data` holds and warn for each that asks for something zerofit does not do.

    `source_format` is "deepspeed", "zerofit" or "accelerate" (an Accelerate YAML's plugin keys).
    """
    for entry, name in _entries(source_format):
        if not has(data, name):
            continue
        raw = dig(data, name)
        if entry.allows_auto and is_auto_text(raw):
            continue
        value = reading.coerce(name, raw, entry.convert)
        if value is INVALID or value == entry.default or value in entry.quiet:
            continue
        reading.warn(f"{name} = {_shown(value)} is ignored: {entry.why}")
    _check_pin_memory(reading, data, source_format)


def _check_pin_memory(reading: Reading, data: Mapping[str, Any], source_format: str) -> None:
    """`pin_memory: false` acts on NVMe staging buffers only: CPU-offloaded state is always page-locked.

    DeepSpeed files only: zerofit's own format documents this on the field, and the resolved file the
    launcher hands to its workers always holds the field.
    """
    if source_format != "deepspeed":
        return
    section = _Z
    for kind in ("offload_optimizer", "offload_param"):
        name = f"{section}.{kind}.pin_memory"
        if reading.values.get(f"zero.{kind}.device") != "cpu" or not has(data, name):
            continue
        if reading.values.get(f"zero.{kind}.pin_memory") is False:
            reading.warn(f"{name} = False is ignored with {section}.{kind}.device cpu: zerofit always page-locks "
                         "CPU-offloaded state (at its exact size), which its asynchronous copies need; "
                         "pin_memory applies to the NVMe staging buffers only")
