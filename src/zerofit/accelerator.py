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
decide when a script's call takes effect (`zerofit.optimizers`, `zerofit.schedulers`), the
dataloaders shard (`zerofit.data`), the config is completed from the script
(`zerofit.script_config`), files are written by `zerofit.persistence` over `zerofit.checkpoint`.
`prepare()` returns the script's own model object, changed in place, so `model.config`,
`model.generate` and `save_pretrained` work as before.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from zerofit import ops, runtime, tracking
from zerofit.config import load_config
from zerofit.config.schema import RunConfig, SchedulerConfig, is_auto
from zerofit.data import ShardedDataLoader
from zerofit.engine import ZeroEngine
from zerofit.errors import ConfigError
from zerofit.optimizers import AcceleratedOptimizer, build_optimizer
from zerofit.persistence import PersistenceMixin
from zerofit.plan.auto import needs_planning, plan_for
from zerofit.plan.backoff import OomBackoff
from zerofit.plan.probe import StepProbe
from zerofit.schedulers import AcceleratedScheduler, build_scheduler
from zerofit.script_config import (
    Facts,
    apply_script_arguments,
    early_accumulation,
    hidden_size_of,
    require_micro_batch,
    resolve,
    scheduler_total_steps,
)
from zerofit.state import AcceleratorState, DistributedType, GradientState, ProcessState
from zerofit.utils import DummyOptim, DummyScheduler, ProjectConfiguration

# Accelerate arguments zerofit accepts and leaves alone (with a warning when given a value).
_IGNORED = ("device_placement", "rng_types", "kwargs_handlers", "dynamo_backend", "dynamo_plugin",
            "deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin", "torch_tp_plugin",
            "parallelism_config", "even_batches", "dispatch_batches", "use_seedable_sampler")


