"""Consolidated export gathers a split group into host memory in bounded pieces ([Note: export gathers in
pieces], #30 item 6): the device buffer one gather takes is at most `GATHER_PIECE_BYTES`, and the weights
are bit-identical whatever the piece size. Two gloo ranks, stage 3 (gathered to rank 0) and stage 2 with
fp32 masters under bf16 (gathered to every rank), in one launch."""

from __future__ import annotations

import math

import pytest
import torch
from test_get_state_dict import _trained

from zerofit.checkpoint import consolidate
from zerofit.testing.distributed import run_distributed

CASES = {"stage 3": (3, torch.float32, "no"), "stage 2, fp32 masters under bf16": (2, torch.float32, "bf16")}
TINY_PIECE_BYTES = 40
"""Ten fp32 elements a piece: at two ranks five of each rank's shard, so every group takes several pieces
and most end in a shorter one."""


def _export_in_pieces(rank, world):
    out = {}
    for name, (stage, dtype, precision) in CASES.items():
        acc, model = _trained(rank, world, stage, dtype, precision)
        whole = acc.get_state_dict(model)
        labels: list[str] = []
        named, default = consolidate.named, consolidate.GATHER_PIECE_BYTES
        consolidate.named, consolidate.GATHER_PIECE_BYTES = _counting(named, labels), TINY_PIECE_BYTES
        try:
            pieces = acc.get_state_dict(model)
        finally:
            consolidate.named, consolidate.GATHER_PIECE_BYTES = named, default
        engine = acc._prepared.engines[id(model)]
        split = [g for g in engine.groups if consolidate._source(g)[1]]
        expected = {f"checkpoint:export:{g.unit_name or 'root'}":
                    math.ceil(consolidate._source(g)[0].numel() / (TINY_PIECE_BYTES // (world * 4))) for g in split}
        out[name] = {"same": sorted(whole) == sorted(pieces) and all(
                         v.device.type == "meta" or torch.equal(v, pieces[k]) for k, v in whole.items()),
                     "meta": {v.device.type == "meta" for v in pieces.values()},
                     "pieces": {label: labels.count(label) for label in labels}, "expected": expected}
    return out


def _counting(named, labels: list[str]):
    """`named` that notes each label it wraps (one gather a piece)."""
    def counting(label, who, **kw):
        labels.append(label)
        return named(label, who, **kw)

    return counting


@pytest.fixture(scope="module")
def launched():
    return run_distributed(_export_in_pieces, 2, timeout=180)


@pytest.mark.parametrize("case", list(CASES))
def test_small_pieces_give_the_same_weights(launched, case):
    for rank, result in enumerate(launched):
        got = result[case]
        assert got["same"], (rank, case)
        assert got["expected"] and got["pieces"] == got["expected"], (rank, case)  # one named gather a piece
        assert got["meta"] == ({rank > 0} if case == "stage 3" else {False}), (rank, case)


def test_a_piece_never_exceeds_the_bound(monkeypatch):
    for bound in (40, 64 * 2**20):
        monkeypatch.setattr(consolidate, "GATHER_PIECE_BYTES", bound)
        for world in (1, 2, 3, 8, 64):
            for size in (1, 2, 4, 8):
                n = consolidate.piece_numel(world, size)
                assert n >= 1 and (world * n * size <= bound or n == 1), (bound, world, size)
    monkeypatch.setattr(consolidate, "GATHER_PIECE_BYTES", 64 * 2**20)
    assert consolidate.piece_numel(8, 4) == 2 * 2**20  # 8 ranks of fp32: 2 Mi elements (8 MiB) each a piece
