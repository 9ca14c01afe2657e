"""`save_state` / `load_state` and the weight exports through the Accelerator, on 2 gloo ranks.

Resume: 6 optimizer steps straight equal 3 steps, save_state, a fresh Accelerator/model/optimizer/
scheduler/dataloader, load_state, skip_first_batches, 3 steps (losses bit-identical), with the
scheduler, a registered object, the dataloader position and the RNG states restored.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerofit import Accelerator
from zerofit.config.schema import RunConfig, ZeroConfig
from zerofit.testing.distributed import run_distributed

pytest.importorskip("zerofit.checkpoint")
transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16,
                                                                  n_layer=2, n_head=2))


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def _setup(stage: int):
    acc = Accelerator(gradient_accumulation_steps=2, config=RunConfig(zero=ZeroConfig(
        stage=stage, param_persistence_threshold=0)))
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ids = torch.randint(0, 50, (48, 8), generator=torch.Generator().manual_seed(3))
    dl = DataLoader(TensorDataset(ids), batch_size=2, shuffle=True)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    return acc, model, opt, dl, sched, counter


def _steps(acc, model, opt, dl, sched, counter, n_steps: int, start: int = 0):
    losses = []
    for (ids,) in acc.skip_first_batches(dl, start):
        with acc.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.item())
        if acc.sync_gradients:
            counter.n += 1
            if counter.n == n_steps:
                break
    return losses


def resume_and_export(rank: int, world: int, root: str):
    out = {}
    for stage in (2, 3):
        torch.manual_seed(11)
        straight = _steps(*_setup(stage), n_steps=6)
        torch.manual_seed(11)
        acc, model, opt, dl, sched, counter = _setup(stage)
        first = _steps(acc, model, opt, dl, sched, counter, n_steps=3)
        path = acc.save_state(f"{root}/stage{stage}/step3")
        after_save = torch.get_rng_state()
        torch.manual_seed(999)  # a different RNG state that load_state must undo
        acc2, model2, opt2, dl2, sched2, counter2 = _setup(stage)
        acc2.load_state(path)
        after_load = torch.get_rng_state()
        position = dl2.resume_position
        second = _steps(acc2, model2, opt2, dl2, sched2, counter2, n_steps=6, start=position)
        out[stage] = {"straight": straight, "resumed": first + second, "rng": (after_save, after_load),
                      "lr": (sched2.get_last_lr(), position, counter2.n)}
        if stage == 3:
            full = acc2.get_state_dict(model2)
            acc2.save_model(model2, f"{root}/export")
            out["full_keys"] = sorted(full)
            out["full_wte"] = full.get("transformer.wte.weight")
            acc2.wait_for_everyone()
    return out


def test_resume_is_exact_and_the_stage3_export_loads_with_from_pretrained(tmp_path):
    results = run_distributed(resume_and_export, 2, str(tmp_path), timeout=170)
    for rank, got in enumerate(results):
        for stage in (2, 3):
            r = got[stage]
            assert r["resumed"] == r["straight"], (rank, stage)  # bit-identical losses
            assert torch.equal(*r["rng"])
            lrs, position, count = r["lr"]
            assert position == 6 and count == 6  # 3 steps x 2 micro-batches consumed before the save
            assert lrs == pytest.approx([1e-2 / (1 + 2 * 6)])  # 2 scheduler steps per optimizer step
    # stage 3: rank 1 gets the same keys, as placeholders (tests/test_get_state_dict.py checks their kind)
    assert "transformer.wte.weight" in results[0]["full_keys"] and results[1]["full_keys"] == results[0]["full_keys"]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export")
    torch.testing.assert_close(loaded.transformer.wte.weight, results[0]["full_wte"])
