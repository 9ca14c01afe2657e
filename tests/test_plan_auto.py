"""`stage: auto` / offload `auto`: accepted by every config format, resolved by the planner at prepare()."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from zerofit import Accelerator
from zerofit.config import load_config
from zerofit.config.schema import AUTO, OffloadConfig, RunConfig, ZeroConfig
from zerofit.errors import ConfigError
from zerofit.frontend.planning.auto_plan import budget_for
from zerofit.plan.activations import checkpointing_switch
from zerofit.plan.auto import candidates, choose
from zerofit.plan.choose import HOST_BASELINE_BYTES
from zerofit.testing.distributed import run_distributed

GIB = 1 << 30


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_zerofit_yaml_auto_stage_opens_unwritten_offload(tmp_path):
    cfg = load_config(_write(tmp_path, "z.yaml", "zero:\n  stage: auto\n  offload_param:\n    device: none\n"))
    assert cfg.zero.stage is AUTO and cfg.zero.offload_optimizer.device is AUTO
    assert cfg.zero.offload_param.device == "none"  # written: kept


def test_deepspeed_json_auto(tmp_path):
    planned = {"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"}},
               "train_micro_batch_size_per_gpu": "auto"}
    cfg = load_config(_write(tmp_path, "ds.json", json.dumps(planned)))
    assert (cfg.zero.stage, cfg.zero.offload_optimizer.device, cfg.zero.offload_param.device) == (AUTO, AUTO, AUTO)
    # with a written stage, an "auto" offload device keeps Accelerate's launch-time meaning: none
    fixed = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "auto"}},
             "train_micro_batch_size_per_gpu": "auto"}
    assert load_config(_write(tmp_path, "ds2.json", json.dumps(fixed))).zero.offload_optimizer.device == "none"


def test_accelerate_yaml_auto(tmp_path):
    cfg = load_config(_write(tmp_path, "acc.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                                   "  zero_stage: auto\n  offload_optimizer_device: auto\n"))
    assert cfg.zero.stage is AUTO and cfg.zero.offload_optimizer.device is AUTO


@pytest.mark.parametrize(("name", "text", "match"), [
    ("z.yaml", "zero:\n  stage: fastest\n",
     r"zero\.stage must be a whole number \(got 'fastest'\).*or \"auto\" to let zerofit fill it"),
    ("acc.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 5\n",
     r"deepspeed_config\.zero_stage must be 0, 1, 2 or 3 \(got 5\).*or \"auto\""),
    ("ds.json", json.dumps({"zero_optimization": {"stage": "auto", "offload_param": {"device": "gpu"}}}),
     r"zero_optimization\.offload_param\.device must be one of 'none', 'cpu', 'nvme' \(got 'gpu'\).*\"auto\""),
])
def test_bad_values_name_key_value_and_fix(tmp_path, name, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(_write(tmp_path, name, text))


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=False))


def _loader():
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(0, 64, (16,), generator=g)} for _ in range(16)]
    return DataLoader(rows, batch_size=4)


AUTO_ZERO = ZeroConfig(stage=AUTO, offload_optimizer=OffloadConfig(device=AUTO),
                       offload_param=OffloadConfig(device=AUTO))


def test_candidates_carry_the_written_offload_ratio():
    zero = ZeroConfig(stage=AUTO, offload_optimizer=OffloadConfig(device=AUTO, ratio=0.25),
                      offload_param=OffloadConfig(device="none"))
    settings = candidates(RunConfig(zero=zero), 2, False)
    assert {s.offload_ratio for s in settings if s.offload_optimizer == "cpu"} == {0.25}
    assert {s.offload_ratio for s in settings if s.offload_optimizer == "none"} == {1.0}


def test_auto_resolves_on_cpu_and_draws_no_random_numbers(monkeypatch, capsys):
    monkeypatch.setenv("ZEROFIT_HOST_MEMORY_GIB", "64")
    acc = Accelerator(config=RunConfig(zero=AUTO_ZERO), cpu=True)
    model = _tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = torch.get_rng_state()
    model, opt, dl = acc.prepare(model, opt, _loader())
    assert torch.equal(before, torch.get_rng_state())
    assert acc.config.zero.stage == 0 and acc.config.zero.offload_optimizer.device == "none"
    assert "auto -> DDP (stage 0): the fastest setting that fits" in capsys.readouterr().out


def _needs(world: int) -> dict[str, int]:
    """Every candidate's host need per machine (2 ranks share it), from the planner itself."""
    _, result = choose(RunConfig(zero=AUTO_ZERO), _tiny_gpt2(), world=world, shape=(4, 16),
                       budget=budget_for(torch.device("cpu"), world))
    return {e.setting.label: 2 * (e.gpu_total + e.host_total + HOST_BASELINE_BYTES) for e in result.estimates}


