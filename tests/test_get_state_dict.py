"""`Accelerator.get_state_dict` loads strictly into a plain, unprepared model: a tied weight is listed
under each of its names (one tensor), as Accelerate+DDP and DeepSpeed return it (#25). Two gloo ranks,
stages 0 and 3 in one launch."""

from __future__ import annotations

import os

import pytest
import torch
from engine_cases import Case, TinyLM, batches, loss_fn, make_model_and_optim

from zerofit import Accelerator
from zerofit.config.schema import RunConfig, ZeroConfig
from zerofit.testing.distributed import run_distributed

STAGES = (0, 3)


def _state_dicts(rank, world, folder):
    out = {}
    for stage in STAGES:
        case = Case(stage=stage, steps=2)
        model, opt = make_model_and_optim(case)
        acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=stage, param_persistence_threshold=0)), cpu=True)
        model, opt = acc.prepare(model, opt)
        for x, y in batches(case):
            half = len(x) // world
            mine = slice(rank * half, (rank + 1) * half)
            acc.backward(loss_fn(model(x[mine]), y[mine]))
            opt.step()
            opt.zero_grad()
        state = acc.get_state_dict(model)  # {} off the main process
        shared = not state or state.get("head.weight") is state["emb.weight"]
        out[stage] = (state, shared, list(model.state_dict(keep_vars=True)), model.state_dict())
        if state:  # safetensors takes no two names over one storage: the tied weight goes once
            acc.save(state, os.path.join(folder, f"stage{stage}.safetensors"), safe_serialization=True)
    return out


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
        state, shared, keys, live = ranks[0][stage]
        assert ranks[1][stage][0] == {}, stage
        assert list(state) == keys, stage  # every key of the model's state dict, in its order
        assert shared, stage  # the tied weight is one tensor under both names
        fresh = TinyLM()
        fresh.load_state_dict(state, strict=True)
        assert fresh.head.weight is fresh.emb.weight  # still tied after the load
        loaded = fresh.state_dict()
        for name, value in live.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=f"stage {stage} {name}")
        assert not torch.equal(loaded["emb.weight"], TinyLM().emb.weight.detach()), stage  # it trained
