"""`stage: auto` at `prepare()`: the planner's inputs read off this run, its choice printed and probed.

The decision itself is offline and pure (`zerofit.plan.auto.choose`, see its note on why every rank
decides the same); this module supplies what only the running job knows - the memory budget (the
minimum over the ranks, one all-reduce), the first batch's shape from the prepared DataLoader - and
returns the probe that checks the choice on the first optimizer step (`zerofit.frontend.probe`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerofit.config.naming import key_name
from zerofit.config.schema import RunConfig
from zerofit.frontend.probe import StepProbe
from zerofit.plan.auto import choose, describe
from zerofit.plan.choose import Budget, allowed_gpu_bytes, machine_budget


def budget_for(device: torch.device, world: int) -> Budget:
    """This machine's memory, the minimum over ranks; env ZEROFIT_GPU_MEMORY_GIB / ZEROFIT_HOST_MEMORY_GIB override."""
    gpu = _env_gib("ZEROFIT_GPU_MEMORY_GIB")
    host = _env_gib("ZEROFIT_HOST_MEMORY_GIB")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    if device.type == "cuda":
        b = machine_budget(gpu_memory_gib=gpu, host_memory_gib=host, ranks_per_host=local)
        if gpu is None:
            b = dataclasses.replace(b, gpu_bytes=allowed_gpu_bytes(device))
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


def plan_for(config: RunConfig, model: nn.Module, *, loaders: list[Any], micro_batch: int | None,
             process: Any) -> tuple[RunConfig, StepProbe]:
    """`config` with its "auto" stage / offload resolved for `model` (the choice is printed on the local
    main process), and the probe that checks the choice on the first optimizer step (`zerofit.frontend.probe`).

    `loaders` are the DataLoaders prepared so far (the first gives the batch shape), `micro_batch` the
    script's micro-batch if known, `process` this process's place in the run (`ProcessState`)."""
    shape = first_batch_shape(loaders[0], micro_batch) if loaders else None
    world, device = process.num_processes, process.device
    budget = budget_for(device, world)
    config_out, result = choose(config, model, world=world, shape=shape, budget=budget)
    if process.is_local_main_process:
        print(describe(config, result))
    fmt = config.source_format
    probe = StepProbe(result, budget, device=device, world=world, is_main=process.is_main_process,
                      spell=lambda key: key_name(fmt, key))
    return config_out, probe
