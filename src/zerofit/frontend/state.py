"""Who this process is in the run, and where the training loop stands: `ProcessState`, `GradientState`.

`ProcessState` joins (or creates) the process group once: under `zerofit launch` / torchrun the
environment names the rendezvous; a process started as plain `python train.py` runs as a world of
one with no process group at all (the engine and every collective below degrade to no-ops), so no
environment variable is needed.

`GradientState` is what `accumulate()`, the dataloaders and the optimizer wrapper share: whether the
current micro-step closes an accumulation window, and whether the batch being processed is the last
of its dataloader (and how many of its samples are real, for `gather_for_metrics`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zerofit.config.schema import RunConfig, is_auto
from zerofit.distributed import arrival, process_group, runtime
from zerofit.distributed.collectives import Peers
from zerofit.engine.window import AccumulationWindow, InWindow


class DistributedType(str, enum.Enum):
    """How the run is distributed (compare with `accelerator.distributed_type`); Accelerate's members.

    zerofit reports NO for one process without sharding, MULTI_CPU / MULTI_GPU for several processes
    at ZeRO stage 0 (plain data parallelism, gradients all-reduced), and DEEPSPEED whenever its ZeRO
    engine shards (stage 1, 2, 3 or "auto"), on any number of processes: scripts that branch on
    `== DistributedType.DEEPSPEED` reach their DeepSpeed paths (`DummyOptim`, `model.save_checkpoint`,
    `accelerator.state.deepspeed_plugin`), which zerofit serves with its own engine. `ZERO` is
    zerofit's older name for that member (an alias), `TPU` Accelerate's deprecated alias of `XLA`.
    The other members exist so that scripts comparing against them run; zerofit never reports them.
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    ZERO = "DEEPSPEED"
    TPU = "XLA"


@dataclass
class ProcessState:
    """This process's place in the run: rank, world, device, process group (None for a world of one)."""

    process_index: int
    num_processes: int
    local_process_index: int
    device: torch.device
    backend: str | None
    group: Any = None
    initialized_here: bool = False

    @classmethod
    def create(cls, config: RunConfig, *, cpu: bool = False) -> ProcessState:
        runtime.note_zerofit_state_built()  # Accelerator and PartialState both start here
        use_cpu = cpu or runtime.use_cpu(config)
        device = torch.device("cpu") if use_cpu else runtime.device(config)
        backend = runtime.backend_for(use_cpu)
        created = False
        if device.type == "cuda":
            # Whoever creates the process group (zerofit, the script, TrainingArguments), the rank's GPU
            # must be current before any CUDA work: collectives with no tensor to go by (barrier, the
            # object collectives) and CUDA calls that name no device use it; else every rank opens a
            # context on GPU 0. Accelerate's PartialState selects it unconditionally too.
            torch.cuda.set_device(device)
        if not dist.is_initialized() and process_group.launched():
            process_group.join(config, backend, device)
            created = True
        if dist.is_initialized():
            arrival.open_board(created=created)  # every rank says where it is at checked places from now on
            backend = dist.get_backend()
            return cls(dist.get_rank(), dist.get_world_size(), runtime.local_rank(), device, backend,
                       dist.group.WORLD, created)
        return cls(0, 1, 0, device, None)

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    def barrier(self, place: arrival.Place = arrival.WAIT_FOR_EVERYONE) -> None:
        arrival.check_in(place)  # a rank elsewhere (in a save, exited) makes this raise now, not at the timeout
        Peers().barrier("barrier (wait_for_everyone)")


