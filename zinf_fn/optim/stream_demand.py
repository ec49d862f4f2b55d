"""What the optimizer's stream holds and reads, declared beside ``optim.readahead`` for the memory
model: the buffers the read-ahead reads into and the write-behind retires, per phase, and the kept
16-bit rows.

A step's optimizer pass (``_pass``: its units in order, the masters they lend, its kinds and phase)
is the one ``Updater.begin_step`` or ``Updater.stream_clipped`` begins ``ReadAhead`` on; ``demand``
counts the pieces a window of that pass holds, the lent masters, and the last writes left in flight
into the next step (``planner.memory.demands`` sums them with the other parts').
"""

from __future__ import annotations

from typing import NamedTuple

from ..layout.demand import Buffers, Demand, Sizing, pieces_held, shared
from ..layout.units import STAGES, Unit
from ..store import Store
from .passes import pass_order, pieces_ahead, streamed_units
from .pieces import pieces


class _Pass(NamedTuple):
    """A step's optimizer pass, as a demand sees it (``_pass``): what it reads, in which order and
    phase."""

    order: list[Unit]
    lent: set[tuple[str, int]]
    ahead: int
    kinds: list[str]
    phase: tuple[str, ...]


def _pass(store: Store, sizing: Sizing) -> _Pass:
    """The pass of ``Updater.begin_step`` (one-pass: the stages' streamed units in reverse scan
    order) or of ``Updater.stream_clipped`` (every streamed unit, tiles after the stages, in scan
    order)."""
    depth, clipping = sizing.depth, sizing.clipping
    rows = {(u.group, u.row) for us in streamed_units(store, sizing.n_layers).values() for u in us}
    every = [u for g in store.groups.values() for u in store.row_units(g, sizing.n_layers)]
    stages = sorted((u for u in every if u.group in STAGES), key=lambda u: u.index)
    # the updater's
    units_ = [*stages, *(u for u in every if u.group not in STAGES)] if clipping else stages
    order = pass_order(units_, clipping, lambda u: (u.group, u.row) in rows)
    # the masters lent (none with clipping)
    lent = {(u.group, u.row) for u in order if store.row_kinds.policy(u.group).lends(u)}
    return _Pass(
        order,
        lent,
        pieces_ahead(depth, len(lent) == len(order)),
        [*(["grad"] if clipping else []), *store.row_kinds.update_kinds()],
        ("update",) if clipping else ("backward",),
    )


def demand(store: Store, sizing: Sizing) -> Demand:
    """What the optimizer's stream holds and reads (see ``zinf_fn.layout.demand``), per group whose
    optimizer rows are on NVMe: the buffers the read-ahead reads into, each held from its read until
    the write-behind retires its write (a stashed gradient's piece goes back after the update). Of
    every kind a pass reads (``_pass``; not a master lent whole), a window of consecutive pieces
    (``pieces_held``): those read ahead (``pieces_ahead``; none for a tile's rows in the one-pass
    update, read as their gradient completes), each worker's and the write-behind's ``depth`` (and
    its room, ``ReadAhead.room``: no more of a size than the reads ahead held fewer of); as many
    16-bit copies cast from them where the params are on NVMe too. Lent masters (their policy's
    ``lent``): ``depth`` + 1 read ahead and the one the backward fetch asks for before its update is
    taken, each worker's, ``depth`` written. Left in flight into the next forward: the room and the
    last ``depth`` writes, these into its turn too (``_last_writes``), where the one-pass reads its
    first window. Every NVMe row of those kinds is read once per step, in backward."""
    depth, workers = sizing.depth, max(1, sizing.workers)
    piece, pass_ = sizing.piece_numel, _pass(store, sizing)
    buffers, read = list(_last_writes(store, sizing, pass_)), 0
    # (kind, phases, window) -> the tiles' (one window serves them all)
    tiles: dict[tuple, list[Buffers]] = {}
    streamed = streamed_units(store, sizing.n_layers)
    for name, rows in ((n, rows) for n, rows in streamed.items() if rows):
        shard, n_lent = (
            store.groups[name].part.shard_numel,
            sum((u.group, u.row) in pass_.lent for u in rows),
        )
        # pieces read ahead
        first = pass_.ahead if any(u.group == name for u in pass_.order) else 0
        for kind, dtype, n_rows in _piece_kinds(store, name, rows, pass_.kinds, n_lent > 0):
            # a stashed gradient is not written
            window = first + workers + (0 if kind == "grad" else depth)
            for phases, held in (
                (pass_.phase, window),
                (("forward",), first if kind != "grad" else 0),
                (("turn",), first if pass_.phase == ("backward",) else 0),
            ):
                made = [
                    Buffers(n, dtype, c, phases=phases)
                    for n, c in _held(store, kind, name, n_rows, held, piece)
                ]
                out = buffers if name in STAGES else tiles.setdefault((kind, phases, held), [])
                out += made
        # the pass's; the room's in the next forward; those the one-pass reads at the turn
        if n_lent:
            dtype = store.row_kinds.dtype_of(store.row_kinds.lent_kind, name)
            buffers += [
                Buffers(shard, dtype, min(n_lent, n), phases=phases)
                for n, phases in (
                    (2 * depth + 2 + workers, pass_.phase),
                    (depth + 2, ("forward",)),
                    (depth + 2, ("turn",)),
                )
            ]
        params_on_disk = (
            sum(store.placement_of("param", u) == "nvme" for u in rows)
            if store.row_kinds.remainder
            else 0
        )
        read += len(rows) * sum(
            store.row_kinds.row_nbytes(k, name) for k in store.row_kinds.opt_kinds(None, name)
        ) + params_on_disk * store.row_kinds.row_nbytes("param", name)  # a remainder's high half
    buffers += [b for (_, _, window), made in tiles.items() for b in shared(made, window)]
    return Demand("optimizer read ahead", tuple(buffers), read_backward=read)