def _train_auto(rank: int, world: int):
    acc = Accelerator(config=RunConfig(zero=AUTO_ZERO))
    model = _tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, dl = acc.prepare(model, opt, _loader())
    for batch in dl:
        with acc.accumulate(model):
            acc.backward(model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss)
            opt.step()
            opt.zero_grad()
    z = acc.config.zero
    return z.stage, z.offload_optimizer.device, acc._prepared.trained_engine().policy.stage


@pytest.mark.slow  # two gloo ranks tracing the model
def test_two_ranks_pick_the_same_fastest_fitting_stage(monkeypatch):
    monkeypatch.setenv("ZEROFIT_HOST_MEMORY_GIB", "1000")
    needs = _needs(2)
    assert needs["DDP (stage 0)"] > needs["ZeRO-1"]  # sharding the optimizer saves memory on 2 ranks
    budget = (needs["DDP (stage 0)"] + needs["ZeRO-1"]) / 2 / 0.9  # stage 0 misses, ZeRO-1 fits
    monkeypatch.setenv("ZEROFIT_HOST_MEMORY_GIB", repr(budget / GIB))
    assert run_distributed(_train_auto, 2, timeout=120) == [(1, "none", 1), (1, "none", 1)]


def test_the_allowed_gpu_memory_takes_a_device_without_an_index(monkeypatch):
    """`torch.device("cuda")` has no index, and torch's fraction query refuses it: the current device is asked."""
    from types import SimpleNamespace

    from zerofit.plan.choose import allowed_gpu_bytes

    def fraction(device):
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        return 0.25

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=96 * GIB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for device in (torch.device("cuda"), "cuda", torch.device("cuda", 0), 0):
        assert allowed_gpu_bytes(device) == 24 * GIB


# -- activation checkpointing as a planned choice (zero.gradient_checkpointing) -----------------------

