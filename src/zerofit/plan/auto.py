"""`zero_optimization.stage: auto` and offload `device: auto`, resolved at `prepare()` by the planner.

When the model is known, the planner estimates every setting the config leaves open (a fixed stage
or offload device stays as written) and picks the fastest that fits this machine with headroom
(see `zerofit.plan.choose`): stage 0 before 1, 2, 3, before optimizer offload, before parameter
offload. NVMe is never chosen by itself: it needs a path the user names.

[Note: every rank decides the same]
Ranks must run one setting. The inputs of the decision are made identical first - the memory
budget is the minimum over the ranks (one all-reduce) - and the rest is deterministic (the model's
sizes, the first batch's shape, the activation trace), so every rank computes the same choice.

Activations are traced on a data-free replica of a transformers model at the first batch's shape
(collated from the dataset's first samples, which draws nothing from any random generator), with
activation checkpointing as the model has it. For other modules, or without a DataLoader, only the
model states are planned, and the reason printed says so. On CUDA the first optimizer step then
checks the choice against the measured peak (`zerofit.plan.probe`). Without CUDA the "GPU" is host memory: a
setting fits when its device and host bytes together fit the host (`Budget.unified`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerofit.config.naming import key_name
from zerofit.config.schema import RunConfig, is_auto
from zerofit.engine.policy import COMPUTE_DTYPES
from zerofit.plan.activations import trace_step
from zerofit.plan.choose import Budget, Plan, machine_budget, plan
from zerofit.plan.memory import DTYPE_BYTES, ModelCounts, Setting, Workload, all_settings
from zerofit.plan.probe import StepProbe
from zerofit.plan.sources import replica_of


def needs_planning(config: RunConfig) -> bool:
    z = config.zero
    return is_auto(z.stage) or is_auto(z.offload_optimizer.device) or is_auto(z.offload_param.device)


def candidates(config: RunConfig, world: int, checkpointing: bool) -> list[Setting]:
    """The settings the config leaves open (a written stage or device is kept)."""
    z = config.zero
    ratio = offload_ratio(config)
    out = []
    for s in all_settings(max(world, 2), checkpointing=(checkpointing,), offload_ratio=ratio):
        if not is_auto(z.stage) and s.stage != z.stage:
            continue
        for kind, value in (("offload_optimizer", z.offload_optimizer.device), ("offload_param", z.offload_param.device)):
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


def budget_for(device: torch.device, world: int) -> Budget:
    """This machine's memory, the minimum over ranks; env ZEROFIT_GPU_MEMORY_GIB / ZEROFIT_HOST_MEMORY_GIB override."""
    gpu = _env_gib("ZEROFIT_GPU_MEMORY_GIB")
    host = _env_gib("ZEROFIT_HOST_MEMORY_GIB")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    if device.type == "cuda":
        b = machine_budget(gpu_memory_gib=gpu, host_memory_gib=host, ranks_per_host=local)
        if gpu is None:
            b = dataclasses.replace(b, gpu_bytes=torch.cuda.get_device_properties(device).total_memory)
    else:
        b = machine_budget(gpu_memory_gib=None, host_memory_gib=host, ranks_per_host=local)
        b = dataclasses.replace(b, gpu_bytes=None, unified=True)
    if world > 1 and dist.is_initialized():
        values = torch.tensor([b.gpu_bytes or 0, b.host_bytes or 0], dtype=torch.float64,
                              device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
        b = dataclasses.replace(b, gpu_bytes=int(values[0]) or None, host_bytes=int(values[1]) or None)
    return b


def _env_gib(name: str) -> float | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be a number of GiB (for example 24)") from None


def first_batch_shape(loader: Any, micro_batch: int | None) -> tuple[int, int] | None:
    """(samples, tokens) of the first batch, collated from the dataset's first samples (no RNG drawn)."""
    base = getattr(loader, "base", loader)
    dataset = getattr(base, "dataset", None)
    if dataset is None or micro_batch is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return None
    try:
        samples = [dataset[i] for i in range(min(micro_batch, len(dataset)))]
        batch = base.collate_fn(samples)
    except Exception:  # noqa: BLE001 - an unusual dataset only loses the activation term
        return None
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(batch.values()) if hasattr(batch, "values") \
        else list(batch) if isinstance(batch, (list, tuple)) else []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point():
            return micro_batch, int(t.shape[1])
    return None


def choose(config: RunConfig, model: nn.Module, *, world: int, device: torch.device,
           shape: tuple[int, int] | None, budget: Budget | None = None) -> tuple[RunConfig, Plan]:
    """`config` with the open stage / offload devices filled by the planner, and the plan behind it.

    `budget` defaults to this machine's (`budget_for`)."""
    precision = config.precision.mixed_precision
    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    threshold = config.zero.param_persistence_threshold
    work = Workload(world=world, mixed_precision=precision if precision in DTYPE_BYTES else "no",
                    micro_batch=shape[0] if shape else 1, seq=shape[1] if shape else 1,
                    gradient_accumulation_steps=_int(config.batch.gradient_accumulation_steps, 1),
                    persistence_threshold=_int(threshold, 100_000),
                    unit_size_threshold=config.zero.unit_size_threshold)
    trace = None
    if shape is not None:
        fake = replica_of(model, COMPUTE_DTYPES.get(precision, torch.float32))
        if fake is not None:
            try:
                trace = trace_step(fake, batch=shape[0], seq=shape[1], checkpointing=checkpointing,
                                   unit_size_threshold=work.unit_size_threshold)
            except Exception:  # noqa: BLE001 - the states are still planned, and the reason says so
                trace = None
    counts = ModelCounts.of(model, unit_size_threshold=work.unit_size_threshold)
    result = plan(counts, work, budget or budget_for(device, world), {checkpointing: trace},
                  settings=candidates(config, world, checkpointing))
    chosen = result.choice or result.smallest
    s = chosen.setting
    z = config.zero
    zero = dataclasses.replace(
        z, stage=s.stage,
        offload_optimizer=dataclasses.replace(z.offload_optimizer, device=s.offload_optimizer),
        offload_param=dataclasses.replace(z.offload_param, device=s.offload_param))
    return config.replace(zero=zero), result


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not is_auto(value) else default


def plan_for(accelerator: Any, model: nn.Module) -> tuple[RunConfig, StepProbe]:
    """The Accelerator's config with its "auto" stage / offload resolved for `model` (the choice is
    printed), and the probe that checks the choice on the first optimizer step (`zerofit.plan.probe`)."""
    loaders = accelerator._dataloaders
    shape = first_batch_shape(loaders[0], accelerator._facts.micro_batch_size) if loaders else None
    world, device = accelerator.num_processes, accelerator.device
    budget = budget_for(device, world)
    config, result = choose(accelerator.config, model, world=world, device=device, shape=shape, budget=budget)
    accelerator.print(describe(accelerator.config, result))
    fmt = accelerator.config.source_format
    probe = StepProbe(result, budget, device=device, world=world, is_main=accelerator.is_main_process,
                      spell=lambda key: key_name(fmt, key))
    return config, probe


def describe(config: RunConfig, result: Plan) -> str:
    """The line printed on the main process: what was chosen, for which keys, and why."""
    keys = ", ".join(key_name(config.source_format, k) for k in
                     ("zero.stage", "zero.offload_optimizer.device", "zero.offload_param.device"))
    if result.choice is None:
        return (f"zerofit: {keys} auto -> {result.smallest.setting.label} (the smallest; {result.reason}; the "
                "out-of-memory back-off will halve the micro-batch if a step does not fit)")
    return f"zerofit: {keys} auto -> {result.reason}"
