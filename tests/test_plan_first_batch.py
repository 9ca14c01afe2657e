"""[Note: planned without the batch] (zerofit.frontend.planning.first_batch): a script that passes no DataLoader to
prepare() leaves the batch shape unknown, so `stage: auto` plans the states alone; the first training
forward is checked before it runs. A pretrained 13 B at 8x512 on one H200 ran out of GPU memory in that
forward (#29). Here: a tiny GPT-2 whose activations at 8x512 dwarf its states, on CPU (host memory is the
budget) and against a GPU-like budget given directly."""

from __future__ import annotations

import pytest
import torch

from zerofit import Accelerator
from zerofit.config import config_from_dict
from zerofit.config.schema import AUTO, RunConfig, ZeroConfig
from zerofit.errors import ConfigError
from zerofit.frontend.planning.auto_plan import budget_for
from zerofit.frontend.planning.first_batch import FirstBatchCheck, batch_shape
from zerofit.plan.auto import choose
from zerofit.plan.choose import GIB, GPU_RESERVE_BYTES, HOST_BASELINE_BYTES, Budget

pytest.importorskip("transformers")


def _long_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=512,
                                      use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _checkpoints(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _needs(monkeypatch) -> dict[str, int]:
    monkeypatch.setenv("ZEROFIT_HOST_MEMORY_GIB", "1000")
    _, result = choose(RunConfig(zero=ZeroConfig(stage=AUTO)), _long_gpt2(), world=1, shape=(8, 512),
                       budget=budget_for(torch.device("cpu"), 1))
    return {e.setting.label: e.gpu_total + e.host_total + HOST_BASELINE_BYTES for e in result.estimates}


def test_batch_shape_reads_input_ids_or_the_first_token_tensor():
    ids = torch.zeros(3, 7, dtype=torch.long)
    assert batch_shape((), {"input_ids": ids}) == (3, 7)
    assert batch_shape((ids,), {}) == (3, 7)
    assert batch_shape((torch.zeros(3, 7),), {}) is None  # float features: no tokens


def test_an_unseen_batch_that_fits_only_with_checkpointing_turns_it_on(monkeypatch, capsys):
    need = _needs(monkeypatch)
    assert need["DDP (stage 0)"] - need["DDP (stage 0) + ckpt"] > 16 << 20  # activations decide
    budget = (need["DDP (stage 0)"] + need["DDP (stage 0) + ckpt"]) / 2 / 0.9  # only checkpointing fits
    monkeypatch.setenv("ZEROFIT_HOST_MEMORY_GIB", repr(budget / GIB))
    ids = torch.randint(0, 64, (8, 512), generator=torch.Generator().manual_seed(1))
    reference = _long_gpt2()
    expected = reference(input_ids=ids, labels=ids).loss

    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=AUTO)), cpu=True)
    model = _long_gpt2()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # no DataLoader
    assert "activations unknown" in capsys.readouterr().out and not _checkpoints(model)
    with torch.no_grad():
        model(input_ids=ids[:1, :8])  # evaluation first: not what was planned, not checked
    assert not _checkpoints(model)
    loss = model(input_ids=ids, labels=ids).loss
    assert _checkpoints(model) and acc.config.zero.gradient_checkpointing is True
    assert "activation checkpointing is on from this forward" in capsys.readouterr().out
    assert torch.equal(loss.detach(), expected.detach())
    acc.backward(loss)
    opt.step()


def test_an_unseen_batch_that_cannot_fit_is_an_error_naming_the_fix_before_the_forward(monkeypatch):
    need = _needs(monkeypatch)
    budget = (need["DDP (stage 0) + ckpt"] - (8 << 20)) / 0.9  # the states fit, no activations do
    monkeypatch.setenv("ZEROFIT_HOST_MEMORY_GIB", repr(budget / GIB))
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=AUTO)), cpu=True)
    model = _long_gpt2()
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.zeros(8, 512, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"first training batch is 8x512 tokens, which prepare\(\) did not see "
                                          r"\(no DataLoader.*No setting fits this batch.*lower the batch size"):
        model(input_ids=ids, labels=ids)


def test_the_error_names_the_setting_the_planner_chooses_for_the_batch():
    """A GPU-like budget, judged directly: stage 0 planned without activations, the batch needs more; with
    checkpointing written off, the planner picks an offloading setting for this batch."""
    config = config_from_dict({"zero": {"stage": "auto", "gradient_checkpointing": False}})  # offload open
    model = _long_gpt2()
    roomy = Budget(gpu_bytes=64 * GIB, host_bytes=64 * GIB)
    _, planned = choose(config, model, world=1, shape=None, budget=roomy)
    _, traced = choose(config, model, world=1, shape=(8, 512), budget=roomy)
    by = {e.setting.label.split(" ")[0] + ("+off" if e.setting.offload_optimizer != "none" else ""): e
          for e in traced.estimates}
    ddp, offload = by["DDP"], min((e for e in traced.estimates if e.setting.offload_optimizer != "none"),
                                  key=lambda e: e.gpu_total)
    assert offload.gpu_total < ddp.gpu_total
    # offload fits with the batch, DDP not
    gpu = int(((offload.gpu_total + ddp.gpu_total) / 2 + GPU_RESERVE_BYTES) / 0.9)
    budget = Budget(gpu_bytes=gpu, host_bytes=64 * GIB)
    _, planned = choose(config, model, world=1, shape=None, budget=budget)
    assert planned.choice.setting.label.startswith("DDP")  # states alone: DDP fits
    check = FirstBatchCheck(config, planned, budget, world=1, device=torch.device("cpu"), is_main=True,
                            spell=str, on_checkpointing=lambda: None)
    with pytest.raises(ConfigError, match=r"planned DDP \(stage 0\) without activations.*For this batch the "
                                          r"planner chooses .*opt cpu.*pass the training DataLoader to prepare"):
        check.judge(model, (8, 512))
    check.judge(model, (1, 8))  # a small batch fits as planned: nothing happens
