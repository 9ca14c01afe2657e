"""Helpers shared by the checkpoint tests (imported by spawned ranks); holds no tests itself."""

from __future__ import annotations

import torch
from engine_cases import DEFAULT_CHUNK, Case, batches, loss_fn, make_model_and_optim

from zerofit.config.schema import LossScaleConfig, OffloadConfig, PrecisionConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.offload import gpu
from zerofit.engine.state import local_fragments


def build(stage: int, *, precision: str = "no", perturb: float = 0.0, freeze: bool = False,
          steps: int = 12, offload: bool = False, optimizer_state: str = "fp32", step_on: str = "auto",
          chunk: int = 0, nvme_path: str | None = None):
    """TinyLM + AdamW under `stage` (`offload`: optimizer, and at stage 3 parameters, on the host, stepped where
    `step_on` says, in streamed chunks of `chunk` elements when given; `nvme_path`: the optimizer's master and
    state in files there); `perturb` shifts every weight so a load visibly changes them; `optimizer_state`: how
    the state is stored."""
    case = Case(stage=stage, precision=precision, freeze=freeze, steps=steps)
    model, opt = make_model_and_optim(case)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(perturb)
    precision_cfg = PrecisionConfig(mixed_precision=precision, optimizer_state=optimizer_state,
                                    loss_scale=LossScaleConfig(initial_scale_power=8, hysteresis=1))
    host = OffloadConfig(device="cpu" if offload else "none")
    zero = ZeroConfig(stage=stage, param_persistence_threshold=0,
                      offload_optimizer=OffloadConfig(device="nvme" if nvme_path else host.device, step_on=step_on,
                                                      nvme_path=nvme_path) if offload else host,
                      offload_param=host if stage == 3 else OffloadConfig())
    gpu.STREAM_CHUNK = chunk or DEFAULT_CHUNK  # read when the engine builds its step mode
    try:
        engine = ZeroEngine(model, opt, zero=zero, precision=precision_cfg, device=torch.device("cpu"))
    finally:
        gpu.STREAM_CHUNK = DEFAULT_CHUNK
    return case, model, opt, engine


def train(engine, model, case: Case, rank: int, world: int, steps: range) -> list[float]:
    """Optimizer steps `steps` of the case's data, each rank on its slice; returns the mean losses."""
    data = batches(case)
    micro = case.batch // world
    losses = []
    for step in steps:
        x, y = data[step]
        loss = loss_fn(model(x[rank * micro:(rank + 1) * micro]), y[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        engine.step()
    return losses


def owned_state(engine, rank: int) -> list[tuple[str, int, dict[str, torch.Tensor]]]:
    """This rank's share of the full training state (each element reported by exactly one rank), once the last
    step is done (a host-stepped group's may still run on the stepper's thread)."""
    engine.settle()
    return [(f.name, f.start, {k: v.detach().clone() for k, v in f.tensors.items()})
            for f in local_fragments(engine.groups, engine.optimizer, rank)]


def assemble(per_rank: list) -> dict[tuple[str, str], torch.Tensor]:
    """{(parameter, 'master' | state key): full flattened tensor} from every rank's `owned_state`."""
    pieces: dict[tuple[str, str], list] = {}
    for frags in per_rank:
        for name, start, tensors in frags:
            for key, t in tensors.items():
                pieces.setdefault((name, key), []).append((start, t))
    return {k: torch.cat([t for _, t in sorted(v, key=lambda item: item[0])]) for k, v in pieces.items()}
