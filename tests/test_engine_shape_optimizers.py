"""Optimizers that read a parameter's shape, and several optimizers over one model, train as plain PyTorch.

2 gloo ranks on CPU against one plain-PyTorch process on the whole global batch (the mean of the ranks'
losses): torch's Adafactor, transformers' Adafactor (Trainer's `--optim adafactor` settings), and torch's
Muon over the matrices beside AdamW over the rest (two optimizers, one model, as torch documents Muon),
at stages 0-3, with optimizer offload (host-stepped) and with parameter offload. The whole-parameter
step computes each owner's update on the whole parameter with the same kernel, so the only difference
from the reference is the order in which the ranks' gradients are summed: within fp32 rounding. Muon's
Newton-Schulz iterations run in bf16, where that rounding of the gradient can move a rounding of the
iterate; its tolerance is looser (stated below). A checkpoint of Muon + AdamW taken after 3 steps
resumes to the same weights, at another stage.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from torch import nn

from zerofit.checkpoint import load_state, save_state
from zerofit.config.schema import OffloadConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.optimizer_set import OptimizerSet
from zerofit.errors import EngineError
from zerofit.testing.distributed import run_distributed

VOCAB, DIM, HID, SEQ = 29, 12, 37, 5  # sizes that no world size divides: parameters straddle shards
STEPS, BATCH = 5, 8
TOL = {"adafactor": 1e-6, "hf_adafactor": 1e-6, "muon_adamw": 1e-6}
"""Max |weight - reference| after STEPS steps, the reference summing the ranks' gradients in rank order as DDP
does. Against the whole batch's gradient (another summation order, ~1e-7 relative) Muon ends up to 1e-3
away: its Newton-Schulz iterations run in bf16, whose roundings that difference moves - at every stage alike."""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, HID), nn.Tanh(),
                                                  nn.Linear(HID, DIM)) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def build(kind: str):
    torch.manual_seed(0)
    model = Net()
    if kind == "adafactor":
        return model, torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.01)
    if kind == "hf_adafactor":
        from transformers.optimization import Adafactor

        return model, Adafactor(model.parameters(), lr=1e-2, scale_parameter=False, relative_step=False)
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "blocks" in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "blocks" in n)]
    return model, [torch.optim.Muon(matrices, lr=2e-2, weight_decay=0.1),
                   torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)]


def data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def set_ddp_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, world: int) -> None:
    """Each parameter's `.grad`: the mean of the gradients of `world` row blocks of the batch, summed in rank
    order, as DDP (and zerofit) compute it."""
    params = list(model.parameters())
    parts = [torch.autograd.grad(loss_of(model, xs, ys), params) for xs, ys in zip(x.chunk(world), y.chunk(world))]
    for i, p in enumerate(params):
        total = parts[0][i].clone()
        for part in parts[1:]:
            total += part[i]
        p.grad = total / world


def reference(kind: str, world: int = 1) -> dict[str, torch.Tensor]:
    """Plain PyTorch on the whole global batch; with `world`, its gradient is the mean of the `world` row
    blocks' gradients, summed in rank order, as DDP (and zerofit) compute it."""
    model, opt = build(kind)
    opts = opt if isinstance(opt, list) else [opt]
    for x, y in data():
        set_ddp_grads(model, x, y, world)
        for o in opts:
            o.step()
            o.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# (stage, offload_optimizer, offload_param); "cpu-device": GPU-stepped, the CPU standing in for the GPU; "nvme": the