def _piece_kinds(
    store: Store, group: str, rows: list[Unit], kinds: list[str], lends: bool
) -> list[tuple]:
    """``(kind, dtype, rows)`` of the rows a pass reads of ``group``'s streamed ``rows``
    (``RowKinds.rows_of``; not the row lent whole, ``RowKinds.lent_kind``), and of the 16-bit copies
    cast from them ("copy": of the rows whose params are on NVMe too)."""
    out = [
        (k, store.row_kinds.dtype_of(k, group), len(rows))
        for k in store.row_kinds.rows_of(kinds, group)
        if not (lends and k == store.row_kinds.lent_kind)
    ]
    casts = (
        sum(store.placement_of("param", u) == "nvme" for u in rows)
        if store.row_kinds.casts_copies
        else 0
    )
    return out + ([("copy", store.row_kinds.param_dtype, casts)] if casts else [])


def _held(
    store: Store, kind: str, group: str, rows: int, window: int, piece: int
) -> list[tuple[int, int]]:
    """``(numel, count)`` of ``kind``'s buffers a window of ``window`` consecutive pieces holds over
    ``rows`` rows (``pieces_held``); a row read whole with its unit's first piece
    (``RowKinds.whole_row``: int8 scales) is held whole by each unit the window touches, one more
    than its pieces' units at most."""
    shard = store.groups[group].part.shard_numel
    if not store.row_kinds.whole_row(kind):
        return pieces_held(shard, piece, rows, window)
    return (
        [(store.row_kinds.row_numel(kind, group), min(rows, -(-window // -(-shard // piece)) + 1))]
        if window
        else []
    )


def _last_writes(store: Store, sizing: Sizing, pass_: _Pass) -> list[Buffers]:
    """The buffers of a pass's last ``depth`` writes (a piece's rows and 16-bit copy; after a unit's
    last piece, its lent row and the rows read whole), which the write-behind still holds when the
    next step's pass begins (pressed back to ``depth``: they are waited for before its first update
    or stash): in the next forward and its turn."""
    piece, left = sizing.piece_numel, sizing.depth
    out: list[Buffers] = []
    for unit in reversed(pass_.order):
        lends, shard = (unit.group, unit.row) in pass_.lent, store.group_of(unit).part.shard_numel
        kinds = [
            (k, d)
            for k, d, n in _piece_kinds(store, unit.group, [unit], pass_.kinds, lends)
            if k != "grad" and n
        ]
        whole = [
            (store.row_kinds.row_numel(k, unit.group), d)
            for k, d in kinds
            if store.row_kinds.whole_row(k)
        ]
        whole += (
            [(shard, store.row_kinds.dtype_of(store.row_kinds.lent_kind, unit.group))]
            if lends
            else []
        )
        writes = [whole] if whole else []
        pieced = [d for k, d in kinds if not store.row_kinds.whole_row(k)]
        writes += [[(hi - lo, d) for d in pieced] for lo, hi in reversed(pieces(shard, piece))]
        for group in writes[:left]:
            out += [Buffers(n, d, 1, phases=("forward", "turn")) for n, d in group]
        left -= min(left, len(writes))
        if not left:
            break
    return out


def kept_demand(store: Store, rows: list[Unit]) -> Demand:
    """What the kept rows hold (their policy's ``resident``; ``Runtime.keep_first_rows``): a copy of
    each kept 16-bit row on NVMe of ``rows`` (the stages' units and their frozen rows: no tile row
    is kept), outside the pool (an fp32 param row is its master row: kept at its own size)."""
    held = 0
    for unit in rows:
        if store.row_kinds.policy(unit.group).keeps(
            unit
        ):  # a row on NVMe (``optim.passes.keeps_resident``)
            held += store.group_of(unit).part.shard_numel * store.row_kinds.param_dtype.itemsize
    return Demand("kept 16-bit rows", held=held)
