"""`stage: auto` at `prepare()`: the planner's inputs read off this run, its choice printed and probed.

The decision itself is offline and pure (`zerofit.plan.auto.choose`, see its note on why every rank
decides the same); this module supplies what only the running job knows - the memory budget (the
minimum over the ranks, one all-reduce), the first batch's shape from the prepared DataLoader - and
returns the probe that checks the choice on the first optimizer step (`zerofit.frontend.planning.first_step_check`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerofit.config.naming import key_name
from zerofit.config.schema import RunConfig, is_auto
from zerofit.distributed.failures import named
from zerofit.errors import ConfigError
from zerofit.frontend.planning.first_batch import FirstBatchCheck
from zerofit.frontend.planning.first_step_check import StepProbe
from zerofit.plan import bandwidth
from zerofit.plan.activations import checkpointing_switch, has_checkpointing
from zerofit.plan.auto import can_checkpoint, choose, describe
from zerofit.plan.choose import Budget, allowed_gpu_bytes, machine_budget
from zerofit.plan.sharing import shared_rates


def processes_per_host(world: int) -> int:
    """The processes of this run on this host, which share its memory, cores and links: LOCAL_WORLD_SIZE
    (set by the launcher and torchrun), else all `world` of them (one machine)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    except ValueError:
        local = world
    return max(1, min(local, world))


def budget_for(device: torch.device, world: int) -> Budget:
    """This machine's memory, the minimum over ranks; env ZEROFIT_GPU_MEMORY_GIB / ZEROFIT_HOST_MEMORY_GIB override."""
    gpu = _env_gib("ZEROFIT_GPU_MEMORY_GIB")
    host = _env_gib("ZEROFIT_HOST_MEMORY_GIB")
    local = processes_per_host(world)
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
        with named("all_reduce of the memory budget (stage: auto)", dist.get_rank()):
            dist.all_reduce(values, op=dist.ReduceOp.MIN)
        b = dataclasses.replace(b, gpu_bytes=int(values[0]) or None, host_bytes=int(values[1]) or None)
    return b


def wants_host_share(config: RunConfig, device: torch.device) -> bool:
    """The config asks for `offload_optimizer.host_share: auto` where offloaded state may be GPU-stepped
    (unset means no split: on the H200 box no split paid, benchmarks/results/split_gpt2xl_h200.md)."""
    off = config.zero.offload_optimizer
    return (device.type == "cuda" and is_auto(off.host_share) and off.step_on != "host"
            and (is_auto(off.device) or off.device == "cpu"))


def machine_rates(device: torch.device, world: int, *, measure: bool = True) -> bandwidth.Rates | None:
    """This machine's measured rates, rank 0's for every rank (one broadcast): the cached ones, measured
    again where an older zerofit cached them (not `current`) and, with `measure`, measured now where none
    are cached (once per machine, a few seconds, printed) and cached; None without CUDA, where none are
    cached and `measure` is off, or where they cannot be measured (the planner then keeps its fixed order).
    `prepare()` reads them once, for the split (`host_share_of`) and the planner's ranking alike."""
    rates = None
    if device.type == "cuda" and (not dist.is_initialized() or dist.get_rank() == 0):
        rates = bandwidth.cached(device)
        if (rates is None and measure) or (rates is not None and not rates.current):
            print(f"zerofit: measuring this machine's offload and matmul rates once for the planner "
                  f"(cached in {bandwidth.cache_path()}; `zerofit env` shows them)", flush=True)
            try:
                rates = bandwidth.probe(device, refresh=True)
            except Exception as e:  # noqa: BLE001 - the planner still works without rates
                print(f"zerofit: could not measure the rates ({e}); the planner keeps its fixed order", flush=True)
                rates = None
    if world > 1 and dist.is_initialized():
        box = [rates]
        with named("broadcast of the measured rates (stage: auto)", dist.get_rank()):
            dist.broadcast_object_list(box, src=0)
        rates = box[0]
    return rates


def host_share_of(rates: bandwidth.Rates | None, world: int, compute_bytes: int) -> float | None:
    """The share of GPU-stepped offload to step on the host at the same time that `rates` (`machine_rates`:
    the same on every rank) favour (`zerofit.plan.bandwidth.best_host_share`; `zerofit env --probe` measures
    them), at one process's share of them ([Note: rates shared on one host]); None: no rates, or no split pays."""
    if rates is None:
        return None
    share = bandwidth.best_host_share(shared_rates(rates, processes_per_host(world)), 10**9,
                                      param_bytes=compute_bytes)
    return share if share > 0 else None


