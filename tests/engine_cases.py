"""Models, data and the unsharded reference shared by the engine tests (imported by spawned ranks)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from zerofit.config.schema import LossScaleConfig, OffloadConfig, PrecisionConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.offload import gpu
from zerofit.engine.state_codec import Codec, round_trip

DEFAULT_CHUNK = gpu.STREAM_CHUNK

VOCAB, DIM, SEQ = 37, 13, 5  # prime sizes: nothing divides evenly by the world size


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.l1 = nn.Linear(d, 2 * d + 1)
        self.l2 = nn.Linear(2 * d + 1, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.l2(torch.tanh(self.l1(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding tied to the head, repeated blocks, a frozen part when asked."""

    def __init__(self, n_blocks: int = 3, freeze: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(n_blocks))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        if freeze:  # a frozen block, and a frozen parameter inside a trainable block
            self.blocks[0].requires_grad_(False)
            self.blocks[1].l1.bias.requires_grad_(False)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


@dataclass(frozen=True)
class Case:
    stage: int = 0
    gas: int = 1
    precision: str = "no"
    optim: str = "adamw"
    clip: float = 0.0
    freeze: bool = False
    steps: int = 10
    batch: int = 8  # global batch per optimizer step
    persistence: int = 0
    overflow_at: int = -1  # inject inf into rank 1's loss at this step
    offload: str = "none"  # offload_optimizer.device
    ratio: float = 1.0
    offload_param: str = "none"
    sched: bool = False  # a LambdaLR stepped right after every optimizer step
    nvme_path: str | None = None  # offload_optimizer.nvme_path (with offload="nvme")
    step_on: str = "auto"  # offload_optimizer.step_on ("device": GPU-stepped, the CPU standing in for the GPU)
    chunk: int = 0  # elements per streamed chunk (0: the engine's default)
    host_share: float | None = None  # offload_optimizer.host_share (None: not written)
    buffer_count: int = 4  # offload_optimizer.buffer_count (NVMe: host slots in the swapper's pool)
    state: str = "fp32"  # precision.optimizer_state (the reference stores its state the same way)


def batches(case: Case):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, VOCAB, (case.batch, SEQ), generator=g),
             torch.randint(0, VOCAB, (case.batch, SEQ), generator=g)) for _ in range(case.steps)]


def loss_fn(logits, y):
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_model_and_optim(case: Case):
    torch.manual_seed(0)
    model = TinyLM(freeze=case.freeze)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim > 1]
    no_decay = [p for p in params if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if case.optim == "adamw":
        opt = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    else:
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, fused=True)
    return model, opt


def reference(case: Case):
    """One process, whole model, whole global batch: losses, grads before each step, final params."""
    model, opt = make_model_and_optim(case)
    losses, grads = [], []
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)) if case.sched else None
    for x, y in batches(case):
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        if case.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        opt.step()
        if case.state != "fp32":
            store_state(opt, case.state)
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def store_state(opt: torch.optim.Optimizer, kind: str) -> None:
    """What keeping the state in `kind` does to an unsharded optimizer: every fp32 per-element state tensor
    stored and widened again, blocks counted from the parameter's first element (see [Note: narrow
    optimizer state] in zerofit.engine.state_codec)."""
    codec = Codec(kind)
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.shape == p.shape:
                v.copy_(round_trip(v, codec, k))


def run_engine(rank: int, world: int, case: Case, record_grads: bool = True, device: str = "cpu"):
    """The same training on `world` ranks through ZeroEngine; returns what `reference` returns, + stats.
    `device` "cuda": every rank on the one GPU (gloo moves CUDA tensors through host memory)."""
    model, opt = make_model_and_optim(case)
    precision = PrecisionConfig(mixed_precision=case.precision, optimizer_state=case.state,
                                loss_scale=LossScaleConfig(initial_scale_power=8, hysteresis=1))
    zero = ZeroConfig(stage=case.stage, param_persistence_threshold=case.persistence,
                      offload_optimizer=OffloadConfig(device=case.offload, ratio=case.ratio,
                                                      nvme_path=case.nvme_path, step_on=case.step_on,
                                                      host_share=case.host_share, buffer_count=case.buffer_count),
                      offload_param=OffloadConfig(device=case.offload_param))
    gpu.STREAM_CHUNK = case.chunk or DEFAULT_CHUNK  # read when the engine builds its step mode
    try:
        engine = ZeroEngine(model, opt, zero=zero,
                            precision=precision, gradient_accumulation_steps=case.gas,
                            gradient_clipping=case.clip, device=torch.device(device))
    finally:  # the default again for whatever runs next in this process
        gpu.STREAM_CHUNK = DEFAULT_CHUNK
    micro = case.batch // (world * case.gas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)) if case.sched else None
    losses, grads, skipped, micro_comm = [], [], [], []
    for step, (x, y) in enumerate(batches(case)):
        total = torch.zeros((), device=device)
        for k in range(case.gas):
            start = (k * world + rank) * micro  # micro-batch k of every rank, back to back
            loss = loss_fn(model(x[start:start + micro].to(device)), y[start:start + micro].to(device))
            total += loss.detach() / case.gas
            if step == case.overflow_at and rank == 1:
                loss = loss * float("inf")
            before = engine.comm.calls
            engine.backward(loss)
            if k < case.gas - 1:
                micro_comm.append(engine.comm.calls - before)
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        if record_grads and case.precision == "no":
            grads.append({k: v.cpu() for k, v in engine.named_full_tensors("grad").items()})
        skipped.append(not engine.step())
        if sched is not None:
            sched.step()  # on the main thread while an offloaded host step may still run
    params = {k: v.cpu() for k, v in engine.named_full_tensors("master").items()}
    return {"losses": losses, "grads": grads, "params": params, "skipped": skipped,
            "micro_comm": micro_comm, "scale": engine.scaler.scale,
            "offloaded": sum(g.placement.host_stepped for g in engine.groups),
            "streamed": sum(g.placement.gpu_stepped for g in engine.groups),
            "early": engine.times.host_steps_in_backward,
            "gpu_early": engine.times.gpu_steps_in_backward,
            "param_offloaded": sum(g.placement.offload_params for g in engine.groups),
            "handed_over": engine.offload.gpu.handover.kept if engine.offload.gpu is not None else 0,
            "nvme_files": len(os.listdir(engine.offload.swapper.dir)) if engine.offload.swapper is not None else 0}


def run_cases(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """`run_engine` for each case on this rank (for `run_distributed`: several cases, one launch)."""
    return [run_engine(rank, world, c) for c in cases]


def max_diff(a: dict, b: dict) -> float:
    """The largest elementwise difference between two name -> tensor dicts with the same names."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def trainable(model) -> dict:
    """A copy of every trainable parameter of `model`, by name (what an unsharded reference ends with)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class TwoHeads(nn.Module):
    """Blocks that a plan may skip, and a second head a plan may leave out of the loss."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(3))
        self.head_a = nn.Linear(DIM, VOCAB)
        self.head_b = nn.Linear(DIM, VOCAB)

    def forward(self, x, skip=()):
        h = self.emb(x)
        for i, b in enumerate(self.blocks):
            if i not in skip:
                h = b(h)
        return self.head_a(h), self.head_b(h)
