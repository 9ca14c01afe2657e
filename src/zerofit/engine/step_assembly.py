"""Which step modes an engine's groups get, and how they chain (see [Note: step modes] in
zerofit.engine.step_mode and [Note: offload parts] in zerofit.engine.offload.part).

The groups kept on the device get a `PlainStep` (or `CompactStep` for compact gradients); GPU-stepped groups -
and, with optimizer state stored in fewer bits, the device-kept ones too (see [Note: narrow state in the
stream] in zerofit.engine.offload.gpu) - a `GpuStep` around it; host-stepped groups a `HostStep` around that;
the parameters of per-parameter optimizers a `WholeStep` around everything.
"""

from __future__ import annotations

from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.offload import GpuStep, HostStep, Offload
from zerofit.engine.step_mode import CompactStep, PlainStep, StepMode
from zerofit.engine.whole_step import WholeStep


def assemble_step_mode(engine) -> tuple[StepMode, Offload, WholeStep | None]:
    """(the step mode, its offload parts, its whole-parameter step if any) of `engine`, a `ZeroEngine` being built
    (not imported here: the engine imports this module)."""
    whole = [g for g in engine.trainable_groups if g.whole]
    mode, offload = _elementwise_step(engine, [g for g in engine.trainable_groups if not g.whole])
    if not whole:
        return mode, offload, None
    whole_step = WholeStep(engine.optimizer, whole, mode, engine.comm, engine.device)
    return whole_step, offload, whole_step


def _elementwise_step(engine, elementwise: list[FlatGroup]) -> tuple[StepMode, Offload]:
    """The step of the groups of elementwise optimizers: on the device, or wrapped by the offload parts."""
    optimizer = engine.optimizer
    hosted = [g for g in elementwise if g.placement.host_stepped]
    # narrow state on the device is widened and narrowed chunk by chunk as GPU-stepped state is: those groups
    # join its stream
    narrow = engine.codec.narrow and optimizer is not None
    streamed = [g for g in elementwise if g.placement.gpu_stepped or (narrow and not g.placement.offloaded)]
    if optimizer is None or not (hosted or streamed):
        return _device_step(optimizer, PlainStep(optimizer, elementwise, engine.comm)), Offload()
    on_device = [g for g in elementwise if not g.placement.offloaded and not narrow]
    mode = _device_step(optimizer, PlainStep.part_of(optimizer, on_device, engine.comm))
    gpu = host = None
    offload, aio = engine.zero.offload_optimizer, engine.zero.aio
    # the step's factor waits for the global gradient norm: no update may start during backward
    needs_norm = engine.gradient_clipping > 0 or engine.scaler.enabled or engine.precision.skip_nonfinite_steps
    if streamed:
        mode = gpu = GpuStep(optimizer, streamed, mode, model=engine.model, units=engine.units, comm=engine.comm,
                             times=engine.times, offload=offload, aio=aio, codec=engine.codec,
                             trainable=engine.trainable_groups, reductions=engine.reductions, needs_norm=needs_norm)
    if hosted:
        mode = host = HostStep(optimizer, hosted, mode, model=engine.model, units=engine.units,
                               trainable=engine.trainable_groups, comm=engine.comm, reductions=engine.reductions,
                               times=engine.times, offload=offload, aio=aio, needs_norm=needs_norm,
                               codec=engine.codec)
    return mode, Offload(host=host, gpu=gpu)


def _device_step(optimizer, plain: PlainStep) -> StepMode:
    return CompactStep(optimizer, plain) if any(g.compact for g in plain.groups) else plain
