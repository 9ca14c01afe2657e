"""Shard layouts are pure functions: every element lands in exactly one shard, padding stays small."""

from __future__ import annotations

import itertools
import random

import pytest

from zerofit.engine.layout import plan_layout

SIZES = [[1], [7], [2, 3, 5, 7, 11, 13], [97, 1, 1, 1009], [0, 4, 0], [31] * 9, [10**6 + 3, 17]]


@pytest.mark.parametrize(("numels", "world", "align"),
                         list(itertools.product(SIZES, [1, 2, 3, 4, 7], [1, 16])))
def test_shards_cover_every_element_once(numels, world, align):
    lay = plan_layout(numels, world, align=align)
    assert lay.shard_numel % align == 0
    assert 0 <= lay.padded_numel - lay.numel < world * align or lay.numel == 0
    seen = [0] * lay.numel
    for rank in range(world):
        lo, hi = lay.shard_range(rank)
        assert hi - lo == lay.shard_numel
        for o in lay.overlaps(rank):
            assert 0 <= o.shard_offset and o.shard_offset + o.length <= lay.shard_numel
            flat_start = lay.offsets[o.index] + o.param_start
            assert lo <= flat_start and flat_start + o.length <= hi
            for e in range(flat_start, flat_start + o.length):
                seen[e] += 1
    owned = [0] * lay.numel  # gap elements between aligned parameters belong to no one
    for off, n in zip(lay.offsets, lay.numels):
        owned[off:off + n] = [1] * n
    assert seen == owned
    assert all(off % align == 0 for off in lay.offsets)


@pytest.mark.parametrize(("numels", "world"), list(itertools.product(SIZES, [2, 3, 4, 7])))
def test_a_parameter_cut_by_a_shard_boundary_is_cut_after_a_multiple_of_the_alignment(numels, world):
    # so a vectorised optimizer kernel treats each element of its pieces as in the whole parameter
    lay = plan_layout(numels, world, align=16)
    for rank in range(world):
        for piece in lay.pieces(rank):
            assert piece.shard_offset % 16 == 0
            start = lay.shard_range(rank)[0] + piece.shard_offset - lay.offsets[piece.index]
            assert start % 16 == 0
            assert piece.group == lay.groups[piece.index]


def test_padding_below_world_size_without_alignment():
    rng = random.Random(0)
    for _ in range(200):
        numels = [rng.randint(1, 500) for _ in range(rng.randint(1, 6))]
        world = rng.randint(1, 9)
        lay = plan_layout(numels, world)
        assert lay.padded_numel - lay.numel < world


def test_group_pieces_are_contiguous_and_complete():
    numels, groups = [5, 6, 7, 3, 4], [0, 0, 1, 1, 2]
    for world in (1, 2, 3, 5):
        lay = plan_layout(numels, world, groups=groups)
        covered = {0: 0, 1: 0, 2: 0}
        for rank in range(world):
            pieces = lay.pieces(rank)
            assert [p.group for p in pieces] == sorted(p.group for p in pieces)
            for p in pieces:
                covered[p.group] += p.length
        assert covered == {0: 11, 1: 10, 2: 4}


def test_odd_prime_sizes_overlap_exactly():
    lay = plan_layout([3, 5], 2)  # 8 elements, shards of 4: the second parameter straddles
    assert lay.shard_numel == 4
    assert [(o.index, o.param_start, o.length, o.shard_offset) for o in lay.overlaps(0)] == [(0, 0, 3, 0), (1, 0, 1, 3)]
    assert [(o.index, o.param_start, o.length, o.shard_offset) for o in lay.overlaps(1)] == [(1, 1, 4, 0)]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"numels": [1], "world": 0}, "world must be >= 1"),
    ({"numels": [1], "world": 2, "align": 0}, "align must be >= 1"),
    ({"numels": [1, 2], "world": 2, "groups": [1, 0]}, "ordered by group"),
    ({"numels": [1, 2], "world": 2, "groups": [0]}, "1 group ids for 2"),
    ({"numels": [-1], "world": 2}, "negative parameter size"),
])
def test_bad_layout_requests(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_layout(**kwargs)
