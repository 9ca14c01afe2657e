"""Several optimizers over one model through `Accelerator.prepare`, as torch documents Muon beside AdamW.

2 gloo ranks on CPU, each optimizer with an LR scheduler stepped after it and the gradient norm clipped
by the Accelerator, against one plain-PyTorch process on the same global batch (its gradient the mean
of the ranks' row blocks, summed in rank order as DDP does): stages 0-3 and optimizer offload; a
checkpoint saved at stage 2 with both optimizers resumes at stage 3 to the uninterrupted run's weights;
a script that leaves one optimizer unstepped in a window is refused at the next step, naming it.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_engine_shape_optimizers import BATCH, STEPS, build, data, loss_of, set_ddp_grads

from zerofit import Accelerator
from zerofit.config.schema import OffloadConfig, RunConfig, ZeroConfig
from zerofit.testing.distributed import run_distributed

CLIP = 0.5
TOL = 1e-6


def _schedules(opts):
    return [torch.optim.lr_scheduler.LambdaLR(o, lambda s, k=k: 1.0 / (1 + s + k)) for k, o in enumerate(opts)]


def reference(world: int = 2):
    """Plain PyTorch; each scheduler steps `world` times per optimizer step, as Accelerate's wrapper does."""
    model, opts = build("muon_adamw")
    scheds = _schedules(opts)
    for x, y in data():
        set_ddp_grads(model, x, y, world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for o, s in zip(opts, scheds):
            o.step()
            for _ in range(world):
                s.step()
            o.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, [s.get_last_lr() for s in scheds]


def train(rank: int, world: int, stage: int, offload: str, steps=range(STEPS), save_to: str | None = None,
          load_from: str | None = None, skip_adamw_at: int = -1):
    device, _, step_on = offload.partition("-")  # "cpu-device": GPU-stepped, the CPU standing in for the GPU
    config = RunConfig(zero=ZeroConfig(stage=stage, param_persistence_threshold=0,
                                       offload_optimizer=OffloadConfig(device=device, step_on=step_on or "auto")))
    acc = Accelerator(config=config)
    model, opts = build("muon_adamw")
    scheds = _schedules(opts)
    model, muon, adamw, s_muon, s_adamw = acc.prepare(model, *opts, *scheds)
    if load_from is not None:
        acc.load_state(load_from)
    micro = BATCH // world
    for step, (x, y) in enumerate(data()):
        if step not in steps:
            continue
        rows = slice(rank * micro, (rank + 1) * micro)
        acc.backward(loss_of(model, x[rows], y[rows]))
        acc.clip_grad_norm_(model.parameters(), CLIP)
        for opt, sched in ((muon, s_muon), (adamw, s_adamw)):
            if opt is adamw and step == skip_adamw_at:
                continue
            opt.step()
            sched.step()
            opt.zero_grad()
    if save_to is not None:
        acc.save_state(save_to)
    return acc._prepared.engine_of(model).named_full_tensors("master"), [s.get_last_lr() for s in (s_muon, s_adamw)]


CONFIGS = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "cpu-device")]


def run_all(rank: int, world: int, folder: str) -> dict:
    out = {config: train(rank, world, *config) for config in CONFIGS}
    path = os.path.join(folder, "both")
    train(rank, world, 2, "none", steps=range(3), save_to=path)
    out["resumed"] = train(rank, world, 3, "none", steps=range(3, STEPS), load_from=path)
    try:
        train(rank, world, 2, "none", skip_adamw_at=1)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_distributed(run_all, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


def test_muon_beside_adamw_matches_plain_pytorch_at_every_stage(world2):
    ref, ref_lrs = reference()
    for config in CONFIGS:
        for rank, result in enumerate(world2):
            got, lrs = result[config]
            worst = max((got[n] - ref[n]).abs().max().item() for n in ref)
            assert worst <= TOL, f"stage/offload {config} rank {rank}: {worst:.3g} from PyTorch"
            assert lrs == ref_lrs  # each scheduler moved with its optimizer


def test_both_optimizers_resume_from_a_checkpoint_at_another_stage(world2):
    for rank, result in enumerate(world2):
        full, _ = result[(2, "none")]
        resumed, lrs = result["resumed"]
        worst = max((resumed[n] - full[n]).abs().max().item() for n in full)
        assert worst <= TOL, f"rank {rank}: the resumed run ends {worst:.3g} from the uninterrupted one"
        assert lrs == result[(2, "none")][1]


def test_an_optimizer_left_unstepped_in_a_window_is_refused_by_name(world2):
    for result in world2:
        assert result["refused"] is not None
        assert "AdamW #1 did not call step()" in result["refused"]

