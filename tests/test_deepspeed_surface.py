"""Scripts written for DeepSpeed call DeepSpeedEngine methods on what `prepare()` returned:
`save_checkpoint(dir, tag, client_state)` / `load_checkpoint(dir)` resume exactly (2 gloo ranks, fp32)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerofit import Accelerator
from zerofit.config.schema import RunConfig, ZeroConfig
from zerofit.testing.distributed import run_distributed

transformers = pytest.importorskip("transformers")


def _setup():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16,
                                                                   n_layer=2, n_head=2))
    acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=2)), cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ids = torch.randint(0, 50, (24, 8), generator=torch.Generator().manual_seed(3))
    model, opt, dl, sched = acc.prepare(model, opt, DataLoader(TensorDataset(ids), batch_size=2), sched)
    return acc, model, opt, dl, sched


def _train(acc, model, opt, sched, batches):
    losses = []
    for (ids,) in batches:
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _save_then_resume(rank, world, out):
    acc, model, opt, dl, sched = _setup()
    batches = list(dl)
    _train(acc, model, opt, sched, batches[:3])
    assert model.zero_optimization_stage() == 2 and model.gradient_accumulation_steps() == 1
    assert model.save_checkpoint(out, "step3", client_state={"epoch": 1, "last_global_step": 3}) is True
    straight = _train(acc, model, opt, sched, batches[3:])
    acc, model, opt, dl, sched = _setup()
    batches = list(dl)  # before the load, as above: starting an epoch draws from the global RNG, as under Accelerate
    path, client_state = model.load_checkpoint(out)  # no tag: the one `latest` names
    resumed = _train(acc, model, opt, sched, batches[3:])
    with pytest.warns(UserWarning, match="there is no checkpoint to load"):
        nothing = model.load_checkpoint(out + "-empty")
    with pytest.raises(ValueError, match="zerofit restores the whole training state"):
        model.load_checkpoint(out, load_module_only=True)
    return straight, resumed, path, client_state, nothing


def test_save_checkpoint_and_load_checkpoint_resume_exactly(tmp_path):
    out = str(tmp_path / "ckpt")
    for straight, resumed, path, client_state, nothing in run_distributed(_save_then_resume, 2, out, timeout=180):
        assert resumed == straight
        assert path == str(tmp_path / "ckpt" / "step3")
        assert client_state == {"epoch": 1, "last_global_step": 3}
        assert nothing == (None, None)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step3"
