"""`writer_fragments`: a checkpoint's writers share the replicated groups out, each element written once."""

from __future__ import annotations

import pytest
import torch
from test_checkpoint_support import build, train

from zerofit.engine.state import local_fragments, writer_fragments


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_every_element_of_a_replicated_group_is_written_once_and_the_writers_share_evenly(world):
    case, model, _, engine = build(0, freeze=True)  # one process: every group replicated
    train(engine, model, case, 0, 1, range(1))  # optimizer state exists
    whole = {f.name: f for f in local_fragments(engine.groups, engine.optimizer, 0)}
    written: dict[str, list[tuple[int, int]]] = {}
    shares = []
    for rank in range(world):
        frags = writer_fragments(engine.groups, engine.optimizer, rank, world)
        shares.append(sum(f.length for f in frags))
        for f in frags:
            written.setdefault(f.name, []).append((f.start, f.length))
            base = whole[f.name]
            for key, t in f.tensors.items():  # views of the same state, at the same offsets
                assert torch.equal(t, base.tensors[key][f.start - base.start:f.start - base.start + f.length])
                assert t.data_ptr() == base.tensors[key][f.start - base.start:].data_ptr()
    for name, f in whole.items():
        runs = sorted(written[name])
        assert runs[0][0] == f.start and sum(n for _, n in runs) == f.length
        assert all(a + n == b for (a, n), (b, _) in zip(runs, runs[1:])), runs  # contiguous, no overlap
    assert max(shares) - min(shares) <= 1, shares
    assert any(not f.trainable for f in whole.values()) and any(f.trainable for f in whole.values())
