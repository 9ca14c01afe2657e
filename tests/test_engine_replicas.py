"""Replicas start equal (issue #30 item 4): ranks that built their model from different seeds all start
from rank 0's weights and buffers, as under DDP; ranks that agree exchange only a fingerprint per unit
(gloo, 2 ranks, every stage in one launch)."""

from __future__ import annotations

import pytest
import torch
from engine_cases import TinyLM
from torch import nn

from zerofit.config.schema import ZeroConfig
from zerofit.engine import ZeroEngine
from zerofit.engine.comm import Collectives
from zerofit.engine.replicas import agree
from zerofit.testing.distributed import run_distributed


class WithNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = TinyLM()
        self.bn = nn.BatchNorm1d(4)
        self.bn.running_mean.uniform_()  # a buffer that differs per rank too


def build(seed: int, stage: int):
    torch.manual_seed(seed)
    model = WithNorm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, opt, zero=ZeroConfig(stage=stage, param_persistence_threshold=0),
                        device=torch.device("cpu"))
    return model, engine


def run(rank: int, world: int) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        model, engine = build(seed=rank, stage=stage)  # every rank its own seed
        out[("differ", stage)] = ({k: v.clone() for k, v in engine.named_full_tensors("param").items()},
                                  model.bn.running_mean.clone(), engine.replicas_aligned, len(engine.units))
        model, engine = build(seed=0, stage=stage)  # every rank the same seed
        out[("same", stage)] = (engine.replicas_aligned, engine.comm.calls)  # a new engine counts from 0
    same = [torch.arange(6.0)]
    permuted = [torch.arange(6.0).flip(0) if rank else torch.arange(6.0)]  # the same sum, another order
    comm = Collectives(None, torch.device("cpu"))
    out["agree"] = (agree(same, comm, "same"), agree(permuted, comm, "permuted"), permuted[0].tolist())
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(run, 2, timeout=180)


def test_ranks_that_built_different_weights_all_start_from_rank_0s(ranks):
    r0, r1 = ranks
    for stage in (0, 1, 2, 3):
        params0, mean0, aligned0, units = r0[("differ", stage)]
        params1, mean1, aligned1, _ = r1[("differ", stage)]
        assert all(torch.equal(params0[k], params1[k]) for k in params0), stage
        torch.manual_seed(0)
        want = WithNorm()
        assert torch.equal(params0["lm.emb.weight"], want.lm.emb.weight.detach()), stage  # rank 0's own init
        assert torch.equal(mean0, mean1) and torch.equal(mean0, want.bn.running_mean), stage
        assert aligned0 == aligned1 == units + 1, stage  # every unit, and the buffers


def test_ranks_that_agree_exchange_one_fingerprint_per_unit_and_nothing_else(ranks):
    for r in ranks:
        for stage in (0, 1, 2, 3):
            aligned, calls = r[("same", stage)]
            assert aligned == 0, stage
            units = r[("differ", stage)][3]
            assert calls == units + 1, stage  # one small all-reduce per unit, one for the buffers


def test_a_reordering_that_keeps_the_sum_is_still_seen(ranks):
    for r in ranks:
        assert r["agree"][:2] == (False, True)
        assert r["agree"][2] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
