"""What the planner says about the running model when memory runs out: the estimate, in one message."""

from __future__ import annotations

from typing import Any

import torch

from zerofit.engine.policy import step_on_for
from zerofit.plan.memory import GIB, ModelCounts, Setting, Workload, estimate


def _setting_of(config: Any) -> Setting | None:
    z = config.zero
    try:
        ratio = z.offload_optimizer.ratio if z.offload_optimizer.device != "none" else 1.0
        step_on = step_on_for(z.offload_optimizer.step_on, cuda=torch.cuda.is_available(),
                              nvme=z.offload_optimizer.device == "nvme")
        offloaded = z.offload_optimizer.device in ("cpu", "nvme")
        return Setting(stage=z.stage, offload_optimizer=z.offload_optimizer.device,
                       offload_param=z.offload_param.device, offload_ratio=ratio,
                       step_on=step_on if offloaded else "host")
    except (ValueError, TypeError):
        return None


def memory_advice(config: Any, model: Any, *, world: int, micro_batch: int = 1, seq: int | None = None) -> str:
    """`zerofit estimate`'s figures for `model` (None: unknown) under `config` at `micro_batch`, and what to
    change (never raises)."""
    fix = ("Lower the DataLoader's batch_size, turn on activation checkpointing "
           "(model.gradient_checkpointing_enable()), raise zero_optimization.stage, or offload the optimizer state "
           "(zero_optimization.offload_optimizer.device: cpu); `zerofit estimate --model ...` lists every setting")
    if model is None:
        return fix + "."
    try:
        cfg = config
        counts = ModelCounts.of(model)
        setting = _setting_of(cfg)
        work = Workload(world=world, mixed_precision=cfg.precision.mixed_precision,
                        micro_batch=micro_batch, seq=seq or 512, optimizer_state=cfg.precision.optimizer_state,
                        nvme_buffer_count=cfg.zero.offload_optimizer.buffer_count)
        if setting is None:
            return fix + "."
        e = estimate(counts, setting, work, None)
        states = e.gpu_total
        return (f"Estimate for this model ({counts.numel / 1e9:.3f} B parameters) under {setting.label} on "
                f"{work.world} rank(s): {states / GIB:.2f} GiB of GPU memory per rank before activations "
                f"(parameters {e.params / GIB:.2f}, gradients {e.grads / GIB:.2f}, optimizer {e.optimizer / GIB:.2f}, "
                f"buffers {e.buffers / GIB:.2f}), {e.host_total / GIB:.2f} GiB pinned host. {fix}.")
    except Exception as bad:  # noqa: BLE001 - advice must never hide the out-of-memory error it explains
        return f"{fix} (no estimate: {bad})."
