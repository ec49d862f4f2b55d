"""Read-ahead of the optimizer's rows, in pieces, for tiers that keep nothing resident (NVMe).

The optimizer side of a step touches the units in an order known before the step starts: in the
one-pass path the gradients arrive head, blocks L-1..0, embed (the reverse scan), and the clipped
second pass walks the units in scan order. A unit's update streams its rows in *pieces*
(``optim.pieces``: fixed element ranges of the row, ``Config.optimizer_piece_bytes`` of fp32 each).
``ReadAhead`` reads the pieces of the moments (and of the master and the stashed gradient) ``depth``
pieces ahead of the one being updated, into pool buffers: a ``window.Window`` over the pass's
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
from ..layout.units import Unit, key
from ..observe.trace import WaitClock
from ..offload.transfers import Transfer
from ..overlap.stream import Room, buffer_key
from ..overlap.window import Window
from ..store import Store
from .passes import pieces_ahead
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