# elementwise part's state in files (the per-parameter optimizer's state stays on the device either way)
CONFIGS = [
    (0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (3, "none", "none"),
    (2, "cpu", "none"), (3, "cpu", "cpu"), (2, "cpu-device", "none"), (3, "cpu-device", "cpu"), (3, "nvme", "cpu"),
]


def engine_for(kind: str, stage: int, offload: str, offload_param: str):
    model, opt = build(kind)
    optimizer = OptimizerSet(opt) if isinstance(opt, list) else opt
    device, _, step_on = offload.partition("-")
    nvme_path = tempfile.mkdtemp(prefix="zerofit-nvme-") if device == "nvme" else None
    zero = ZeroConfig(stage=stage, param_persistence_threshold=0,
                      offload_optimizer=OffloadConfig(device=device, step_on=step_on or "auto", nvme_path=nvme_path),
                      offload_param=OffloadConfig(device=offload_param))
    return model, ZeroEngine(model, optimizer, zero=zero)


def train(rank: int, world: int, kind: str, stage: int, offload: str, offload_param: str,
          steps=range(STEPS), save_to: str | None = None, load_from: str | None = None) -> dict[str, torch.Tensor]:
    model, engine = engine_for(kind, stage, offload, offload_param)
    if load_from is not None:
        load_state(load_from, engine)
    micro = BATCH // world
    for step, (x, y) in enumerate(data()):
        if step in steps:
            rows = slice(rank * micro, (rank + 1) * micro)
            engine.backward(loss_of(model, x[rows], y[rows]))
            engine.step()
    if save_to is not None:
        save_state(save_to, engine)
    return engine.named_full_tensors("master")


def run_all(rank: int, world: int, folder: str) -> dict:
    out = {(kind, *c): train(rank, world, kind, *c) for kind in TOL for c in CONFIGS}
    path = os.path.join(folder, "muon")  # saved at stage 2 after 3 steps, resumed at stage 3
    train(rank, world, "muon_adamw", 2, "none", "none", steps=range(3), save_to=path)
    out["resumed"] = train(rank, world, "muon_adamw", 3, "none", "none", steps=range(3, STEPS), load_from=path)
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_distributed(run_all, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


@pytest.mark.parametrize("kind", list(TOL))
def test_matches_plain_pytorch_at_every_stage_and_offload(world2, kind):
    ref = reference(kind, world=2)
    moved = max((ref[n] - p).abs().max().item() for n, p in build(kind)[0].named_parameters())
    assert moved > 1e-3  # the steps changed the weights: a no-op would not pass for equal
    for config in CONFIGS:
        for rank, result in enumerate(world2):
            got = result[(kind, *config)]
            worst = max((got[n] - ref[n]).abs().max().item() for n in ref)
            assert worst <= TOL[kind], f"{kind} stage/offload {config} rank {rank}: {worst:.3g} from PyTorch"


def test_one_process_steps_whole_parameters_bit_for_bit():
    for kind in TOL:  # the AdamW beside Muon runs fused under zerofit (the reference's kernel differs by ~6e-8)
        ref = reference(kind)
        got = train(0, 1, kind, 2, "none", "none")
        exact = {n for n, p in build(kind)[0].named_parameters()
                 if kind != "muon_adamw" or (p.ndim == 2 and "blocks" in n)}
        assert all(torch.equal(got[n], ref[n]) for n in exact), kind
        assert max((got[n] - ref[n]).abs().max().item() for n in ref) < 2e-7, kind


def test_muon_and_adamw_resume_from_a_checkpoint_at_another_stage(world2):
    for rank, result in enumerate(world2):
        full = result[("muon_adamw", 2, "none", "none")]
        worst = max((result["resumed"][n] - full[n]).abs().max().item() for n in full)
        assert worst <= TOL["muon_adamw"], f"rank {rank}: resumed run {worst:.3g} from the uninterrupted one"


def test_an_optimizer_zerofit_cannot_classify_is_refused_by_name():
    class Custom(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    model = Net()
    with pytest.raises(EngineError, match=r"Custom is unknown to zerofit.*declare_optimizer\(Custom, 'elementwise'\)"):
        ZeroEngine(model, Custom(model.parameters(), lr=0.1))
    with pytest.raises(EngineError, match="LBFGS is not supported by zerofit: it re-evaluates the loss"):
        ZeroEngine(model, torch.optim.LBFGS(model.parameters()))


def test_block_quantised_optimizers_are_refused_by_library():
    # bitsandbytes' and torchao's 8-bit optimizers keep per-block state that shards would cut into other blocks;
    # their classes are known by the library that defines them (no import of it needed)
    model = Net()
    for module in ("bitsandbytes.optim.adamw", "torchao.optim.adam"):
        body = {"__module__": module, "step": lambda self, closure=None: None}
        cls = type("AdamW8bit", (torch.optim.Optimizer,), body)
        with pytest.raises(EngineError, match=rf"{module}.AdamW8bit keeps block-quantised .* --optim adamw_torch"):
            ZeroEngine(model, cls(model.parameters(), {"lr": 0.1}))


def test_a_declared_optimizer_runs_its_way():
    from zerofit.engine.optimizer_kinds import declare_optimizer

    class Declared(torch.optim.Adafactor):
        def step(self, closure=None):
            return super().step(closure)

    declare_optimizer(Declared, "per_parameter")
    torch.manual_seed(0)
    model, ref_model = Net(), Net()
    ref_model.load_state_dict(model.state_dict())
    engine = ZeroEngine(model, Declared(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.Adafactor(ref_model.parameters(), lr=1e-2)
    for x, y in data()[:2]:
        engine.backward(loss_of(model, x, y))
        engine.step()
        loss_of(ref_model, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = engine.named_full_tensors("master")
    assert all(torch.equal(got[n], p) for n, p in ref_model.named_parameters())