@dataclass
class GradientState:
    """Shared by `accumulate()`, the dataloaders and the optimizer/scheduler wrappers."""

    window: AccumulationWindow = field(default_factory=AccumulationWindow)
    """The accumulation steps and the micro-steps `accumulate()` counted since the last window closed:
    the engine's window too (`GradientState(n)` makes a window of n)."""
    sync_gradients: bool = True
    """True on the micro-step that closes an accumulation window (the optimizer steps after it)."""
    active_dataloaders: list[Any] = field(default_factory=list)
    """Dataloaders being iterated, innermost last."""

    def __post_init__(self) -> None:
        if not isinstance(self.window, AccumulationWindow):
            self.window = AccumulationWindow(self.window)

    gradient_accumulation_steps = InWindow("steps")
    micro_step = InWindow("micro_step")

    @property
    def end_of_dataloader(self) -> bool:
        """True while the script processes the last batch of the innermost dataloader."""
        return bool(self.active_dataloaders) and self.active_dataloaders[-1].at_last_batch

    @property
    def remainder(self) -> int:
        """Real samples in the innermost dataloader's last global batch, or -1 when nothing was padded."""
        return self.active_dataloaders[-1].remainder if self.active_dataloaders else -1

    @property
    def in_dataloader(self) -> bool:
        return bool(self.active_dataloaders)

    def begin(self, loader: Any) -> None:
        self.active_dataloaders.append(loader)

    def end(self, loader: Any) -> None:
        if loader in self.active_dataloaders:
            self.active_dataloaders.remove(loader)

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """What Accelerate's `GradientAccumulationPlugin` settings are under zerofit (read by transformers'
        Trainer): windows of `num_steps`, closed at the end of a dataloader, the scheduler stepped only
        when a window closes; `sync_each_batch` is False, the engine decides when gradients travel."""
        return {"num_steps": self.gradient_accumulation_steps, "adjust_scheduler": True,
                "sync_with_dataloader": True, "sync_each_batch": False}

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Say whether the current micro-step closes a window, for a loop that counts its own micro-steps
        instead of entering `accumulate()` (Accelerate's name; transformers' Trainer calls it every micro-step)."""
        self.sync_gradients = bool(sync_gradients)

    def count_micro_step(self) -> None:
        """Advance by one micro-step: the window closes every N steps and at the end of the dataloader."""
        if self.end_of_dataloader:
            self.micro_step = 0
            self.sync_gradients = True
            return
        self.micro_step += 1
        self.sync_gradients = self.micro_step % self.gradient_accumulation_steps == 0
        if self.sync_gradients:
            self.micro_step = 0


class ZeroPlugin:
    """Read-only stand-in for Accelerate's `state.deepspeed_plugin`, for scripts that inspect it.

    Scripts written for DeepSpeed often choose between `DummyOptim` and a torch optimizer with
    `"optimizer" in accelerator.state.deepspeed_plugin.deepspeed_config`; `deepspeed_config` here is
    the run's config in DeepSpeed's spelling (the keys such scripts read).
    """

    def __init__(self, config: RunConfig):
        self.zero_stage = config.zero.stage
        self.gradient_accumulation_steps = config.batch.gradient_accumulation_steps
        self.deepspeed_config: dict[str, Any] = {
            "zero_optimization": {"stage": config.zero.stage},
            "gradient_accumulation_steps": config.batch.gradient_accumulation_steps,
            "train_micro_batch_size_per_gpu": config.batch.train_micro_batch_size_per_gpu,
            "gradient_clipping": config.gradient_clipping,
        }
        for section in ("optimizer", "scheduler"):
            named = getattr(config, section)
            if named is not None:
                self.deepspeed_config[section] = {"type": named.type, "params": dict(named.params)}

    def is_zero3_init_enabled(self) -> bool:
        return False


class AcceleratorState:
    """`accelerator.state`: the attributes scripts read from Accelerate's state, and a readable summary."""

    def __init__(self, accelerator: Any):
        self._acc = accelerator

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._acc, name)

    @property
    def deepspeed_plugin(self) -> ZeroPlugin | None:
        """A `ZeroPlugin` when the config shards (stage >= 1) or names an optimizer or scheduler; else None."""
        cfg = self._acc.config
        if is_auto(cfg.zero.stage) or cfg.zero.stage >= 1 or cfg.optimizer is not None or cfg.scheduler is not None:
            return ZeroPlugin(cfg)
        return None

    def __repr__(self) -> str:
        acc = self._acc
        return (f"Distributed environment: {acc.distributed_type.value} (ZeRO stage {acc.config.zero.stage})\n"
                f"Num processes: {acc.num_processes}\nProcess index: {acc.process_index}\n"
                f"Local process index: {acc.local_process_index}\nDevice: {acc.device}\n"
                f"Mixed precision type: {acc.mixed_precision}\n"
                f"Gradient accumulation steps: {acc.gradient_accumulation_steps}\n")
