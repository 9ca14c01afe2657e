"""Small models, and a probe, for tests and CPU benchmarks of the engine's per-unit machinery.

`BlockStack` is a stack of small blocks (two Linear and a LayerNorm each) under one ModuleList, so the engine
makes each block a unit; `gpu_stepped_engine` wraps it in ZeroEngine stage 2 with GPU-stepped optimizer offload
on the CPU (the CPU standing in for the GPU) and the two param groups transformers' Trainer makes, so each unit
holds two runs (weights with weight decay; biases and norms without). `top_level_aten_ops` counts the aten ops a
profiled stretch ran that no other aten op ran inside (what the issuing thread launches).
"""

from __future__ import annotations

import collections

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.l1 = nn.Linear(d, 2 * d)
        self.l2 = nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.l2(torch.tanh(self.l1(self.norm(x))))


class BlockStack(nn.Module):
    """`blocks` blocks of width `d`, run in order (each a unit of the engine)."""

    def __init__(self, blocks: int = 4, d: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def gpu_stepped_engine(blocks: int, d: int, state: str, lr: float, ratio: float = 1.0):
    """A seeded `BlockStack` under ZeroEngine stage 2, GPU-stepped offload on the CPU (of the last units, `ratio` of
    the state), fused AdamW over Trainer's two param groups, `precision.optimizer_state` `state`."""
    from zerofit.config.schema import OffloadConfig, PrecisionConfig, ZeroConfig
    from zerofit.engine import ZeroEngine

    torch.manual_seed(0)
    model = BlockStack(blocks, d)
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, fused=True)
    zero = ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu", step_on="device", ratio=ratio))
    return ZeroEngine(model, opt, zero=zero, precision=PrecisionConfig(optimizer_state=state),
                      device=torch.device("cpu"))


def top_level_aten_ops(events) -> collections.Counter:
    """Per aten op name, how often it ran not inside another aten op, among torch.profiler `events` (all threads
    when the profile was taken with `profile_all_threads`)."""
    def top_level(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return collections.Counter(e.name for e in events if e.name.startswith("aten::") and top_level(e))
