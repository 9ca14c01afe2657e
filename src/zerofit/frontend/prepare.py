"""What `prepare()` makes of each object a script passes, and the registry of what it made.

`Prepared` holds every prepared object by kind - the engines (one per model), the optimizer and
scheduler wrappers, the sharded dataloaders, the objects registered for checkpointing - so that
`save_state`, the out-of-memory back-off and `free_memory` walk one list each. `PrepareMixin` holds
`prepare()` and the rules it applies (see its doc); `zerofit.Accelerator` provides the run's
config, process and gradient state.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from zerofit.config.naming import key_name
from zerofit.config.schema import SchedulerConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.optim import whole_param_ids
from zerofit.engine.optimizer_set import OptimizerSet, members_of
from zerofit.engine.plain_backward import BackwardCaller
from zerofit.errors import ConfigError
from zerofit.frontend import compiling, engine_surface, lowbit_optimizers, ops
from zerofit.frontend.banner import describe_engine
from zerofit.frontend.data.loaders import ShardedDataLoader
from zerofit.frontend.data.sampling import order_for
from zerofit.frontend.lowbit_optimizers import with_optimizer_state
from zerofit.frontend.optimizers import AcceleratedOptimizer, SiblingSteps, build_optimizer
from zerofit.frontend.planning.auto_plan import (
    apply_checkpointing,
    host_share_of,
    keep_checkpointing_effective,
    machine_rates,
    plan_for,
    wants_host_share,
)
from zerofit.frontend.progress import Progress
from zerofit.frontend.schedulers import AcceleratedScheduler, build_scheduler
from zerofit.frontend.script_config import hidden_size_of, resolve, scheduler_total_steps
from zerofit.frontend.utils import DummyOptim, DummyScheduler
from zerofit.plan.auto import needs_planning


@dataclass
class Prepared:
    """Every object `prepare()` returned, by kind (the Accelerator's one registry of them)."""

    engines: dict[int, ZeroEngine] = field(default_factory=dict)
    """id(model) -> the engine that shards it."""
    optimizers: list[AcceleratedOptimizer] = field(default_factory=list)
    schedulers: list[AcceleratedScheduler] = field(default_factory=list)
    dataloaders: list[ShardedDataLoader] = field(default_factory=list)
    custom: list[Any] = field(default_factory=list)
    """Objects given to `register_for_checkpointing`, in order."""
    built: dict[int, Any] = field(default_factory=dict)
    """id(DummyOptim / DummyScheduler / raw optimizer) -> what replaced it."""
    siblings: dict[int, SiblingSteps] = field(default_factory=dict)
    """id(engine) -> what the optimizers of its model share (zerofit.frontend.optimizers.SiblingSteps)."""

    def engine_of(self, model: nn.Module) -> ZeroEngine | None:
        """The engine that shards `model`, looked up through a `torch.compile` wrapper; None: not prepared."""
        return self.engines.get(id(compiling.uncompiled(model)))

    def trained_engines(self) -> list[ZeroEngine]:
        """The engines of the models prepared with an optimizer, in the order they were prepared."""
        return [e for e in self.engines.values() if e.optimizer is not None]

    def trained_engine(self) -> ZeroEngine | None:
        """The engine of the one model prepared with an optimizer; None before that, or where several are
        (a GAN's generator and discriminator: see [Note: several trained models] in zerofit.frontend.accelerator)."""
        trained = self.trained_engines()
        return trained[0] if len(trained) == 1 else None

    def only_trained_engine(self, what: str) -> ZeroEngine | None:
        """`trained_engine()`, or an error saying that `what` takes one trained model where several are."""
        trained = self.trained_engines()
        if len(trained) > 1:
            raise ValueError(f"{what} with {len(trained)} models with optimizers is not supported yet: zerofit "
                             "checkpoints one trained model per Accelerator; save each model's weights with "
                             "accelerator.get_state_dict(model) or save_model(model, dir) instead")
        return trained[0] if trained else None

    def any_engine(self) -> ZeroEngine | None:
        """The trained engine, else the first prepared one (a frozen model's), else None."""
        return self.trained_engine() or next(iter(self.engines.values()), None)

    def clear(self) -> None:
        """Forget every prepared object (registered objects stay registered)."""
        self.engines.clear()
        self.optimizers.clear()
        self.schedulers.clear()
        self.dataloaders.clear()
        self.built.clear()


class PrepareMixin:
    """`prepare()` and its variants for `zerofit.Accelerator`, which provides `config`, `process`,
    `gradient_state`, `_facts`, `_prepared` and the rest."""

    keep_gathered_in_generation = True
    """Stage 3: forwards without autograd (generation, evaluation) keep the units they gather until the next
    training forward, backward or step, as far as the budget allows; False: every engine this Accelerator
    prepares streams them instead (`keep_gathered_budget = 0`; TRL's `ds3_gather_for_generation=False`).
    See [Note: kept units] in zerofit.engine.kept."""

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
        elif self._batch_waiting and any(k == "dataloader" for k in kinds) and self._prepared.engines:
            self._resolve(optimizer=False, scheduler=False)
        real = {id(o): self._real_optimizer(o) for o in optimizers}
        trained = [m for m in models if any(_holds_params_of(real[id(o)], m) for o in optimizers)]
        if len(trained) + len(self._prepared.trained_engines()) > 1 and self.config.precision.mixed_precision == "fp16":
            raise ValueError("fp16 loss scaling with several models with optimizers (a GAN's) is not supported: "
                             "each model's engine keeps a loss scale of its own, and one backward through both "
                             "cannot honour two; use bf16 (mixed_precision: bf16) or fp32")
        for model in models:
            mine = [real[id(o)] for o in optimizers if _holds_params_of(real[id(o)], model)]
            # [Note: several optimizers over one model] in zerofit.engine.optimizer_set
            self._prepare_model(model, OptimizerSet(mine) if len(mine) > 1 else (mine[0] if mine else None))
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
        if self._seed is None:  # one seed of the workers for every process (see zerofit.frontend.data.loaders)
            self._seed = int(ops.broadcast_object(torch.initial_seed() % 2**62))
        order = functools.partial(order_for, loader_generator=loader.generator, seedable=self.use_seedable_sampler,
                                  data_seed=getattr(self.dataloader_config, "data_seed", None),
                                  world=self.num_processes, share=ops.broadcast_object)
        sharded = ShardedDataLoader(loader, gradient_state=self.gradient_state, device=self.device,
                                    rank=self.process_index, world=self.num_processes,
                                    split_batches=self.split_batches, seed=self._seed, order=order)
        if sharded.batch_size is not None:
            known = self._facts.micro_batch_size
            self._facts.micro_batch_size = sharded.batch_size if known is None else min(known, sharded.batch_size)
        self._prepared.dataloaders.append(sharded)
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
            self._prepared.built[id(opt)] = built
            return built
        if named is not None:
            raise ConfigError(f"the script passes its own optimizer ({type(opt).__name__}) and the config names "
                              f"one too (optimizer.type {named.type}): remove the optimizer section from the config, "
                              "or pass zerofit.utils.DummyOptim(params, lr=...) in the script", self.config.source)
        replaced = lowbit_optimizers.replacement(opt)  # [Note: low-bit optimizers of other libraries]
        if replaced is None:
            return opt
        built, mapped = replaced
        what = f"optimizer {type(opt).__module__}.{type(opt).__qualname__}"
        self.config = with_optimizer_state(self.config, mapped.state, what)
        if self.is_main_process:
            print(mapped.said(what), flush=True)
        self._prepared.built[id(opt)] = built
        # `opt` itself never steps; a torch scheduler built on it reads this flag to warn about a scheduler step
        # before the first optimizer step, and would warn on every run (zerofit.engine.optim.mark_stepped)
        opt._opt_called = True
        return built

    def _prepare_model(self, wrapper: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        model = compiling.uncompiled(wrapper)  # torch.compile(model) before prepare(): shard the module inside
        if self._prepared.engine_of(model) is not None:
            raise ValueError(f"this {type(model).__name__} was prepared already: prepare each model once, "
                             "together with its optimizer")
        probe = rates = share = None
        auto, wants_share = needs_planning(self.config), wants_host_share(self.config, self.device)
        if auto or wants_share:  # read once: the split and the planner's ranking see the same rates
            rates = machine_rates(self.device, self.num_processes, measure=auto)
        if wants_share:  # a split of GPU-stepped offload, from measured rates
            share = host_share_of(rates, self.num_processes,
                                  2 if self.config.precision.mixed_precision in ("bf16", "fp16") else 4)
        planned = auto or share is not None
        if planned:  # "auto": the planner picks (zerofit.frontend.planning.auto_plan) and prints its choice
            batch = self.config.batch
            planning = self.config
            if self.planning_accumulation is not None:  # the loop accumulates itself (Trainer)
                planning = planning.replace(batch=dataclasses.replace(
                    batch, gradient_accumulation_steps=self.planning_accumulation))
            planned_config, probe, check = plan_for(planning, model, loaders=self._prepared.dataloaders,
                                                    micro_batch=self._facts.micro_batch_size, process=self.process,
                                                    host_share=share, rates=rates, whole=whole_param_ids(optimizer))
            self.config = planned_config.replace(batch=batch)
            if check is not None:  # [Note: planned without the batch]
                check.on_checkpointing = self._checkpointing_turned_on
                check.install(model)
        apply_checkpointing(self.config, model)
        keep_checkpointing_effective(self.config, model, training=optimizer is not None,
                                     is_main=self.is_main_process)
        cfg = self.config
        engine = ZeroEngine(model, optimizer, zero=cfg.zero, precision=cfg.precision,
                            gradient_accumulation_steps=self.gradient_state.window,
                            gradient_clipping=cfg.gradient_clipping, device=self.device)
        self._prepared.engines[id(model)] = engine  # the wrapper's calls look through it (Prepared.engine_of)
        if not self.keep_gathered_in_generation:
            engine.keep_gathered_budget = 0
        # A script's own loss.backward() closes the window as accelerator.backward(loss) would there.
        engine.watch.caller = BackwardCaller(begins=self._engine_backward_begins, ended=self._engine_backward_ended)
        if self.is_main_process and not planned:  # the planner's line already said what runs
            print(describe_engine(engine, num_processes=self.num_processes, backend=self.process.backend,
                                  spell=lambda key: key_name(cfg.source_format, key)), flush=True)
        if probe is not None:
            self._probe = probe
            probe.start(engine)
        engine_surface.attach(model, self, engine.policy.stage)  # DDP's / DeepSpeedEngine's calls on the model
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
        if self._compile is not None:  # dynamo_backend / dynamo_config: after every hook is in place
            compiling.compile_prepared(wrapper, model, self._compile, engine)

    def _checkpointing_turned_on(self) -> None:
        """The first training forward turned activation checkpointing on (see first_batch.py): the config says so."""
        self.config = self.config.replace(zero=dataclasses.replace(self.config.zero, gradient_checkpointing=True))

    def is_prepared(self, model: nn.Module) -> bool:
        """True once `model` went through `prepare()` (its weights are then the engine's: save through it)."""
        return self._prepared.engine_of(model) is not None

    def _wrap_optimizer(self, opt: Any, real: torch.optim.Optimizer) -> AcceleratedOptimizer:
        engine = next((e for e in self._prepared.engines.values() if any(m is real for m in members_of(e.optimizer))),
                      None)
        if engine is None:
            raise ValueError(f"the optimizer {type(real).__name__} was prepared without its model: pass the model "
                             "and its optimizer to the same prepare() call")
        wrapped = AcceleratedOptimizer(real, engine, self.gradient_state,
                                       siblings=self._prepared.siblings.setdefault(id(engine), SiblingSteps()))
        wrapped.progress = Progress.for_process(self.config.logging, is_main=self.is_main_process, engine=engine,
                                                world=self.num_processes, device=self.device,
                                                log=lambda values, step: self.log(values, step=step))
        if self._probe is not None and self._probe.engine is engine:
            wrapped.after_step = self._probe.check
        self._prepared.built[id(opt)] = wrapped
        self._prepared.built[id(real)] = wrapped
        self._prepared.built[id(wrapped)] = wrapped  # DummyScheduler(prepared optimizer), as Trainer builds it
        self._prepared.optimizers.append(wrapped)
        return wrapped

    def _prepare_scheduler(self, sched: Any) -> AcceleratedScheduler:
        named: SchedulerConfig | None = self.config.scheduler
        if isinstance(sched, DummyScheduler):
            wrapped_opt = self._prepared.built.get(id(sched.optimizer))
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
        target = getattr(inner, "optimizer", None)  # the script's optimizer, or the prepared one (built after)

        def stepped_with() -> list[AcceleratedOptimizer]:
            mine = [o for o in self._prepared.optimizers if target is o or target is o.optimizer]
            return mine or self._prepared.optimizers

        wrapped = AcceleratedScheduler(
            inner, stepped_with,
            sync_gradients=lambda: self.sync_gradients, steps_per_call=steps,
            step_with_optimizer=self.step_scheduler_with_optimizer)
        self._prepared.schedulers.append(wrapped)
        return wrapped


def _kind(obj: Any) -> str:
    if isinstance(obj, AcceleratedOptimizer):  # prepared already (it is a torch Optimizer): comes back untouched
        return "other"
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
