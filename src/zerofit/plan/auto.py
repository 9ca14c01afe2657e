"""`zero_optimization.stage: auto` and offload `device: auto`, resolved at `prepare()` by the planner.

When the model is known, the planner estimates every setting the config leaves open (a fixed stage
or offload device stays as written) and picks the fastest that fits this machine with headroom
(see `zerofit.plan.choose`): stage 0 before 1, 2, 3, before optimizer offload, before parameter
offload. NVMe is never chosen by itself: it needs a path the user names.

[Note: every rank decides the same]
Ranks must run one setting. The inputs of the decision are made identical first - the memory
budget is the minimum over the ranks (one all-reduce, `zerofit.frontend.planning.auto_plan.budget_for`) -
and the rest is deterministic (the model's
sizes, the first batch's shape, the activation trace), so every rank computes the same choice.

Activations are traced on a data-free replica of a transformers model at the first batch's shape
(collated from the dataset's first samples, which draws nothing from any random generator), with
activation checkpointing as the model has it. For other modules, or without a DataLoader, only the
model states are planned, and the reason printed says so. On CUDA the first optimizer step then
checks the choice against the measured peak (`zerofit.frontend.planning.first_step_check`). Without CUDA the
"GPU" is host memory: a setting fits when its device and host bytes together fit the host
(`Budget.unified`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from zerofit.config.naming import key_name
from zerofit.config.schema import RunConfig, is_auto
from zerofit.engine.policy import COMPUTE_DTYPES, step_on_for
from zerofit.plan.activations import ActivationTrace, checkpointing_switch, has_checkpointing
from zerofit.plan.bandwidth import Rates
from zerofit.plan.choose import Budget, Plan, plan, traces_for
from zerofit.plan.memory import DTYPE_BYTES, ModelCounts, Setting, Workload, all_settings
from zerofit.plan.sources import replica_of


def needs_planning(config: RunConfig) -> bool:
    z = config.zero
    return (is_auto(z.stage) or is_auto(z.offload_optimizer.device) or is_auto(z.offload_param.device)
            or is_auto(z.offload_optimizer.ratio) or is_auto(z.gradient_checkpointing))


def can_checkpoint(model: nn.Module) -> bool:
    """`model` is a transformers model that can turn activation checkpointing on."""
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and checkpointing_switch(model) is not None


def checkpointing_choices(config: RunConfig, model: nn.Module) -> tuple[bool, ...]:
    """The activation checkpointing settings the planner may pick between for `model` (see
    `zero.gradient_checkpointing`): the model as it is, and on too where the planner may turn it on."""
    written = config.zero.gradient_checkpointing
    on = has_checkpointing(model)
    if written is True or on:
        return (True,)
    if written is False or not can_checkpoint(model):
        return (False,)
    if written is None and not needs_planning(config):  # planned only for the host share: as the script built it
        return (False,)
    return (False, True)


def candidates(config: RunConfig, world: int, checkpointing: bool, *, host_share: float | None = None) -> list[Setting]:
    """The settings the config leaves open (a written stage or device is kept). GPU-stepped offload is
    listed with the written `host_share`, or under "auto" with `host_share` (the split this machine's
    rates favour, `zerofit.frontend.planning.auto_plan.host_share_of`) and without a split."""
    z = config.zero
    ratio = offload_ratio(config)
    out: list[Setting] = []
    step_on = step_on_for(z.offload_optimizer.step_on, cuda=torch.cuda.is_available(), nvme=False)
    written = z.offload_optimizer.host_share
    shares = [float(written)] if not (written is None or is_auto(written)) else [host_share, 0.0] if host_share \
        else [0.0]
    listed = [s for share in shares for s in all_settings(max(world, 2), checkpointing=(checkpointing,),
                                                          offload_ratio=ratio, step_on=step_on, host_share=share)]
    for s in dict.fromkeys(listed):  # the settings without GPU-stepped offload come once
        if not is_auto(z.stage) and s.stage != z.stage:
            continue
        for kind, value in (("offload_optimizer", z.offload_optimizer.device),
                            ("offload_param", z.offload_param.device)):
            if not is_auto(value) and getattr(s, kind) != value:
                break
        else:
            out.append(s)
    if not out:  # a written offload the list does not hold (nvme): keep what was written
        stage = 3 if is_auto(z.stage) else z.stage
        opt = _written(z.offload_optimizer.device, stage)
        out.append(Setting(stage=stage, offload_optimizer=opt, offload_param=_written(z.offload_param.device, stage),
                           checkpointing=checkpointing, offload_ratio=ratio if opt != "none" else 1.0))
    return out


def offload_ratio(config: RunConfig) -> float:
    """`offload_optimizer.ratio` as the memory model takes it (1.0 where it is not a number)."""
    ratio = config.zero.offload_optimizer.ratio
    return float(ratio) if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) else 1.0


def _written(value: Any, stage: int) -> str:
    return "none" if is_auto(value) else value


def choose(config: RunConfig, model: nn.Module, *, world: int, shape: tuple[int, int] | None,
           budget: Budget, host_share: float | None = None, rates: Rates | None = None,
           whole: frozenset[int] = frozenset()) -> tuple[RunConfig, Plan]:
    """`config` with the open stage / offload devices / ratio / host share / checkpointing filled by the
    planner for `budget`, and the plan behind it; `host_share`: the split between host- and GPU-stepped
    offload this machine's measured rates favour (None: none known), tried before no split where it fits;
    `rates`: this machine's measured rates, which rank the settings that fit (None: the fixed order);
    `whole`: id() of the parameters a per-parameter optimizer steps whole (`ModelCounts.whole`).
    `zero.gradient_checkpointing` comes back true or false: what the model must run with
    (`zerofit.frontend.planning.auto_plan.apply_checkpointing` turns it on)."""
    precision = config.precision.mixed_precision
    choices = checkpointing_choices(config, model)
    work = workload_for(config, world=world, shape=shape)
    traces = activation_traces(model, shape, choices, precision, work)
    if len(choices) > 1 and traces.get(True) is None:
        traces.pop(True, None)  # what checkpointing saves is unknown: it would only add recomputation
    counts = ModelCounts.of(model, unit_size_threshold=work.unit_size_threshold, whole=whole)
    settings = [s for ck in traces for s in candidates(config, world, ck, host_share=host_share)]
    result = plan(counts, work, budget, traces, settings=settings, rates=rates,
                  open_ratio=is_auto(config.zero.offload_optimizer.ratio))
    chosen = result.choice or result.smallest
    s = chosen.setting
    z = config.zero
    zero = dataclasses.replace(
        z, stage=s.stage, gradient_checkpointing=s.checkpointing,
        offload_optimizer=dataclasses.replace(
            z.offload_optimizer, device=s.offload_optimizer, ratio=s.offload_ratio,
            host_share=s.host_share if s.step_on == "device" else z.offload_optimizer.host_share),
        offload_param=dataclasses.replace(z.offload_param, device=s.offload_param))
    return config.replace(zero=zero), result


def workload_for(config: RunConfig, *, world: int, shape: tuple[int, int] | None) -> Workload:
    """What one rank runs, as the memory model takes it: the config's precision, accumulation and
    thresholds, and the micro-batch `shape` (samples, tokens; None: unknown, 1 x 1)."""
    precision = config.precision.mixed_precision
    return Workload(world=world, mixed_precision=precision if precision in DTYPE_BYTES else "no",
                    micro_batch=shape[0] if shape else 1, seq=shape[1] if shape else 1,
                    optimizer_state=config.precision.optimizer_state,
                    gradient_accumulation_steps=_int(config.batch.gradient_accumulation_steps, 1),
                    persistence_threshold=_int(config.zero.param_persistence_threshold, 100_000),
                    unit_size_threshold=config.zero.unit_size_threshold,
                    nvme_buffer_count=config.zero.offload_optimizer.buffer_count)


def activation_traces(model: nn.Module, shape: tuple[int, int] | None, choices: tuple[bool, ...], precision: str,
                      work: Workload) -> dict[bool, ActivationTrace | None]:
    """The activation trace of `model` at the batch `shape` (the workload's) for each checkpointing choice,
    from one data-free replica; None for a choice without one (no shape, not a model the replica knows,
    or the trace failed: the states are still planned, and the reason says so)."""
    fake = replica_of(model, COMPUTE_DTYPES.get(precision, torch.float32)) if shape is not None else None
    traces: dict[bool, ActivationTrace | None] = {}
    for ck in choices:
        try:
            traces[ck] = traces_for(fake, work, (ck,)).get(ck)  # no entry: the model cannot checkpoint
        except Exception:  # noqa: BLE001 - see above
            traces[ck] = None
    return traces


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not is_auto(value) else default


def describe(config: RunConfig, result: Plan) -> str:
    """The line printed on the main process: what was chosen, for which keys, and why."""
    planned = ["zero.stage", "zero.offload_optimizer.device", "zero.offload_param.device"]
    if is_auto(config.zero.offload_optimizer.ratio):
        planned.append("zero.offload_optimizer.ratio")
    if len({e.setting.checkpointing for e in result.estimates}) > 1:
        planned.append("zero.gradient_checkpointing")
    share = config.zero.offload_optimizer.host_share
    if (share is None or is_auto(share)) and any(e.setting.host_share for e in result.estimates):
        planned.append("zero.offload_optimizer.host_share")
    keys = ", ".join(key_name(config.source_format, k) for k in planned)
    if result.choice is None:
        return (f"zerofit: {keys} auto -> {result.smallest.setting.label} (the smallest; {result.reason}; the "
                "out-of-memory back-off will halve the micro-batch if a step does not fit)")
    return f"zerofit: {keys} auto -> {result.reason}"
