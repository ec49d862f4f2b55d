"""Read-ahead of the optimizer's rows, in pieces, for tiers that keep nothing resident (NVMe).

The optimizer side of a step touches the units in an order known before the step starts: in the
one-pass path the gradients arrive head, blocks L-1..0, embed (the reverse scan), and the clipped
second pass walks the units in scan order. A unit's update streams its rows in *pieces*
(``optim.pieces``: fixed element ranges of the row, ``Config.optimizer_piece_bytes`` of fp32 each).
``ReadAhead`` reads the pieces of the moments (and of the master and the stashed gradient) ``depth``
pieces ahead of the one being updated, into pool buffers: a ``stream.Window`` over the pass's pieces.
``overlap.stream.WriteBehind`` writes each updated piece out from those buffers and returns them to the
pool once written. The optimizer's host memory is then O(pieces in flight), not O(layer).

One exception, the price of reading each parameter once per step: where the backward fetch of a unit
casts its 16-bit copy from the master (``lends_master``: the params are on NVMe too), the master rows
are read whole, ``depth + 1`` units ahead (a second ``Window``, over units), lent to the fetch
(``master_of``) and then taken by the update, whose pieces carry the other kinds only. A master is held
whole from its backward fetch to its update, so only a unit whose row is at most ``LEND_PIECES`` pieces
lends it: a larger one reads its 16-bit copy for the fetch (2 bytes per parameter more) and keeps the
optimizer's memory at pieces in flight. Where every unit of a pass lends (all are that small), the
pieces are read ``depth * LEND_PIECES`` ahead, as far as the masters: a unit's moments are in memory by
the time its gradient is, so the step's last updates (block 0's, the embedding's) wait on no read.

    plain loop this equals (per unit, in order):
        for lo, hi in pieces(unit):
            rows = {kind: tier.read(kind, unit, lo, hi)}; update(rows); for kind: tier.write(kind, unit, lo, rows[kind])
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..demand import Buffers, Demand, pieces_held, shared
from ..io.buffers import BufferPool
from ..offload.transfers import Transfer
from ..overlap.stream import Room, Window, buffer_key
from ..store import Store
from ..trace import WaitClock
from ..units import STAGES, Unit, key, units
from .pieces import piece_numel, pieces

if TYPE_CHECKING:   # type names only: the layout step and the config sit above the optimizer
    from ..config import Config
    from ..layout import Layout


class Piece(NamedTuple):
    """Elements ``[lo, hi)`` of ``unit``'s rows: one item of a pass."""

    unit: Unit
    lo: int
    hi: int


Reads = dict[str, Transfer]   # the reads of one piece (or one lent master row), by kind, in issue order

LEND_PIECES = 4   # the largest master row lent whole, in pieces: (depth + 2) such rows are held at once


def fits_whole(shard_numel: int, piece_numel: int) -> bool:
    """Whether a row of ``shard_numel`` elements is small enough to be held whole: at most ``LEND_PIECES`` pieces."""
    return shard_numel <= LEND_PIECES * piece_numel


def lends_master(store: Store, unit: Unit, depth: int, piece_numel: int, clipping: bool) -> bool:
    """Whether ``unit``'s update lends its master row to its backward fetch: the one rule, asked by the
    updater (``begin_step``), the read-ahead and the planner's memory model alike.

    It does where the one-pass update (no ``clipping``) reads ahead (``depth`` > 0), both the unit's 16-bit row
    and its master live on NVMe (``store.placement_of``: the fetch would read the one, the update reads the
    other), and its row is at most ``LEND_PIECES`` pieces (``fits_whole``: it is held whole from the fetch
    to the update). A copy rounded ties away (``Config.param_rounding``; always, with a remainder master,
    whose param row *is* the copy) is not a torch cast of the master: nothing lends then; nor does a frozen
    group (``Store.frozen``), which has no master."""
    return (not clipping and depth > 0 and not store.ties_away and unit.group not in store.frozen
            and store.placement_of("param", unit) == "nvme"
            and store.placement_of("master", unit) == "nvme"
            and fits_whole(store.group_of(unit).part.shard_numel, piece_numel))


def keeps_resident(unit_index: int, shard_numel: int, piece_numel: int) -> bool:
    """Whether a unit's 16-bit row on NVMe stays in memory, written through (``offload.resident``): the
    embedding's and the first block's (indices 0 and 1), whose reads no compute before them could hide, where
    the row is at most ``LEND_PIECES`` pieces (the bound of a lent master)."""
    return unit_index <= 1 and fits_whole(shard_numel, piece_numel)


