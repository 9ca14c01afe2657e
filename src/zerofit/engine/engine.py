"""`ZeroEngine`: the training step of one rank, as a short list of phases.

    engine = ZeroEngine(model, optimizer, zero=ZeroConfig(stage=2), precision=PrecisionConfig(...))
    for batch in data:
        loss = model(**batch).loss          # the model is changed in place, not wrapped
        engine.backward(loss)               # scales, backpropagates, reduces as the stage says
        if engine.at_boundary:              # every gradient_accumulation_steps micro-steps
            engine.step()                   # unscale, clip, overflow check, optimizer step, publish

Phases of `step()`: wait for reductions -> unscale and clip (global norm over all shards) -> skip on
fp16 overflow (decided the same on every rank) -> optimizer step on the fp32 master shards -> copy
the masters back into compute-dtype parameters and all-gather them where they are replicated.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from zerofit.config.schema import PrecisionConfig, ZeroConfig
from zerofit.engine.comm import Collectives, Pending
from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.host_step import HostStepper
from zerofit.engine.loss_scale import LossScaler
from zerofit.engine.materialize import Materializer, has_meta_tensors
from zerofit.engine.nvme import NvmeSwapper
from zerofit.engine.optim import (
    CompactSteps,
    bind_grads,
    folds_grad_scale,
    local_grad_sumsq,
    mark_stepped,
    master_pieces,
    param_group_index,
    rebind_optimizer,
    scale_grads,
    step_with_factor,
    sub_optimizer,
    sync_hyperparams,
)
from zerofit.engine.policy import COMPUTE_DTYPES, StagePolicy, keeps_compact_grads, offloaded_units
from zerofit.engine.stage3 import Stage3Hooks
from zerofit.engine.timing import StepTimes
from zerofit.engine.unit import Unit
from zerofit.engine.units import plan_units
from zerofit.errors import EngineError

# Public: the memory model (zerofit.plan) replays these rules, so it must read the same numbers.
SHARD_ALIGN = 16  # shard sizes are a multiple of 16 elements: aligned collectives and kernels
MAX_INFLIGHT_REDUCTIONS = 2  # reductions in flight before backward waits: bounds transient gradient memory


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class ZeroEngine:
    """Shards one model's training state over a process group, per the ZeRO stage in `zero`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 zero: ZeroConfig | None = None, precision: PrecisionConfig | None = None,
                 gradient_accumulation_steps: int = 1, gradient_clipping: float = 0.0,
                 group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 init_fn: Callable[[nn.Module], None] | None = None):
        """`init_fn(module)` initialises a module of a model built on the meta device (default: the
        model's Hugging Face `_init_weights`, else `reset_parameters()`); see `zerofit.engine.materialize`."""
        self.model = model
        self.optimizer = optimizer
        self.zero = zero or ZeroConfig()
        self.precision = precision or PrecisionConfig()
        if gradient_accumulation_steps < 1:
            raise EngineError(f"gradient_accumulation_steps must be >= 1 (got {gradient_accumulation_steps})")
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.gradient_clipping = float(gradient_clipping or 0.0)
        if self.zero.offload_param.device == "nvme":
            raise EngineError("zero_optimization.offload_param.device 'nvme' is not supported by this zerofit "
                              "version yet: use 'cpu' (optimizer state can go to NVMe: offload_optimizer)")
        self.device = device or default_device()
        self.comm = Collectives(group, self.device)
        self.compute_dtype = COMPUTE_DTYPES[self.precision.mixed_precision]
        self.scaler = LossScaler(self.precision.loss_scale, enabled=self.precision.mixed_precision == "fp16")
        self.policy = StagePolicy(stage=self.zero.stage, world=self.comm.world, rank=self.comm.rank,
                                  persistence_threshold=int(self.zero.param_persistence_threshold),
                                  offload_param=self.zero.offload_param.enabled)
        self._move_buffers()
        self.units = self._build_units(init_fn)
        self.groups = [g for u in self.units for g in u.groups]
        self._trainable = [g for g in self.groups if g.trainable]
        self._host_grads = [g for g in self._trainable if g.placement.offload_state]
        if optimizer is not None:
            rebind_optimizer(optimizer, self._trainable, self.comm.rank)
        compact = [g for g in self._trainable if g.compact]
        self._compact_steps = CompactSteps(optimizer, compact) if compact else None
        self._grads_pending = False
        """A backward ran since the last step or zero_grad (a second one widens compact gradients)."""
        self._step_factor: torch.Tensor | float | None = None
        """This step's whole unscale/clip factor, for the compact groups (which scale it on upcast)."""
        self._inflight: deque[Pending] = deque()
        self._micro_step = 0
        self._sync = True
        self._in_backward = False
        self._grads_prepared: torch.Tensor | None = None
        self._grad_factor: torch.Tensor | float | None = None
        """Unscale/clip factor still to be applied to the gradients (by the fused optimizer step)."""
        self.times = StepTimes()
        self.last_grad_norm: torch.Tensor | None = None
        self._steps_taken = 0
        self._clip_seen = False
        self._early_off: str | None = None
        """Why host steps may not start during backward (None: they may; see the note below)."""
        self._early_now = False
        self._early_groups: set[int] = set()
        self._early_hyper: list[dict] | None = None
        self._to_submit: deque[tuple[list[Pending], list[FlatGroup]]] = deque()
        self._hooks = [p.register_post_accumulate_grad_hook(partial(self._on_grad, u, gi, i))
                       for u in self.units for gi, g in enumerate(u.trainable) for i, p in enumerate(g.params)]
        self.stepper: HostStepper | None = None
        self.swapper: NvmeSwapper | None = None
        self._unpublished: set[int] = set()
        if self._host_grads and optimizer is not None:
            self._start_host_stepper()
        if self.stepper is None or self.swapper is not None:
            self._early_off = "no host optimizer steps" if self.stepper is None else "NVMe offload"
        elif self.gradient_clipping > 0 or self.scaler.enabled:
            self._early_off = "the step depends on the global gradient norm (clipping or fp16)"
        self.stage3 = Stage3Hooks(self.units[0], self.units, lambda: self._in_backward)
        if any(u.sharded for u in self.units):
            self.stage3.install()
        if self.compute_dtype != torch.float32:
            self._hooks.append(model.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))

    def _start_host_stepper(self) -> None:
        """Offloaded groups step on a worker thread, overlapped with the next forward (see host_step)."""
        self.stepper = HostStepper(self.optimizer, self._host_grads, self.device, self.times)
        on_device = [t for g in self._trainable if not g.placement.offload_state for t in master_pieces(g)]
        self._device_opt = sub_optimizer(self.optimizer, on_device) if on_device else (None, [])
        for unit in self.units:
            if any(g.placement.offload_state for g in unit.trainable):
                unit.before_use = partial(self._await_host_step, unit)
                target = self.model if unit is self.units[0] else unit.module
                # registered before the stage-3 hooks, so a unit is stepped before it is gathered
                self._hooks.append(target.register_forward_pre_hook(lambda *_a, u=unit: self._await_host_step(u)))
        if self.zero.offload_optimizer.device == "nvme":
            # After the sub-optimizers above matched their pieces: swapping out empties the tensors.
            self.swapper = NvmeSwapper(self._host_grads, self.optimizer, self.zero.offload_optimizer,
                                       self.zero.aio, self.comm, self.device)
            self.stepper.swap = self.swapper
            settle = self.stepper.settle_state  # one object: local_fragments calls each distinct hook once
            for g in self._host_grads:
                g.before_read = settle  # the stepper's, not the engine's: the worker must not keep us alive
        # The worker thread holds the stepper forever: stop it (and remove NVMe files) with the engine.
        weakref.finalize(self, self.stepper.close)

    def _await_host_step(self, unit: Unit) -> None:
        for g in unit.trainable:
            if id(g) not in self._unpublished:
                continue
            self._unpublished.discard(id(g))
            self.stepper.wait(g)
            if g.placement.shard_world > 1 and not g.placement.shard_params:
                lo, hi = g.layout.shard_range(g.placement.rank)  # collectives stay on the main thread
                self.comm.all_gather(g.param_flat, g.param_flat[lo:hi], f"publish:{g.unit_name}").wait()

    def _settle_params(self) -> None:
        """Finish every overlapped host step and publish its parameters (before anything reads state)."""
        if self.stepper is not None:
            self.stepper.wait_all()
            for unit in self.units:
                self._await_host_step(unit)

    def settle(self) -> None:
        """Finish overlapped host steps and make every offloaded state tensor readable (with NVMe:
        materialised in host memory until the next step; see [Note: NVMe residency])."""
        self._settle_params()
        if self.swapper is not None:
            self.swapper.materialize()

    # --- construction ---------------------------------------------------------------------------
    def _move_buffers(self) -> None:
        for module in self.model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf is not None and not buf.is_meta and buf.device != self.device:
                    setattr(module, name, buf.to(self.device))

    def _build_units(self, init_fn) -> list[Unit]:
        group_of = param_group_index(self.optimizer)
        meta = Materializer(self.model, self.device, init_fn) if has_meta_tensors(self.model) else None
        model_params = {id(p) for p in self.model.parameters()}
        missing = [i for i in group_of if i not in model_params]
        if missing:
            raise EngineError(f"the optimizer holds {len(missing)} tensor(s) that are not parameters of the "
                              "model: build the optimizer from model.parameters()")
        units = []
        specs = plan_units(self.model, size_threshold=self.zero.unit_size_threshold)
        offloaded = self._offloaded_units(specs)
        for spec in specs:
            if meta is not None:  # one unit at a time: never the whole model at once
                real = meta.materialize([p for _, p in spec.params])
                for (_, old), new in zip(spec.params, real):
                    if id(old) in group_of:
                        group_of[id(new)] = group_of[id(old)]
                spec.params = [(n, new) for (n, _), new in zip(spec.params, real)]
            train = [(n, p) for n, p in spec.params if p.requires_grad and id(p) in group_of]
            frozen = [(n, p) for n, p in spec.params if not (p.requires_grad and id(p) in group_of)]
            if self.optimizer is not None:
                lost = [n for n, p in frozen if p.requires_grad]
                if lost:
                    raise EngineError(f"parameters {lost[:3]} require grad but are not in the optimizer: "
                                      "add them to the optimizer or set requires_grad=False")
            train.sort(key=lambda item: group_of[id(item[1])])  # stable: module order inside a group
            groups = []
            for members, trainable in ((train, True), (frozen, False)):
                if not members:
                    continue
                placement = self.policy.placement(trainable=trainable, unit_numel=spec.numel,
                                                  offload_state=id(spec.module) in offloaded)
                groups.append(FlatGroup(
                    spec.name, [n for n, _ in members], [p for _, p in members],
                    [group_of[id(p)] if trainable else 0 for _, p in members], trainable=trainable,
                    placement=placement, compute_dtype=self.compute_dtype, device=self.device, align=SHARD_ALIGN,
                    compact_grads=trainable and self.optimizer is not None and keeps_compact_grads(
                        placement, world=self.comm.world, gradient_accumulation_steps=self.gradient_accumulation_steps,
                        low_precision=self.compute_dtype != torch.float32)))
            units.append(Unit(spec.name, spec.module, groups, self.comm))
        if meta is not None:
            meta.finish()
        return units

    def _offloaded_units(self, specs) -> set[int]:
        """Modules of the units whose optimizer runs on the host (see `offloaded_units`)."""
        off = self.zero.offload_optimizer
        if not off.enabled:
            return set()
        return {id(specs[i].module) for i in offloaded_units([s.numel for s in specs], off.ratio)}

    def _cast_inputs(self, _module, args, kwargs):
        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.compute_dtype:
                return x.to(self.compute_dtype)
            return x
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    # --- backward -------------------------------------------------------------------------------
    @property
    def at_boundary(self) -> bool:
        """True when the last backward completed an accumulation window (time to `step()`)."""
        return self._micro_step == 0

    def backward(self, loss: torch.Tensor, *, sync: bool | None = None) -> None:
        """Backpropagate `loss / gradient_accumulation_steps` (times the fp16 loss scale).

        `sync` says whether this micro-step closes an accumulation window; by default the engine
        counts micro-steps itself.
        """
        if sync is None:
            sync = self._micro_step + 1 >= self.gradient_accumulation_steps
        if self._grads_pending and self._compact_steps is not None:
            self._widen_grads()
        self._grads_pending = True
        self._sync = sync
        if self._early_groups:
            self._disable_early("backward ran again before step() applied the last window (zerofit had "
                                "already started that update during backward)")
        self._early_now = (sync and self._early_off is None and self._steps_taken > 0 and not self._clip_seen)
        for unit in self.units:
            unit.begin_backward()
        self._in_backward = True
        try:
            (loss * (self.scaler.scale / self.gradient_accumulation_steps)).backward()
        finally:
            self._in_backward = False
        for unit in self.units:  # units backward did not finish (unused or frozen parameters)
            needs_sync_reduce = sync and not self.policy.reduces_every_micro_step and unit.trainable
            if not unit.reduced and (unit.has_new_grads() or needs_sync_reduce):
                self._reduce(unit)
            unit.release()
        if self._host_grads:
            # Offloaded gradients: the staging buffers are reused by the next micro-step, so their
            # contents must reach the host gradient shards now (waits for the downloads in flight).
            self._drain()
            self._submit_ready()
            with self.times.measure("wait_grad_download"):
                for g in self._host_grads:
                    if id(g) not in self._early_groups:
                        g.settle_host_grad()
            if self._early_now:  # groups that got no gradient this window step too (on zeros)
                rest = [g for g in self._host_grads if id(g) not in self._early_groups]
                for g in rest:
                    g.grads_for_step()
                self._submit_early(rest, settle_grads=False)
        self._micro_step = 0 if sync else self._micro_step + 1

    def _widen_grads(self) -> None:
        """A second backward before step(): compact gradients become fp32 before anything is added to them."""
        for g in self._trainable:
            if g.compact:
                g.widen()
                bind_grads(self.optimizer, g, g.grad_shard)
        self._compact_steps = None

    def _on_grad(self, unit: Unit, group: int, index: int, param: nn.Parameter) -> None:
        grad, param.grad = param.grad, None
        if unit.on_grad(group, index, grad):
            self._reduce(unit)
            if unit is not self.units[0]:
                unit.release()

    def _reduce(self, unit: Unit) -> None:
        pendings = unit.reduce(sync=self._sync)
        hosted = [g for g in unit.trainable if g.placement.offload_state]
        if self._early_now and hosted:
            self._to_submit.append((pendings, hosted))
        self._launch(pendings)
        self._submit_ready()

    def _launch(self, pendings: list[Pending]) -> None:
        self._inflight.extend(pendings)
        while len(self._inflight) > MAX_INFLIGHT_REDUCTIONS:
            self._inflight.popleft().wait()

    # [Note: host steps during backward]
    # When the step's gradient factor is known before backward ends - no clipping, no fp16 loss
    # scale (so the factor is exactly 1), no NVMe - an offloaded group's host step can start as soon
    # as its reduced gradient is on its way to the host, overlapping the rest of backward; the
    # result is the same update, bit for bit. Two things a script could still do would change it
    # after the fact, so the engine only starts early once it has seen a whole step without them:
    # calling clip_grad_norm_ (from then on never early; a first call in an early window raises
    # if clipping would bite) and changing lr & co. between backward and step() (detected at
    # step(): warned, and never early again).
    def _submit_ready(self) -> None:
        """Hand the host steps whose gradient reduction has been issued to the worker, in order."""
        while self._to_submit and all(p.done for p in self._to_submit[0][0]):
            self._submit_early(self._to_submit.popleft()[1], settle_grads=True)

    def _submit_early(self, groups: list[FlatGroup], *, settle_grads: bool) -> None:
        if not groups:
            return
        if self._early_hyper is None:
            self._early_hyper = self.stepper.hyperparams()
        self.stepper.submit(groups, None, hyper=self._early_hyper, settle_grads=settle_grads)
        for g in groups:
            self._early_groups.add(id(g))
            self._unpublished.add(id(g))
        self.times.host_steps_in_backward += len(groups)

    def _disable_early(self, reason: str) -> None:
        if self._early_off is None:
            warnings.warn(f"zerofit: {reason}; host optimizer steps no longer start during backward "
                          "(slower, same results from now on)", stacklevel=3)
        self._early_off = reason

    def _drain(self) -> None:
        while self._inflight:
            self._inflight.popleft().wait()

    # --- step -----------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Unscale, then clip the global gradient norm to `max_norm`; returns the norm before clipping."""
        self._drain()
        self._clip_seen = True
        if self._early_groups:
            return self._norm_after_early_step(float(max_norm))
        self._grads_prepared = self._unscale_and_clip(float(max_norm), need_norm=True)
        return self._grads_prepared

    def _norm_after_early_step(self, max_norm: float) -> torch.Tensor:
        """The norm of a window whose host steps already ran (see [Note: host steps during backward])."""
        self.stepper.wait_all()
        sumsq = local_grad_sumsq(self._trainable, self.device)
        if any(g.placement.shard_world > 1 for g in self._trainable):
            self.comm.all_reduce_now(sumsq, "grad_norm")
        norm = sumsq.sqrt()
        if max_norm > 0 and float(norm) > max_norm:
            raise EngineError(
                f"clip_grad_norm_(max_norm={max_norm}) was first called at optimizer step {self._steps_taken + 1}, "
                f"after zerofit had already applied this step's update during backward (gradient norm {float(norm):.4g}): "
                f"set gradient_clipping: {max_norm} in the config (zerofit then clips inside every step), or call "
                "clip_grad_norm_ from the first step on")
        return norm

    def _unscale_and_clip(self, max_norm: float, *, need_norm: bool) -> torch.Tensor | None:
        self._settle_params()
        for g in self._host_grads:
            g.grads_for_step()
        inv_scale = 1.0 / self.scaler.scale
        norm = None
        if need_norm or max_norm > 0 or self.scaler.enabled:
            sumsq = local_grad_sumsq(self._trainable, self.device)
            if any(g.placement.shard_world > 1 for g in self._trainable):
                self.comm.all_reduce_now(sumsq, "grad_norm")
            norm = sumsq.sqrt() * inv_scale
        factor: torch.Tensor | float = inv_scale
        if max_norm > 0:
            factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0) * inv_scale
        self._step_factor = factor
        if folds_grad_scale(self.optimizer):
            self._grad_factor = factor  # applied inside the fused optimizer kernels, no pass here
        elif isinstance(factor, torch.Tensor) or factor != 1.0:
            scale_grads(self._trainable, factor)
        return norm

    def step(self) -> bool:
        """Apply the accumulated gradients; returns False when an fp16 overflow skipped the step."""
        self._drain()
        self._steps_taken += 1
        if self._early_groups:
            self._finish_early_step()
            return True
        norm = self._grads_prepared
        if norm is None:
            norm = self._unscale_and_clip(self.gradient_clipping, need_norm=False)
        self._grads_prepared = None
        self.last_grad_norm = norm
        if self.scaler.enabled:
            # Host sync on purpose: every rank must agree to skip. The norm was all-reduced, so an
            # overflow on any one rank is an overflow everywhere.
            overflow = not bool(torch.isfinite(norm))
            self.scaler.update(overflow)
            if overflow:
                self._grad_factor = self._step_factor = None
                self.zero_grad()
                return False
        factor, self._grad_factor = self._grad_factor, None
        if self.stepper is not None:
            self._step_on_device(factor, self._step_factor)
            mark_stepped(self.optimizer)
            self._publish(host=False)
            self._unpublished = {id(g) for g in self._host_grads}
            if self.swapper is not None:
                self.swapper.evict_materialized()  # inspected or loaded state goes back to its files
            # unit order = forward order: the units needed first are stepped first
            self.stepper.submit(self._host_grads, factor)
        elif self._compact_steps is not None:
            self._compact_steps.step(self._step_factor)
            self._publish()
        else:
            if self.optimizer is not None:
                step_with_factor(self.optimizer, factor)
            self._publish()
        self._step_factor = None
        self.zero_grad()
        return True

    def _finish_early_step(self) -> None:
        """step() of a window whose host steps started during backward: the on-device rest only."""
        if not _same_settings(self.stepper.hyperparams(), self._early_hyper):
            self._disable_early("the optimizer's settings (lr & co.) changed between backward and step(); this "
                                "step used the values they had when backward ended")
        self._grads_prepared = self._early_hyper = None
        self.last_grad_norm = None
        self._step_on_device(None, None)  # an early window's factor is exactly 1
        mark_stepped(self.optimizer)
        self._publish(host=False)
        self._early_groups = set()
        self.zero_grad()

    def _step_on_device(self, factor: torch.Tensor | float | None, whole: torch.Tensor | float | None) -> None:
        """The step of the groups whose optimizer state is on the device, beside the host stepper's:
        `factor` is what is left to apply to wide gradients, `whole` the step's factor (compact ones)."""
        if self._compact_steps is not None:
            self._compact_steps.step(whole)
            return
        sub, index = self._device_opt
        if sub is not None:
            sync_hyperparams(sub, index, self.optimizer)
            step_with_factor(sub, factor)

    def refresh_params(self) -> None:
        """Rebuild the compute-dtype parameters from the fp32 masters (after a checkpoint wrote into them)."""
        self.settle()
        self._drain()
        for unit in self.units:  # a gathered stage-3 unit would keep stale values until its next release
            unit.release()
        self._publish()

    def _publish(self, host: bool = True) -> None:
        """Masters -> compute-dtype parameters (all-gathered where replicated); `host=False` skips the
        offloaded groups, which the host stepper publishes."""
        gathers = []
        for g in self._trainable:
            if not host and g.placement.offload_state:
                continue
            g.publish_master()
            if g.placement.shard_world > 1 and not g.placement.shard_params:
                lo, hi = g.layout.shard_range(g.placement.rank)
                gathers.append(self.comm.all_gather(g.param_flat, g.param_flat[lo:hi], f"publish:{g.unit_name}"))
        for p in gathers:
            p.wait()

    def zero_grad(self) -> None:
        self._drain()
        self._grads_pending = False
        for g in self._trainable:
            g.zero_grads()
        self._micro_step = 0

    # --- inspection (tests, checkpoints) --------------------------------------------------------
    def named_full_tensors(self, what: str) -> dict[str, torch.Tensor]:
        """Reassembled full fp32 `master` weights or reduced `grad`s (or compute-dtype `param`s), by name.

        Collective: every rank must call it. Meant for tests and consolidation, not the hot path.
        """
        if what == "master":
            self.settle()
        else:
            self._settle_params()
        self._drain()
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            if what != "param" and not g.trainable:
                continue
            local = {"master": g.master, "grad": g.grad_shard, "param": g.param_shard}[what]
            local = (local.float() if what == "grad" else local).to(self.device)  # compact gradients as fp32
            full = torch.empty(g.layout.padded_numel, dtype=local.dtype, device=local.device)
            if g.placement.shard_world > 1:
                self.comm.all_gather(full, local.contiguous(), "inspect").wait()
            else:
                full.copy_(local)
            for name, off, n, shape in zip(g.names, g.layout.offsets, g.layout.numels, g.shapes):
                out[name] = full[off:off + n].view(shape).clone()
        return out


def _same_settings(a: list[dict], b: list[dict]) -> bool:
    """Param-group settings equal value for value (lr may be a tensor)."""
    def same(x, y):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        return x == y
    return len(a) == len(b) and all(ga.keys() == gb.keys() and all(same(ga[k], gb[k]) for k in ga)
                                    for ga, gb in zip(a, b))
