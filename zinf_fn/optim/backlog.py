"""The gradients waiting for their update: the backlog's bound and each gradient's weight in it
(what the runtime builds the ``UpdateQueue`` with), the tile throttle, and what the gradients hold
from the vjp that makes one to the end of its update (their ``demand``, summed by the memory model).

The backlog (``optim.queue``) is bounded by weight: ``backlog_bytes`` over ``grad_weight`` is how
many gradients of a size may wait (``grad_slots``); the gradients' demand counts the buffers those
slots hold, per group and phase, as ``Updater.submit`` queues them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..layout.demand import Buffers, Demand, Sizing, shared
from ..layout.units import STAGES
from ..scan.grads import keeps_leaf_grads
from ..store import Store
from .passes import LEND_PIECES
from .pieces import pieces


def backlog_bytes(workers: int, depth: int, piece_numel: int) -> int:
    """The weight of the gradients that may wait for their update: ``workers + depth + 1`` slots of
    ``LEND_PIECES`` pieces, each gradient weighing its bytes or a slot, whichever is more (so as
    many small gradients wait as workers + depth + 1, and a layer-sized one alone where layers are
    large)."""
    return (workers + depth + 1) * LEND_PIECES * piece_numel * 4


def grad_weight(shard_numel: int, piece_numel: int) -> int:
    """A waiting gradient's weight in ``backlog_bytes``: its fp32 bytes, or a slot of
    ``LEND_PIECES`` pieces."""
    return max(shard_numel, LEND_PIECES * piece_numel) * 4


def demand(
    store: Store, sizing: Sizing, reuses: Callable[[str], bool] = lambda group: False
) -> Demand:
    """What the gradients hold (see ``zinf_fn.layout.demand``), per group, from the vjp that makes
    one to the end of its update: the one the backward is making and those waiting for their update
    (``grad_slots`` of the backlog), at most one per row; at the turn
    (``zinf_fn.layout.demand.PHASES``), the first one. Padded flat fp32 buffers on the device as the
    backward makes them; with several ranks the flat buffer is one at a time and the shards
    (``shard_numel``) wait; where the optimizer is on the host and compute is not, the shards wait
    on the host. With one rank and nothing that needs a flat buffer
    (``scan.grads.keeps_leaf_grads``) they are the vjp's own tensors, outside the pool (``held``):
    the one the backward is making and the one each worker updates, whose leaves it releases as it
    goes (more wait only where the updates fall behind; the allocator, unlike the pool, gives them
    back). With clipping the backward's gradients are stashed (the write-behind holds them:
    ``overlap.stream.demand``) and the second pass copies the stash of a row in memory into a buffer
    for its update. A group never written (its policy's ``written``: frozen) has none. A tile's:
    ``_tile_grads`` (``reuses(group)``: whether a tile of that group writes its gradient into its
    fetched buffer, ``tiling.leaf_tiles.reuses_fetched``). With a remainder master, each worker
    joins the fp32 master of the piece it updates (``optim.masters``)."""
    device, opt = sizing.device, store.opt_tier.device
    here = "host" if device.type == "cpu" else "device"
    there = "host" if opt.type == "cpu" else "device"
    leaves = keeps_leaf_grads(
        sizing.world_size, sizing.grad_accum, sizing.clipping, sizing.compute, device, opt
    )
    # a frozen group has none
    trained = [g for g in store.groups.values() if store.row_kinds.policy(g.name).written]
    stages = [g for g in trained if leaves and g.name in STAGES]  # a tile's gradient is flat
    sizes = sorted((g.spec.numel * 4 for g in stages for _ in range(g.rows)), reverse=True)
    # the one being made, each worker's (released as it goes)
    held = sum(sizes[: max(1, sizing.workers) + 1])
    buffers = [
        b
        for g in trained
        if g.name in STAGES and g not in stages
        for b in _flat_grads(store, sizing, g, here, there)
    ]
    tiles = [g for g in trained if g.name not in STAGES]
    return Demand(
        "gradients",
        (
            *buffers,
            *_tile_grads(store, sizing, tiles, here, there, reuses),
            *_scratch(store, sizing, there, trained),
        ),
        held=held,
    )


def _tile_grads(
    store: Store,
    sizing: Sizing,
    tiles: list,
    here: str,
    there: str,
    reuses: Callable[[str], bool],
) -> list[Buffers]:
    """The gradient buffers of the tiles (``demand``): of each tile size, ``TILE_BACKLOG`` updates
    unfinished (the runtime's tile throttle; none with clipping, whose stash the write-behind holds)
    and the one being sent, unless it is written into its tile's fetched buffer (``reuses(group)``;
    the fetcher's demand counts that one), each update the gradients of
    ``overlap.tile_runs.update_run`` tiles (a run's wait for its last); with clipping, in the second
    pass, the stash of a row in memory copied for its update."""
    clipping = sizing.clipping
    sent: list[Buffers] = []
    copied: list[Buffers] = []
    for g in tiles:
        run = store.row_kinds.policy(g.name).update_run
        count = run * ((0 if clipping else TILE_BACKLOG) + (0 if reuses(g.name) else 1))
        sent.append(
            Buffers(
                g.part.padded_numel, torch.float32, min(g.rows, count), here, ("turn", "backward")
            )
        )
        in_memory = sum(
            store.placement_of("master", u) != "nvme" for u in store.row_units(g, sizing.n_layers)
        )
        if clipping and in_memory:
            waiting = grad_slots(sizing, g.part.shard_numel) + 1
            copied.append(
                Buffers(
                    g.part.shard_numel, torch.float32, min(in_memory, waiting), there, ("update",)
                )
            )
    # of a size, what one tile's update backlog holds: at most the most one of its groups would
    cap = max((b.count for b in sent), default=0)
    return [
        b
        for b in shared(sent, cap) + shared(copied, max((b.count for b in copied), default=0))
        if b.count
    ]


def _flat_grads(store: Store, sizing: Sizing, g, here: str, there: str) -> list[Buffers]:
    """The flat gradient buffers of group ``g`` (``demand``): made ``here`` (the compute device),
    waiting ``there`` (the optimizer's)."""
    world, clipping = sizing.world_size, sizing.clipping
    waiting = min(g.rows, grad_slots(sizing, g.part.shard_numel) + 1)
    out = [
        Buffers(
            g.part.padded_numel,
            torch.float32,
            1 if clipping or world > 1 else waiting,
            here,
            ("backward",),
        ),
        Buffers(g.part.padded_numel, torch.float32, 1, here, ("turn",)),
    ]
    if world > 1:
        out.append(
            Buffers(
                g.part.shard_numel, torch.float32, 1 if clipping else waiting, here, ("backward",)
            )
        )
    if not clipping and there != here:
        out.append(Buffers(g.part.shard_numel, torch.float32, waiting, there, ("backward",)))
    in_memory = [
        u for u in store.row_units(g, sizing.n_layers) if store.placement_of("master", u) != "nvme"
    ]
    if clipping and in_memory:
        out.append(
            Buffers(
                g.part.shard_numel, torch.float32, min(len(in_memory), waiting), there, ("update",)
            )
        )
    return out


# Tile updates left unfinished while the backward goes on (the runtime's tile throttle): one, the
# update of tile t - 1 beside tile t's backward. A tile's gradient is its fetched buffer
# (``tiling.leaf_tiles.reuses_fetched``), so each unfinished update holds a buffer of its tile's
# size beside the fetch window's depth + 1, and the pool keeps that many of every tile size from the
# first step on (``planner.memory.pool_plan``): two would add a buffer of each size to every step's
# working memory for a second update queued, which the worker rarely needs.
TILE_BACKLOG = 1


def grad_slots(sizing: Sizing, shard_numel: int) -> int:
    """How many gradients of ``shard_numel`` elements may wait for their update at once
    (``backlog_bytes`` over ``grad_weight``; always the newest)."""
    piece = sizing.piece_numel
    return max(
        1,
        backlog_bytes(sizing.workers, sizing.depth, piece) // grad_weight(shard_numel, piece),
    )


def _scratch(store: Store, sizing: Sizing, where: str, trained: list) -> tuple[Buffers, ...]:
    """With a remainder master: each worker's fp32 master of the piece it updates, joined
    (``optim.masters``), of the ``trained`` groups."""
    if not store.row_kinds.remainder:
        return ()
    piece, workers = sizing.piece_numel, max(1, sizing.workers)
    passes = ("update",) if sizing.clipping else ("backward",)
    sizes = {hi - lo for g in trained for lo, hi in pieces(g.part.shard_numel, piece)}
    return tuple(Buffers(n, torch.float32, workers, where, passes) for n in sorted(sizes))
