"""Read-ahead of the optimizer's rows, in pieces, for tiers that keep nothing resident (NVMe).

The optimizer side of a step touches the units in an order known before the step starts: in the
one-pass path the gradients arrive head, blocks L-1..0, embed (the reverse scan), and the clipped
second pass walks the units in scan order. A unit's update streams its rows in *pieces*
(``optim.pieces``: fixed element ranges of the row, ``Config.optimizer_piece_bytes`` of fp32 each).
``ReadAhead`` reads the pieces of the moments (and of the master and the stashed gradient) ``depth``
pieces ahead of the one being updated, into pool buffers: a ``stream.Window`` over the pass's
pieces. ``overlap.stream.WriteBehind`` writes each updated piece out from those buffers and returns
them to the pool once written. The optimizer's host memory is then O(pieces in flight), not
O(layer).

One exception, the price of reading each parameter once per step: where the backward fetch of a unit
casts its 16-bit copy from the master (``lends_master``: the params are on NVMe too), the master
rows are read whole, ``depth + 1`` units ahead (a second ``Window``, over units), lent to the fetch
(``master_of``) and then taken by the update, whose pieces carry the other kinds only. With a
remainder master the row lent is the param row itself (``RowKinds.lent_kind``: the master's high
half, which the update reads anyway, is the copy the fetch wants), updated in place piece by piece
and written whole. A master is held whole from its backward fetch to its update, so only a unit
whose row is at most ``LEND_PIECES`` pieces lends it: a larger one reads its 16-bit copy for the
fetch (2 bytes per parameter more) and keeps the optimizer's memory at pieces in flight. Where every
unit of a pass lends (all are that small), the pieces are read ``depth * LEND_PIECES`` ahead, as far
as the masters: a unit's moments are in memory by the time its gradient is, so the step's last
updates (block 0's, the embedding's) wait on no read.

    plain loop this equals (per unit, in order):
        for lo, hi in pieces(unit):
            rows = {kind: tier.read(kind, unit, lo, hi)}; update(rows); for kind: tier.write(kind,
            unit, lo, rows[kind])
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..io.buffers import BufferPool
from ..layout.demand import Buffers, Demand, Sizing, pieces_held, shared
from ..layout.units import STAGES, Unit, key
from ..observe.trace import WaitClock
from ..offload.transfers import Transfer
from ..overlap.stream import Room, Window, buffer_key
from ..store import Store
from .passes import pass_order, pieces_ahead, streamed_units
from .pieces import pieces


class Piece(NamedTuple):
    """Elements ``[lo, hi)`` of ``unit``'s rows: one item of a pass."""

    unit: Unit
    lo: int
    hi: int


# the reads of one piece (or one lent master row), by kind, in issue order
Reads = dict[str, Transfer]


class _PassReads(NamedTuple):
    """What a ``ReadAhead`` reads in the pass in progress, made by each ``begin``: the kinds, the
    units whose masters are lent (and their positions), the pass's pieces in order (and their
    indices), the two windows over them, and per size the most buffers its reads ahead have held at
    once (``ReadAhead.room``)."""

    kinds: list[str]
    lent: list[Unit]
    position: dict[tuple, int]
    items: list[Piece]
    item_of: dict[tuple, int]
    masters: Window[Reads]
    pieces: Window[Reads]
    high_water: Room


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


