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
Where and when the optimizer step runs (on the device, from compact gradients, on the host) is the
engine's `StepMode`, called at fixed points of these phases (see [Note: step modes] in
zerofit.engine.step_mode).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from zerofit.config.schema import PrecisionConfig, ZeroConfig, is_auto
from zerofit.distributed import runtime
from zerofit.engine import replicas, weight_source
from zerofit.engine.comm import Collectives, InFlight
from zerofit.engine.find_units import plan_units
from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.full_state import FullStateDict
from zerofit.engine.full_state_load import FullStateLoad
from zerofit.engine.kept import configured_budget
from zerofit.engine.loss_scale import LossScaler
from zerofit.engine.materialize import Materializer, has_meta_tensors
from zerofit.engine.optim import (
    folds_grad_scale,
    global_grad_sumsq,
    group_kinds,
    param_group_index,
    rebind_optimizer,
    scale_grads,
)
from zerofit.engine.optimizer_kinds import PER_PARAMETER
from zerofit.engine.plain_backward import BackwardWatch
from zerofit.engine.policy import (
    COMPUTE_DTYPES,
    StagePolicy,
    StateHome,
    communication_dtype,
    host_share_for,
    keeps_compact_grads,
    packs_master,
    state_homes,
    step_on_for,
)
from zerofit.engine.stage3 import Stage3Hooks
from zerofit.engine.state_codec import Codec
from zerofit.engine.step_assembly import assemble_step_mode
from zerofit.engine.step_mode import StepFactors, publish
from zerofit.engine.timing import StepTimes
from zerofit.engine.unit import Unit
from zerofit.engine.unused_params import mark_unused
from zerofit.engine.window import AccumulationWindow, InWindow
from zerofit.errors import EngineError

# Public: the memory model (zerofit.plan) replays these rules, so it must read the same numbers.
SHARD_ALIGN = 16  # shard sizes are a multiple of 16 elements: aligned collectives and kernels
MAX_INFLIGHT_REDUCTIONS = 2  # reductions in flight before backward waits: bounds transient gradient memory


def default_device() -> torch.device:
    """This worker's GPU when CUDA is available (`runtime.local_gpu`), else the CPU."""
    return runtime.local_gpu() if torch.cuda.is_available() else torch.device("cpu")


