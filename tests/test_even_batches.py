"""Prepared dataloaders give every rank the same number of batches, whatever the dataset size.

This is what keeps ranks in step (see [Note: even batches] in zerofit.frontend.data.loaders); a DataLoader the script
does not prepare has no such guarantee, and tests/test_faults.py shows that ranks then raise a
CollectiveError instead of hanging.
"""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import RandomSampler, SequentialSampler

from zerofit.frontend.data.loaders import ShardedBatchSampler
from zerofit.frontend.data.sampling import SeededOrder

CASES = list(itertools.product((1, 5, 9, 24, 31), (1, 2, 4), (2, 3, 4), (False, True), (False, True)))


@pytest.mark.parametrize(("n", "batch", "world", "drop_last", "shuffle"), CASES)
def test_every_rank_gets_the_same_number_of_batches(n, batch, world, drop_last, shuffle):
    data = list(range(n))
    sampler = RandomSampler(data) if shuffle else SequentialSampler(data)
    counts, seen = [], []
    for rank in range(world):
        order = SeededOrder(sampler, 7) if shuffle else None  # every rank cuts the same epoch
        s = ShardedBatchSampler(sampler, batch, drop_last, rank=rank, world=world, split_batches=False, order=order)
        batches = list(s)
        assert len(batches) == len(s) and all(len(b) == batch for b in batches)
        counts.append(len(batches))
        seen += [i for b in batches for i in b]
    assert len(set(counts)) == 1, f"ranks would run {counts} steps"
    if not drop_last:
        assert set(seen) == set(data)  # every sample is seen; the last global batch is filled up with repeats
    else:
        assert counts[0] == n // (batch * world)
