"""How many small tiles the tile prefetcher fetches as one item, and what its window then holds.

The tile prefetcher (``tiling.runtime``, over ``tiling.runs``) fetches runs of adjacent tiles of one leaf
as one item of its window: a run is one fetch-thread job, one future and one hand-off instead of one per
tile, each tile still its own row and pool buffer. ``tile_run`` is the one rule for a run's length: the
runtime cuts its runs with it and the fetcher's demand (``overlap.fetch.demand``) counts their buffers.
"""

from __future__ import annotations

import torch

from ..demand import Buffers, shared

TILE_RUN_BYTES = 4 << 20   # a run of small tiles fetched as one item holds about this many bytes of compute dtype


def tile_run(padded_numel: int, compute_dtype: torch.dtype, depth: int) -> int:
    """Adjacent tiles of one leaf fetched as one item: as many as ``TILE_RUN_BYTES`` holds, at least one; one
    where nothing is fetched ahead (``depth`` 0: every fetch is on demand, tile by tile)."""
    return 1 if depth == 0 else max(1, TILE_RUN_BYTES // max(1, padded_numel * compute_dtype.itemsize))


def window_buffers(tiles: list[Buffers], runs: dict[int, int], compute: torch.dtype, depth: int) -> list[Buffers]:
    """The tiles' fetch buffers (every tile group's, ``tiles``) that their one window holds at once: of each size
    (a tile buffer of ``compute`` dtype), ``depth`` + 1 runs of its longest run (``runs``: numel -> tiles a run,
    at most a leaf's tiles); a staging or gather buffer of another dtype, ``depth`` + 1 at most. The window's
    runs may be a forward and a backward run of the same tiles (the head), so no group's rows bound them."""
    def window(b: Buffers) -> int:
        return (depth + 1) * (runs.get(b.numel, 1) if b.dtype == compute else 1)

    return [b._replace(count=min(b.count, window(b))) for b in shared(tiles, sum(b.count for b in tiles))]
