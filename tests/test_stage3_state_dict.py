"""Under ZeRO-3, `model.state_dict()` and `save_pretrained` without `state_dict=` give the full, trained
weights on every rank (DeepSpeed writes empty weight files in this case); see [Note: full state dict
under stage 3] in zerofit.engine.full_state. Two gloo ranks, fp32, so the comparisons are exact."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerofit import Accelerator
from zerofit.config.schema import RunConfig, ZeroConfig
from zerofit.testing.distributed import run_distributed

transformers = pytest.importorskip("transformers")


def _trained(freeze_base: bool):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16,
                                                                   n_layer=2, n_head=2))
    if freeze_base:  # PEFT-style: only the last block and the final norm train
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith(("transformer.h.1.", "transformer.ln_f."))
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=3, param_persistence_threshold=0)), cpu=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 50, (8, 8), generator=torch.Generator().manual_seed(3))
    model, opt, dl = acc.prepare(model, opt, DataLoader(TensorDataset(ids), batch_size=2))
    for (batch,) in dl:
        acc.backward(model(input_ids=batch, labels=batch).loss)
        opt.step()
        opt.zero_grad()
    return acc, model


def _save_and_read(rank, world, out, freeze_base):
    acc, model = _trained(freeze_base)
    reference = acc.get_state_dict(model)  # {} off the main process
    state = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    acc.unwrap_model(model).save_pretrained(out, is_main_process=acc.is_main_process, save_function=acc.save)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapter = {k: v for k, v in model.state_dict().items() if k in trainable}  # what PEFT-style saving keeps
    loss = model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.item()  # still trains
    return reference, state, shapes, adapter, loss


@pytest.mark.parametrize("freeze_base", [False, True])
def test_state_dict_and_save_pretrained_hold_the_full_trained_weights(tmp_path, freeze_base):
    out = str(tmp_path / "saved")
    (ref, state0, shapes0, adapter0, loss0), (_, state1, shapes1, adapter1, loss1) = run_distributed(
        _save_and_read, 2, out, freeze_base, timeout=180)
    full = {k: tuple(v.shape) for k, v in ref.items()}
    assert {k: s for k, s in shapes0.items() if k in full} == full and shapes1 == shapes0
    for name, value in ref.items():
        torch.testing.assert_close(state0[name], value, rtol=0, atol=0)
        torch.testing.assert_close(state1[name], value, rtol=0, atol=0)  # every rank: the same full tensors
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).state_dict()
    for name, value in ref.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
    assert adapter0 and adapter0.keys() == adapter1.keys()
    for name, value in adapter0.items():
        torch.testing.assert_close(value, ref[name], rtol=0, atol=0)
    assert loss0 == pytest.approx(loss1)
