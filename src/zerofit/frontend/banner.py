"""The one line a run prints when `prepare()` has built its engine: the ZeRO stage, what it shards over how
many ranks, what it offloads and where that state is stepped, the precision and the process count
(one line, wrapped here):

    zerofit: ZeRO-3, 4 of 5 units sharded over 2 ranks, optimizer state offloaded to cpu (host-stepped),
    fp32, 2 processes (gloo)

It is read off the built engine, not the config, so it says what actually runs: a stage-3 unit under
`param_persistence_threshold` stays whole, a single process has nothing to shard over, and the offload
ratio and the host share split the offloaded state. The main process prints it, once per prepared model
(`zerofit.frontend.prepare`), unless the planner has just printed its own choice for that model
(`zerofit.frontend.planning.auto_plan`), which says the same.
"""

from __future__ import annotations

from collections.abc import Callable

from zerofit.engine import ZeroEngine

PRECISION_NAMES = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
"""`precision.mixed_precision` -> what the line calls the compute dtype."""

SHARDED_BY_STAGE = {1: "optimizer state", 2: "optimizer state and gradients"}
"""What stages 1 and 2 split over the ranks (stage 3 names its units instead)."""


def _count(part: int, whole: int, noun: str) -> str:
    """ "the optimizer state" when `part` is all of it, else "the optimizer state of 3 of 5 units"."""
    return noun if part == whole else f"{noun} of {part} of {whole} units"


def _sharding(engine: ZeroEngine, spell: Callable[[str], str]) -> str:
    stage, world = engine.policy.stage, engine.comm.world
    if stage == 0:
        return "ZeRO-0 (plain data parallel: nothing sharded)"
    if stage in SHARDED_BY_STAGE:
        if engine.optimizer is None:  # a frozen model (DPO's reference model): no state or gradients to split
            return f"ZeRO-{stage}, a model without an optimizer (frozen): nothing of it is sharded below stage 3"
        if world == 1:
            return f"ZeRO-{stage} (one process: nothing to shard over)"
        return f"ZeRO-{stage}, {SHARDED_BY_STAGE[stage]} sharded over {world} ranks"
    sharded, units = sum(u.sharded for u in engine.units), len(engine.units)
    if sharded == 0 and world == 1 and not engine.policy.offload_param:
        return "ZeRO-3 (one process: nothing to shard over)"
    if sharded == 0:
        threshold = engine.policy.persistence_threshold
        return (f"ZeRO-3, 0 of {units} units sharded (each holds fewer than {spell('zero.param_persistence_threshold')}"
                f" = {threshold:,} elements: lower it to shard them)")
    return f"ZeRO-3, {sharded} of {units} units sharded over {world} rank{'s' if world != 1 else ''}"


def _optimizer_offload(engine: ZeroEngine) -> str | None:
    trained = [u for u in engine.units if u.trainable]
    if engine.optimizer is None:
        return None if engine.policy.stage in SHARDED_BY_STAGE else "no optimizer (frozen)"
    host = [u for u in trained if any(g.placement.host_stepped for g in u.trainable)]
    streamed = [u for u in trained if any(g.placement.gpu_stepped for g in u.trainable)]
    offloaded = len({id(u) for u in host + streamed})
    if offloaded == 0:
        return None
    if not streamed:
        where = "host-stepped"
    elif not host:
        where = "GPU-stepped"
    else:
        where = f"{len(host)} of {offloaded} units host-stepped, the rest GPU-stepped"
    device = engine.zero.offload_optimizer.device
    return f"{_count(offloaded, len(trained), 'optimizer state')} offloaded to {device} ({where})"


def _param_offload(engine: ZeroEngine) -> str | None:
    offloaded = sum(any(g.placement.offload_params for g in u.groups) for u in engine.units)
    if offloaded == 0:
        return None
    return f"{_count(offloaded, len(engine.units), 'parameters')} offloaded to {engine.zero.offload_param.device}"


def describe_engine(engine: ZeroEngine, *, num_processes: int, backend: str | None,
                    spell: Callable[[str], str] = lambda key: key) -> str:
    """The line for `engine` (see the module doc); `spell` names a config key in the user's format."""
    parts = [_sharding(engine, spell), _optimizer_offload(engine), _param_offload(engine),
             PRECISION_NAMES.get(engine.precision.mixed_precision, engine.precision.mixed_precision),
             f"optimizer state stored in {engine.codec.kind}" if engine.codec.narrow else None,
             f"{num_processes} process{'es' if num_processes != 1 else ''}" + (f" ({backend})" if backend else "")]
    return "zerofit: " + ", ".join(p for p in parts if p)
