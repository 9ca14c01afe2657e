"""One process standing in for one rank of a bigger world, through torch's fake process group (#30).

`fake_world(rank, world)` makes `dist.get_world_size()` return `world` in this process alone: the
engine takes every world > 1 path (shards, padding, the collectives' order and shapes), and each
collective returns at once without writing its output, much as an NCCL call returns to the CPU. So
what runs here checks order, shapes, streams and lifetimes - never values: outputs are garbage.

Also the cases the CUDA stream-sanitizer run loops over (tests/scripts/fake_world_sanitized.py,
launched by tests/test_fake_world_gpu.py), written so that the same loop also runs on the CPU in CI
(test_fake_world_trace.py) and cannot rot between GPU runs.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from engine_cases import SEQ, VOCAB, TinyLM, loss_fn

from zerofit.config.schema import LossScaleConfig, OffloadConfig, PrecisionConfig, ZeroConfig

STEPS, GAS, MICRO, CLIP = 3, 2, 2, 1.0


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """The default process group is a fake one of `world` ranks in which this process is `rank`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    hook = sys.excepthook  # each init_process_group wraps it again (to prefix the rank): undone below
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        if dist.is_initialized():  # a script's end_training may have ended it already
            dist.destroy_process_group()
        sys.excepthook = hook


@dataclass(frozen=True)
class FakeCase:
    """One configuration of the sanitized run: through `ZeroEngine` or `Accelerator.prepare`."""

    stage: int
    precision: str = "bf16"
    offload: str = "none"  # offload_optimizer.device: none, cpu, nvme
    step_on: str = "auto"  # host: the CPU optimizer steps it; device: GPU-stepped from host memory or files
    offload_param: str = "none"
    api: str = "engine"  # engine or accelerator

    def zero(self, nvme_dir: str) -> ZeroConfig:
        path = nvme_dir if self.offload == "nvme" else None
        return ZeroConfig(stage=self.stage, param_persistence_threshold=0,
                          offload_optimizer=OffloadConfig(device=self.offload, step_on=self.step_on, nvme_path=path),
                          offload_param=OffloadConfig(device=self.offload_param))

    def __str__(self) -> str:
        parts = [self.api, f"stage{self.stage}", self.precision]
        if self.offload != "none":
            parts.append(f"{self.offload}-{self.step_on}")
        if self.offload_param != "none":
            parts.append("param-" + self.offload_param)
        return "/".join(parts)


# Every stage; optimizer offload host- and GPU-stepped from host memory and from files; parameter
# offload; fp16 and bf16. With 2 ranks of accumulation, clipping, 3 steps each.
CASES = [
    FakeCase(0), FakeCase(1, "fp16"), FakeCase(2), FakeCase(3), FakeCase(3, "fp16"),
    FakeCase(2, "fp16", "cpu", "host"), FakeCase(2, "bf16", "cpu", "device"),
    FakeCase(3, "bf16", "cpu", "host", "cpu"), FakeCase(3, "fp16", "cpu", "device", "cpu"),
    FakeCase(2, "bf16", "nvme", "host"), FakeCase(3, "bf16", "nvme", "device", "cpu"),
    FakeCase(1, api="accelerator"), FakeCase(2, "fp16", "cpu", "host", api="accelerator"),
    FakeCase(3, "bf16", "cpu", "device", "cpu", api="accelerator"),
]


def rank_for(case: FakeCase, world: int) -> int:
    """The engine runs as the last rank (its shard holds the padding). The front end runs as rank 0: its
    object collectives decode what rank 0 broadcasts, which a fake group leaves unwritten elsewhere."""
    return 0 if case.api == "accelerator" else world - 1


def run_case(case: FakeCase, world: int, device: str, nvme_dir: str) -> dict:
    """Train `case` for STEPS steps as one rank of a fake world; returns what went on (no values)."""
    with fake_world(rank_for(case, world), world):
        start = time.perf_counter()
        torch.manual_seed(0)
        model = TinyLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if case.api == "engine":
            out = _train_engine(case, model, opt, device, nvme_dir)
        else:
            out = _train_accelerator(case, model, opt, device, nvme_dir)
        if device == "cuda":
            torch.cuda.synchronize()
        return {**out, "seconds": round(time.perf_counter() - start, 2)}


def _batch(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (MICRO, SEQ), device=device)
    return x, torch.roll(x, 1, dims=1)


def _train_engine(case: FakeCase, model, opt, device: str, nvme_dir: str) -> dict:
    from zerofit.engine import ZeroEngine

    precision = PrecisionConfig(mixed_precision=case.precision, loss_scale=LossScaleConfig(initial_scale_power=8))
    engine = ZeroEngine(model, opt, zero=case.zero(nvme_dir), precision=precision, gradient_accumulation_steps=GAS,
                        gradient_clipping=CLIP, device=torch.device(device))
    stepped = 0
    for _ in range(STEPS):
        for _ in range(GAS):
            x, y = _batch(device)
            engine.backward(loss_fn(model(x), y))
        stepped += bool(engine.step())
    engine.settle()
    return {"calls": engine.comm.calls, "stepped": stepped}


def _train_accelerator(case: FakeCase, model, opt, device: str, nvme_dir: str) -> dict:
    from zerofit import Accelerator
    from zerofit.config.schema import RunConfig

    config = RunConfig(zero=case.zero(nvme_dir), gradient_clipping=CLIP)
    acc = Accelerator(config=config, mixed_precision=case.precision, gradient_accumulation_steps=GAS,
                      cpu=device == "cpu")
    model, opt = acc.prepare(model, opt)
    stepped = 0
    for _ in range(STEPS * GAS):
        with acc.accumulate(model):
            x, y = _batch(device)
            acc.backward(loss_fn(model(x), y))
            opt.step()
            stepped += acc.sync_gradients and not opt.step_was_skipped
            opt.zero_grad()
    acc.end_training()
    return {"calls": opt.engine.comm.calls, "stepped": stepped}
