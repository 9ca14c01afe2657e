"""`Accelerator.gathered_parameters(model)`: PEFT's `merge_and_unload()` after a ZeRO-3 LoRA run, on 2 gloo ranks.

Without the block merging fails inside torch (the sharded weights hold no data between uses). Inside it the
merged model equals a single process's merge of the same training (the same global batch, unsharded), and
`save_pretrained` inside the block writes it; at its end the units are released again and the training state
is untouched ([Note: gathered parameters] in zerofit.engine.full_state).
"""

from __future__ import annotations

import os

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from engine_cases import max_diff  # noqa: E402

from zerofit import Accelerator  # noqa: E402
from zerofit.config.schema import OffloadConfig, RunConfig, ZeroConfig  # noqa: E402
from zerofit.engine.unit import ParamState  # noqa: E402
from zerofit.testing.distributed import run_distributed  # noqa: E402

STEPS, BATCH = 2, 4  # global batch


def lora_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config),
                                peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0))
    with torch.no_grad():  # LoRA's B starts at zero: a merge would add nothing
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def data():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 61, (BATCH, 8), generator=g) for _ in range(STEPS)]


def train(model, opt, rows, backward):
    for ids in data():
        ids = rows(ids)
        backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()


def reference() -> dict[str, torch.Tensor]:
    model = lora_gpt2()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    train(model, opt, lambda ids: ids, lambda loss: loss.backward())
    return {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}


def merge_on_ranks(rank, world, root):
    out = {}
    for offload in ("none", "cpu"):
        acc = Accelerator(config=RunConfig(zero=ZeroConfig(stage=3, param_persistence_threshold=0,
                                                           offload_param=OffloadConfig(device=offload))))
        model = lora_gpt2()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        model, opt = acc.prepare(model, opt)
        train(model, opt, lambda ids, micro=BATCH // world: ids[rank * micro:(rank + 1) * micro], acc.backward)
        engine = acc._engine_of(model)
        before = {what: {k: v.clone() for k, v in engine.named_full_tensors(what).items()}
                  for what in ("master", "param")}  # the trained masters, and every shard (the frozen base's)
        where = os.path.join(root, offload)
        with acc.gathered_parameters(model):
            merged = acc.unwrap_model(model).merge_and_unload()
            state = merged.state_dict()  # every rank (it gathers; the main process gets the values)
            state = {k: v.clone() for k, v in state.items()} if acc.is_main_process else None
            merged.save_pretrained(where, is_main_process=acc.is_main_process)
        acc.wait_for_everyone()
        released = all(u.state is ParamState.RELEASED for u in engine.full_state.units)
        unchanged = all(torch.equal(before[what][k], v) for what in before
                        for k, v in engine.named_full_tensors(what).items())
        out[offload] = {"state": state, "released": released, "unchanged": unchanged,
                        "where": where}
        acc.end_training()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(merge_on_ranks, 2, str(tmp_path_factory.mktemp("gathered")))


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_merge_and_unload_inside_the_block_equals_the_unsharded_merge_and_saves_it(ranks, offload):
    want = reference()
    got = ranks[0][offload]
    assert got["state"].keys() == want.keys() and not any("lora" in k for k in got["state"])
    assert max_diff(got["state"], want) < 2e-6
    saved = transformers.GPT2LMHeadModel.from_pretrained(got["where"]).state_dict()
    assert max_diff({k: saved[k] for k in want}, want) < 2e-6


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_the_block_leaves_the_units_released_and_the_training_state_as_it_was(ranks, offload):
    for rank in ranks:
        assert rank[offload]["released"] and rank[offload]["unchanged"]
