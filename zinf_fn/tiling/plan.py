"""The tile plan of a step (data): every tile fetch in the order the tiled ops will ask for it.

Each unit fetch of the step's plan (``overlap.plan``) with tiled leaves makes the fetches of its
tiles, per micro-batch: the forward visits each tiled leaf's tiles 0..T-1, and where gradients are
computed the recompute does that again and the backward visits them in reverse, where its op's
backward reads them (``backward_reads``). The tile prefetcher (``tiling.step_tiles``) runs this plan
ahead of the ops, and the planner counts a step's tile reads from it (``demand``)::

    a block's tiled linear      forward 1, backward unit: recompute 1 (none where kept) + backward 1
    a trained head              forward 1 + backward 1 (one unit fetch: no recompute)
    a frozen head               forward 1 (its pull-back to h is made there)
    an embedding, trained       forward 1, backward unit: recompute 1 (the tiles its ids use)
    an embedding, frozen        forward 1 (no backward unit)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from ..layout.demand import Demand, Sizing
from ..layout.units import BLOCKS, EMBED, HEAD, units
from ..overlap.plan import FetchOp, format_plan, train_plan
from ..store import Store
from .layout import TiledLeaf, TileLayout, TileOp


class PassOps(NamedTuple):
    """One micro-batch's tile fetches of one unit fetch: its forward (a backward unit's recompute),
    then its backward."""

    forward: tuple[TileOp, ...]
    backward: tuple[TileOp, ...]


def unit_passes(layout: TileLayout, op: FetchOp, n_micro: int, train: bool) -> list[PassOps]:
    """The tile fetches one unit fetch will make, per micro-batch, in the order the tiled ops ask
    for them.

    Per micro-batch: the forward visits the tiled leaves in use order (``TileLayout.in_use_order``),
    tiles 0..T-1; a backward-phase unit's recompute does that for the leaves it recomputes
    (``TileLayout.in_recompute``: a recorded block's last linear is not), and where gradients are
    computed (backward-phase units, and the head in a training step) the backward visits the leaves
    in reverse, tiles T-1..0.
    """
    leaves = layout.in_use_order(op.unit.group)
    if not leaves:
        return []
    ahead = layout.in_recompute(op.unit.group) if op.phase == "backward" else leaves
    fwd = tuple(
        TileOp(layout.tile_unit(leaf, op.unit, t), "forward")
        for leaf in ahead
        for t in range(leaf.n_tiles)
    )
    bwd = tuple(
        TileOp(layout.tile_unit(leaf, op.unit, t), "backward")
        for leaf in reversed(leaves)
        if backward_reads(layout, leaf)
        for t in reversed(range(leaf.n_tiles))
    )
    return [PassOps(fwd, bwd if computes_grads(op, train) else ())] * n_micro


def backward_reads(layout: TileLayout, leaf: TiledLeaf) -> bool:
    """Whether the backward of ``leaf``'s op fetches its tiles: the one rule, that the tile plan and
    the planner's reads follow. A block's tiled linear's does (``dx = g W``); the embedding's lookup
    never (``tiling.vocab``: its gradient is the output's rows added at the ids); the head's
    cross-entropy only where its weight trains (``tiling.cross_entropy``: a frozen head's pull-back
    to h is made in forward). A stage's tiled leaf is the op its stage runs (a tiled embedding is
    looked up by ``tiling.embedding``, a tiled head read by ``tiling.linear_cross_entropy``); an op
    that fetches otherwise is served on demand (``tiling.step_tiles``), never wrongly."""
    if leaf.stage == EMBED:
        return False
    return leaf.stage != HEAD or leaf.group not in layout.frozen


def unit_tile_ops(
    layout: TileLayout,
    op: FetchOp,
    n_micro: int,
    train: bool,
    routed: Mapping[int, PassOps] | None = None,
    planned: list[PassOps] | None = None,
) -> list[TileOp]:
    """``unit_passes`` (or ``planned``, what it gave) in one list: every tile fetch of the unit
    fetch, in order; ``routed``: micro-batch -> its pass where the ops' routing rewrote it
    (``tiling.routed``)."""
    routed = routed or {}
    out: list[TileOp] = []
    for m, one in enumerate(planned or unit_passes(layout, op, n_micro, train)):
        one = routed.get(m, one)
        out.extend((*one.forward, *one.backward))
    return out


def computes_grads(op: FetchOp, train: bool) -> bool:
    """Whether the unit fetched by ``op`` runs a backward: in training, backward-phase units and the
    head."""
    return train and (op.phase == "backward" or op.unit.group == HEAD)


def step_tile_plan(layout: TileLayout, plan: list[FetchOp], n_micro: int, train: bool):
    """(tile ops of the whole step, [start, end) of each unit fetch's ops in it)."""
    ops, sections = [], []
    for op in plan:
        mine = unit_tile_ops(layout, op, n_micro, train)
        sections.append((len(ops), len(ops) + len(mine)))
        ops.extend(mine)
    return ops, sections


class PlannedFetch(NamedTuple):
    """One tile fetch of a training step's plan: the op, the phase that computes with it
    ("forward": a unit of the forward scan; "backward": the head or a unit of the reverse scan), and
    whether it is a block's backward unit's recompute (which a block that kept its activations
    skips, ``tiling.routed.without_recompute``)."""

    op: TileOp
    phase: str
    recompute: bool


def step_fetches(layout: TileLayout, plan: list[FetchOp], n_micro: int) -> list[PlannedFetch]:
    """Every tile fetch of a training step of ``plan``, in order, as planned before any op runs
    (every expert fetched, no tape kept: what routing and kept tapes leave out is the planner's
    expectation, ``planner.sizes``)."""
    out: list[PlannedFetch] = []
    for op in plan:
        phase = "forward" if op.phase == "forward" and op.unit.group != HEAD else "backward"
        # the forward of a block's backward unit is its recompute (which a kept tape skips)
        again = op.phase == "backward" and op.unit.group == BLOCKS
        for one in unit_passes(layout, op, n_micro, train=True):
            out += [PlannedFetch(tile_op, phase, again) for tile_op in one.forward]
            out += [PlannedFetch(tile_op, phase, False) for tile_op in one.backward]
    return out


class TileReads(NamedTuple):
    """NVMe bytes of one tile group's param rows a training step reads (this rank): in forward, in
    backward, and of the backward's, those of recomputes."""

    forward: int = 0
    backward: int = 0
    recompute: int = 0


def step_reads(layout: TileLayout, store: Store, sizing: Sizing) -> dict[str, TileReads]:
    """Per tile group, the NVMe bytes a training step's tile fetches read (``step_fetches``): every
    fetch of a tile whose row is on NVMe reads the row, as often as the plan fetches it (a tile's
    layer is never held, and its fetch casts no master lent for the update: ``tiling.runs``'
    ``Fetcher.start`` derives nothing)."""
    plan = train_plan(units(sizing.n_layers), sizing.embed_trains, sizing.reuse)
    out: dict[str, TileReads] = {}
    for fetch in step_fetches(layout, plan, sizing.grad_accum):
        unit = fetch.op.unit
        if store.placement_of("param", unit) != "nvme":
            continue
        row = store.row_kinds.row_nbytes("param", unit.group)
        reads = out.get(unit.group, TileReads())
        if fetch.phase == "forward":
            reads = reads._replace(forward=reads.forward + row)
        else:
            again = reads.recompute + (row if fetch.recompute else 0)
            reads = reads._replace(backward=reads.backward + row, recompute=again)
        out[unit.group] = reads
    return out


def demand(layout: TileLayout, store: Store, sizing: Sizing) -> Demand:
    """The NVMe bytes the tile plan reads per step (``step_reads``; its buffers are the fetcher's,
    ``overlap.fetch_demand.demand``): what the engine's ``bytes_read.nvme`` counts of the tile
    groups, every expert fetched and no tape kept (the planner's expectation scales both,
    ``planner.sizes``)."""
    reads = step_reads(layout, store, sizing).values()
    return Demand(
        "tile reads",
        (),
        read_forward=sum(r.forward for r in reads),
        read_backward=sum(r.backward for r in reads),
    )


def _runs(ops: list[TileOp]) -> list[str]:
    """Consecutive ops of one leaf and direction, as 'forward  mlp.fc.w  tiles 0..3 of 4'."""
    lines, i = [], 0
    while i < len(ops):
        j = i
        while (
            j + 1 < len(ops)
            and ops[j + 1].unit.group == ops[i].unit.group
            and ops[j + 1].direction == ops[i].direction
            and abs(ops[j + 1].unit.tile - ops[j].unit.tile) == 1
        ):
            j += 1
        first, last = ops[i].unit, ops[j].unit
        n = j - i + 1
        lines.append(
            f"{ops[i].direction:8s} {first.path:14s} tiles {first.tile}..{last.tile} ({n} fetches)"
        )
        i = j + 1
    return lines


def format_plan_with_tiles(
    layout: TileLayout, plan: list[FetchOp], depth: int, n_micro: int
) -> str:
    """``overlap.plan.format_plan`` with each unit's tile fetches listed under it (one line per
    run)."""
    base = format_plan(plan, depth)
    if not layout:
        return base
    head = [
        "tiled leaves (each tile its own fetch unit, fetched just before use, released right "
        "after):"
    ]
    head += [
        f"  {leaf.describe()}" for stage in layout.leaves for leaf in layout.in_use_order(stage)
    ]
    head.append(
        f"tile fetches run the same prefetch depth ({depth}) over the tile plan below, each "
        "stage's leaves "
        "in the order its apply uses them (tree order until a step has run it)"
    )
    lines = []
    for op, line in zip(plan, base.splitlines(), strict=True):
        lines.append(line)
        ops = unit_tile_ops(layout, op, 1, train=True)
        per_mb = f"  x {n_micro} micro-batches" if n_micro > 1 and ops else ""
        lines += [f"       tile  {run}{per_mb}" for run in _runs(ops)]
    return "\n".join(head + lines)
