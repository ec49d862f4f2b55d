"""How many small tiles the tile prefetcher fetches as one item, and what its window then holds.

The tile prefetcher (``tiling.step_tiles``, over ``tiling.runs``) fetches runs of adjacent tiles of
one leaf as one item of its window: a run is one fetch-thread job, one future and one hand-off
instead of one per tile, each tile still its own row and pool buffer. ``tile_run`` is the one rule
for a run's length: the runtime cuts its runs with it and the fetcher's demand
(``overlap.fetch_demand.demand``) counts their buffers. ``update_run`` is the one rule for how many
tiles' gradients go to the updater as one update: the runtime's tiles
(``tiling.leaf_tiles.LeafTiles``) submit them so, and the gradients' demand
(``optim.backlog.demand``) counts the buffers a run's gradients hold while they wait for it."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..layout.demand import Buffers, shared
from ..layout.policy import TILE, GroupPolicy
from ..store import Group, Store

# a run of small tiles fetched as one item holds about this many bytes of compute dtype
TILE_RUN_BYTES = 4 << 20
# the tile prefetcher keeps about this many bytes of runs issued ahead (``window_runs``) ...
TILE_WINDOW_BYTES = 32 << 20
# ... in at most this many runs: reads enough in flight to fill a disk's queue. 16 MiB and 16 runs
# (the 30B's lent NF4 experts: 9 runs, 4.5 experts ahead) left its 8-layer step waiting 0.35-0.45 s
# for tiles where the disk read 1.1-1.2 GB/s a stream; 32 and 32 halved that (the step 0.90-0.97
# of the time, alternated in one process); 64 and 64 waited less still, the step no faster
TILE_WINDOW_RUNS = 32


# a streamed frozen expert group's tiles of a size out at once for compute: a layer's experts of
# few rows on their lent codes run two at a time, one on a side thread, with one more fetched
# waiting for it (``tiling.two_at_once``), each holding its tile of each of its weights
EXPERTS_AT_ONCE = 3


def computing(policy: GroupPolicy) -> int:
    """Tiles of a tile group's size that its ops hold while they compute (beside the window's runs
    fetched ahead): a streamed group's whose codes are lent to the op ``EXPERTS_AT_ONCE``, else
    one."""
    return EXPERTS_AT_ONCE if policy.streamed and policy.codes_lent is not None else 1


def keeps_tiles(policy: GroupPolicy) -> bool:
    """Whether a training step may keep a tile group's tiles from their forward fetch into their
    backward (``Config.keep_tiles``, ``tiling.keep``): a streamed group whose rows are never
    written after init (a frozen base's experts), so the forward's values are the backward's."""
    return policy.unit == TILE and policy.streamed and not policy.written


def kept_tile_nbytes(group: Group, policy: GroupPolicy, compute: torch.dtype) -> int:
    """The bytes of the pool buffer a kept tile of ``group`` holds: its values decoded into the
    compute dtype (its policy's ``decoded``), or its gathered row (``GroupPolicy.gathered_as``: a
    frozen NF4 expert's codes, lent to the op as they are)."""
    if policy.decoded is not None:
        return policy.decoded.values.numel * compute.itemsize
    return group.part.padded_numel * policy.gathered_as(compute).itemsize


def kept_tiles(store: Store, compute: torch.dtype, world_size: int, budget: int) -> dict[str, int]:
    """How many tiles of each group a training step keeps from their forward fetch into their
    backward (``Config.keep_tiles``): of every group that ``keeps_tiles``, as many as ``budget``
    bytes hold of one tile of each such group (a touched expert brings one tile of each of its
    weights); none with several ranks (each fetch a collective, and a fetch issued ahead may race
    the keep on one rank and not on another). The one rule: the runtime's tiles
    (``tiling.keep.KeptTiles``) keep so many and the fetcher's demand
    (``overlap.fetch_demand.demand``) counts their buffers."""
    if world_size != 1 or budget <= 0:
        return {}
    policies = {g.name: store.row_kinds.policy(g.name) for g in store.groups.values()}
    groups = [g for g in store.groups.values() if keeps_tiles(policies[g.name])]
    each = sum(kept_tile_nbytes(g, policies[g.name], compute) for g in groups)
    count = budget // each if each else 0
    return {g.name: count for g in groups} if count else {}


def tile_run(padded_numel: int, compute_dtype: torch.dtype, depth: int) -> int:
    """Adjacent tiles of one leaf fetched as one item: as many as ``TILE_RUN_BYTES`` holds, at least
    one; one where nothing is fetched ahead (``depth`` 0: every fetch is on demand, tile by
    tile)."""
    return (
        1 if depth == 0 else max(1, TILE_RUN_BYTES // max(1, padded_numel * compute_dtype.itemsize))
    )


def window_runs(run_bytes: Iterable[int], depth: int) -> int:
    """How far ahead the tile prefetcher issues runs of streamed experts (their reads started):
    ``depth`` (``Config.prefetch_depth``), or more where the largest such run (``run_bytes``: each
    streamed group's run of ``tile_run`` tiles, in compute bytes) is small: as many as
    ``TILE_WINDOW_BYTES`` holds, at most ``TILE_WINDOW_RUNS``. An expert's compute on its few routed
    rows is far shorter than its read: the disk needs several reads in flight. Other tiles (a tiled
    linear's, computed on every token, tiled to bound memory) stay ``depth`` ahead; 0 (nothing
    fetched ahead) stays 0."""
    largest = max(run_bytes, default=0)
    if depth == 0 or largest == 0:
        return depth
    return max(depth, min(TILE_WINDOW_BYTES // largest, TILE_WINDOW_RUNS))


def store_window(store: Store, compute: torch.dtype, depth: int) -> int:
    """``window_runs`` of ``store``'s streamed tile groups (their policy's ``streamed``): each one's
    run (``fetch_run``) of its padded tile in the bytes its buffer holds: ``compute`` bytes, or
    where the policy lends the tile's codes to the op (``GroupPolicy.codes_lent``: a frozen NF4
    expert), the codes' own (``GroupPolicy.gathered_as``), about an eighth of fp32's, so that as
    many more reads are in flight. The one rule: the runtime's window
    (``tiling.runtime.TileEngine.window``) and the fetcher's demand
    (``overlap.fetch_demand.demand``) ask it."""
    runs = []
    for group in store.groups.values():
        policy = store.row_kinds.policy(group.name)
        if policy.streamed:
            held = policy.gathered_as(compute) if policy.codes_lent is not None else compute
            runs.append(group.part.padded_numel * held.itemsize * policy.fetch_run)
    return window_runs(runs, depth)


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


def window_buffers(tiles: list[Buffers], most: dict[int, int]) -> list[Buffers]:
    """The tiles' fetch buffers (every tile group's, ``tiles``) that their one window holds at once:
    of each size, at most ``most[numel]`` (the largest over the groups of that size of their
    window's runs, ``window_runs`` or ``depth``, plus the one computing, times their run of tiles):
    a tile buffer of the compute dtype, and a staging buffer of another dtype, read into as its run
    enters the window (a gather buffer of another dtype is counted once per size by its group).
    The window's runs may be a forward and a backward run of the same tiles (the head), so no
    group's rows bound them."""
    return [
        b._replace(count=min(b.count, most.get(b.numel, b.count)))
        for b in shared(tiles, sum(b.count for b in tiles))
    ]