def pieces_ahead(depth: int, all_lent: bool) -> int:
    """How many pieces a pass reads ahead: ``depth``, or as far as the masters (``depth * LEND_PIECES``)
    where every unit of the pass lends its master."""
    return depth * LEND_PIECES if all_lent else depth


def streamed_units(layout: Layout) -> dict[str, list[Unit]]:
    """Per group, the units whose optimizer rows a step streams (on NVMe, ``store.placement_of``)."""
    store = layout.store
    return {g.name: [u for u in store.row_units(g, layout.n_layers) if store.placement_of("master", u) == "nvme"]
            for g in store.groups.values() if g.name not in store.frozen}


class _Pass(NamedTuple):
    """A step's optimizer pass, as a demand sees it (``_pass``): what it reads, in which order and phase."""

    order: list[Unit]
    lent: set[tuple[str, int]]
    ahead: int
    kinds: list[str]
    phase: tuple[str, ...]


def pass_order(units_: list[Unit], clipping: bool, streamed: Callable[[Unit], bool]) -> list[Unit]:
    """The units of ``units_`` (scan order) a step's optimizer pass reads, in the order it updates them: the
    one-pass update's in reverse (the gradients' order: ``Updater.begin_step``), the clipped second pass's in
    scan order (``Updater.stream_clipped``); ``streamed(unit)``: its optimizer rows are read, not viewed."""
    return [u for u in (units_ if clipping else reversed(units_)) if streamed(u)]


def _pass(layout: Layout, config: Config) -> _Pass:
    """The pass of ``Updater.begin_step`` (one-pass: the stages' streamed units in reverse scan order) or of
    ``Updater.stream_clipped`` (every streamed unit, tiles after the stages, in scan order)."""
    store, depth = layout.store, config.prefetch_depth
    piece, clipping = piece_numel(config.optimizer_piece_bytes), config.clip_grad_norm is not None
    rows = {(u.group, u.row) for us in streamed_units(layout).values() for u in us}
    every = [u for g in store.groups.values() for u in store.row_units(g, layout.n_layers)]
    stages = sorted((u for u in every if u.group in STAGES), key=lambda u: u.index)
    units_ = [*stages, *(u for u in every if u.group not in STAGES)] if clipping else stages   # the updater's
    order = pass_order(units_, clipping, lambda u: (u.group, u.row) in rows)
    lent = {(u.group, u.row) for u in order if lends_master(store, u, depth, piece, clipping)}
    return _Pass(order, lent, pieces_ahead(depth, len(lent) == len(order)),
                 [*(["grad"] if clipping else []), *store.update_kinds()], ("update",) if clipping else ("backward",))


def demand(layout: Layout, config: Config) -> Demand:
    """What the optimizer's stream holds and reads (see ``zinf_fn.demand``), per group whose optimizer rows are
    on NVMe: the buffers the read-ahead reads into, each held from its read until the write-behind retires its
    write (a stashed gradient's piece goes back after the update). Of every kind a pass reads (``_pass``; not
    a master lent whole), a window of consecutive pieces (``pieces_held``): those read ahead
    (``pieces_ahead``; none for a tile's rows in the one-pass update, read as their gradient completes), each
    worker's and the write-behind's ``depth`` (and its room, ``ReadAhead.room``: no more of a size than the
    reads ahead held fewer of); as many 16-bit copies cast from them where the params are on NVMe too. Lent
    masters (``lends_master``): ``depth`` + 1 read ahead and the one the backward fetch asks for before its
    update is taken, each worker's, ``depth`` written. Left in flight into the next forward: the room and the
    last ``depth`` writes, these into its turn too (``_last_writes``), where the one-pass reads its first
    window. Every NVMe row of those kinds is read once per step, in backward."""
    store, depth, workers = layout.store, config.prefetch_depth, max(1, config.update_workers)
    piece, pass_ = piece_numel(config.optimizer_piece_bytes), _pass(layout, config)
    buffers, read = list(_last_writes(layout, config, pass_)), 0
    tiles: dict[tuple, list[Buffers]] = {}   # (kind, phases, window) -> the tiles' (one window serves them all)
    for name, rows in ((n, rows) for n, rows in streamed_units(layout).items() if rows):
        shard, n_lent = store.groups[name].part.shard_numel, sum((u.group, u.row) in pass_.lent for u in rows)
        first = pass_.ahead if any(u.group == name for u in pass_.order) else 0   # pieces read ahead
        for kind, dtype, n_rows in _piece_kinds(store, name, rows, pass_.kinds, n_lent > 0):
            window = first + workers + (0 if kind == "grad" else depth)   # a stashed gradient is not written
            for phases, held in ((pass_.phase, window), (("forward",), first if kind != "grad" else 0),
                                 (("turn",), first if pass_.phase == ("backward",) else 0)):
                made = [Buffers(n, dtype, c, phases=phases) for n, c in pieces_held(shard, piece, n_rows, held)]
                out = buffers if name in STAGES else tiles.setdefault((kind, phases, held), [])
                out += made
        if n_lent:   # the pass's; the room's in the next forward; those the one-pass reads at the turn
            buffers += [Buffers(shard, torch.float32, min(n_lent, n), phases=phases)
                        for n, phases in ((2 * depth + 2 + workers, pass_.phase), (depth + 2, ("forward",)),
                                          (depth + 2, ("turn",)))]
        params_on_disk = sum(store.placement_of("param", u) == "nvme" for u in rows) if store.remainder else 0
        read += shard * (len(rows) * sum(store.dtype_of(k, name).itemsize for k in store.opt_kinds())
                         + params_on_disk * store.param_dtype.itemsize)   # a remainder's high half
    buffers += [b for (_, _, window), made in tiles.items() for b in shared(made, window)]
    return Demand("optimizer read ahead", tuple(buffers), read_backward=read)


