"""A loop that calls `loss.backward()` itself trains as plain PyTorch + DDP does (gloo, 2 ranks, CPU).

Every configuration - stages 0-3, optimizer offload to the CPU (host-stepped) at stages 2 and 3,
parameter offload at stage 3, fp32 and bf16 - runs these loops through the Accelerator, each compared
with an unsharded single-process reference running the same `loss.backward()` loop on the whole
global batch (the micro-batches of both ranks at once; their mean loss is what DDP's averaged
gradient is the gradient of):
- `plain`: `loss.backward()`, one micro-step per step;
- `accumulate`: under `accelerator.accumulate()` with gradient_accumulation_steps 2 - the micro-steps'
  gradients add up undivided (the script did not divide; Accelerate + DDP sums them too);
- `no_sync`: accumulation 1, the first micro-step under `accelerator.no_sync()`;
- `divided` and `accelerator`: `(loss / 2).backward()` under accumulate() equals
  `accelerator.backward(loss)`, which divides by the 2 steps itself (where the two coincide);
- `several` (no offload): `torch.autograd.grad` of the logits first (harmless), then the loss's
  backward in two halves, the first with retain_graph;
- `two_models` (stages 2 and 3): the loss goes through a second, frozen, prepared model;
- `checkpointed` (fp32): every block under reentrant activation checkpointing, whose backward runs
  the blocks' gradients in nested backward passes.
No loop warns that a step had no backward. fp32 (AdamW) matches to 2e-6 (the order of float sums);
bf16 compute (SGD, whose update is proportional to the gradient: under AdamW a tiny gradient whose
sign bf16 flips moves its weight by 2 lr) to 2e-3 against the fp32 reference, a tenth or less of what
the three steps move the weights; the `divided` and `accelerator` loops to 1e-6 of each other.
The engine used on its own (no Accelerator, accumulation 2) counts the micro-steps of plain backward
calls itself. fp16 with dynamic loss scaling: the update equals the fp32 reference to 2e-3, the first
step warns once that the plain backward was not loss-scaled, and a step whose gradients overflow is
still skipped on every rank.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from engine_cases import SEQ, VOCAB, TinyLM, loss_fn, max_diff
from torch.utils.checkpoint import checkpoint

from zerofit import Accelerator
from zerofit.config.schema import LossScaleConfig, OffloadConfig, PrecisionConfig, RunConfig, ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.errors import EngineError
from zerofit.testing.distributed import run_distributed

STEPS, MICRO = 3, 2  # micro-batch per rank per micro-step
FP32_TOL, BF16_TOL, FP16_TOL = 2e-6, 2e-3, 2e-3
CONFIGS = [(0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (3, "none", "none"),
           (2, "cpu", "none"), (3, "cpu", "cpu")]  # (stage, offload_optimizer, offload_param)
LOOPS = ("plain", "accumulate", "no_sync", "divided", "accelerator", "several", "two_models", "checkpointed")


def accumulation(loop: str) -> int:
    """gradient_accumulation_steps given to the Accelerator."""
    return 2 if loop in ("accumulate", "divided", "accelerator") else 1


def micro_steps(loop: str) -> int:
    """Micro-steps (backward calls on new data) per optimizer step."""
    return 2 if loop in ("accumulate", "divided", "accelerator", "no_sync") else 1


def data(world: int, loop: str):
    g = torch.Generator().manual_seed(11)
    rows = MICRO * world * micro_steps(loop)
    return [(torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g))
            for _ in range(STEPS)]


class CheckpointedLM(TinyLM):
    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=True)
        return self.head(h)


def model_and_optim(sgd: bool = False, loop: str = "plain"):
    torch.manual_seed(0)
    model = CheckpointedLM() if loop == "checkpointed" else TinyLM()
    if sgd:  # an update proportional to the gradient: a wrongly scaled gradient shows
        return model, torch.optim.SGD(model.parameters(), lr=0.1)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def judge():
    torch.manual_seed(5)
    return torch.nn.Linear(VOCAB, VOCAB).requires_grad_(False)


def reference(world: int, loop: str, sgd: bool = False, skip_step: int = -1) -> dict[str, torch.Tensor]:
    """One process, the whole global batch of each micro-step, the same loss.backward() loop."""
    model, opt = model_and_optim(sgd, loop)
    head = judge() if loop == "two_models" else torch.nn.Identity()
    for step, (x, y) in enumerate(data(world, loop)):
        for xs, ys in zip(x.chunk(micro_steps(loop)), y.chunk(micro_steps(loop))):
            loss = loss_fn(head(model(xs)), ys)
            (loss / 2 if loop in ("divided", "accelerator") else loss).backward()
        if step != skip_step:
            opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(rank: int, world: int, loop: str, stage: int, offload: str, offload_param: str, precision: str = "no",
          sgd: bool = False, overflow_step: int = -1) -> dict:
    zero = ZeroConfig(stage=stage, param_persistence_threshold=0, offload_optimizer=OffloadConfig(device=offload),
                      offload_param=OffloadConfig(device=offload_param))
    config = RunConfig(zero=zero, precision=PrecisionConfig(mixed_precision=precision,
                                                            loss_scale=LossScaleConfig(initial_scale_power=12)))
    acc = Accelerator(gradient_accumulation_steps=accumulation(loop), config=config)
    model, opt = model_and_optim(sgd, loop)
    model, opt = acc.prepare(model, opt)
    head = acc.prepare(judge()) if loop == "two_models" else torch.nn.Identity()
    skipped = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(data(world, loop)):
            for k in range(micro_steps(loop)):
                start = (k * world + rank) * MICRO  # micro-step k of every rank, back to back
                xs, ys = x[start:start + MICRO], y[start:start + MICRO]
                with acc.accumulate(model):
                    logits = head(model(xs))
                    loss = loss_fn(logits, ys)
                    if step == overflow_step and rank == 1:
                        loss = loss * float("inf")
                    if loop == "accelerator":
                        acc.backward(loss)
                    elif loop == "divided":
                        (loss / 2).backward()
                    elif loop == "no_sync" and k == 0:
                        with acc.no_sync(model):
                            loss.backward()
                    elif loop == "several":
                        torch.autograd.grad(loss, logits, retain_graph=True)  # accumulates nothing
                        (loss / 2).backward(retain_graph=True)
                        (loss / 2).backward()
                    else:
                        loss.backward()
                    if loop != "no_sync" or k == 1:
                        opt.step()
                        opt.zero_grad()
                        if acc.sync_gradients:
                            skipped.append(acc.optimizer_step_was_skipped)
    engine = acc._prepared.trained_engine()
    params = {k: v.cpu() for k, v in engine.named_full_tensors("master").items()}
    return {"params": params, "warnings": [str(w.message) for w in caught], "skipped": skipped,
            "backwards": engine.units[0].backward_pass}


def train_engine_alone(rank: int, world: int, stage: int) -> dict:
    """ZeroEngine without an Accelerator, accumulation 2: `at_boundary` follows the plain backward calls."""
    model, opt = model_and_optim()
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=stage, param_persistence_threshold=0),
                        gradient_accumulation_steps=2, device=torch.device("cpu"))
    boundaries = []
    for x, y in data(world, "accumulate"):
        for k in range(2):
            start = (k * world + rank) * MICRO
            loss_fn(model(x[start:start + MICRO]), y[start:start + MICRO]).backward()
            boundaries.append(engine.at_boundary)
            if engine.at_boundary:
                engine.step()
    return {"params": engine.named_full_tensors("master"), "boundaries": boundaries}


def runs() -> list[tuple]:
    out = []
    for stage, offload, offload_param in CONFIGS:
        for precision in ("no", "bf16"):
            for loop in LOOPS:
                if loop == "several" and offload != "none":
                    continue  # a second backward after an early host step is refused (test_engine_torch_semantics)
                if loop == "two_models" and (stage < 2 or offload != "none" or precision != "no"):
                    continue
                if loop == "checkpointed" and (stage == 1 or precision != "no"):
                    continue
                out.append((loop, stage, offload, offload_param, precision))
    return out


FP16 = [("plain", 2, "none", "none"), ("plain", 3, "cpu", "cpu"), ("accelerator", 2, "none", "none")]


def run_all(rank: int, world: int) -> dict:
    out = {key: train(rank, world, *key, sgd=key[-1] != "no") for key in runs()}
    for key in FP16:
        out[("fp16", *key)] = train(rank, world, *key, precision="fp16", sgd=True)
    out["engine"] = {stage: train_engine_alone(rank, world, stage) for stage in (0, 3)}
    out["overflow"] = train(rank, world, "plain", 2, "none", "none", precision="fp16", sgd=True, overflow_step=1)
    return out


@pytest.fixture(scope="module")
def world2():
    return run_distributed(run_all, 2, timeout=300)


@pytest.mark.parametrize("key", runs(), ids=lambda k: "-".join(map(str, k)))
def test_plain_backward_trains_as_pytorch_does(world2, key):
    loop, precision = key[0], key[-1]
    r0, r1 = world2[0][key], world2[1][key]
    assert not [w for w in r0["warnings"] + r1["warnings"] if "no backward" in w]
    assert max_diff(r0["params"], r1["params"]) == 0.0  # every rank holds the same model
    # one engine backward per backward call: none for autograd.grad, one for a reentrant checkpoint's nesting
    assert r0["backwards"] == r1["backwards"] == STEPS * micro_steps(loop) * (2 if loop == "several" else 1)
    want = {n: p for n, p in reference(2, loop, sgd=precision != "no").items() if n in r0["params"]}
    start = {n: p.detach() for n, p in model_and_optim()[0].named_parameters() if n in want}
    tol = FP32_TOL if precision == "no" else BF16_TOL
    assert max_diff(r0["params"], want) < tol < max_diff(start, want) / 10  # and the weights moved


@pytest.mark.parametrize("stage,offload,offload_param,precision",
                         sorted({k[1:] for k in runs() if k[0] == "divided"}), ids=str)
def test_a_divided_plain_backward_equals_accelerator_backward(world2, stage, offload, offload_param, precision):
    divided = world2[0][("divided", stage, offload, offload_param, precision)]["params"]
    explicit = world2[0][("accelerator", stage, offload, offload_param, precision)]["params"]
    assert max_diff(divided, explicit) < 1e-6


@pytest.mark.parametrize("key", FP16, ids=lambda k: "-".join(map(str, k)))
def test_fp16_plain_backward_gives_the_scaled_update_and_warns_once(world2, key):
    r0, r1 = world2[0][("fp16", *key)], world2[1][("fp16", *key)]
    assert max_diff(r0["params"], r1["params"]) == 0.0
    want = reference(2, key[0], sgd=True)
    assert max_diff(r0["params"], {n: want[n] for n in r0["params"]}) < FP16_TOL
    for r in (r0, r1):
        unscaled = [w for w in r["warnings"] if "not multiplied by the loss scale" in w]
        assert len(unscaled) == (1 if key[0] == "plain" else 0)


def test_fp16_overflow_of_a_plain_backward_skips_the_step_on_every_rank(world2):
    r0, r1 = world2[0]["overflow"], world2[1]["overflow"]
    assert r0["skipped"] == r1["skipped"] == [False, True, False]
    want = reference(2, "plain", sgd=True, skip_step=1)
    assert max_diff(r0["params"], {n: want[n] for n in r0["params"]}) < FP16_TOL


@pytest.mark.parametrize("stage", [0, 3])
def test_the_engine_alone_counts_plain_backward_micro_steps(world2, stage):
    got = world2[0]["engine"][stage]
    assert got["boundaries"] == [False, True] * STEPS
    want = reference(2, "accumulate")
    assert max_diff(got["params"], {n: want[n] for n in got["params"]}) < FP32_TOL


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises the first time (a script that catches it and carries on)."""

    failed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if not _FailOnce.failed:
            _FailOnce.failed = True
            raise RuntimeError("injected failure in backward")
        return grad


class _FailingBetween(torch.nn.Module):
    def forward(self, x):
        return _FailOnce.apply(x)


def test_a_plain_backward_that_raised_is_thrown_away_by_zero_grad_and_step_refuses_it():
    torch.manual_seed(0)
    # the failure sits between two layers: the engine's backward is open (the head's gradients arrived) when it raises
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), _FailingBetween(), torch.nn.Linear(6, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Identity(), torch.nn.Linear(6, 3))
    ref.load_state_dict(model.state_dict())
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), zero=ZeroConfig(stage=2))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    _FailOnce.failed = False
    with pytest.raises(RuntimeError, match="injected"):
        model(x).sum().backward()
    with pytest.raises(EngineError, match="after a backward that raised before it finished"):
        engine.step()
    engine.zero_grad()  # throws the partial window away
    for _ in range(2):  # then a plain backward is noticed and trains as PyTorch
        model(x).pow(2).sum().backward()
        engine.step()
        ref(x).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = engine.named_full_tensors("master")
    assert all(torch.allclose(got[n], p, atol=1e-7, rtol=0) for n, p in ref.named_parameters())
