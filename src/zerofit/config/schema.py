"""The one typed config tree of a zerofit run.

Every loader (zerofit YAML, Accelerate launch YAML, DeepSpeed JSON) produces a `RunConfig`; every
component receives only its own sub-config. A field may hold `AUTO` until `prepare()` fills it from
the training script (see `zerofit.config.auto`); components never see `AUTO`.

Cross-field rules live in `zerofit.config.validate`, so one call can list every problem at once;
`__post_init__` here checks only what a single field can get wrong on its own.

Every field acts: DeepSpeed knobs zerofit accepts but has no use for (bucket sizes, overlap_comm,
libaio modes, ...) are not fields; `zerofit.config.ignored` lists them, with the warning they give.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


class _Auto:
    """The value `"auto"`: filled at `prepare()` time from the script, as Accelerate does."""

    _instance: _Auto | None = None

    def __new__(cls) -> _Auto:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "AUTO"

    def __reduce__(self):
        return (_Auto, ())


AUTO: Any = _Auto()
"""Sentinel for a value that `prepare()` resolves; serialised as the string "auto"."""


def is_auto(value: Any) -> bool:
    return value is AUTO


OffloadDevice = Literal["none", "cpu", "nvme"]
StepOn = Literal["auto", "host", "device"]
MixedPrecision = Literal["no", "fp16", "bf16"]
OptimizerStateDtype = Literal["fp32", "bf16", "8bit"]
CommunicationDataType = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where one kind of state lives when it is not on the accelerator."""

    device: OffloadDevice | Any = "none"
    """none: stays on the accelerator; cpu: pinned host memory; nvme: files under nvme_path; "auto": the
    planner picks none or cpu at prepare()."""
    nvme_path: str | None = None
    """Directory for NVMe offload files (required when device is nvme)."""
    pin_memory: bool = True
    """Page-lock the NVMe staging buffers (on CUDA); CPU-offloaded state is always page-locked, whatever this says."""
    buffer_count: int = 4
    """Number of staging buffers in the NVMe pool (at least 2: one group steps while the next is read)."""
    ratio: float | Any = 1.0
    """Fraction of the parameters whose optimizer state is offloaded, whole units from the last one back (the
    rest stay on the GPU); "auto": the planner keeps as much on the GPU as fits (also what an unwritten ratio
    means under `stage: auto` or `device: auto`)."""
    step_on: StepOn = "auto"
    """Where offloaded optimizer state is stepped: host (the CPU optimizer, on host memory) or device
    (streamed through the GPU in chunks and stepped there by the same fused kernel as without offload); auto:
    device on a CUDA machine, host on CPU-only ones and for NVMe (write device to stream NVMe-homed state
    through the GPU). offload_optimizer only."""
    host_share: float | Any | None = None
    """Where offloaded state is GPU-stepped (step_on device, or auto on a CUDA machine): the share of it
    stepped on the host instead (whole units, the last ones), both at once; unset: none; "auto": the share
    this machine's measured offload rates favour (`zerofit env --probe`), chosen at prepare() (none when none
    are cached). offload_optimizer only."""

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """Asynchronous file I/O used by NVMe offload (DeepSpeed's top-level `aio` block)."""

    block_size: int = 1_048_576
    """Bytes per I/O request."""
    queue_depth: int = 8
    """Requests in flight per submitting thread."""
    thread_count: int = 1
    """Threads submitting I/O."""


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """What the ZeRO engine shards and when it communicates."""

    stage: int | Any = 0
    """0: DDP (gradients all-reduced); 1: + optimizer state sharded; 2: + gradients; 3: + parameters; "auto":
    the fastest that fits, picked at prepare() (zerofit.plan.auto)."""
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    """fp32 master weights and optimizer states off the accelerator (stages 1-3)."""
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    """Parameter shards off the accelerator (stage 3 only; cpu, not nvme)."""
    param_persistence_threshold: int | Any = 100_000
    """Units with fewer elements than this stay unsharded (stage 3); "auto" = 10 * hidden_size."""
    unit_size_threshold: int = 10_000_000
    max_live_parameters: int | None = None
    """Stage 3: elements of gathered parameters that forwards without autograd (generation, evaluation) keep
    gathered until the next training forward, backward or step (DeepSpeed's stage3_max_live_parameters);
    unset: as many as fit the device; 0: none, every unit is gathered again at every forward."""
    """Parameter count above which a module becomes its own communication unit when no repeated block is found."""
    aio: AioConfig = field(default_factory=AioConfig)
    """File I/O settings for NVMe offload."""
    gradient_checkpointing: bool | Any | None = None
    """Activation checkpointing of a transformers model (`gradient_checkpointing_enable()`, called at
    prepare()): true: on; false: zerofit never turns it on (a script's own call stands); "auto": the planner
    turns it on where that makes the fastest setting that fits; unset: "auto" when the planner runs (stage, an
    offload device or the ratio "auto"), else the model as the script built it."""


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """fp16 loss scaling, with DeepSpeed's meaning of every field."""

    loss_scale: float = 0.0
    """0: dynamic loss scaling; any other value: that static scale."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the scale is doubled."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis on every overflow-free step, not only when the scale grows."""
    min_loss_scale: float = 1.0
    """The scale never drops below this; overflowing at it is an error."""


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """Compute precision; master weights are always fp32, optimizer state fp32 unless `optimizer_state` says."""

    mixed_precision: MixedPrecision | Any = "no"
    """no: fp32 compute; bf16 or fp16: compute in that dtype."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Used when mixed_precision is fp16."""
    communication_data_type: CommunicationDataType = "fp32"
    """The dtype gradients are reduced in between ranks: fp32 (default, exact sums); bf16 or fp16 send half
    the bytes, and each rank's share is added to its fp32 gradient after the reduction
    (see [Note: gradients on the wire] in zerofit.engine.unit). One rank: no reduction, no effect.
    DeepSpeed's unset value (the compute dtype) is not followed: unset is fp32."""
    optimizer_state: OptimizerStateDtype = "fp32"
    """How the optimizer's per-element state (Adam's moments, momentum) is stored between steps: fp32 (as the
    optimizer makes it), bf16 (half the bytes), or 8bit (block-wise dynamic quantisation, 1.25 bytes per
    element). The update always runs in fp32 with the script's optimizer class; the fp32 master is never
    narrowed (see [Note: narrow optimizer state] in zerofit.engine.state_codec)."""
    skip_nonfinite_steps: bool = False
    """zerofit only: in fp32 / bf16, a step whose gradient norm is NaN or inf is skipped on every rank (as
    fp16's loss scaler skips overflows; costs one host sync per step when clipping is off); false: the step is
    applied and a warning names it."""


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """The batch triple: train_batch_size = micro_batch * accumulation * world size."""

    train_batch_size: int | Any | None = None
    """Samples per optimizer step over all ranks."""
    train_micro_batch_size_per_gpu: int | Any | None = None
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int | Any | None = AUTO
    """Micro-steps per optimizer step; "auto" (default): the script's value (Accelerator argument, else 1);
    None: derived from the other two, as DeepSpeed does."""
    oom_backoff: bool = True
    """zerofit only: a CUDA out-of-memory error inside accumulate() halves the micro-batch and doubles
    accumulation, keeping train_batch_size (zerofit.frontend.planning.backoff). On several ranks under stages 0-2
    without offload this costs one small blocking all-reduce per micro-step; false: no back-off and no
    all-reduce, an out-of-memory error ends the run."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """An optimizer named by the config (used when the script passes `DummyOptim`)."""

    type: str
    """AdamW, Adam, SGD, or any torch.optim class name."""
    params: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments; lr and weight_decay may be "auto"."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """A learning-rate schedule named by the config (used when the script passes `DummyScheduler`)."""

    type: str
    """WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest."""
    params: dict[str, Any] = field(default_factory=dict)
    """The schedule's parameters, with DeepSpeed's names; some may be "auto"."""


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How many processes, on which machines, talking where."""

    num_processes: int | None = None
    """Processes in total over all machines; None: one per GPU, or 1 on CPU."""
    num_machines: int = 1
    """Machines taking part."""
    machine_rank: int = 0
    """This machine's index, 0 .. num_machines - 1."""
    main_process_ip: str | None = None
    """Address of machine 0's rendezvous; None: 127.0.0.1 on one machine."""
    main_process_port: int | None = None
    """Port of the rendezvous; None: a free port on one machine, 29500 on several."""
    rdzv_backend: Literal["static", "c10d"] = "static"
    """torchrun rendezvous backend."""
    use_cpu: bool = False
    """Run on CPU with gloo even where GPUs exist."""
    gpu_ids: str | None = None
    """Comma-separated GPU indices to use on each machine ("0,1"); None or "all": every visible GPU."""
    max_restarts: int = 0
    """Elastic restarts of the worker group after a failure (each restart resumes per checkpoint.resume)."""
    process_group_timeout: float = 1800.0
    """Seconds a collective (and joining the process group) may wait for a peer before it raises."""
    main_training_function: str = "main"
    """Kept from Accelerate configs; scripts are run as __main__."""
    hostfile: str | None = None
    """DeepSpeed hostfile (`host slots=N` lines): the run's machines; the launch without --machine_rank
    starts the others over ssh (docs/cli.md, several machines)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how `save_state` writes."""

    output_dir: str | None = None
    """Default directory for checkpoints; None: the script passes one."""
    total_limit: int | None = None
    """After each save_state, keep only the newest this many zerofit checkpoints in the folder that holds it
    (never the one `latest` names, never anything else); None: keep all. ProjectConfiguration(total_limit=...)
    means the same; the config wins."""
    resume: Literal["restart", "auto", "must", "never"] = "restart"
    """When prepare() loads the latest complete checkpoint by itself: restart: on a restarted attempt
    (--max_restarts); auto: whenever one exists; must: always, and fail when there is none; never."""
    overwrite: bool = False
    """Let this run replace and prune (total_limit) checkpoints an earlier run left where it saves; false: such
    a save is refused before it writes anything, unless the run loaded a checkpoint from that folder."""


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """What the run reports."""

    log_with: tuple[str, ...] = ()
    """Trackers: jsonl (always available), tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive, or all
    (every installed one); a named tracker whose library is missing is an error at init_trackers."""
    logging_dir: str | None = None
    """Where trackers write."""
    steps_per_print: int | None = None
    """Rank 0 prints one line (step, lr, fp16 loss scale, skipped steps) every this many optimizer steps; None
    (the default, also for a DeepSpeed file that leaves it out, where DeepSpeed would use 10): never."""
    throughput: bool = True
    """The progress line also carries tokens/s, samples/s, MFU and the GPU memory peak over the steps since
    the previous line, and with trackers started logs them under `zerofit/` keys; false: step and lr only."""


CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """`torch.compile` of each prepared model, at the end of `prepare()` (an Accelerate YAML's `dynamo_config`);
    a script's `Accelerator(dynamo_backend=...)` or `dynamo_plugin=...` replaces the whole section."""

    backend: str = "no"
    """A `torch._dynamo.list_backends()` name (inductor, cudagraphs; eager or aot_eager to debug); no: eager."""
    mode: CompileMode = "default"
    """torch.compile's mode: default, reduce-overhead, max-autotune or max-autotune-no-cudagraphs."""
    fullgraph: bool = False
    """One graph or an error; stages 0-2 without offload only (the engine's hooks break the graph)."""
    dynamic: bool | None = None
    """Trace with dynamic shapes (true), never (false), or as torch decides after a shape changes (unset)."""
    regional: bool = False
    """Compile each communication unit (the repeated blocks, large modules) and the modules around them one by
    one instead of the whole model: the blocks share one compiled graph, so the first step compiles faster."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a zerofit run needs, after loading and before `auto` resolution."""

    launch: LaunchConfig = field(default_factory=LaunchConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    gradient_clipping: float | Any = 0.0
    """Clip the global gradient norm to this before each optimizer step; 0: no clipping; "auto": 1.0, the
    value Accelerate fills under DeepSpeed. On a step where the script calls clip_grad_norm_(max_norm), that
    max_norm applies instead."""
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    source: str | None = None
    """The file(s) this config was loaded from, for messages."""
    source_format: Literal["zerofit", "accelerate", "deepspeed", "accelerate+deepspeed"] = "zerofit"
    """The format the user wrote, so later messages (after `auto` resolution, on workers) use the user's key names."""
    written: tuple[str, ...] = field(default=(), compare=False, metadata={"record": True})
    """The zerofit keys the user's file (or a command-line flag) gave a value, so a written 0 or false is told
    from a default one (transformers' Trainer refuses a written value that disagrees with TrainingArguments);
    filled at load, kept on workers (zerofit_yaml.dump writes it; `to_dict` leaves it out, as it is no setting);
    not compared: two configs with the same values are equal."""

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)


def to_dict(config: Any) -> Any:
    """Plain JSON-ready data from a config tree (AUTO becomes the string "auto")."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)
                if not f.metadata.get("record")}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    if is_auto(config):
        return "auto"
    return config