class Accelerator(PersistenceMixin):
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
                              f"its engine and config decide this; remove the argument to silence this warning",
                              stacklevel=2)
        if gradient_accumulation_plugin is not None:
            gradient_accumulation_steps = getattr(gradient_accumulation_plugin, "num_steps", gradient_accumulation_steps)
        if dataloader_config is not None:
            split_batches = bool(getattr(dataloader_config, "split_batches", split_batches))
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be a whole number >= 1 (got "
                             f"{gradient_accumulation_steps!r})")
        if mixed_precision not in (None, "no", "fp16", "bf16"):
            raise ValueError(f"mixed_precision must be 'no', 'fp16' or 'bf16' (got {mixed_precision!r})")
        if config is None:
            config = runtime.current_config()
        elif not isinstance(config, RunConfig):
            config = load_config(config)
        self.process = ProcessState.create(config, cpu=cpu)
        self.config = apply_script_arguments(config, gradient_accumulation_steps=gradient_accumulation_steps,
                                             mixed_precision=mixed_precision, world=self.num_processes)
        self.gradient_state = GradientState(early_accumulation(self.config, self.num_processes))
        self.split_batches = split_batches
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(str(project_dir))
        if logging_dir is not None:
            self.project_configuration.logging_dir = str(logging_dir)
        self.log_with = tracking.requested(log_with if log_with is not None else list(self.config.logging.log_with))
        self.trackers: list[Any] = []
        self._facts = Facts()
        self._batch_waiting = True
        self._engines: dict[int, ZeroEngine] = {}
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[ShardedDataLoader] = []
        self._custom: list[Any] = []
        self._built: dict[int, Any] = {}  # id(DummyOptim / DummyScheduler / raw optimizer) -> what replaced it
        self._no_sync_depth = 0
        self._seed: int | None = None
        self._warned: set[str] = set()
        self.step = 0
        self.state = AcceleratorState(self)
        self._backoff = OomBackoff(self)  # out-of-memory back-off inside accumulate()
        self._probe: StepProbe | None = None  # checks an "auto" choice on the first step (zerofit.plan.probe)

    # --- who and where --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.process.device

    @property
    def process_index(self) -> int:
        return self.process.process_index

    @property
    def local_process_index(self) -> int:
        return self.process.local_process_index

    @property
    def num_processes(self) -> int:
        return self.process.num_processes

    @property
    def is_main_process(self) -> bool:
        return self.process.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.process.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def mixed_precision(self) -> str:
        return self.config.precision.mixed_precision

    @property
    def use_fp16(self) -> bool:
        return self.mixed_precision == "fp16"

    @property
    def distributed_type(self) -> DistributedType:
        if is_auto(self.config.zero.stage) or self.config.zero.stage >= 1:  # "auto": decided at prepare()
            return DistributedType.ZERO
        if self.num_processes == 1:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.gradient_accumulation_steps

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    # --- prepare --------------------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: Any = None) -> Any:
        """Shard, wrap or replace each object; the same number of objects comes back, in the same order.

        Models become ZeRO-managed in place (the same object comes back); optimizers (or `DummyOptim`)
        come back as `AcceleratedOptimizer`; schedulers (or `DummyScheduler`) as `AcceleratedScheduler`;
        DataLoaders as per-process `ShardedDataLoader`s. Anything else comes back untouched.
        A model and its optimizer must be prepared in the same call.
        """
        out = list(objects)
        kinds = [_kind(obj) for obj in objects]
        for i, obj in enumerate(objects):
            if kinds[i] == "dataloader":
                out[i] = self._prepare_dataloader(obj)
        models = [obj for obj, k in zip(objects, kinds) if k == "model"]
        optimizers = [obj for obj, k in zip(objects, kinds) if k == "optimizer"]
        schedulers = [(i, obj) for i, (obj, k) in enumerate(zip(objects, kinds)) if k == "scheduler"]
        self._learn_facts(models, optimizers, [obj for _, obj in schedulers])
        if models or optimizers:
            self._resolve(optimizer=any(isinstance(o, DummyOptim) for o in optimizers),
                          scheduler=any(isinstance(s, DummyScheduler) for _, s in schedulers))
        elif self._batch_waiting and any(k == "dataloader" for k in kinds) and self._engines:
            self._resolve(optimizer=False, scheduler=False)
        real = {id(o): self._real_optimizer(o) for o in optimizers}
        for model in models:
            mine = [o for o in optimizers if _holds_params_of(real[id(o)], model)]
            if len(mine) > 1:
                raise ValueError(f"{len(mine)} optimizers hold parameters of one {type(model).__name__}: zerofit "
                                 "steps one optimizer per model; put the parameters in param groups of one optimizer")
            self._prepare_model(model, real[id(mine[0])] if mine else None)
        for i, obj in enumerate(objects):
            if kinds[i] == "optimizer":
                out[i] = self._wrap_optimizer(obj, real[id(obj)])
        for i, sched in schedulers:
            out[i] = self._prepare_scheduler(sched)
        self._resume_if_configured()  # checkpoint.resume: a restarted attempt continues from its checkpoint
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: nn.Module, device_placement: Any = None, evaluation_mode: bool = False) -> nn.Module:
        return self.prepare(model)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: Any = None) -> ShardedDataLoader:
        return self.prepare(data_loader)

    def prepare_optimizer(self, optimizer: Any, device_placement: Any = None) -> AcceleratedOptimizer:
        return self.prepare(optimizer)

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        return self.prepare(scheduler)

    def _learn_facts(self, models: list[Any], optimizers: list[Any], schedulers: list[Any]) -> None:
        f = self._facts
        for model in models:
            f.hidden_size = f.hidden_size or hidden_size_of(model)
        for opt in optimizers:
            if isinstance(opt, DummyOptim):
                f.lr, f.weight_decay = opt.lr, opt.weight_decay
            elif f.lr is None and opt.param_groups:
                f.lr = opt.param_groups[0].get("lr")
        for sched in schedulers:
            if isinstance(sched, DummyScheduler):
                f.total_num_steps = scheduler_total_steps(sched.total_num_steps, self.num_processes, self.split_batches)
                f.warmup_num_steps = sched.warmup_num_steps

    def _resolve(self, *, optimizer: bool, scheduler: bool) -> None:
        self.config, self._batch_waiting = resolve(self.config, self._facts, self.num_processes,
                                                   optimizer=optimizer, scheduler=scheduler)
        self.gradient_state.gradient_accumulation_steps = self.config.batch.gradient_accumulation_steps

    def _prepare_dataloader(self, loader: DataLoader) -> ShardedDataLoader:
        if self._seed is None:  # one shuffling seed for every process (see zerofit.data)
            self._seed = int(ops.broadcast_object(torch.initial_seed() % 2**62))
        sharded = ShardedDataLoader(loader, gradient_state=self.gradient_state, device=self.device,
                                    rank=self.process_index, world=self.num_processes,
                                    split_batches=self.split_batches, seed=self._seed)
        if sharded.batch_size is not None:
            known = self._facts.micro_batch_size
            self._facts.micro_batch_size = sharded.batch_size if known is None else min(known, sharded.batch_size)
        self._dataloaders.append(sharded)
        return sharded

    def _real_optimizer(self, opt: Any) -> torch.optim.Optimizer:
        """The torch optimizer behind `opt`: built from the config for a DummyOptim (see the error rules)."""
        named = self.config.optimizer
        if isinstance(opt, DummyOptim):
            if named is None:
                raise ConfigError("the script passes DummyOptim but the config has no optimizer section: add one "
                                  "(for example optimizer: {type: AdamW, params: {lr: auto}}) or pass a "
                                  "torch.optim optimizer instead of DummyOptim", self.config.source)
            built = build_optimizer(named, opt.params)
            self._built[id(opt)] = built
            return built
        if named is not None:
            raise ConfigError(f"the script passes its own optimizer ({type(opt).__name__}) and the config names "
                              f"one too (optimizer.type {named.type}): remove the optimizer section from the config, "
                              "or pass zerofit.utils.DummyOptim(params, lr=...) in the script", self.config.source)
        return opt

    def _prepare_model(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if id(model) in self._engines:
            raise ValueError(f"this {type(model).__name__} was prepared already: prepare each model once, "
                             "together with its optimizer")
        probe = None
        if needs_planning(self.config):  # stage / offload "auto": the planner picks (zerofit.plan.auto)
            self.config, probe = plan_for(self, model)
        cfg = self.config
        engine = ZeroEngine(model, optimizer, zero=cfg.zero, precision=cfg.precision,
                            gradient_accumulation_steps=self.gradient_state.window,
                            gradient_clipping=cfg.gradient_clipping, device=self.device)
        self._engines[id(model)] = engine
        if probe is not None:
            self._probe = probe
            probe.start(engine)
        if engine.shards_parameters and self.num_processes > 1:
            # [Note: synced generation] Under stage 3 every rank must run the same number of forward
            # passes, or the parameter all-gathers hang when one rank's `generate()` stops early.
            # transformers (5.x, generation/utils.py `_extract_generation_mode_kwargs`) turns on its
            # `synced_gpus` loop by itself when `is_fsdp_managed_module(model)`, which reads this
            # instance attribute (the marker FSDP2 sets for exactly this purpose; speech models read
            # it for synced layer drop too). Setting it on our module is documented, instance-local
            # state: nothing in torch or transformers is patched, and `generate(synced_gpus=False)`
            # still overrides it.
            for module in model.modules():
                if hasattr(module, "generate") or module is model:
                    module._is_fsdp_managed_module = True

    def _wrap_optimizer(self, opt: Any, real: torch.optim.Optimizer) -> AcceleratedOptimizer:
        engine = next((e for e in self._engines.values() if e.optimizer is real), None)
        if engine is None:
            raise ValueError(f"the optimizer {type(real).__name__} was prepared without its model: pass the model "
                             "and its optimizer to the same prepare() call")
        wrapped = AcceleratedOptimizer(real, engine, self.gradient_state)
        if self._probe is not None and self._probe.engine is engine:
            wrapped.after_step = self._probe.check
        self._built[id(opt)] = wrapped
        self._built[id(real)] = wrapped
        self._optimizers.append(wrapped)
        return wrapped

    def _prepare_scheduler(self, sched: Any) -> AcceleratedScheduler:
        named: SchedulerConfig | None = self.config.scheduler
        if isinstance(sched, DummyScheduler):
            wrapped_opt = self._built.get(id(sched.optimizer))
            if wrapped_opt is None:
                raise ValueError("DummyScheduler(optimizer) must be prepared with (or after) that optimizer: pass "
                                 "both to the same prepare() call")
            if sched.lr_scheduler_callable is not None:
                inner, from_config = sched.lr_scheduler_callable(wrapped_opt.optimizer), False
            elif named is None:
                raise ConfigError("the script passes DummyScheduler but the config has no scheduler section: add one "
                                  "(for example scheduler: {type: WarmupDecayLR, params: {total_num_steps: auto}}), "
                                  "give DummyScheduler an lr_scheduler_callable, or pass a torch scheduler",
                                  self.config.source)
            else:
                inner, from_config = build_scheduler(named, wrapped_opt.optimizer), True
        else:
            if named is not None:
                raise ConfigError(f"the script passes its own scheduler ({type(sched).__name__}) and the config names "
                                  f"one too (scheduler.type {named.type}): remove the scheduler section from the "
                                  "config, or pass zerofit.utils.DummyScheduler(optimizer, ...) in the script",
                                  self.config.source)
            inner, from_config = sched, False
        steps = 1 if from_config or self.split_batches else self.num_processes
        target = getattr(inner, "optimizer", None)
        wrapped = AcceleratedScheduler(
            inner, lambda: [o for o in self._optimizers if o.optimizer is target] or self._optimizers,
            sync_gradients=lambda: self.sync_gradients, steps_per_call=steps,
            step_with_optimizer=self.step_scheduler_with_optimizer)
        self._schedulers.append(wrapped)
        return wrapped

    # --- the training loop ----------------------------------------------------------------------
    def _trained_engine(self) -> ZeroEngine | None:
        trained = [e for e in self._engines.values() if e.optimizer is not None]
        if len(trained) > 1:
            raise ValueError(f"{len(trained)} models with optimizers are prepared: zerofit trains one model per "
                             "Accelerator (prepare other models without an optimizer, frozen)")
        return trained[0] if trained else None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate `loss`: divided by the accumulation steps, loss-scaled under fp16, reduced per stage."""
        engine = self._trained_engine()
        sync = self.sync_gradients and self._no_sync_depth == 0
        if self._batch_waiting:  # still no DataLoader: a written micro-batch "auto" cannot be filled now
            require_micro_batch(self.config)
        self._backoff.before_backward()  # several ranks: agree that no rank ran out of memory in forward
        if engine is None:
            (loss / self.gradient_accumulation_steps).backward(**kwargs)
            return
        engine.backward(loss, sync=sync)
        self._backoff.after_backward()
        if not sync:
            for opt in self._optimizers:
                opt.window_open = True

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """Count one micro-step; `sync_gradients` is True when it closes a window (or ends the dataloader).

        A CUDA out-of-memory error inside the block backs off: see `zerofit.plan.backoff`."""
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
        engine = self._trained_engine()
        if engine is None:
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
        if not self.sync_gradients:
            self._warn_once("clip_grad_norm_ was called on a micro-step that does not close an accumulation "
                            "window: gradients are still accumulating, so nothing was clipped; call it under "
                            "`if accelerator.sync_gradients:`")
            return None
        return engine.clip_grad_norm_(max_norm)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        raise NotImplementedError("clip_grad_value_ is not supported by zerofit (gradients are sharded): use "
                                  "clip_grad_norm_(parameters, max_norm)")

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

    def wait_for_everyone(self) -> None:
        self.process.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. to build a dataset cache), then the others."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        if not self.is_local_main_process:
            self.wait_for_everyone()
        yield
        if self.is_local_main_process:
            self.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared object, collect garbage and empty the CUDA cache; returns Nones to rebind."""
        self._engines.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._built.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    def clear(self, *objects: Any) -> list[None]:
        return self.free_memory(*objects)

    # --- trackers -------------------------------------------------------------------------------
    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, Any] | None = None) -> None:
        """Start the trackers named by `log_with` (JSON lines always) on the main process."""
        if not self.is_main_process or not self.log_with:
            return
        logging_dir = self.logging_dir or self.config.logging.logging_dir or self.project_dir or "zerofit_logs"
        self.trackers = tracking.start(self.log_with, project_name, str(logging_dir), config)
        from zerofit.config import save_config

        save_config(self.config, os.path.join(str(logging_dir), project_name, "zerofit_config.json"))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        return next((t for t in self.trackers if t.name == name), None)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        for tracker in self.trackers:
            tracker.log(values, step)

    def end_training(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.wait_for_everyone()

    # --- models and checkpoints -----------------------------------------------------------------
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> nn.Module:
        """The model itself: prepare() changes it in place rather than wrapping it."""
        return model

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=3)


def _kind(obj: Any) -> str:
    if isinstance(obj, nn.Module):
        return "model"
    if isinstance(obj, (torch.optim.Optimizer, DummyOptim)):
        return "optimizer"
    if isinstance(obj, (LRScheduler, DummyScheduler)) or (hasattr(obj, "step") and hasattr(obj, "optimizer")
                                                           and hasattr(obj, "state_dict")):
        return "scheduler"
    if isinstance(obj, DataLoader):
        return "dataloader"
    return "other"


def _holds_params_of(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    ids = {id(p) for p in model.parameters()}
    return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])


def _only_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return all(_only_tensors(d) for d in data)
    if isinstance(data, dict) or hasattr(data, "items"):
        return all(_only_tensors(v) for v in data.values())
    return False