def _checkpoints(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _long_gpt2():
    """A tiny GPT-2 whose activations at 8 x 512 tokens dwarf its states: checkpointing decides what fits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=512,
                                      use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _long_loader():
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(0, 64, (512,), generator=g)} for _ in range(8)]
    return DataLoader(rows, batch_size=8)


@pytest.mark.parametrize(("written", "has", "expected"), [
    (None, False, (False, True)), (AUTO, False, (False, True)), (True, False, (True,)), (False, False, (False,)),
    (None, True, (True,)), (False, True, (True,)),  # a script's own call stands
])
def test_which_checkpointing_settings_the_planner_weighs(written, has, expected):
    from zerofit.plan.auto import checkpointing_choices

    model = _tiny_gpt2()
    if has:
        checkpointing_switch(model)[0]()
    config = RunConfig(zero=ZeroConfig(stage=AUTO, gradient_checkpointing=written))
    assert checkpointing_choices(config, model) == expected
    assert checkpointing_choices(RunConfig(zero=ZeroConfig(stage=AUTO)), torch.nn.Linear(2, 2)) == (False,)
    # a written stage and devices (the planner runs for the host share only): unset keeps the model as it is
    assert checkpointing_choices(RunConfig(zero=ZeroConfig(stage=2)), _tiny_gpt2()) == (False,)
    assert checkpointing_choices(RunConfig(zero=ZeroConfig(stage=2, gradient_checkpointing=AUTO)),
                                 _tiny_gpt2()) == (False, True)


def test_the_planner_turns_checkpointing_on_where_only_that_fits(monkeypatch, capsys):
    monkeypatch.setenv("ZEROFIT_HOST_MEMORY_GIB", "1000")
    _, result = choose(RunConfig(zero=ZeroConfig(stage=AUTO)), _long_gpt2(), world=1, shape=(8, 512),
                       budget=budget_for(torch.device("cpu"), 1))
    need = {e.setting.label: e.gpu_total + e.host_total + HOST_BASELINE_BYTES for e in result.estimates}
    assert need["DDP (stage 0)"] - need["DDP (stage 0) + ckpt"] > 16 << 20  # activations decide
    budget = (need["DDP (stage 0)"] + need["DDP (stage 0) + ckpt"]) / 2 / 0.9  # only checkpointing fits
    monkeypatch.setenv("ZEROFIT_HOST_MEMORY_GIB", repr(budget / GIB))
    reference = _long_gpt2()
    batch = next(iter(_long_loader()))["input_ids"]
    expected = reference(input_ids=batch, labels=batch).loss
    expected.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()

    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=AUTO)), cpu=True)
    model = _long_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, dl = acc.prepare(model, opt, _long_loader())
    assert acc.config.zero.gradient_checkpointing is True and _checkpoints(model)
    assert "zero.gradient_checkpointing auto -> DDP (stage 0) + ckpt" in capsys.readouterr().out.replace(
        "zero.stage, zero.offload_optimizer.device, zero.offload_param.device, ", "")
    for b in dl:
        loss = model(input_ids=b["input_ids"], labels=b["input_ids"]).loss
        acc.backward(loss)
        opt.step()
    assert torch.equal(loss.detach(), expected.detach())  # the recomputed forward is the same forward
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name

    # written false: the planner never turns it on, and says what does not fit
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=AUTO, gradient_checkpointing=False)), cpu=True)
    model = _long_gpt2()
    model, opt, dl = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0), _long_loader())
    assert acc.config.zero.gradient_checkpointing is False and not _checkpoints(model)


def test_written_checkpointing_is_turned_on_and_refused_for_a_plain_module(tmp_path):
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=2, gradient_checkpointing=True)), cpu=True)
    model = _tiny_gpt2()
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert _checkpoints(model)
    path = _write(tmp_path, "ds.json", json.dumps({"zero_optimization": {"stage": 2, "gradient_checkpointing": True},
                                                   "train_micro_batch_size_per_gpu": 1}))
    acc = Accelerator(config=load_config(path), cpu=True)
    plain = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"zero_optimization\.gradient_checkpointing is true, but Linear has no "
                                          r"gradient_checkpointing_enable\(\).*remove the key"):
        acc.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.1))


def test_a_model_in_eval_mode_is_trained_with_checkpointing_in_effect(capsys):
    """[Note: checkpointing needs training mode] from_pretrained returns an eval-mode model; transformers
    checkpoints only in training mode, so a script that never calls model.train() keeps every layer's
    activations where the plan counted on checkpointing (#29). prepare() with an optimizer puts
    the model in training mode; a later grad-enabled forward in eval mode warns once."""
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=2, gradient_checkpointing=True)), cpu=True)
    model = _tiny_gpt2().eval()
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.training and _checkpoints(model)
    assert "prepare() called model.train()" in capsys.readouterr().out
    ids = torch.arange(8)[None]
    model.eval()
    with pytest.warns(UserWarning, match=r"gradients on while the model is in eval mode.*model\.train\(\)"):
        model(input_ids=ids, labels=ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=ids, labels=ids)  # once
        model.train()
        with torch.no_grad():
            model.eval()(input_ids=ids)  # evaluation under no_grad: silent
    # without checkpointing, or prepared for evaluation only, the mode is the script's
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=2)), cpu=True)
    model = _tiny_gpt2().eval()
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not model.training


def _train_checkpointed(rank: int, world: int):
    """Per setting, with and without activation checkpointing turned on by zerofit: losses and masters."""
    out = {}
    settings = {"s2": ZeroConfig(stage=2), "s3": ZeroConfig(stage=3),
                "s3-offload": ZeroConfig(stage=3, offload_optimizer=OffloadConfig(device="cpu", step_on="device"),
                                         offload_param=OffloadConfig(device="cpu"))}
    for name, zero in settings.items():
        for ck in (False, True):
            acc = Accelerator(config=RunConfig(zero=dataclasses.replace(zero, gradient_checkpointing=ck)))
            model = _long_gpt2()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, opt, dl = acc.prepare(model, opt, _long_loader())
            assert _checkpoints(model) == ck
            losses = []
            for _ in range(3):
                for b in dl:
                    loss = model(input_ids=b["input_ids"][:, :64], labels=b["input_ids"][:, :64]).loss
                    acc.backward(loss)
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
            masters = acc._prepared.trained_engine().named_full_tensors("master")
            out[(name, ck)] = (losses, masters)
    return out


@pytest.mark.slow  # two gloo ranks, three settings twice
def test_checkpointing_zerofit_turns_on_trains_as_without_at_stages_2_and_3():
    """The recomputed forward under stage 3's gathers (and GPU-stepped offload with parameter offload)
    gives the same losses and weights as keeping the activations."""
    out = run_distributed(_train_checkpointed, 2, timeout=300)[0]
    for name in ("s2", "s3", "s3-offload"):
        (l0, m0), (l1, m1) = out[(name, False)], out[(name, True)]
        assert l0 == l1, name
        assert all(torch.equal(m0[k], m1[k]) for k in m0), name
