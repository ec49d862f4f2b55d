"""What the fetcher (``overlap.fetch.Fetcher``) holds and moves in a step: its buffers and the
bytes it reads, a part of the engine's demand (``layout.demand``) that the pool is made from and the
planner sums.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..layout.demand import SCANS, Buffers, Demand, Sizing
from ..layout.policy import TILE, GroupPolicy
from ..layout.units import BLOCKS, Unit, reused, stage_of
from ..store import Group, Store
from .plan import refetched, row_is_layer, staged_is_layer
from .tile_runs import computing, kept_tiles, store_window, window_buffers


def demand(store: Store, sizing: Sizing) -> Demand:
    """What the prefetcher and its fetcher hold and move (see ``zinf_fn.layout.demand``), in the
    scans.

    Per group: ``prefetch_depth`` + 1 gathered units in the compute dtype (the one computing and the
    ones fetched ahead; none where the stored row is the layer: one rank, in memory on the device,
    of the compute dtype), where its 16-bit rows are on NVMe ``depth`` (at least one) staging rows
    read into (the fetch thread reads one unit at a time per depth; the ``depth`` + 1 layers
    themselves where a staged row is the layer, as on one CPU rank of the compute dtype), and with
    several ranks a 16-bit gather buffer where the compute dtype is another (one unit at a time:
    cast, then given back); a stage's frozen row (``zinf_fn.formats.frozen``) is fetched with its
    unit, as a unit. The tiles of every tiled leaf share one prefetcher (``tiling.step_tiles``): of
    each size, ``depth`` + 1 runs of ``tile_run`` tiles at once (a streamed expert group's:
    ``window_runs`` + 1), their staging rows too (a run's reads start as it enters the window; a
    tile whose buffer becomes its gradient is the gradients' from then on). NVMe bytes: each unit's
    16-bit row on NVMe (its frozen row's too; a tile's reads are the tile plan's,
    ``tiling.plan.demand``) is read in forward and again in backward where the backward fetches it
    (``overlap.plan.refetched``: not the head's, not a frozen embedding's), unless its policy
    ``lends`` its master (``zinf_fn.layout.policy``: read ahead for its update, the fetch casts it),
    and but once where it ``holds`` its layer (its buffers held from then on: one, or two where
    it lends some leaves' codes and decodes the others, ``_kept``). A row the
    policy ``decode``s (``Config.frozen_storage``) is gathered as its bytes
    (``GroupPolicy.gathered_as``), then decoded into a buffer of the compute dtype, unless its
    policy lends those bytes to the op as they are (``GroupPolicy.codes``: no decoded buffer; where
    it lends some leaves' only, ``lent_leaves``, a buffer of the others' values, the gathered row
    out as long as its layer). With ``Config.keep_tiles`` (one rank), the frozen streamed tiles a
    training step keeps from their forward into their backward hold their buffers beyond the
    window (``tile_runs.kept_tiles`` of each group, ``_kept_tiles``); their spared reads are the
    planner's (``planner.sizes``)."""
    n_layers, reuse = sizing.n_layers, sizing.reuse
    stages: list[Buffers] = []
    tiles: list[Buffers] = []
    most: dict[int, int] = {}  # tile buffers of a numel out at once (``window_buffers``)
    streamed = store_window(store, sizing.compute, sizing.depth)
    keeps = kept_tiles(store, sizing.compute, sizing.world_size, sizing.keep_tiles)
    kept: list[Buffers] = []  # tiles kept from forward into backward, beyond the window
    forward = backward = 0
    for group in store.groups.values():
        rows = store.row_units(group, n_layers)
        on_disk = [u for u in rows if store.placement_of("param", u) == "nvme"]
        policy = store.row_kinds.policy(group.name)
        if policy.unit != TILE:
            blocks = stage_of(group.name) == BLOCKS
            stages += _held(
                store,
                sizing,
                group,
                len(on_disk),
                reuse=reuse if blocks else 0,
                kept=tuple(u for u in rows if policy.holds(u)),
            )
        else:  # tiles: one window, of runs of at most a leaf's tiles
            run = policy.fetch_run
            ahead = sizing._replace(depth=streamed if policy.streamed else sizing.depth)
            decoded = () if policy.decoded is None else (policy.decoded.values.numel,)
            held = computing(policy)  # runs out computing, beside those fetched ahead
            for numel in (group.part.padded_numel, group.part.shard_numel, *decoded):
                most[numel] = max(most.get(numel, 0), (ahead.depth + held) * run)
            tiles += _held(store, ahead, group, len(on_disk), run, computing=held)
            kept += _kept_tiles(store, sizing, group, bool(on_disk), keeps.get(group.name, 0))
        if policy.unit == TILE:  # as often as the tile plan fetches it (``tiling.plan.demand``)
            continue
        row = store.row_kinds.row_nbytes("param", group.name)
        on_disk = [u for u in on_disk if not policy.holds(u)]
        forward += row * len(on_disk)
        again = refetched(stage_of(group.name), sizing.embed_trains)
        refetches = [u for u in on_disk if not policy.lends(u) and not reused(u, n_layers, reuse)]
        backward += row * len(refetches) if again else 0
    windows = window_buffers(tiles, most)
    buffers = [b for b in [*stages, *windows, *kept] if b.count]
    return Demand("fetched layers", tuple(buffers), read_forward=forward, read_backward=backward)


def _held(
    store: Store,
    sizing: Sizing,
    group,
    on_disk: int,
    run: int | None = None,
    reuse: int = 0,
    kept: tuple[Unit, ...] = (),
    computing: int = 1,
) -> list[Buffers]:
    """The fetch buffers of one group (``demand``), ``on_disk`` of its rows on NVMe; a tile group's
    (``run``: its tiles fetched as one item, ``overlap.tile_runs``) as many as its window's runs
    whatever its rows; ``reuse`` of a unit group's units held from their forward into their backward
    (``units.reused``) besides, and the ``kept`` units whose layers the fetcher holds
    (``Fetcher.release``) from their first fetch on."""
    depth, world, compute = sizing.depth, sizing.world_size, sizing.compute
    policy = store.row_kinds.policy(group.name)
    where, row, flat, direct, staged_layer = _made_as(store, sizing, group)
    full = (0 if direct else group.rows - on_disk) + (0 if staged_layer else on_disk)

    # a unit's: at most its rows; a tile group's: the window's runs of it
    def window(rows: int) -> int:
        if run is None:
            return min(rows, depth + 1 + reuse)
        return (depth + computing) * run * (rows > 0)

    out = [Buffers(group.part.padded_numel, flat, window(full), where, SCANS)]
    if on_disk:
        out.append(
            Buffers(
                group.part.shard_numel,
                row,
                window(on_disk) if staged_layer or run else min(on_disk, max(1, depth)),
                phases=SCANS,
            )
        )
    if world > 1 and row != flat:
        out.append(Buffers(group.part.padded_numel, row, 1, where, SCANS))
    values = None if policy.decoded is None else policy.decoded.values
    if values is not None:  # a row decoded, for each unit held (``Fetcher._decoded``)
        out.append(Buffers(values.numel, compute, window(group.rows), where, SCANS))
    # a kept layer's gathered row is a pool buffer, unless its stored row (in memory) is the layer
    pooled = [u for u in kept if not direct or store.placement_of("param", u) == "nvme"]
    return out + _kept(group, policy, flat, compute, where, len(kept), len(pooled))


class _Made(NamedTuple):
    """How a group's fetched layer is made (``demand``'s one answer, for every buffer it counts):
    where its buffers live ("host" or "device"), its stored ``row`` dtype, the dtype it is
    gathered as (``flat``: ``GroupPolicy.gathered_as``), whether a stored row in memory is the layer
    itself (``direct``: ``overlap.plan.row_is_layer``) and whether a row staged from NVMe is
    (``staged_layer``: ``overlap.plan.staged_is_layer``)."""

    where: str
    row: torch.dtype
    flat: torch.dtype
    direct: bool
    staged_layer: bool


def _made_as(store: Store, sizing: Sizing, group) -> _Made:
    """How ``group``'s fetched layer is made under ``sizing`` (``_Made``)."""
    world, device = sizing.world_size, sizing.device
    where = "host" if device.type == "cpu" else "device"
    row = store.row_kinds.dtype_of("param", group.name)
    flat = store.row_kinds.policy(group.name).gathered_as(sizing.compute)
    direct = row_is_layer(world, store.param_tier.device, row, device, flat)
    return _Made(where, row, flat, direct, where == "host" and staged_is_layer(world, row, flat))


def _kept_tiles(store: Store, sizing: Sizing, group, on_disk: bool, count: int) -> list[Buffers]:
    """The pool buffers of ``count`` tiles of ``group`` a training step keeps from their forward
    fetch into their backward (``overlap.tile_runs.kept_tiles``, one rank), in the scans: what a
    kept layer holds (``_kept``), none where the stored row in memory is the layer (handed out, not
    owned: nothing to keep)."""
    made = _made_as(store, sizing, group)
    policy = store.row_kinds.policy(group.name)
    pooled = count if on_disk or not made.direct else 0
    kept = _kept(group, policy, made.flat, sizing.compute, made.where, count, pooled)
    return [b._replace(phases=SCANS) for b in kept]


def _kept(
    group: Group,
    policy: GroupPolicy,
    gathered: torch.dtype,
    compute: torch.dtype,
    where: str,
    kept: int,
    pooled: int,
) -> list[Buffers]:
    """The buffers of the ``kept`` layers the fetcher holds (``Fetcher.release``, ``Kept``), for
    the whole step: each as fetched, decoded (its policy's ``decoded``: a buffer of the compute
    dtype, wherever its row is) or as gathered (in ``gathered``, ``GroupPolicy.gathered_as``), and
    where it lends some leaves' codes and decodes the others (``lent_leaves``) the gathered row
    those view besides. ``pooled``: those of the kept layers whose gathered row is a pool buffer,
    not the stored row itself (``row_is_layer``)."""
    decode = policy.decoded
    decoded = [] if decode is None else [Buffers(decode.values.numel, compute, kept, where)]
    if decode is not None and not policy.lent_leaves:
        return decoded
    return [*decoded, Buffers(group.part.padded_numel, gathered, pooled, where)]
