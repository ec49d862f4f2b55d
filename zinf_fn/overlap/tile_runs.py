"""How many small tiles the tile prefetcher fetches as one item, and what its window then holds.

The tile prefetcher (``tiling.runtime``, over ``tiling.runs``) fetches runs of adjacent tiles of one
leaf as one item of its window: a run is one fetch-thread job, one future and one hand-off instead
of one per tile, each tile still its own row and pool buffer. ``tile_run`` is the one rule for a
run's length: the runtime cuts its runs with it and the fetcher's demand (``overlap.fetch.demand``)
counts their buffers. ``update_run`` is the one rule for how many tiles' gradients go to the updater
as one update: the runtime's tiles (``tiling.leaf_tiles.LeafTiles``) submit them so, and the
gradients' demand (``optim.updater.demand``) counts the buffers a run's gradients hold while they
wait for it.
"""

from __future__ import annotations

import torch

from ..layout.demand import Buffers, shared

# a run of small tiles fetched as one item holds about this many bytes of compute dtype
TILE_RUN_BYTES = 4 << 20


def tile_run(padded_numel: int, compute_dtype: torch.dtype, depth: int) -> int:
    """Adjacent tiles of one leaf fetched as one item: as many as ``TILE_RUN_BYTES`` holds, at least
    one; one where nothing is fetched ahead (``depth`` 0: every fetch is on demand, tile by
    tile)."""
    return (
        1 if depth == 0 else max(1, TILE_RUN_BYTES // max(1, padded_numel * compute_dtype.itemsize))
    )


def update_run(
    padded_numel: int,
    compute_dtype: torch.dtype,
    depth: int,
    n_tiles: int,
    world_size: int,
    clipping: bool,
) -> int:
    """Adjacent tiles of one leaf whose gradients go to the updater as one update (one submission,
    one fused optimizer call over their rows: ``optim.updater.Updater.submit_run``): a fetch run's
    worth (``tile_run``, at most the leaf's ``n_tiles``) with one rank and no clipping, where a
    tile's gradient is its own shard and goes straight to its update; one otherwise (a
    reduce-scatter per tile, or a stash per tile for the clipped pass)."""
    if world_size != 1 or clipping:
        return 1
    return min(tile_run(padded_numel, compute_dtype, depth), n_tiles)


def window_buffers(
    tiles: list[Buffers], runs: dict[int, int], compute: torch.dtype, depth: int
) -> list[Buffers]:
    """The tiles' fetch buffers (every tile group's, ``tiles``) that their one window holds at once:
    of each size (a tile buffer of ``compute`` dtype), ``depth`` + 1 runs of its longest run
    (``runs``: numel -> tiles a run, at most a leaf's tiles); a staging or gather buffer of another
    dtype, ``depth`` + 1 at most. The window's runs may be a forward and a backward run of the same
    tiles (the head), so no group's rows bound them."""

    def window(b: Buffers) -> int:
        return (depth + 1) * (runs.get(b.numel, 1) if b.dtype == compute else 1)

    return [
        b._replace(count=min(b.count, window(b)))
        for b in shared(tiles, sum(b.count for b in tiles))
    ]