class ReadAhead:
    """Reads the pieces of ``kinds`` rows of the units of a pass up to ``depth`` pieces ahead of the
    one taken (and, lending masters, whole master rows ``depth + 1`` units ahead); ``waits`` counts
    the compute thread's time blocked on them.

    Nineteen methods, for a reason: seven are what the updater's strategies call (``begin``,
    ``pieces_of``, ``take_piece``, ``take_master``, ``master_of``, ``room``, ``abort``), the others
    the named steps of those over its two windows (pieces, lent masters) under one lock.

    Its state is the pass in progress (``_reading``, a ``_PassReads``): each ``begin`` makes the
    pass's record afresh (its plan of pieces and lent masters, a value of that pass, with the two
    windows that read it), and nothing of it outlives the pass."""

    def __init__(
        self,
        store: Store,
        pool: BufferPool,
        device: torch.device,
        depth: int,
        waits: WaitClock,
        piece_numel: int,
    ):
        self.store, self.pool, self.device, self.depth = store, pool, device, depth
        self.piece_numel = piece_numel
        self._lock = threading.Lock()
        self.waits = waits  # counts only when the update runs on the compute thread
        # what the pass in progress reads: none yet (``begin`` starts one)
        self._reading = _PassReads(
            kinds=[],
            lent=[],
            position={},
            items=[],
            item_of={},
            masters=Window((), self._issue_master, self._give_back, depth),
            pieces=Window((), self._issue_piece, self._give_back, depth),
            high_water={},
        )

    def begin(self, order: list[Unit], kinds: list[str], clipping: bool = True) -> None:
        """Start a pass over ``order`` reading ``kinds``; the first ``depth`` pieces' reads are
        issued now.

        ``clipping`` False (the one-pass update): the master rows of the units that lend theirs
        (their policy's ``lent``: ``optim.passes.lends_master``) are read whole per unit instead
        (``take_master``, ``master_of``).
        """
        with self._lock:
            previous = self._reading
            assert not (previous.pieces.outstanding or previous.masters.outstanding), (
                "ReadAhead.begin while reads of the previous pass are pending"
            )
            lend = self.store.row_kinds.lent_kind in kinds
            # the units whose masters are lent
            lends = lend and not clipping
            lent = [u for u in order if lends and self.store.row_kinds.policy(u.group).lends(u)]
            items = [Piece(u, lo, hi) for u in order for lo, hi in self.pieces_of(u)]
            # Several update workers may take a little out of order: reads issued behind the cursor
            # stay.
            # one unit further ahead than the pieces: the backward fetch needs a master before its
            # update does (a lent row is at most LEND_PIECES pieces)
            masters = Window(
                lent, self._issue_master, self._give_back, self.depth + 1, keep_behind=True
            )
            # where every unit lends (all are small), the pieces are read ahead as far as the
            # masters: a unit's moments are in memory by the time its gradient is, and the last
            # updates of a step do not wait
            ahead = pieces_ahead(self.depth, bool(order) and len(lent) == len(order))
            self._reading = _PassReads(
                kinds=list(kinds),
                lent=lent,
                position={(u.group, u.row): p for p, u in enumerate(lent)},
                items=items,
                item_of={(p.unit.group, p.unit.row, p.lo): i for i, p in enumerate(items)},
                masters=masters,
                pieces=Window(items, self._issue_piece, self._give_back, ahead, keep_behind=True),
                high_water={},
            )
            self._reading.masters.advance(0)
            self._reading.pieces.advance(0)
            self._reading.high_water.update(self._held())

    def pieces_of(self, unit: Unit) -> list[tuple[int, int]]:
        return pieces(self.store.group_of(unit).part.shard_numel, self.piece_numel)

    def take_master(self, unit: Unit) -> torch.Tensor | None:
        """The whole row ``unit`` lends (``RowKinds.lent_kind``: the master, or a remainder master's
        param row) where this pass lends it (a pool buffer the caller hands on to ``WriteBehind``),
        else None: it comes in the pieces."""
        entry = self._at_lent(unit, self._take_master_at)
        if entry is None:
            return None
        self._wait(entry, unit)
        return entry[self.store.row_kinds.lent_kind].buf

    def _take_master_at(self, position: int) -> Reads:
        """Take the lent master at ``position`` and move the masters' window past it (call under the
        lock)."""
        entry = self._reading.masters.take(position)
        self._reading.masters.advance(max(self._reading.masters.cursor, position + 1))
        self._raise_high_water()
        return entry

    def take_piece(self, unit: Unit, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Elements ``[lo, hi)`` of ``unit``'s rows, by kind (pool buffers the caller hands on or
        gives back).

        A unit outside the pass's order (a tile of a tiled leaf, updated as its gradient completes)
        is read on demand, its master with it.
        """
        with self._lock:
            i = self._reading.item_of.get((unit.group, unit.row, lo))
            if i is None:
                entry = self._read(unit, lo, hi, self._kinds_of(unit, lo, in_order=False))
            else:
                entry = self._reading.pieces.take(i)
                self._reading.pieces.advance(max(self._reading.pieces.cursor, i + 1))
                self._raise_high_water()
        self._wait(entry, unit)
        return {kind: read.buf for kind, read in entry.items()}

    def room(self) -> Room:
        """Per size, the buffers the pass's reads ahead hold fewer of than at their most (at the end
        of a pass, where nothing is left to read, all of them). The write-behind may keep that many
        more in flight (``StreamedUpdate``): the buffers of each size in flight, read ahead plus
        written behind, stay what they were mid-pass (``demand`` counts them so)."""
        with self._lock:
            held = self._held()
            return {k: max(0, n - held.get(k, 0)) for k, n in self._reading.high_water.items()}

    def _held(self) -> Room:
        """Per size, the buffers of the reads issued and not taken (call under the lock)."""
        held: Room = {}
        for entry in self._reading.pieces.issued() + self._reading.masters.issued():
            for read in entry.values():
                held[buffer_key(read.buf)] = held.get(buffer_key(read.buf), 0) + 1
        return held

    def _raise_high_water(self) -> None:
        for k, n in self._held().items():
            self._reading.high_water[k] = max(self._reading.high_water.get(k, 0), n)

    def master_of(self, unit: Unit) -> Transfer | None:
        """``unit``'s lent row (the master, or a remainder master's param row:
        ``RowKinds.lent_kind``) as this pass reads it ahead for its update (its buffer and read),
        issued now if the window has not reached it yet; None where the pass lends nothing, the unit
        is outside its order, or its update took the row already.

        Until the update takes the unit, the buffer holds the master as it was before this step
        changed it, so a reader that is done with it by then (the backward fetch, ``overlap.fetch``)
        may share it.
        """
        entry = self._at_lent(unit, self._reach_master)
        # None: not lent, or taken (its update began)
        return None if entry is None else entry[self.store.row_kinds.lent_kind]

    def _reach_master(self, position: int) -> Reads | None:
        """The lent master at ``position``, issued now if the window has not reached it yet; None
        where it was taken (call under the lock)."""
        window = self._reading.masters
        if window.peek(position) is None and position >= window.cursor:
            # Step the cursor to bring ``position`` in: every unit from the update's cursor through
            # it is issued in order, none is dropped (the window keeps what is behind its cursor).
            for cursor in range(window.cursor + 1, position - window.depth + 2):
                window.advance(cursor)
        return window.peek(position)

    def _at_lent(self, unit: Unit, at: Callable[[int], Reads | None]) -> Reads | None:
        """``at(position)`` under the lock, ``position`` the unit's among the pass's lent masters;
        None where ``unit`` lends none this pass: the one lookup of a lent master."""
        with self._lock:
            position = self._reading.position.get((unit.group, unit.row))
            return None if position is None else at(position)

    def abort(self) -> None:
        """An aborted pass: wait for the reads issued but not taken and give their buffers back."""
        with self._lock:
            self._reading.masters.close()
            self._reading.pieces.close()

    def _kinds_of(self, unit: Unit, lo: int, in_order: bool) -> list[str]:
        """The rows the piece of ``unit`` at ``lo`` carries: the pass's kinds as its group stores
        them (``RowKinds.rows_of``), less the master where it is lent whole, and the rows read whole
        (the per-block scales, ``RowKinds.whole_row``) with the first piece only."""
        lent = in_order and (unit.group, unit.row) in self._reading.position
        return [
            k
            for k in self.store.row_kinds.rows_of(self._reading.kinds, unit.group)
            if not (lent and k == self.store.row_kinds.lent_kind)
            and not (lo and self.store.row_kinds.whole_row(k))
        ]

    def _issue_master(self, position: int) -> Reads:
        unit = self._reading.lent[position]
        return self._read(
            unit, 0, self.store.group_of(unit).part.shard_numel, [self.store.row_kinds.lent_kind]
        )

    def _issue_piece(self, i: int) -> Reads:
        piece = self._reading.items[i]
        return self._read(
            piece.unit, piece.lo, piece.hi, self._kinds_of(piece.unit, piece.lo, in_order=True)
        )

    def _give_back(self, entry: Reads) -> None:
        _wait_all(entry, self.pool, give_back=True)

    def _wait(self, entry: Reads, unit: Unit) -> None:
        with self.waits.waiting(f"read state {unit.name}"):
            # sync: the rows are read before they are updated
            _wait_all(entry, self.pool, give_back=False)

    def _read(self, unit: Unit, lo: int, hi: int, kinds: list[str]) -> Reads:
        """Issue the reads of elements ``[lo, hi)`` of one unit's ``kinds`` rows into pool buffers
        ("param" from the param tier: a remainder master's high half; the others from the optimizer
        tier; a row read whole, ``RowKinds.whole_row``, whole)."""
        entry = {}
        for kind in kinds:
            whole = self.store.row_kinds.whole_row(kind)
            numel = self.store.row_kinds.row_numel(kind, unit.group) if whole else hi - lo
            buf = self.pool.take(
                numel, self.store.row_kinds.dtype_of(kind, unit.group), self.device
            )
            read = self.store.tier_of(kind).read_(
                key(unit.group, kind), unit.row, buf, 0 if whole else lo
            )
            entry[kind] = Transfer(buf, read, True)
        return entry


def _wait_all(entry: Reads, pool: BufferPool, give_back: bool) -> None:
    """Wait for every read of one entry; on a failure (or with ``give_back``) its buffers go back to
    the pool, then the first error is raised."""
    error = None
    for read in entry.values():
        try:
            read.future.result()  # sync: every read of the entry has completed
        except Exception as e:  # wait for every read of the entry, then raise
            error = error or e
    if error is not None or give_back:
        for read in entry.values():
            pool.give(read.buf)
    if error is not None:
        raise error
