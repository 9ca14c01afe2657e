"""A run storing its optimizer state in 8 bits at ZeRO-2 on 2 ranks, saved after 3 steps, resumes at ZeRO-3 on 2
ranks exactly as the uninterrupted run goes on, and as fp32 or bf16 state exactly as a run handed the same
state widened and narrowed once; on 1 rank (another summation order of the gradients) within TOL. The 8-bit state
resumes the same way streamed through the device, host-stepped by the CPU optimizer and homed in NVMe files, and
what is saved from those files loads as it was."""

from __future__ import annotations

import os

import pytest
import torch
from test_checkpoint_support import assemble, build, owned_state, train

from zerofit.checkpoint import load_state, save_state
from zerofit.engine.state_codec import Codec, Stored
from zerofit.testing.distributed import run_distributed

FORMS = ("8bit", "fp32", "bf16")
HOMES = {"8bit host": dict(step_on="host"), "8bit nvme host": dict(step_on="host"),
         "8bit nvme streamed": dict(step_on="device", chunk=64)}
"""8-bit state resumed host-stepped and in NVMe files (2 ranks): each must go on as the uninterrupted run."""
SAVED, RESUMED = range(3), range(3, 6)
SCALE = ".absmax"
TOL = 1e-4
"""Max |master - master of the 2-rank run| after 3 steps on 1 rank: the gradients are summed in another order
(see TOL in tests/test_engine_state_dtype.py)."""


def handed_over(src_opt, dst_engine, form: str) -> None:
    """Give `dst_engine` (same stage and world as the run of `src_opt`, so the same pieces) the masters and the
    state of that run, the state widened to fp32 and stored as `form` once: what a load across forms does."""
    dst_opt = dst_engine.optimizer
    codec = Codec(form)
    src = [t for g in src_opt.param_groups for t in g["params"]]
    dst = [t for g in dst_opt.param_groups for t in g["params"]]
    with torch.no_grad():
        for s, d in zip(src, dst, strict=True):
            d.copy_(s)
            state = {}
            for key, value in src_opt.state.get(s, {}).items():
                if key.endswith(SCALE) or not (isinstance(value, torch.Tensor) and value.ndim == 1):
                    if not key.endswith(SCALE):
                        state[key] = value.clone() if isinstance(value, torch.Tensor) else value
                    continue
                wide = torch.empty(value.numel())
                Codec("8bit").decode(Stored(value, src_opt.state[s][key + SCALE]), wide, key)
                stored = codec.empty(wide.numel(), "cpu")
                codec.encode(wide, stored, key)
                state[key] = stored.codes if codec.narrow else wide
                if stored.scale is not None:
                    state[key + SCALE] = stored.scale
            dst_opt.state[d] = state
    dst_engine.refresh_params()


def save_and_go_on(rank, world, root):
    case, model, opt, engine = build(2, freeze=True, optimizer_state="8bit")
    train(engine, model, case, rank, world, SAVED)
    engine.settle()
    dtypes = sorted({(k, str(v.dtype)) for s in opt.state.values() for k, v in s.items()
                     if isinstance(v, torch.Tensor) and v.ndim == 1})
    save_state(os.path.join(root, "s8"), engine, update_latest=False)
    out = {"dtypes": dtypes}
    for form in FORMS[1:]:
        c, m, _, other = build(2, freeze=True, optimizer_state=form)  # the same frozen base
        handed_over(opt, other, form)
        out[form] = (train(other, m, c, rank, world, RESUMED), owned_state(other, rank))
    out["8bit"] = (train(engine, model, case, rank, world, RESUMED), owned_state(engine, rank))
    return out


def resume(rank, world, root):
    out = {}
    for form in FORMS:
        case, model, _, engine = build(3, freeze=True, perturb=0.5, optimizer_state=form)
        load_state(os.path.join(root, "s8"), engine)
        out[form] = (train(engine, model, case, rank, world, RESUMED), owned_state(engine, rank))
    if world > 1:  # the state streamed to the device for its step (the CPU standing in), parameters offloaded
        case, model, _, engine = build(3, freeze=True, perturb=0.5, optimizer_state="8bit", offload=True,
                                       step_on="device", chunk=64)
        load_state(os.path.join(root, "s8"), engine)
        out["8bit streamed"] = (train(engine, model, case, rank, world, RESUMED), owned_state(engine, rank))
        # host-stepped by the CPU optimizer, and homed in NVMe files (read by the CPU optimizer or streamed)
        nvme = os.path.join(root, "nvme")
        os.makedirs(nvme, exist_ok=True)
        for name, where in HOMES.items():
            case, model, _, engine = build(3, freeze=True, perturb=0.5, optimizer_state="8bit", offload=True,
                                           **where, nvme_path=nvme if "nvme" in name else None)
            load_state(os.path.join(root, "s8"), engine)
            out[name] = (train(engine, model, case, rank, world, RESUMED), owned_state(engine, rank))
        # saved from the NVMe files (settle reads them into memory) and loaded on the device: the same state
        save_state(os.path.join(root, "from-nvme"), engine, update_latest=False)
        _, _, _, device = build(3, freeze=True, perturb=0.5, optimizer_state="8bit")
        load_state(os.path.join(root, "from-nvme"), device)
        out["from nvme"] = owned_state(device, rank)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    going_on = run_distributed(save_and_go_on, 2, root)
    return going_on, run_distributed(resume, 2, root), run_distributed(resume, 1, root)


def masters(per_rank, form):
    return {k: v for k, v in assemble([r[form][1] for r in per_rank]).items() if k[1] == "master"}


def test_resume_equals_going_on(runs):
    going_on, two, one = runs
    assert ("exp_avg", "torch.uint8") in going_on[0]["dtypes"] and ("exp_avg.absmax", "torch.float32") in \
        going_on[0]["dtypes"]  # the run stored its state in 8 bits
    for form, resumed in [*((f, f) for f in FORMS), ("8bit", "8bit streamed"), *(("8bit", h) for h in HOMES)]:
        want_loss, got_loss = going_on[0][form][0], two[0][resumed][0]
        assert got_loss == want_loss, (resumed, got_loss, want_loss)
        want = assemble([r[form][1] for r in going_on])
        got = assemble([r[resumed][1] for r in two])
        assert sorted(got) == sorted(want), resumed
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), (resumed, key)
        # not vacuous: the forms went different ways after the load
        if form != "8bit":
            assert not torch.equal(got[("emb.weight", "master")], masters(going_on, "8bit")[("emb.weight", "master")])


def test_state_saved_from_nvme_files_loads_as_it_was(runs):
    _, two, _ = runs
    saved = assemble([r["8bit nvme streamed"][1] for r in two])
    loaded = assemble([r["from nvme"] for r in two])
    assert sorted(saved) == sorted(loaded) and any(key == "exp_avg.absmax" for _, key in saved)
    for key, value in saved.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key


def test_resume_on_one_rank_within_tol(runs):
    going_on, _, one = runs
    for form in FORMS:
        ones = masters(one, form)
        for key, value in masters(going_on, form).items():
            assert (ones[key] - value).abs().max().item() < TOL, (form, key)
