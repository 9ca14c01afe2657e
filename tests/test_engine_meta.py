"""A model built on the meta device is materialised unit by unit: each rank ends with only its shards."""

from __future__ import annotations

import pytest
import torch
from engine_cases import Case, TinyLM, batches, loss_fn

from zerofit.config.schema import ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.testing.distributed import run_distributed


def train_meta_built(rank, world, stage, steps=4):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyLM(n_blocks=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=stage, param_persistence_threshold=0),
                        device=torch.device("cpu"))
    held = sum(g.param_shard.numel() for g in engine.groups)
    total = sum(g.numel for g in engine.groups)
    initial = engine.named_full_tensors("master")
    case = Case(steps=steps)
    micro = case.batch // world
    losses = []
    for x, y in batches(case):
        loss = loss_fn(model(x[rank * micro:(rank + 1) * micro]), y[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"held": held, "total": total, "initial": initial, "final": engine.named_full_tensors("master"),
            "losses": losses}


@pytest.mark.slow  # several gloo launches
def test_meta_model_trains_the_same_sharded_or_not():
    sharded = run_distributed(train_meta_built, 2, 3)
    single = run_distributed(train_meta_built, 1, 0)[0]
    for r in sharded:
        assert r["held"] <= r["total"] // 2 + 16 * len(r["initial"])  # only this rank's shards stay
        for name, value in single["initial"].items():
            assert torch.equal(r["initial"][name], value), name  # same initial values on every rank
        for name, value in single["final"].items():
            assert (r["final"][name] - value).abs().max() < 5e-5, name  # fp32 sum order (Adam, lr 1e-2)
    assert sharded[0]["initial"]["emb.weight"].std() > 0.5  # nn.Embedding's own N(0, 1) init ran


def test_hugging_face_meta_model_gets_its_buffers_back():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=101)
    real = transformers.LlamaForCausalLM(cfg)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ZeroEngine(model, torch.optim.AdamW(model.parameters()), device=torch.device("cpu"))
    assert torch.equal(model.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)
    assert not any(p.is_meta for p in model.parameters())
    out = model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]]))
    assert torch.isfinite(out.loss)
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert abs(std - cfg.initializer_range) < 0.01  # the model's own _init_weights ran