def _piece_kinds(store: Store, group: str, rows: list[Unit], kinds: list[str], lends: bool) -> list[tuple]:
    """``(kind, dtype, rows)`` of the pieces a pass reads of ``group``'s streamed ``rows`` (the master not,
    where it is lent whole), and of the 16-bit copies cast from them ("copy": of the rows whose params are on
    NVMe too)."""
    out = [(k, store.dtype_of(k, group), len(rows)) for k in kinds if not (lends and k == "master")]
    casts = sum(store.placement_of("param", u) == "nvme" for u in rows) if store.casts_copies else 0
    return out + ([("copy", store.param_dtype, casts)] if casts else [])


def _last_writes(layout: Layout, config: Config, pass_: _Pass) -> list[Buffers]:
    """The buffers of a pass's last ``depth`` writes (a piece's kinds and 16-bit copy, or a lent master row),
    which the write-behind still holds when the next step's pass begins (pressed back to ``depth``: they
    are waited for before its first update or stash): in the next forward and its turn."""
    store, piece, left, out = layout.store, piece_numel(config.optimizer_piece_bytes), config.prefetch_depth, []
    for unit in reversed(pass_.order):
        lends = (unit.group, unit.row) in pass_.lent
        dtypes = [d for k, d, n in _piece_kinds(store, unit.group, [unit], pass_.kinds, lends) if k != "grad" and n]
        shard = store.group_of(unit).part.shard_numel
        writes = [[(shard, torch.float32)]] if lends else []
        writes += [[(hi - lo, d) for d in dtypes] for lo, hi in reversed(pieces(shard, piece))]
        for group in writes[:left]:
            out += [Buffers(n, d, 1, phases=("forward", "turn")) for n, d in group]
        left -= min(left, len(writes))
        if not left:
            break
    return out


def kept_demand(layout: Layout, config: Config) -> Demand:
    """What the kept rows hold (``keeps_resident``; ``Runtime.keep_first_rows``): a copy of each kept 16-bit
    row on NVMe, outside the pool (an fp32 param row is its master row: kept at its own size)."""
    store, piece = layout.store, piece_numel(config.optimizer_piece_bytes)
    held = 0
    stages = units(layout.n_layers)
    for unit in stages + layout.frozen.companions(stages):   # the stages' units and frozen rows: no tile row
        shard = store.group_of(unit).part.shard_numel
        if keeps_resident(unit.index, shard, piece) and store.placement_of("param", unit) == "nvme":
            held += shard * store.param_dtype.itemsize
    return Demand("kept 16-bit rows", held=held)


