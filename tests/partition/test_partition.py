"""Shard index math (zinf_fn.partition) on odd sizes: the shards of every rank tile the flat buffer
exactly."""

from __future__ import annotations

import pytest

from zinf_fn.partition import owner_of, partition

CASES = [  # (numel, world_size, align)
    (12704, 4, 1),  # divides: no padding
    (10, 4, 1),  # 10 = 3 + 3 + 3 + 1: the last shard is mostly padding
    (13, 2, 1),  # odd numel, two ranks
    (3, 4, 1),  # fewer elements than ranks: rank 3 holds only padding
    (1, 8, 1),
    (0, 3, 1),  # an empty buffer still gets a (padding-only) shard of `align` elements
    (100, 3, 8),  # shards rounded up to a multiple of 8 elements
    (5, 2, 64),  # alignment larger than the data
    (4096 * 3 + 1, 4, 4096),
]


@pytest.mark.parametrize("numel, world, align", CASES)
def test_shards_tile_the_buffer(numel, world, align):
    part = partition(numel, world, align)
    assert part.shard_numel % align == 0 and part.shard_numel >= 1
    assert part.padded_numel == part.shard_numel * world >= numel
    # the least padding that gives N equal aligned shards: one shard fewer of `align` would not fit
    # numel
    assert (part.shard_numel - align) * world < max(numel, 1)
    covered = []
    for rank in range(world):
        start, end = part.shard_range(rank)
        assert end - start == part.shard_numel
        assert start == (covered[-1][1] if covered else 0)  # contiguous, in rank order
        lo, hi = part.real_range(rank)
        assert lo == start and hi <= end  # real elements come first in a shard
        assert hi - lo == max(0, min(end, numel) - start)  # ... and are the overlap with [0, numel)
        covered.append((start, end))
    assert covered[-1][1] == part.padded_numel
    assert sum(hi - lo for lo, hi in (part.real_range(r) for r in range(world))) == numel


def test_padding_only_ranks():
    part = partition(3, 4)
    assert part.shard_numel == 1
    assert [part.real_range(r) for r in range(4)] == [
        (0, 1),
        (1, 2),
        (2, 3),
        (3, 3),
    ]  # rank 3: empty, padding only


def test_alignment_rounds_each_shard():
    part = partition(100, 3, align=8)
    assert part.shard_numel == 40  # ceil(100 / 3) = 34 -> 40
    assert part.shard_range(2) == (80, 120)
    assert part.real_range(2) == (80, 100)


@pytest.mark.parametrize("bad", [(-1, 2, 1), (4, 0, 1), (4, 2, 0)])
def test_bad_arguments(bad):
    with pytest.raises(ValueError, match="partition needs"):
        partition(*bad)


def test_rank_outside_world():
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        partition(10, 2).shard_range(2)


def test_owner_round_robin():
    assert [owner_of(u, 3) for u in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert {owner_of(u, 1) for u in range(5)} == {0}
