"""`Accelerator.get_state_dict` loads strictly into a plain, unprepared model: a tied weight is listed
under each of its names (one tensor), as Accelerate+DDP and DeepSpeed return it (#25). At stages 0-2
every rank gets the full dict (PEFT's example saves from every rank); at stage 3 the main process alone
holds full tensors and the others meta placeholders (#29). Weights come in the dtype the model had
when prepared ([Note: saved dtype]). Two gloo ranks, every case in one launch."""

from __future__ import annotations

import os

import pytest
import torch
from engine_cases import Case, TinyLM, batches, loss_fn, make_model_and_optim

from zerofit import Accelerator
from zerofit.config.schema import PrecisionConfig, RunConfig, ZeroConfig
from zerofit.testing.distributed import run_distributed

STAGES = (0, 1, 2, 3)
DTYPE_CASES = {  # name: (stage, dtype the model is built in, mixed precision)
    "bf16 model, bf16, stage 2": (2, torch.bfloat16, "bf16"),
    "fp32 model, bf16, stage 2": (2, torch.float32, "bf16"),
    "fp32 model, bf16, stage 0": (0, torch.float32, "bf16"),
    "bf16 model, bf16, stage 3": (3, torch.bfloat16, "bf16"),
    "fp32 model, bf16, stage 3": (3, torch.float32, "bf16"),
}


def _trained(rank, world, stage, dtype=torch.float32, precision="no"):
    case = Case(stage=stage, steps=2)
    model, opt = make_model_and_optim(case)
    model.to(dtype)
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=stage, param_persistence_threshold=0),
                                       precision=PrecisionConfig(mixed_precision=precision)), cpu=True)
    model, opt = acc.prepare(model, opt)
    for x, y in batches(case):
        half = len(x) // world
        mine = slice(rank * half, (rank + 1) * half)
        acc.backward(loss_fn(model(x[mine]), y[mine]))
        opt.step()
        opt.zero_grad()
    return acc, model


def _masters(acc, model):
    """The engine's fp32 masters, whole, on rank 0 (the exact values the saved weights round)."""
    engine = acc._prepared.engines[id(model)]
    out = {}
    for g in engine.groups:
        local = g.master if g.master is not None else g.param_shard
        parts = [torch.empty_like(local) for _ in range(acc.num_processes)] if g.placement.shard_world > 1 else None
        if parts:
            torch.distributed.all_gather(parts, local.contiguous())
        full = torch.cat(parts) if parts else local
        for name, off, n, shape in zip(g.names, g.layout.offsets, g.layout.numels, g.shapes):
            out[name] = full[off:off + n].view(shape).float().clone()
    return out


def _state_dicts(rank, world, folder):
    out = {}
    for stage in STAGES:
        acc, model = _trained(rank, world, stage)
        state = acc.get_state_dict(model)
        shared = state.get("head.weight") is state["emb.weight"]
        out[stage] = ({k: v.to("cpu") if v.device.type != "meta" else v for k, v in state.items()}, shared,
                      list(model.state_dict(keep_vars=True)), model.state_dict())
        # safetensors takes no two names over one storage: the tied weight goes once
        acc.save(state, os.path.join(folder, f"stage{stage}.safetensors"), safe_serialization=True)
    dtypes = {}
    for name, (stage, dtype, precision) in DTYPE_CASES.items():
        acc, model = _trained(rank, world, stage, dtype, precision)
        masters = _masters(acc, model)
        state = acc.get_state_dict(model)
        params = dict(model.named_parameters())
        dtypes[name] = {
            "dtypes": {str(v.dtype) for v in state.values()},
            "meta": {v.device.type == "meta" for v in state.values()},
            "off_master": [k for k, v in state.items() if k in masters and v.device.type != "meta" and not torch.equal(
                v, masters[k].to(v.dtype))],
            "live_views": [k for k, v in state.items() if k in params and v.device.type != "meta"
                           and v.data_ptr() == params[k].data_ptr()]}
    return out, dtypes


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    return run_distributed(_state_dicts, 2, str(folder), timeout=180), folder


def test_accelerator_save_writes_the_tied_state_dict_as_safetensors_once(launched):
    from safetensors.torch import load_file

    _, tmp_path = launched
    for stage in STAGES:
        saved = load_file(tmp_path / f"stage{stage}.safetensors")
        assert "emb.weight" in saved and "head.weight" not in saved, stage
        fresh = TinyLM()
        missing, unexpected = fresh.load_state_dict(saved, strict=False)
        assert missing == ["head.weight"] and not unexpected, stage  # tied to emb.weight, as from_pretrained ties it


def test_get_state_dict_loads_strictly_into_a_plain_tied_model(launched):
    ranks, _ = launched
    for stage in STAGES:
        state, shared, keys, live = ranks[0][0][stage]
        other = ranks[1][0][stage][0]
        assert list(other) == keys, stage
        if stage < 3:  # every rank: the same full dict
            for name, value in state.items():
                torch.testing.assert_close(other[name], value, rtol=0, atol=0, msg=f"stage {stage} {name}")
        else:  # the other rank: placeholders with the shapes and dtypes, no values
            assert all(v.device.type == "meta" for v in other.values())
            assert ({k: (v.shape, v.dtype) for k, v in other.items()}
                    == {k: (v.shape, v.dtype) for k, v in state.items()})
            assert other["head.weight"] is other["emb.weight"]
        assert list(state) == keys, stage  # every key of the model's state dict, in its order
        assert shared, stage  # the tied weight is one tensor under both names
        fresh = TinyLM()
        fresh.load_state_dict(state, strict=True)
        assert fresh.head.weight is fresh.emb.weight  # still tied after the load
        loaded = fresh.state_dict()
        for name, value in live.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=f"stage {stage} {name}")
        assert not torch.equal(loaded["emb.weight"], TinyLM().emb.weight.detach()), stage  # it trained


def test_weights_come_in_the_dtype_the_model_was_prepared_in(launched):
    """A bf16 model (from_pretrained(dtype=bf16)) gives bf16, the masters rounded; an fp32 model trained
    in bf16 gives its fp32 masters, gathered to every rank at stage 2; stage 3 only on rank 0."""
    ranks, _ = launched
    for name, (stage, dtype, _) in DTYPE_CASES.items():
        for rank in (0, 1):
            got = ranks[rank][1][name]
            if stage == 3 and rank == 1:
                assert got["meta"] == {True} and got["dtypes"] == {str(dtype)}, name
                continue
            assert got["meta"] == {False}, (name, rank)
            assert got["dtypes"] == {str(dtype)}, (name, rank)
            assert got["off_master"] == [], (name, rank)  # exactly the master (rounded to the model's dtype)
            assert got["live_views"] == [], (name, rank)  # a snapshot: later steps leave it as it is