class ReadAhead:
    """Reads the pieces of ``kinds`` rows of the units of a pass up to ``depth`` pieces ahead of the one
    taken (and, lending masters, whole master rows ``depth + 1`` units ahead); ``waits`` counts the compute
    thread's time blocked on them."""

    def __init__(self, store: Store, pool: BufferPool, device: torch.device, depth: int, waits: WaitClock,
                 piece_numel: int):
        self.store, self.pool, self.device, self.depth = store, pool, device, depth
        self.piece_numel = piece_numel
        self._lock = threading.Lock()
        self._lent: list[Unit] = []
        self._position: dict[tuple, int] = {}
        self._items: list[Piece] = []   # the pass's pieces, in order
        self._item_of: dict[tuple, int] = {}
        self._kinds: list[str] = []
        self._masters: Window[Reads] = Window(0, self._issue_master, self._give_back, depth)
        self._pieces: Window[Reads] = Window(0, self._issue_piece, self._give_back, depth)
        self.waits = waits   # counts only when the update runs on the compute thread
        self._high_water: Room = {}   # per size, the most buffers the pass's reads ahead have held at once

    def begin(self, order: list[Unit], kinds: list[str], clipping: bool = True) -> None:
        """Start a pass over ``order`` reading ``kinds``; the first ``depth`` pieces' reads are issued now.

        ``clipping`` False (the one-pass update): the master rows of the units that lend theirs
        (``lends_master``) are read whole per unit instead (``take_master``, ``master_of``).
        """
        with self._lock:
            assert not (self._pieces.outstanding or self._masters.outstanding), \
                "ReadAhead.begin while reads of the previous pass are pending"
            self._kinds = list(kinds)
            lend = "master" in kinds
            # the units whose masters are lent
            self._lent = [u for u in order if lend and lends_master(self.store, u, self.depth, self.piece_numel,
                                                                   clipping)]
            self._position = {(u.group, u.row): p for p, u in enumerate(self._lent)}
            self._items = [Piece(u, lo, hi) for u in order for lo, hi in self.pieces_of(u)]
            self._item_of = {(p.unit.group, p.unit.row, p.lo): i for i, p in enumerate(self._items)}
            # Several update workers may take a little out of order: reads issued behind the cursor stay.
            n_masters = len(self._lent)
            # one unit further ahead than the pieces: the backward fetch needs a master before its update
            # does (a lent row is at most LEND_PIECES pieces)
            self._masters = Window(n_masters, self._issue_master, self._give_back, self.depth + 1, keep_behind=True)
            # where every unit lends (all are small), the pieces are read ahead as far as the masters: a unit's
            # moments are in memory by the time its gradient is, and the last updates of a step do not wait
            ahead = pieces_ahead(self.depth, bool(order) and len(self._lent) == len(order))
            self._pieces = Window(len(self._items), self._issue_piece, self._give_back, ahead, keep_behind=True)
            self._masters.advance(0)
            self._pieces.advance(0)
            self._high_water = self._held()

    def pieces_of(self, unit: Unit) -> list[tuple[int, int]]:
        return pieces(self.store.group_of(unit).part.shard_numel, self.piece_numel)

    def take_master(self, unit: Unit) -> torch.Tensor | None:
        """The whole master row of ``unit`` where this pass lends masters (a pool buffer the caller hands on
        to ``WriteBehind``), else None: the master comes in the pieces."""
        entry = self._at_lent(unit, self._take_master_at)
        if entry is None:
            return None
        self._wait(entry, unit)
        return entry["master"].buf

    def _take_master_at(self, position: int) -> Reads:
        """Take the lent master at ``position`` and move the masters' window past it (call under the lock)."""
        entry = self._masters.take(position)
        self._masters.advance(max(self._masters.cursor, position + 1))
        self._raise_high_water()
        return entry

    def take_piece(self, unit: Unit, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Elements ``[lo, hi)`` of ``unit``'s rows, by kind (pool buffers the caller hands on or gives back).

        A unit outside the pass's order (a tile of a tiled leaf, updated as its gradient completes) is
        read on demand, its master with it.
        """
        with self._lock:
            i = self._item_of.get((unit.group, unit.row, lo))
            if i is None:
                entry = self._read(unit, lo, hi, self._kinds_of(unit, in_order=False))
            else:
                entry = self._pieces.take(i)
                self._pieces.advance(max(self._pieces.cursor, i + 1))
                self._raise_high_water()
        self._wait(entry, unit)
        return {kind: read.buf for kind, read in entry.items()}

    def room(self) -> Room:
        """Per size, the buffers the pass's reads ahead hold fewer of than at their most (at the end of a pass,
        where nothing is left to read, all of them). The write-behind may keep that many more in flight
        (``StreamedUpdate``): the buffers of each size in flight, read ahead plus written behind, stay what
        they were mid-pass (``demand`` counts them so)."""
        with self._lock:
            held = self._held()
            return {k: max(0, n - held.get(k, 0)) for k, n in self._high_water.items()}

    def _held(self) -> Room:
        """Per size, the buffers of the reads issued and not taken (call under the lock)."""
        held: Room = {}
        for entry in self._pieces.issued() + self._masters.issued():
            for read in entry.values():
                held[buffer_key(read.buf)] = held.get(buffer_key(read.buf), 0) + 1
        return held

    def _raise_high_water(self) -> None:
        for k, n in self._held().items():
            self._high_water[k] = max(self._high_water.get(k, 0), n)

    def master_of(self, unit: Unit) -> Transfer | None:
        """``unit``'s master row as this pass reads it ahead for its update (its buffer and read), issued now
        if the window has not reached it yet; None where the pass lends no masters, the unit is outside
        its order, or its update took its master already.

        Until the update takes the unit, the buffer holds the master as it was before this step changed
        it, so a reader that is done with it by then (the backward fetch, ``overlap.fetch``) may share it.
        """
        entry = self._at_lent(unit, self._reach_master)
        return None if entry is None else entry["master"]   # None: not lent, or taken (its update has begun)

    def _reach_master(self, position: int) -> Reads | None:
        """The lent master at ``position``, issued now if the window has not reached it yet; None where it was
        taken (call under the lock)."""
        window = self._masters
        if window.peek(position) is None and position >= window.cursor:
            # Step the cursor to bring ``position`` in: every unit from the update's cursor through it is
            # issued in order, none is dropped (the window keeps what is behind its cursor).
            for cursor in range(window.cursor + 1, position - window.depth + 2):
                window.advance(cursor)
        return window.peek(position)

    def _at_lent(self, unit: Unit, at: Callable[[int], Reads | None]) -> Reads | None:
        """``at(position)`` under the lock, ``position`` the unit's among the pass's lent masters; None where
        ``unit`` lends none this pass: the one lookup of a lent master."""
        with self._lock:
            position = self._position.get((unit.group, unit.row))
            return None if position is None else at(position)

    def abort(self) -> None:
        """An aborted pass: wait for the reads issued but not taken and give their buffers back."""
        with self._lock:
            self._masters.close()
            self._pieces.close()

    def _kinds_of(self, unit: Unit, in_order: bool) -> list[str]:
        """The kinds a piece of ``unit`` carries: all of them, less the master where it is lent whole."""
        lent = in_order and (unit.group, unit.row) in self._position
        return [k for k in self._kinds if not (lent and k == "master")]

    def _issue_master(self, position: int) -> Reads:
        unit = self._lent[position]
        return self._read(unit, 0, self.store.group_of(unit).part.shard_numel, ["master"])

    def _issue_piece(self, i: int) -> Reads:
        piece = self._items[i]
        return self._read(piece.unit, piece.lo, piece.hi, self._kinds_of(piece.unit, in_order=True))

    def _give_back(self, entry: Reads) -> None:
        _wait_all(entry, self.pool, give_back=True)

    def _wait(self, entry: Reads, unit: Unit) -> None:
        with self.waits.waiting(f"read state {unit.name}"):
            _wait_all(entry, self.pool, give_back=False)   # sync: the rows are read before they are updated

    def _read(self, unit: Unit, lo: int, hi: int, kinds: list[str]) -> Reads:
        """Issue the reads of elements ``[lo, hi)`` of one unit's ``kinds`` rows into pool buffers ("param" from
        the param tier: a remainder master's high half; the others from the optimizer tier)."""
        entry = {}
        for kind in kinds:
            buf = self.pool.take(hi - lo, self.store.dtype_of(kind, unit.group), self.device)
            read = self.store.tier_of(kind).read_(key(unit.group, kind), unit.row, buf, lo)
            entry[kind] = Transfer(buf, read, True)
        return entry


def _wait_all(entry: Reads, pool: BufferPool, give_back: bool) -> None:
    """Wait for every read of one entry; on a failure (or with ``give_back``) its buffers go back to the pool,
    then the first error is raised."""
    error = None
    for read in entry.values():
        try:
            read.future.result()   # sync: every read of the entry has completed
        except Exception as e:  # wait for every read of the entry, then raise
            error = error or e
    if error is not None or give_back:
        for read in entry.values():
            pool.give(read.buf)
    if error is not None:
        raise error
