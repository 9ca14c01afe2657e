"""`Accelerator`: the API a Hugging Face Accelerate script already calls, over zerofit's ZeRO engine.

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    for batch in train_dl:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

The facade owns no training logic: the engine shards and steps (`zerofit.engine`), the wrappers
decide when a script's call takes effect (`zerofit.frontend.optimizers`, `zerofit.frontend.schedulers`), the
dataloaders shard (`zerofit.frontend.data.loaders`), the config is completed from the script
(`zerofit.frontend.script_config`), files are written by `zerofit.frontend.persistence` over `zerofit.checkpoint`.
`prepare()` returns the script's own model object, changed in place, so `model.config`,
`model.generate` and `save_pretrained` work as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from zerofit.config import load_config
from zerofit.config.schema import RunConfig, is_auto
from zerofit.distributed import arrival, process_group, runtime
from zerofit.engine.loss_scale import LossScaler
from zerofit.frontend import compiling, ops, plugins
from zerofit.frontend.data.loaders import ShardedDataLoader
from zerofit.frontend.persistence import PersistenceMixin
from zerofit.frontend.planning.backoff import OomBackoff
from zerofit.frontend.planning.first_step_check import StepProbe
from zerofit.frontend.prepare import Prepared, PrepareMixin
from zerofit.frontend.processes import ProcessMethods
from zerofit.frontend.script_config import (
    Facts,
    apply_script_arguments,
    early_accumulation,
    require_micro_batch,
)
from zerofit.frontend.state import AcceleratorState, DistributedType, GradientState, ProcessState
from zerofit.frontend.tracking import selection
from zerofit.frontend.tracking.base import BlankTracker
from zerofit.frontend.utils import ProjectConfiguration

# Accelerate arguments zerofit accepts and leaves alone (with a warning when given a value).
_IGNORED = ("device_placement", "rng_types", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin",
            "torch_tp_plugin", "parallelism_config", "even_batches", "dispatch_batches")
# What the warning for an ignored argument says zerofit does instead (default: _DECIDED_BY_ZEROFIT).
_DECIDED_BY_ZEROFIT = "its engine and config decide this"
_INSTEAD = {
    "fsdp_plugin": "zerofit shards with its own ZeRO engine, as the config's zero.stage says (stage 3 shards "
                   "parameters, gradients and optimizer state, as FSDP's FULL_SHARD does)",
}


class Accelerator(PrepareMixin, PersistenceMixin, ProcessMethods):
    """Accelerate's `Accelerator`, running zerofit's engine with the run's config (see the module doc).

    `config` (zerofit only) is a config file or a RunConfig; by default the one `zerofit launch`
    resolved (or the defaults when the script runs on its own).
    """

    def __init__(self, gradient_accumulation_steps: int = 1, mixed_precision: str | None = None,
                 log_with: Any = None, project_dir: str | os.PathLike | None = None,
                 logging_dir: str | os.PathLike | None = None, split_batches: bool = False, cpu: bool = False,
                 step_scheduler_with_optimizer: bool = True, project_config: ProjectConfiguration | None = None,
                 dataloader_config: Any = None, gradient_accumulation_plugin: Any = None,
                 device_placement: Any = None, rng_types: Any = None, kwargs_handlers: Any = None,
                 dynamo_backend: Any = None, dynamo_plugin: Any = None, deepspeed_plugin: Any = None,
                 deepspeed_plugins: Any = None, fsdp_plugin: Any = None, megatron_lm_plugin: Any = None,
                 torch_tp_plugin: Any = None, parallelism_config: Any = None, even_batches: Any = None,
                 dispatch_batches: Any = None, use_seedable_sampler: Any = None,
                 config: RunConfig | str | os.PathLike | None = None):
        given = locals()
        for name in _IGNORED:
            if given[name] not in (None, [], ()):
                warnings.warn(f"Accelerator({name}=...) is accepted for compatibility and ignored by zerofit: "
                              f"{_INSTEAD.get(name, _DECIDED_BY_ZEROFIT)}; remove the argument to silence this "
                              "warning", stacklevel=2)
        if gradient_accumulation_plugin is not None:
            gradient_accumulation_steps = getattr(gradient_accumulation_plugin, "num_steps",
                                                  gradient_accumulation_steps)
        if dataloader_config is None:
            dataloader_config = plugins.DataLoaderConfiguration(split_batches=split_batches)
        if use_seedable_sampler is not None:  # Accelerate's older spelling of the dataloader_config field
            dataloader_config = dataclasses.replace(dataloader_config, use_seedable_sampler=bool(use_seedable_sampler))
        split_batches = bool(getattr(dataloader_config, "split_batches", split_batches))
        timeout = plugins.process_group_timeout(kwargs_handlers)
        self._profile_kwargs = next((h for h in kwargs_handlers or () if isinstance(h, plugins.ProfileKwargs)), None)
        _check_accumulation_steps(gradient_accumulation_steps)
        if mixed_precision not in (None, "no", "fp16", "bf16"):
            raise ValueError(f"mixed_precision must be 'no', 'fp16' or 'bf16' (got {mixed_precision!r})")
        if config is None:
            config = runtime.current_config()
        elif not isinstance(config, RunConfig):
            config = load_config(config)
        if deepspeed_plugin is not None:  # a plugin given in code wins over the launch config, as in Accelerate
            config = plugins.with_deepspeed_plugin(config, deepspeed_plugin)
        if timeout is not None:  # InitProcessGroupKwargs(timeout=...)
            config = config.replace(launch=dataclasses.replace(config.launch, process_group_timeout=timeout))
        self._compile = compiling.requested(dynamo_backend, dynamo_plugin, config)
        """How `prepare()` compiles each model: the script's arguments, else the config (zerofit.frontend.compiling)."""
        self.process = ProcessState.create(config, cpu=cpu)
        self._before_script = (config, mixed_precision)  # for a later `gradient_accumulation_steps = n`
        self.config = apply_script_arguments(config, gradient_accumulation_steps=gradient_accumulation_steps,
                                             mixed_precision=mixed_precision, world=self.num_processes)
        self.gradient_state = GradientState(early_accumulation(self.config, self.num_processes))
        self.split_batches = split_batches
        self.dataloader_config = dataloader_config
        """How prepared dataloaders shard and shuffle (`split_batches`, `use_seedable_sampler`, `data_seed`)."""
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(str(project_dir))
        if logging_dir is not None:
            self.project_configuration.logging_dir = str(logging_dir)
        self.log_with = (selection.requested(log_with, "Accelerator(log_with=...)") if log_with is not None
                         else selection.requested(list(self.config.logging.log_with), "logging.log_with"))
        self.trackers: list[Any] = []
        self._facts = Facts()
        self._batch_waiting = True
        self._prepared = Prepared()
        self._no_sync_depth = 0
        self._sync_of_backward: bool | None = None
        """Inside `backward()` with several trained models: whether it closes the window (else None)."""
        self._seed: int | None = None
        self._warned: set[str] = set()
        self.step = 0
        self.state = AcceleratorState(self)
        self._backoff = OomBackoff(settings=lambda: self.config, process=self.process,  # inside accumulate()
                                   gradient_state=self.gradient_state, prepared=self._prepared)
        # checks an "auto" choice on the first step (zerofit.frontend.planning.first_step_check)
        self._probe: StepProbe | None = None
        self.planning_accumulation: int | None = None
        """The accumulation the loop really runs, when the loop counts it itself and the Accelerator's own is 1
        (transformers' Trainer: zerofit.integrations.trainer_config); the planner sizes "auto" for it."""

    @property
    def mixed_precision(self) -> str:
        return self.config.precision.mixed_precision

    @property
    def use_seedable_sampler(self) -> bool:
        """Whether shuffled epochs are seeded with seed + epoch ([Note: the same order as Accelerate])."""
        return bool(getattr(self.dataloader_config, "use_seedable_sampler", False))

    @property
    def use_fp16(self) -> bool:
        return self.mixed_precision == "fp16"

    @property
    def distributed_type(self) -> DistributedType:
        if is_auto(self.config.zero.stage) or self.config.zero.stage >= 1:  # "auto": decided at prepare()
            return DistributedType.DEEPSPEED
        return self._data_parallel_type()

    @property
    def deepspeed_plugin(self) -> Any:
        """`state.deepspeed_plugin`: the run's ZeRO settings in DeepSpeed's spelling when it shards, else None."""
        return self.state.deepspeed_plugin

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        """The run's config in DeepSpeed's JSON spelling (what `deepspeed_plugin.deepspeed_config` holds)."""
        plugin = self.state.deepspeed_plugin
        if plugin is None:
            raise AttributeError("deepspeed_config: this run does not shard (ZeRO stage 0, no optimizer or "
                                 "scheduler in the config); accelerator.config holds its settings")
        return plugin.deepspeed_config

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        """As if `Accelerator(gradient_accumulation_steps=steps)` had been passed (before `prepare()`)."""
        _check_accumulation_steps(steps)
        if self._prepared.engines:
            raise ValueError("accelerator.gradient_accumulation_steps = ... after prepare(): set it before "
                             "prepare() (or pass Accelerator(gradient_accumulation_steps=...))")
        config, mixed_precision = self._before_script
        self.config = apply_script_arguments(config, gradient_accumulation_steps=steps,
                                             mixed_precision=mixed_precision, world=self.num_processes)
        self.gradient_state.gradient_accumulation_steps = early_accumulation(self.config, self.num_processes)

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self._prepared.optimizers)

    @property
    def scaler(self) -> LossScaler | None:
        """The trained model's fp16 loss scaler (`state_dict()`, `load_state_dict()`, `get_scale()`, what
        scripts and transformers' Trainer read from Accelerate's GradScaler); None without fp16 loss
        scaling or before `prepare()`. It is the engine's own: it checkpoints with `save_state` too."""
        engine = self._prepared.trained_engine()
        return engine.scaler if engine is not None and engine.scaler.enabled else None

    @property
    def _models(self) -> list[nn.Module]:
        """The prepared models, in the order they were prepared (Accelerate's list; Trainer reads it)."""
        return [engine.model for engine in self._prepared.engines.values()]

    @property
    def parallelism_config(self) -> None:
        """None: zerofit has no tensor, context or sequence parallelism (`Accelerator(parallelism_config=...)`
        is ignored with a warning); its data parallelism is the config's ZeRO settings."""
        return None

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    # --- the training loop ----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate `loss`: divided by the accumulation steps, loss-scaled under fp16, reduced per stage.

        A script's own `loss.backward()` is trained too, without the division and the loss scale (see
        [Note: a backward the engine did not start] in zerofit.engine.plain_backward).

        [Note: several trained models]
        A GAN prepares two models, each with its optimizer: one engine each. A loss may run through both
        (the generator's loss through the discriminator), so no one engine can bracket its backward. With
        several trained models `backward()` decides once whether this micro-step closes the window (and
        agrees on out-of-memory failures once), divides the loss by the accumulation steps and runs autograd
        itself; each engine the loss reaches notices the backward from its hooks, as it notices a script's
        own `loss.backward()`, and takes that decision. Each optimizer steps its own model's engine, so the
        discriminator's gradients from the generator's loss stay until its own `zero_grad()`, as in PyTorch.
        `clip_grad_norm_` clips the model whose parameters it is given; fp16 loss scaling (one scale per
        engine) and `save_state` / `load_state` (one trained model per checkpoint) are refused."""
        trained = self._prepared.trained_engines()
        if len(trained) != 1:  # none prepared yet, or several: [Note: several trained models]
            sync = self._backward_begins()
            self._sync_of_backward = sync
            try:
                (loss / self.gradient_accumulation_steps).backward(**kwargs)
            finally:
                self._sync_of_backward = None
            self._backward_ended(sync)
            return
        engine = trained[0]
        sync = self._backward_begins()
        # Tensor.backward's own arguments; others (DeepSpeed's scale_wrt_gas, which transformers' Trainer
        # passes when distributed_type is DEEPSPEED) have no meaning here.
        engine.backward(loss, sync=sync, **{k: kwargs[k] for k in ("retain_graph", "create_graph") if k in kwargs})
        self._backward_ended(sync)

    def _backward_begins(self) -> bool:
        """Before any backward of the prepared model (the engine asks for one it did not start): whether it
        closes the accumulation window."""
        if self._batch_waiting:  # still no DataLoader: a written micro-batch "auto" cannot be filled now
            require_micro_batch(self.config)
        self._backoff.before_backward()  # several ranks: agree that no rank ran out of memory in forward
        return self.sync_gradients and self._no_sync_depth == 0

    def _engine_backward_begins(self) -> bool:
        """An engine noticed a backward it did not start: inside `backward()` with several trained models, the
        sync that call decided (agreed once, for every engine its loss reaches); else a script's own
        `loss.backward()`, which begins here."""
        return self._sync_of_backward if self._sync_of_backward is not None else self._backward_begins()

    def _engine_backward_ended(self, sync: bool) -> None:
        if self._sync_of_backward is None:  # inside backward(), that call ends it once for every engine
            self._backward_ended(sync)

    def _backward_ended(self, sync: bool) -> None:
        self._backoff.after_backward()
        if not sync:
            for opt in self._prepared.optimizers:
                opt.window_open = True

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """Count one micro-step; `sync_gradients` is True when it closes a window (or ends the dataloader).

        A CUDA out-of-memory error inside the block backs off: see `zerofit.frontend.planning.backoff`."""
        self.gradient_state.count_micro_step()
        with self._backoff.guard():
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None = None) -> Iterator[None]:
        """Backward inside this block accumulates without closing a window (no gradient communication)."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor | None:
        """Clip the global gradient norm of the prepared model to `max_norm`; returns the norm before clipping.

        The norm covers every trainable parameter of the model (all shards, all ranks). On a micro-step
        that does not close an accumulation window the gradients are incomplete, so nothing is clipped
        and None comes back (call it under `if accelerator.sync_gradients:`).
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}) is not supported: zerofit clips the global "
                             "L2 norm; use norm_type=2")
        engine = self._clipped_engine(parameters)
        if engine is None:
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
        if not self.sync_gradients:
            self._warn_once("clip_grad_norm_ was called on a micro-step that does not close an accumulation "
                            "window: gradients are still accumulating, so nothing was clipped; call it under "
                            "`if accelerator.sync_gradients:`")
            return None
        return engine.clip_grad_norm_(max_norm)

    def _clipped_engine(self, parameters: Any):
        """The trained engine whose model `parameters` belong to (the only one, when one model trains)."""
        trained = self._prepared.trained_engines()
        if len(trained) <= 1:
            return trained[0] if trained else None
        ids = {id(p) for p in (parameters if not isinstance(parameters, torch.Tensor) else [parameters])}
        owners = [e for e in trained if any(id(p) in ids for p in e.model.parameters())]
        if len(owners) != 1:
            raise ValueError(f"clip_grad_norm_ got parameters of {len(owners)} of the {len(trained)} trained models: "
                             "with several models (a GAN's), clip each model's own, e.g. "
                             "accelerator.clip_grad_norm_(discriminator.parameters(), 1.0)")
        return owners[0]

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        raise NotImplementedError("clip_grad_value_ is not supported by zerofit (gradients are sharded): use "
                                  "clip_grad_norm_(parameters, max_norm)")

    @contextlib.contextmanager
    def profile(self, profile_handler: plugins.ProfileKwargs | None = None) -> Iterator[Any]:
        """torch.profiler over the block, set by `profile_handler` (else the `ProfileKwargs` given to
        `Accelerator(kwargs_handlers=...)`); with `output_trace_dir`, each process writes its Chrome trace."""
        handler = profile_handler or self._profile_kwargs or plugins.ProfileKwargs()
        with handler.build() as prof:
            yield prof
        if handler.output_trace_dir:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(handler.output_trace_dir, f"trace_rank_{self.process_index}.json"))

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Any = None) -> Iterator[None]:
        """No-op: the engine already computes in the configured dtype (inputs are cast at the model)."""
        yield

    def skip_first_batches(self, dataloader: ShardedDataLoader, num_batches: int = 0) -> ShardedDataLoader:
        """`dataloader`, whose next epoch starts after its first `num_batches` batches."""
        if not isinstance(dataloader, ShardedDataLoader):
            raise TypeError(f"skip_first_batches takes a DataLoader returned by prepare() (got "
                            f"{type(dataloader).__name__}): prepare it first")
        dataloader.skip_batches(num_batches)
        return dataloader

    # --- collectives ----------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """`gather`, minus the samples the dataloader repeated to fill its last batch (exactly the dataset)."""
        tensors_only = _only_tensors(input_data)
        data = ops.gather(input_data) if tensors_only and not use_gather_object else ops.gather_object(input_data)
        remainder = self.gradient_state.remainder
        if self.gradient_state.end_of_dataloader and remainder > 0:
            return ops.truncate(data, remainder) if tensors_only and not use_gather_object else data[:remainder]
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return ops.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared object, collect garbage and empty the CUDA cache; returns Nones to rebind."""
        self._prepared.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    def clear(self, *objects: Any) -> list[None]:
        return self.free_memory(*objects)

    # --- trackers -------------------------------------------------------------------------------
    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, Any] | None = None) -> None:
        """Start the trackers `log_with` names (JSON lines always) on the main process: each built with the
        project name and its entry of `init_kwargs` ({"wandb": {...}}), then `config` stored in each. A
        tracker whose library is missing is an error here, on every process."""
        if not self.log_with:
            return
        selection.check_installed(self.log_with)
        if not self.is_main_process:
            return
        logging_dir = str(self.logging_dir or self.config.logging.logging_dir or self.project_dir or "zerofit_logs")
        self.trackers = selection.start(self.log_with, project_name, logging_dir, config, init_kwargs or {})
        from zerofit.config import save_config

        save_config(self.config, os.path.join(logging_dir, project_name, "zerofit_config.json"))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called `name` (its service's own object with `unwrap=True`); on a process
        without trackers, a blank one whose calls do nothing."""
        if not self.trackers:
            return BlankTracker()
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(f"get_tracker({name!r}): no tracker of that name was started (started: "
                         f"{', '.join(t.name for t in self.trackers)}); add it to log_with")

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        """`values` to every tracker (main process only), with that tracker's entry of `log_kwargs`."""
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def end_training(self) -> None:
        """Finish the trackers, wait for every rank, and have the process group destroyed when the script
        ends ([Note: end of training] in zerofit.distributed.process_group: a save after this still works)."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.process.barrier(arrival.END_TRAINING)
        process_group.destroy_at_exit()

    # --- models and checkpoints -----------------------------------------------------------------
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        """The model itself: prepare() changes it in place rather than wrapping it; with
        `keep_torch_compile=False`, the module inside a `torch.compile` wrapper."""
        return model if keep_torch_compile else compiling.uncompiled(model)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=3)


def _check_accumulation_steps(steps: Any) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be a whole number >= 1 (got {steps!r})")


def _only_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return all(_only_tensors(d) for d in data)
    if isinstance(data, dict) or hasattr(data, "items"):
        return all(_only_tensors(v) for v in data.values())
    return False