def apply_checkpointing(config: RunConfig, model: nn.Module) -> None:
    """Turn activation checkpointing on in `model` where `zero.gradient_checkpointing` is true (written, or
    the planner's choice) and the model does not have it yet."""
    if config.zero.gradient_checkpointing is not True or has_checkpointing(model):
        return
    if not can_checkpoint(model):
        raise ConfigError(f"{key_name(config.source_format, 'zero.gradient_checkpointing')} is true, but "
                          f"{type(model).__name__} has no gradient_checkpointing_enable() (a transformers model "
                          "that supports it): remove the key, or checkpoint the model's blocks in the script",
                          config.source)
    checkpointing_switch(model)[0]()  # non-reentrant, as the planner traced it


def keep_checkpointing_effective(config: RunConfig, model: nn.Module, *, training: bool, is_main: bool) -> None:
    """[Note: checkpointing needs training mode] transformers applies activation checkpointing only while
    the model is in training mode, and `from_pretrained` returns a model in eval mode. A script that never
    calls `model.train()` keeps every layer's activations where the plan counted on checkpointing (a
    pretrained 13 B Llama at 8x512 on one H200: about 30 GiB more by its trace, which fit there only
    because that plan peaks in the optimizer step, not in the forward). So when the run checkpoints and prepare()
    is given an optimizer (`training`) while the model is in eval mode, the model is put in training
    mode, and the main process says so. A later forward with gradients on in eval mode (a `model.eval()`
    left on, or evaluation without `torch.no_grad()`) warns once: it is not stopped, since an evaluation
    that forgot `no_grad` is still an evaluation."""
    if config.zero.gradient_checkpointing is not True:
        return
    if training and not model.training:
        model.train()
        if is_main:
            print("zerofit: the model was in eval mode (from_pretrained returns it so) and activation checkpointing, "
                  "which this run uses, acts only in training mode: prepare() called model.train(). Call "
                  "model.eval() for evaluation and model.train() before training again, as usual", flush=True)
    warned = []

    def check(module: nn.Module, _args: Any) -> None:
        if not warned and not module.training and torch.is_grad_enabled():
            warned.append(True)
            warnings.warn("zerofit: a forward with gradients on while the model is in eval mode: activation "
                          "checkpointing, which this run's memory plan counts on, is off in eval mode, so every "
                          "layer's activations are kept (a large model runs out of memory). Call model.train() "
                          "before training, and run evaluation under torch.no_grad()", stacklevel=2)

    model.register_forward_pre_hook(check)


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
             process: Any, host_share: float | None = None,
             rates: bandwidth.Rates | None = None,
             whole: frozenset[int] = frozenset()) -> tuple[RunConfig, StepProbe, FirstBatchCheck | None]:
    """`config` with its "auto" stage / offload resolved for `model` (the choice is printed on the local
    main process), the probe that checks the choice on the first optimizer step
    (`zerofit.frontend.planning.first_step_check`), and, when no DataLoader gave the batch shape, the check
    of the first training forward ([Note: planned without the batch]) for the caller to install (None when
    the shape was known).

    `loaders` are the DataLoaders prepared so far (the first gives the batch shape), `micro_batch` the
    script's micro-batch if known, `process` this process's place in the run (`ProcessState`),
    `host_share` the split `host_share_of` found (tried where it fits), `rates` this machine's
    measured rates (`machine_rates`), which rank the settings that fit, `whole` the parameters a per-parameter
    optimizer steps whole (`zerofit.engine.optim.whole_param_ids`)."""
    shape = first_batch_shape(loaders[0], micro_batch) if loaders else None
    world, device = process.num_processes, process.device
    budget = budget_for(device, world)
    config_out, result = choose(config, model, world=world, shape=shape, budget=budget, host_share=host_share,
                                rates=rates, whole=whole)
    if process.is_local_main_process:
        print(describe(config, result), flush=True)
    fmt = config.source_format
    probe = StepProbe(result, budget, device=device, world=world, is_main=process.is_main_process,
                      spell=lambda key: key_name(fmt, key))
    check = None
    if shape is None:
        check = FirstBatchCheck(config, result, budget, world=world, device=device,
                                is_main=process.is_main_process, spell=lambda key: key_name(fmt, key),
                                on_checkpointing=lambda: None)
        check.whole = whole
    return config_out, probe, check
