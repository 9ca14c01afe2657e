"""Communication units are found from the model's structure; every parameter has exactly one unit."""

from __future__ import annotations

import pytest
from engine_cases import TinyLM
from torch import nn

from zerofit.engine.find_units import plan_units


def _owned(units):
    return [id(p) for u in units for _, p in u.params]


def test_repeated_blocks_become_units_and_tied_weights_go_to_the_root():
    model = TinyLM(n_blocks=3)
    units = plan_units(model, size_threshold=10**9)
    assert [u.name for u in units] == ["", "blocks.0", "blocks.1", "blocks.2"]
    root_names = [n for n, _ in units[0].params]
    assert root_names == ["emb.weight"]  # the head shares it: one copy, in the root
    assert sorted(_owned(units)) == sorted(id(p) for p in model.parameters())


def test_large_modules_outside_blocks_get_their_own_unit():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(1000, 16)      # 16k parameters
            self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(2)])
            self.head = nn.Linear(16, 1000)        # 17k parameters, not tied
            self.norm = nn.LayerNorm(16)

    units = plan_units(Net(), size_threshold=10_000)
    assert [u.name for u in units] == ["", "emb", "layers.0", "layers.1", "head"]
    assert [n for n, _ in units[0].params] == ["norm.weight", "norm.bias"]


def test_threshold_carving_without_repeated_blocks():
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 3))
    # an nn.Sequential of mixed classes is not a run of blocks; the big layer is carved by size
    units = plan_units(nn.ModuleDict({"body": model}), size_threshold=5_000)
    assert [u.name for u in units] == ["", "body.0"]
    assert [n for n, _ in units[0].params] == ["body.2.weight", "body.2.bias"]


def test_hugging_face_no_split_modules_are_used():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=101, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    units = plan_units(model, size_threshold=10**9)
    assert [u.name for u in units] == ["", "transformer.h.0", "transformer.h.1", "transformer.h.2"]
    root = [n for n, _ in units[0].params]
    assert "transformer.wte.weight" in root and "lm_head.weight" not in root  # tied: stored once
    assert sorted(_owned(units)) == sorted(id(p) for p in model.parameters())


def test_unit_spanning_frozen_and_trainable_parameters_keeps_both():
    model = TinyLM(n_blocks=2, freeze=True)
    units = plan_units(model, size_threshold=10**9)
    grads = {n: p.requires_grad for u in units for n, p in u.params}
    assert grads["blocks.0.l1.weight"] is False and grads["blocks.1.l1.bias"] is False
    assert grads["blocks.1.l1.weight"] is True