class ZeroEngine:
    """Shards one model's training state over a process group, per the ZeRO stage in `zero`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 zero: ZeroConfig | None = None, precision: PrecisionConfig | None = None,
                 gradient_accumulation_steps: int | AccumulationWindow = 1, gradient_clipping: float = 0.0,
                 group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 init_fn: Callable[[nn.Module], None] | None = None):
        """`init_fn(module)` initialises a module of a model built on the meta device (default: the
        model's Hugging Face `_init_weights`, else `reset_parameters()`); see `zerofit.engine.materialize`.
        `gradient_accumulation_steps` may be a window shared with the caller (the Accelerator's)."""
        self.model = model
        self.optimizer = optimizer
        self.zero = zero or ZeroConfig()
        self.precision = precision or PrecisionConfig()
        self.window = (gradient_accumulation_steps if isinstance(gradient_accumulation_steps, AccumulationWindow)
                       else AccumulationWindow(gradient_accumulation_steps))
        self.gradient_clipping = float(gradient_clipping or 0.0)
        if self.zero.offload_param.device == "nvme":
            raise EngineError("zero_optimization.offload_param.device 'nvme' is not supported by this zerofit "
                              "version yet: use 'cpu' (optimizer state can go to NVMe: offload_optimizer)")
        self.device = device or default_device()
        off = self.zero.offload_optimizer
        self.step_on = step_on_for(off.step_on, cuda=self.device.type == "cuda", nvme=off.device == "nvme")
        """Where offloaded optimizer state is stepped: "host" or "device" (see `step_on_for`)."""
        written_share = None if is_auto(off.host_share) else off.host_share  # None: unset
        self.host_share = host_share_for(off.step_on, written_share,
                                         cuda=self.device.type == "cuda", nvme=off.device == "nvme")
        """Share of the offloaded state stepped on the host when the rest is GPU-stepped (see `host_share_for`)."""
        self.codec = Codec(self.precision.optimizer_state)
        """How the optimizer's per-element state is stored (see [Note: narrow optimizer state])."""
        self.comm = Collectives(group, self.device, grad_dtype=communication_dtype(self.precision))
        self.compute_dtype = COMPUTE_DTYPES[self.precision.mixed_precision]
        self.scaler = LossScaler(self.precision.loss_scale, enabled=self.precision.mixed_precision == "fp16")
        self.policy = StagePolicy(stage=self.zero.stage, world=self.comm.world, rank=self.comm.rank,
                                  persistence_threshold=int(self.zero.param_persistence_threshold),
                                  offload_param=self.zero.offload_param.enabled)
        self._move_buffers()
        self.replicas_aligned: int
        """Units (and the buffers, as one) whose initial values differed between ranks and were made rank
        0's (see [Note: equal replicas at the start] in zerofit.engine.replicas)."""
        self.units = self._build_units(init_fn)
        self.groups = [g for u in self.units for g in u.groups]
        self.trainable_groups = [g for g in self.groups if g.trainable]
        """The flat groups the optimizer steps, in order (frozen ones hold no master, gradient or state)."""
        if optimizer is not None:
            rebind_optimizer(optimizer, self.trainable_groups, self.comm.rank)
        self._sync = True
        self._counting = False
        """The open backward's micro-step is counted here (no `sync` was given)."""
        self._grad_factor = 1.0
        """What the open backward's gradients are multiplied by as they are added up: the fp16 loss scale for
        a backward whose loss was not scaled (see [Note: a backward the engine did not start])."""
        self._in_backward = False
        self._backward_in_window = False
        """A backward ran since the last step or zero_grad (else `step()` has nothing to apply)."""
        self._warned_empty = False
        self._reduction_order = [u for u in reversed(self.units) if u.trainable]
        """Several ranks: the order every rank launches its units' reductions in, each backward (see
        [Note: one collective order])."""
        self._next_reduction = 0
        """Index in `_reduction_order` of the next unit to launch (several ranks)."""
        self._prepared: StepFactors | None = None
        """The factors `clip_grad_norm_` measured for this window's step (else `step()` measures them)."""
        self.reductions = InFlight(MAX_INFLIGHT_REDUCTIONS)
        self._closed = True
        """The last backward closed its accumulation window (or none ran since the last step / zero_grad)."""
        self.times = StepTimes()
        self.last_grad_norm: torch.Tensor | None = None
        self.steps_called = 0
        """step() calls so far (skipped steps included): the step number warnings name."""
        self._pending_finite: tuple[int, torch.Tensor] | None = None
        """(step, whether its gradient norm was finite), read at the next step (no stall)."""
        self._warned_nonfinite = False
        self._hooks = [p.register_post_accumulate_grad_hook(partial(self._on_grad, u, gi, i))
                       for u in self.units for gi, g in enumerate(u.trainable) for i, p in enumerate(g.params)]
        # before the stage-3 hooks: see [Note: offload parts]
        self.mode, self.offload, self.whole_step = assemble_step_mode(self)
        """`mode`: how the optimizer step runs; `offload`: its offload parts, for inspection (tests, benchmarks);
        `whole_step`: the step of the parameters stepped whole, when a per-parameter optimizer holds some
        (checkpoints read its stand-ins: zerofit.checkpoint.whole_state)."""
        in_backward = lambda: self._in_backward  # noqa: E731
        self.watch = BackwardWatch(model, [p for g in self.trainable_groups for p in g.params],
                                   in_backward=in_backward, begin=partial(self._begin_backward, scaled=False),
                                   end=self._end_backward)
        self.watch.install()  # before the stage-3 hooks: its output hook opens a backward before they run
        self.stage3 = Stage3Hooks(self.units[0], self.units, in_backward, self._pass_over,
                                  notice_backward=self.watch.notice)
        self.keep_gathered_budget = configured_budget(has_optimizer=self.optimizer is not None,
                                                      max_live_parameters=self.zero.max_live_parameters,
                                                      compute_dtype=self.compute_dtype)
        # model.state_dict() gathers (see its note)
        self.full_state = FullStateDict(model, self.units, is_main=self.comm.rank == 0)
        self.full_state.before_gather = self.stage3.kept.release  # [Note: kept units]
        if self.shards_parameters:
            self.stage3.install()
            self.full_state.install()
        FullStateLoad(self).install()  # model.load_state_dict() reaches the masters and shards (see its note)
        if self.compute_dtype != torch.float32:
            self._hooks.append(model.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))

    @property
    def keep_gathered_budget(self) -> int | None:
        """Stage 3: bytes of gathered parameters forwards without autograd (generation, evaluation) keep until
        the next training forward, backward or step; None: as many as fit the device, 0: none (every unit
        is streamed per forward). See [Note: kept units] in zerofit.engine.kept."""
        return self.stage3.kept.budget

    @keep_gathered_budget.setter
    def keep_gathered_budget(self, budget: int | None) -> None:
        self.stage3.kept.set_budget(budget)

    def settle(self) -> None:
        """Finish overlapped host steps and make every offloaded state tensor readable (with NVMe:
        materialised in host memory until the next step; see [Note: NVMe residency])."""
        self.mode.settle(state=True)

    @contextlib.contextmanager
    def state_by_group(self, *, write: bool = False):
        """`settle()` for a reader of every group's state that takes one group at a time (a checkpoint's save):
        NVMe-offloaded groups stay on file (packed GPU-stepped masters packed), and `scope(g)`, yielded, is None
        for a group readable now, else the context inside which `g`'s master and state are readable host tensors
        (one such group in memory at a time: [Note: saving from NVMe], [Note: packed master at rest]). `write`:
        the reader changes the values (a load): each group is written back."""
        readers = [r for p in (self.offload.host, self.offload.gpu) if p is not None and (r := p.reader())]
        with contextlib.ExitStack() as stack:
            for r in readers:
                stack.enter_context(r.one_at_a_time())
            self.settle()
            yield lambda g: next((r.readable(g, write=write) for r in readers if r.holds(g)), None)

    # --- construction ---------------------------------------------------------------------------
    def _move_buffers(self) -> None:
        for module in self.model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf is not None and not buf.is_meta and buf.device != self.device:
                    setattr(module, name, buf.to(self.device))
        real = {id(b): b for b in self.model.buffers() if not b.is_meta}  # shared buffers once
        self.replicas_aligned = replicas.agree(list(real.values()), self.comm, "buffers")

    def _build_units(self, init_fn) -> list[Unit]:
        group_of = param_group_index(self.optimizer)
        kinds = group_kinds(self.optimizer)  # refuses an optimizer zerofit cannot step exactly
        has_meta = has_meta_tensors(self.model)
        weights = weight_source.source_for(self.model, has_meta=has_meta)  # pretrained values: load_at_prepare
        meta = Materializer(self.model, self.device, init_fn, weights) if has_meta else None
        model_params = {id(p) for p in self.model.parameters()}
        missing = [i for i in group_of if i not in model_params]
        if missing:
            raise EngineError(f"the optimizer holds {len(missing)} tensor(s) that are not parameters of the "
                              "model: build the optimizer from model.parameters()")
        units = []
        specs = plan_units(self.model, size_threshold=self.zero.unit_size_threshold)
        homes = self._state_homes(specs)
        for spec in specs:
            if meta is not None:  # one unit at a time: never the whole model at once
                real = meta.materialize([p for _, p in spec.params])
                for (_, old), new in zip(spec.params, real):
                    if id(old) in group_of:
                        group_of[id(new)] = group_of[id(old)]
                spec.params = [(n, new) for (n, _), new in zip(spec.params, real)]
            self.replicas_aligned += replicas.agree([p for _, p in spec.params], self.comm, spec.name)
            train = [(n, p) for n, p in spec.params if p.requires_grad and id(p) in group_of]
            frozen = [(n, p) for n, p in spec.params if not (p.requires_grad and id(p) in group_of)]
            if self.optimizer is not None:
                lost = [n for n, p in frozen if p.requires_grad]
                if lost:
                    raise EngineError(f"parameters {lost[:3]} require grad but are not in the optimizer: "
                                      "add them to the optimizer or set requires_grad=False")
            train.sort(key=lambda item: group_of[id(item[1])])  # stable: module order inside a group
            # [Note: whole-parameter steps]: a per-parameter optimizer's parameters form groups of their own
            whole = [(n, p) for n, p in train if kinds[group_of[id(p)]] == PER_PARAMETER]
            train = [(n, p) for n, p in train if kinds[group_of[id(p)]] != PER_PARAMETER]
            groups = []
            for members, trainable, is_whole in ((train, True, False), (whole, True, True), (frozen, False, False)):
                if not members:
                    continue
                placement = self.policy.placement(
                    trainable=trainable, unit_numel=spec.numel,
                    state_home=StateHome.DEVICE if is_whole else homes[id(spec.module)])
                groups.append(FlatGroup(
                    spec.name, [n for n, _ in members], [p for _, p in members],
                    [group_of[id(p)] if trainable else 0 for _, p in members], trainable=trainable,
                    placement=placement, compute_dtype=self.compute_dtype, device=self.device, align=SHARD_ALIGN,
                    whole=is_whole, packed_master=trainable and not is_whole and packs_master(
                        placement, bf16=self.compute_dtype == torch.bfloat16,
                        nvme=self.zero.offload_optimizer.device == "nvme"),
                    compact_grads=trainable and not is_whole and self.optimizer is not None and keeps_compact_grads(
                        placement, world=self.comm.world, gradient_accumulation_steps=self.gradient_accumulation_steps,
                        low_precision=self.compute_dtype != torch.float32)))
            units.append(Unit(spec.name, spec.module, groups, self.comm))
        if meta is not None:
            meta.finish(announce=self.comm.rank == 0)
        return units

    def _state_homes(self, specs) -> dict[int, StateHome]:
        """Per unit's module: where its optimizer state lives and who steps it (see `state_homes`)."""
        off = self.zero.offload_optimizer
        if off.enabled and is_auto(off.ratio):
            raise EngineError('zero_optimization.offload_optimizer.ratio "auto" is resolved by the planner at '
                              "Accelerator.prepare(): write a number in (0, 1] when building ZeroEngine directly")
        homes = state_homes([s.numel for s in specs], ratio=off.ratio if off.enabled else 0.0,
                            step_on=self.step_on, host_share=self.host_share)
        return {id(spec.module): home for spec, home in zip(specs, homes)}

    def _cast_inputs(self, _module, args, kwargs):
        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.compute_dtype:
                return x.to(self.compute_dtype)
            return x
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    # --- backward -------------------------------------------------------------------------------
    gradient_accumulation_steps = InWindow("steps")

    @property
    def at_boundary(self) -> bool:
        """True when the last backward completed an accumulation window (time to `step()`)."""
        return self._closed

    def backward(self, loss: torch.Tensor, *, sync: bool | None = None, retain_graph: bool = False,
                 create_graph: bool = False) -> None:
        """Backpropagate `loss / gradient_accumulation_steps` (times the fp16 loss scale); `retain_graph` and
        `create_graph` as in `Tensor.backward`.

        `sync` says whether this micro-step closes an accumulation window. Given (the Accelerator
        gives it), whoever passes it counts the window's micro-steps; None: the engine decides from
        `window.micro_step` and counts them there itself. A script's own `loss.backward()` is noticed
        too (see [Note: a backward the engine did not start] in zerofit.engine.plain_backward).
        """
        self._begin_backward(sync, scaled=True)
        try:
            (loss * (self.scaler.scale / self.window.steps)).backward(retain_graph=retain_graph,
                                                                      create_graph=create_graph)
        finally:
            self._in_backward = False
        self._end_backward()

    def _begin_backward(self, sync: bool | None, *, scaled: bool) -> None:
        """The bookkeeping before a backward: `sync` None counts micro-steps here; `scaled`: the loss was
        multiplied by the fp16 loss scale (else the gradients are, as they are added up)."""
        self._counting = sync is None
        if self._counting:
            sync = self.window.micro_step + 1 >= self.window.steps
        if self._closed:
            # The last backward closed the window and no step followed (several losses, GAN steps): its
            # reductions read and write the buffers this backward adds to, so they finish first.
            self.reductions.drain()
        self._sync = sync
        self._grad_factor = 1.0 if scaled else self.scaler.scale
        self.stage3.kept.release()  # [Note: kept units]: the room is backward's now
        if self._grad_factor != 1.0:
            self.mode.widen()  # a compute-dtype gradient times the scale could overflow: add up in fp32
            self.watch.unscaled_fp16 = True
        self.mode.begin_backward(sync)
        for unit in self.units:
            unit.begin_backward()
        if self.shards_parameters:
            self.stage3.order.begin_backward()
        self._next_reduction = 0
        self._in_backward = True
        self._backward_in_window = True

    def _end_backward(self) -> bool:
        """The bookkeeping after a backward; returns its `sync`."""
        self._in_backward = False
        if self.shards_parameters:
            self.stage3.order.end_backward()
        self._finish_reductions(self._sync)
        for unit in self.units:
            unit.release_after_backward()
        self.mode.end_backward()
        self._closed = self._sync
        if self._counting:
            self.window.micro_step = 0 if self._sync else self.window.micro_step + 1
        return self._sync

    def _on_grad(self, unit: Unit, group: int, index: int, param: nn.Parameter) -> None:
        self.watch.notice(accumulating=True)
        grad, param.grad = param.grad, None
        if unit.passed:
            raise EngineError(
                f"stage 3 with {self.comm.world} ranks: a gradient of unit {unit.name!r} arrived after backward had "
                f"gone past it (its reduction had gone out, see [Note: one gather order] in "
                f"zerofit.engine.gather_order). A unit's gradients must be computed before the backward of the units "
                f"that ran before it in forward: a custom autograd function that defers them breaks that, as do "
                f"units run in a different order on different ranks. Run the modules in one order on every rank, "
                f"or use zero_optimization.stage 2.")
        if unit.on_grad(group, index, grad, factor=self._grad_factor):
            if self.comm.world == 1:
                self._reduce(unit)
            else:
                self._launch_in_order()
            if unit is not self.units[0] and unit.backward_done:  # else stage 3 releases it when done
                unit.release_after_backward()

    def _pass_over(self, unit: Unit) -> None:
        """Stage 3, several ranks: backward went past `unit` (see [Note: one gather order])."""
        unit.pass_over()
        if unit.trainable:
            self._launch_in_order()
        if unit.backward_done:
            unit.release_after_backward()

    def _launch_in_order(self, *, finishing: bool = False) -> None:
        """Launch the reductions of the units next in `_reduction_order` whose gradients are complete (all
        of them when `finishing`: backward is over).

        [Note: one collective order]
        NCCL pairs the collectives of a process group by the order each rank issues them, so every
        rank must issue the same sequence whatever its data: a block one rank skips (LayerDrop, MoE
        routing, a branch drawn per rank) must not move or drop a reduction there. With several ranks
        every trainable unit is reduced once per backward, in one fixed order (the units backwards,
        the root last - the order backward finishes them in a model that runs its blocks in the
        order they are registered), whether or not it got gradients on this rank (zeros then): a unit
        backward completes early waits for the units before it, and those backward never completes
        go when it ends. On one rank nothing pairs, and a unit is reduced the moment it completes.
        """
        order = self._reduction_order
        while self._next_reduction < len(order) and (finishing or order[self._next_reduction].complete):
            self._reduce(order[self._next_reduction])
            self._next_reduction += 1

    def _finish_reductions(self, sync: bool) -> None:
        """After backward: reduce the units backward did not complete (unused or partly used parameters)."""
        if self.comm.world > 1:
            self._launch_in_order(finishing=True)
            return
        for unit in self.units:
            needs_sync_reduce = sync and not self.policy.reduces_every_micro_step and unit.trainable
            if not unit.reduced and (unit.has_new_grads() or needs_sync_reduce):
                self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        pendings = unit.reduce(sync=self._sync)
        self.reductions.launch(pendings)
        self.mode.reduced(unit, pendings)

    # --- step -----------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Unscale, then clip the global gradient norm to `max_norm`; returns the norm before clipping."""
        self.reductions.drain()
        norm = self.mode.clip_requested(float(max_norm))
        if norm is not None:  # the update already ran: [Note: updates during backward]
            return norm
        self._prepared = self._unscale_and_clip(float(max_norm), need_norm=True)
        return self._prepared.norm

    def _unscale_and_clip(self, max_norm: float, *, need_norm: bool) -> StepFactors:
        self.mode.prepare_grads()
        inv_scale = 1.0 / self.scaler.scale
        norm = None
        if need_norm or max_norm > 0 or self.scaler.enabled:
            norm = global_grad_sumsq(self.trainable_groups, self.comm, self.device).sqrt() * inv_scale
        factor: torch.Tensor | float = inv_scale
        if max_norm > 0:
            factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0) * inv_scale
        if folds_grad_scale(self.optimizer):
            return StepFactors(norm, factor, remaining=factor)  # applied inside the fused kernels, no pass here
        if isinstance(factor, torch.Tensor) or factor != 1.0:
            scale_grads(self.trainable_groups, factor)
        return StepFactors(norm, factor)

    def step(self) -> bool:
        """Apply the accumulated gradients; returns False when the step was skipped (an fp16 overflow, a
        non-finite norm with `precision.skip_nonfinite_steps`, or no backward since the last step)."""
        if self._in_backward:  # only a backward that raised leaves it open here: its gradients are partial
            raise EngineError("optimizer.step() after a backward that raised before it finished: this window's "
                              "gradients are incomplete, so nothing was applied; call optimizer.zero_grad() (it "
                              "throws the window away) and run the batch again")
        if not self._backward_in_window:
            self._warn_empty_step()
            return False
        self.stage3.kept.release()  # the step writes the shards: no stale full copy may outlive it
        self.reductions.drain()
        self.watch.warn_if_unscaled()
        mark_unused(self.units, self.comm, self.device)
        self._warn_if_nonfinite()  # the previous step's norm: long computed, so reading it stalls nothing
        skip_nonfinite = self.precision.skip_nonfinite_steps and not self.scaler.enabled
        if self.mode.begin_step():
            factors = StepFactors()  # the update began during backward, with a factor of exactly 1
        elif self._prepared is not None:
            factors = self._prepared
        else:
            factors = self._unscale_and_clip(self.gradient_clipping, need_norm=skip_nonfinite)
        self._prepared = None
        self.last_grad_norm = factors.norm
        self.steps_called += 1
        if skip_nonfinite and factors.norm is not None and not bool(torch.isfinite(factors.norm)):
            # Host sync on purpose, as for fp16 below: the norm was all-reduced, so every rank skips alike.
            warnings.warn(f"optimizer step {self.steps_called}: the gradient norm is {float(factors.norm)}; the "
                          "step was skipped on every rank (precision.skip_nonfinite_steps)", stacklevel=2)
            self.zero_grad()
            return False
        if not self.scaler.enabled and factors.norm is not None:
            self._pending_finite = (self.steps_called, torch.isfinite(factors.norm))
        if self.scaler.enabled:
            # Host sync on purpose: every rank must agree to skip. The norm was all-reduced, so an
            # overflow on any one rank is an overflow everywhere.
            overflow = not bool(torch.isfinite(factors.norm))
            self.scaler.update(overflow)
            if overflow:
                self.zero_grad()
                return False
        self.mode.step(factors)
        self.zero_grad()
        return True

    @property
    def backward_in_window(self) -> bool:
        """A backward ran since the last step or zero_grad: `step()` has gradients to apply."""
        return self._backward_in_window

    def _warn_empty_step(self) -> None:
        if not self._warned_empty:
            self._warned_empty = True
            warnings.warn("optimizer.step() was called with no backward since the last step: nothing was "
                          "applied (no weight decay, no moment update, no step count, the LR scheduler does "
                          "not advance), as torch's optimizers do without gradients; this warning is shown "
                          "once", stacklevel=3)

    def _warn_if_nonfinite(self) -> None:
        """Warn, once per run, about the last step whose gradient norm was NaN or inf (fp32 / bf16)."""
        pending, self._pending_finite = self._pending_finite, None
        if pending is not None and not self._warned_nonfinite and not bool(pending[1]):
            self._warned_nonfinite = True
            warnings.warn(f"optimizer step {pending[0]}: the gradient norm was NaN or inf, and the step was applied, "
                          "so the weights are likely NaN now: find the bad batch or loss; set "
                          "precision.skip_nonfinite_steps: true to skip such steps on every rank", stacklevel=3)

    def refresh_params(self, *, published: bool = False) -> None:
        """Rebuild the compute-dtype parameters from the fp32 masters (after a checkpoint wrote into them).
        `published`: each group's shard was published from its master already (a load that read the groups one at
        a time, `state_by_group`, inside which masters kept packed or on file hold no values: never False there)."""
        self.settle()
        self.reductions.drain()
        self.stage3.kept.release()
        for unit in self.units:  # a gathered stage-3 unit would keep stale values until its next release
            unit.release()
        publish(self.trainable_groups, self.comm, masters=not published)

    def zero_grad(self) -> None:
        """Zero the window's gradients; the next backward opens a new window (micro-step count 0)."""
        if self._in_backward:  # a backward that raised never reached its end: throw its window away whole
            self.discard_window()
            return
        self.reductions.drain()
        self.mode.zero_grad()
        for g in self.trainable_groups:
            g.zero_grads()
        for unit in self.units:
            unit.new_window()
        self._backward_in_window = False
        self._closed = True
        self.window.micro_step = 0

    def discard_window(self) -> None:
        """Throw the partial accumulation window away (after an out-of-memory error in it): nothing in
        flight reaches the next window, every unit is released, the gradients are zeroed and (by
        `zero_grad`) the window's micro-step count starts again."""
        self.mode.discard()
        self._in_backward = False  # a failed backward the engine did not start never reached its end
        self.stage3.kept.release()
        for unit in self.units:
            unit.release()
        self.zero_grad()

    # --- what callers may ask -------------------------------------------------------------------
    @property
    def shards_parameters(self) -> bool:
        """Some unit keeps its parameters sharded between uses (stage 3): forward gathers them."""
        return any(u.sharded for u in self.units)

    @property
    def update_started(self) -> bool:
        """This window's optimizer update began during backward (host steps started early): throwing the
        window away now would leave part of the parameters updated."""
        return self.mode.update_started

    @property
    def forward_communicates(self) -> bool:
        """Forward runs collectives: parameter gathers (stage 3) or the host step's publishing, on several ranks."""
        return self.comm.world > 1 and (self.shards_parameters or self.mode.forward_communicates)

    # --- introspection of the step mode -----------------------------------------------------------
    @property
    def early_off(self) -> str | None:
        """Why offloaded updates may not start during backward, None when one offload part's may
        ([Note: updates during backward] in zerofit.engine.offload.early)."""
        parts = [p for p in (self.offload.host, self.offload.gpu) if p is not None]
        if not parts:
            return "no offloaded optimizer steps"
        reasons = [p.early.off for p in parts]
        return None if None in reasons else "; ".join(dict.fromkeys(reasons))

    # --- inspection (tests, checkpoints) --------------------------------------------------------
    def named_full_tensors(self, what: str) -> dict[str, torch.Tensor]:
        """Reassembled full fp32 `master` weights or reduced `grad`s (or compute-dtype `param`s), by name.

        Collective: every rank must call it. Meant for tests and consolidation, not the hot path.
        """
        self.mode.settle(state=what == "master")
        self.reductions.drain()
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

