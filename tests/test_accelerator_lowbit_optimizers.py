"""bitsandbytes' and torchao's 8-bit Adam objects handed to `prepare()` run as torch's AdamW / Adam with
`precision.optimizer_state: 8bit`, over the script's own param groups (an LR scheduler built on the script's
object keeps driving the run); other low-bit optimizers are refused with the fix. Neither library is installed:
stand-ins carry the real classes' module and name, and their hyperparameters as the real ones keep them."""

from __future__ import annotations

import types

import pytest
import torch
from engine_cases import SEQ, VOCAB, TinyLM, loss_fn

from zerofit import Accelerator
from zerofit.config.schema import PrecisionConfig, RunConfig, ZeroConfig
from zerofit.errors import ConfigError

LR = 1e-2


def _stand_in(module: str, name: str, *, optim_bits: int | None = None, tensor_lr: bool = False):
    """A class named `module.name` that keeps its settings as the real one does (bitsandbytes: `optim_bits` in
    `self.args`; torchao: a tensor lr per group) and whose step must never run."""
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if module.startswith("torchao"):
            defaults["amsgrad"] = amsgrad
        torch.optim.Optimizer.__init__(self, params, defaults)
        if optim_bits is not None:
            self.args = types.SimpleNamespace(optim_bits=optim_bits, min_8bit_size=4096, max_unorm=0.0,
                                              skip_zeros=False)
        if tensor_lr:
            for g in self.param_groups:
                g["lr"] = torch.tensor(g["lr"])

    def step(self, closure=None):
        raise AssertionError(f"{name}.step ran: zerofit must step its torch replacement")

    return type(name, (torch.optim.Optimizer,), {"__module__": module, "__init__": __init__, "step": step})


def _groups(model):
    decay = [p for p in model.parameters() if p.ndim > 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in model.parameters() if p.ndim <= 1],
                                                      "weight_decay": 0.0}]


def _train(make_optimizer, config: RunConfig, *, scheduler_first: bool = True):
    torch.manual_seed(0)
    model = TinyLM()
    opt = make_optimizer(_groups(model))
    acc = Accelerator(config=config)
    if scheduler_first:  # built on the script's object before prepare()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
        model, popt, psched = acc.prepare(model, opt, sched)
    else:
        model, popt = acc.prepare(model, opt)
        psched = acc.prepare(torch.optim.lr_scheduler.LambdaLR(popt, lambda s: 1.0 / (1.0 + s)))
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        acc.backward(loss_fn(model(x), torch.roll(x, 1, dims=1)))
        popt.step()
        psched.step()
        popt.zero_grad()
    engine = acc._prepared.engines[id(model)]
    return acc, popt, engine.named_full_tensors("master")


CASES = {
    "bitsandbytes AdamW8bit": (_stand_in("bitsandbytes.optim.adamw", "AdamW8bit", optim_bits=8), torch.optim.AdamW),
    "bitsandbytes AdamW(optim_bits=8)": (_stand_in("bitsandbytes.optim.adamw", "AdamW", optim_bits=8),
                                         torch.optim.AdamW),
    "bitsandbytes PagedAdamW8bit": (_stand_in("bitsandbytes.optim.adamw", "PagedAdamW8bit", optim_bits=8),
                                    torch.optim.AdamW),
    # bitsandbytes' "adam" update decays decoupled, whatever the class's name: torch's AdamW
    "bitsandbytes Adam8bit": (_stand_in("bitsandbytes.optim.adam", "Adam8bit", optim_bits=8), torch.optim.AdamW),
    "torchao AdamW8bit": (_stand_in("torchao.optim.adam", "AdamW8bit", tensor_lr=True), torch.optim.AdamW),
    "torchao Adam8bit": (_stand_in("torchao.optim.adam", "Adam8bit", tensor_lr=True), torch.optim.Adam),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_8bit_adam_runs_as_the_torch_optimizer_with_8bit_state(case, capsys):
    cls, torch_cls = CASES[case]
    config = RunConfig(zero=ZeroConfig(stage=2))
    # torchao's lr is a tensor, so a scheduler built on its object before prepare() keeps writing 0-d tensors
    # (its base_lrs); the float lr zerofit gives the groups is checked with the scheduler built after prepare()
    first = "torchao" not in case
    acc, popt, got = _train(lambda groups: cls(groups, lr=LR, betas=(0.8, 0.95), eps=1e-6), config,
                            scheduler_first=first)
    assert acc.config.precision.optimizer_state == "8bit"
    assert type(popt.optimizer) is torch_cls
    assert f"runs as torch.optim.{torch_cls.__name__} with precision.optimizer_state 8bit" in capsys.readouterr().out
    assert popt.param_groups[0]["lr"] == pytest.approx(LR / 4)  # the scheduler on the script's object drove it
    assert [g["weight_decay"] for g in popt.param_groups] == [0.1, 0.0]
    eight = RunConfig(zero=ZeroConfig(stage=2), precision=PrecisionConfig(optimizer_state="8bit"))
    _, _, want = _train(lambda groups: torch_cls(groups, lr=LR, betas=(0.8, 0.95), eps=1e-6), eight,
                        scheduler_first=first)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_a_32bit_bitsandbytes_adam_is_plain_adamw():
    cls = _stand_in("bitsandbytes.optim.adamw", "PagedAdamW32bit", optim_bits=32)
    acc, popt, _ = _train(lambda groups: cls(groups, lr=LR), RunConfig(zero=ZeroConfig(stage=2)))
    assert acc.config.precision.optimizer_state == "fp32" and type(popt.optimizer) is torch.optim.AdamW


@pytest.mark.parametrize(("module", "name"), [("bitsandbytes.optim.lion", "Lion8bit"),
                                              ("torchao.optim.adam", "AdamW4bit"),
                                              ("torchao.optim.adam", "AdamWFp8"),
                                              ("bitsandbytes.optim.rmsprop", "RMSprop8bit")])
def test_other_low_bit_optimizers_are_refused_with_the_fix(module, name):
    cls = _stand_in(module, name, optim_bits=8 if module.startswith("bitsandbytes") else None)
    with pytest.raises(ConfigError, match=rf"optimizer {module}.{name} keeps its state in its own low-bit format.*"
                                          "use torch.optim.AdamW with precision.optimizer_state: 8bit"):
        _train(lambda groups: cls(groups, lr=LR), RunConfig(zero=ZeroConfig(stage=2)))


def test_8bit_object_against_a_written_fp32_state_names_both():
    cls = _stand_in("bitsandbytes.optim.adamw", "AdamW8bit", optim_bits=8)
    config = RunConfig(precision=PrecisionConfig(optimizer_state="bf16"), source="ds.json", source_format="deepspeed",
                       written=("precision.optimizer_state",))
    with pytest.raises(ConfigError, match="optimizer bitsandbytes.optim.adamw.AdamW8bit asks for 8bit optimizer "
                                          "state but the config's zero_optimization.optimizer_state is 'bf16'"):
        _train(lambda groups: cls(groups, lr=LR), config)
