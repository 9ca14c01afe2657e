"""Per-parameter fragments cover every element once and alias the engine's master and optimizer state."""

from __future__ import annotations

import pytest
import torch
from engine_cases import Case

from zerofit.engine.state import local_fragments
from zerofit.testing.distributed import run_distributed


def fragments_after_training(rank, world, stage):
    import engine_cases

    from zerofit.config.schema import ZeroConfig
    from zerofit.engine import ZeroEngine

    case = Case(stage=stage, steps=2, freeze=True)
    model, opt = engine_cases.make_model_and_optim(case)
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=stage, param_persistence_threshold=0),
                        device=torch.device("cpu"))
    x, y = engine_cases.batches(case)[0]
    engine.backward(engine_cases.loss_fn(model(x), y))
    engine.step()
    frags = local_fragments(engine.groups, opt, rank)
    full = engine.named_full_tensors("master")
    return [(f.name, f.numel, f.start, f.length, f.trainable, sorted(f.tensors),
             torch.equal(f.tensors["master"], full[f.name].reshape(-1)[f.start:f.start + f.length])
             if f.trainable else True) for f in frags]


@pytest.mark.parametrize("stage", [0, 3])
def test_fragments_cover_each_element_once(stage):
    ranks = run_distributed(fragments_after_training, 2, stage)
    seen: dict[str, list[int]] = {}
    for frags in ranks:
        for name, numel, start, length, trainable, keys, matches in frags:
            seen.setdefault(name, [0] * numel)
            for e in range(start, start + length):
                seen[name][e] += 1
            assert matches, name
            assert keys == (["exp_avg", "exp_avg_sq", "master"] if trainable else ["param"])
    assert all(counts == [1] * len(counts) for counts in seen.values())
    assert "blocks.0.l1.weight" in seen  # frozen parameters are part of the state too


def call_root_module_directly(rank, world):
    import engine_cases

    from zerofit.config.schema import ZeroConfig
    from zerofit.engine import ZeroEngine

    model, opt = engine_cases.make_model_and_optim(Case())
    expected = model.emb.weight.detach().clone()
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=3, param_persistence_threshold=0),
                        device=torch.device("cpu"))
    assert engine.units[0].sharded
    with torch.no_grad():
        model(torch.tensor([[1, 2]]))  # a whole forward releases every unit afterwards
        # generate() of encoder-decoder models calls the encoder directly, without the root's forward
        rows = model.emb(torch.tensor([3, 4]))
    return torch.equal(rows, expected[[3, 4]])


def test_stage3_submodule_called_without_the_root_gathers_root_parameters():
    assert all(run_distributed(call_root_module_directly, 2))
