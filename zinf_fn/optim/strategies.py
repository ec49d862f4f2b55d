"""The two ways a unit's optimizer state is updated, behind one interface (``UpdateStrategy``).

``InPlaceUpdate``: the optimizer tier keeps the unit's rows in memory (cpu, device, or a row a
spilled placement keeps resident): every piece of the rows' views is updated in place, then the rows
are written back (a no-op copy for a memory tier) with their 16-bit copy. ``StreamedUpdate``: the
tier keeps nothing resident (NVMe): each piece is read ahead (``ReadAhead``), updated, and written
behind (``WriteBehind``) with its 16-bit copy. Both cut the same pieces (``optim.pieces``), so both
give the same bits.

    plain loop both equal (per unit):
        for lo, hi in pieces(unit):
            update_piece_(opt, grad[lo:hi], master[lo:hi], state[lo:hi]); param[lo:hi] =
            master[lo:hi]

With a remainder master (``Config(master="remainder")``) the piece's master is joined from the param
and remainder pieces into a scratch buffer and split back after the update (``optim.masters``): in
place, the remainder row's view and the param row's (or the param piece read, where the param row is
not in the optimizer's memory); streamed, the param and remainder pieces the read-ahead read.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from ..io.buffers import BufferPool
from ..layout.units import Unit, key
from ..offload.transfers import Write
from ..overlap.stream import WriteBehind
from ..scan.grads import LeafGrads
from ..store import Store
from .decay import DecayCache
from .masters import piece_master, stored_
from .optimizers import Optimizer
from .paramcast import ParamCast
from .pieces import Compressed, grad_spans, pieces, update_piece_
from .readahead import ReadAhead


class UpdateStrategy(Protocol):
    """Applies the optimizer to one unit's master and moments and writes them and the 16-bit copy
    back.

    ``grad``: the unit's gradient shard (consumed: used as scratch at most; the caller gives it
    back), its leaves, or None (its stashed gradient, which the strategy reads and scales by
    ``scale``). ``ready`` (CUDA): the event after which compute is done with the unit's device
    rows."""

    def update_(
        self, unit: Unit, grad: torch.Tensor | LeafGrads | None, step: int, scale: float, ready
    ) -> None: ...


class Strategies(NamedTuple):
    """The two strategies an updater chooses between, per unit (``Updater.strategy_of``)."""

    in_place: InPlaceUpdate  # also updates runs of small tiles as one (``update_run_``)
    streamed: UpdateStrategy


class UpdateTools(NamedTuple):
    """What both strategies update with, built once by the runtime (``runtime.compose_updater``)."""

    store: Store  # the rows
    opt: Optimizer  # the optimizer's update
    decay: DecayCache  # the weight-decay spans of a row (``optim.decay``)
    cast: ParamCast  # the 16-bit copy of an updated master (``optim.paramcast``)
    writes: WriteBehind  # the rows written back (``overlap.stream``)
    pool: BufferPool  # the buffers a piece is updated in


class InPlaceUpdate:
    """Memory tiers: every piece of the rows' views updated in place, then the rows written back."""

    def __init__(self, tools: UpdateTools, piece_numel: int):
        """``tools``: the store, optimizer, decay spans, cast, write-behind and pool;
        ``piece_numel``: the elements of a piece (``optim.pieces``)."""
        self.store = tools.store
        self.opt = tools.opt
        self.decay = tools.decay
        self.cast = tools.cast
        self.writes = tools.writes
        self.pool = tools.pool
        self.piece_numel = piece_numel

    def update_(
        self, unit: Unit, grad: torch.Tensor | LeafGrads, step: int, scale: float, ready
    ) -> None:
        if self.store.row_kinds.remainder:
            return self._update_remainder_(unit, grad, step, ready)
        tier, kinds = self.store.opt_tier, self.store.row_kinds.opt_kinds(False, unit.group)
        rows = {k: tier.view(key(unit.group, k), unit.row) for k in kinds}
        for lo, hi in pieces(rows["master"].numel(), self.piece_numel):
            state = piece_state(self.store, rows, kinds[1:], lo, hi)
            update_piece_(
                self.opt,
                grad_spans(grad, lo, hi),
                rows["master"][lo:hi],
                state,
                step,
                self.decay.of(unit),
                lo,
                compressed_at(self.store, self.decay, unit, lo),
            )
            release_through(grad, hi)
        params = self.cast.writes(unit, rows["master"], 0, ready)
        self.writes.put(
            [
                *(Write(tier, key(unit.group, k), unit.row, buf, False) for k, buf in rows.items()),
                *params,
            ]
        )

    def update_run_(self, units: list[Unit], grads: list[torch.Tensor], step: int, ready) -> None:
        """``update_`` of each unit with its gradient shard (whole rows): one fused optimizer call
        over all of them (``Optimizer.update_many``: each shard its own tensor, so the bits of one
        call per unit) and one cast of their 16-bit copies (``ParamCast.writes_many``), where every
        unit is one piece of an fp32 master and fp32 moments; else ``update_`` of each."""
        if not self._fuses(units):
            for unit, grad in zip(units, grads, strict=True):
                self.update_(unit, grad, step, 1.0, ready)
            return
        tier, kinds = self.store.opt_tier, self.store.row_kinds.opt_kinds(False, units[0].group)
        rows = [{k: tier.view(key(u.group, k), u.row) for k in kinds} for u in units]
        masters = [r["master"] for r in rows]
        self.opt.update_many(
            [g[: m.numel()] for g, m in zip(grads, masters, strict=True)],
            [tuple(r[k] for k in kinds[1:]) for r in rows],
            masters,
            step,
            [self.decay.of(u) for u in units],
        )
        params = self.cast.writes_many(units, masters, ready)
        self.writes.put(
            [
                *(
                    Write(tier, key(u.group, k), u.row, buf, False)
                    for u, r in zip(units, rows, strict=True)
                    for k, buf in r.items()
                ),
                *params,
            ]
        )

    def _fuses(self, units: list[Unit]) -> bool:
        """Whether ``update_run_`` updates ``units`` in one optimizer call: an optimizer with
        ``update_many``, fp32 masters and moments, every unit's shard one piece (``optim.pieces``:
        the cut ``update_`` makes)."""
        return (
            self.opt.update_many is not None
            and not self.store.row_kinds.remainder
            and all(
                u.group not in self.store.row_kinds.compressed
                and self.store.group_of(u).part.shard_numel <= self.piece_numel
                for u in units
            )
        )

    def _update_remainder_(
        self, unit: Unit, grad: torch.Tensor | LeafGrads, step: int, ready
    ) -> None:
        """Every piece's master joined from the param and remainder pieces, updated, and split
        back."""
        tier, kinds = self.store.opt_tier, self.store.row_kinds.opt_kinds(False, unit.group)
        rows = {k: tier.view(key(unit.group, k), unit.row) for k in kinds}
        remainder, params = rows["remainder"], []
        for lo, hi in pieces(remainder.numel(), self.piece_numel):
            param, own = self._param_piece(unit, lo, hi, remainder.device)
            where = compressed_at(self.store, self.decay, unit, lo)
            master = piece_master(self.pool, param, remainder[lo:hi], where is not None)
            update_piece_(
                self.opt,
                grad_spans(grad, lo, hi),
                master,
                piece_state(self.store, rows, kinds[1:], lo, hi),
                step,
                self.decay.of(unit),
                lo,
                where,
            )
            release_through(grad, hi)
            stored_(self.pool, master, param, remainder[lo:hi])
            if own:  # split into the param row itself
                self.store.param_tier.count_view_io(written=param.numel() * param.element_size())
            else:
                params += self.cast.writes16(unit, param, lo, ready)
        self.writes.put(
            [
                *(Write(tier, key(unit.group, k), unit.row, buf, False) for k, buf in rows.items()),
                *params,
            ]
        )

    def _param_piece(
        self, unit: Unit, lo: int, hi: int, device: torch.device
    ) -> tuple[torch.Tensor, bool]:
        """(elements ``[lo, hi)`` of ``unit``'s param row, whether that is a view of the row
        itself): the view where the row is in memory on ``device``, else a pool buffer it was read
        into."""
        tier = self.store.param_tier
        view = tier.view(key(unit.group, "param"), unit.row)
        if view is not None and view.device == device:
            return view[lo:hi], True
        buf = self.pool.take(hi - lo, self.store.row_kinds.param_dtype, device)
        # sync: the master's high half is here
        tier.read_(key(unit.group, "param"), unit.row, buf, lo).result()
        return buf, False


class StreamedUpdate:
    """NVMe: each piece read ahead (``reads``), updated, and written behind (``writes``) with its
    16-bit copy; a master row lent whole to the backward fetch, and the rows read whole with the
    first piece (the per-block scales of int8 moments, ``RowKinds.whole_row``), are written whole
    after the last piece."""

    def __init__(self, tools: UpdateTools, reads: ReadAhead):
        """``tools``: the store, optimizer, decay spans, cast, write-behind and pool; ``reads``: the
        read-ahead of the pass's pieces."""
        self.store = tools.store
        self.opt = tools.opt
        self.decay = tools.decay
        self.cast = tools.cast
        self.writes = tools.writes
        self.pool = tools.pool
        self.reads = reads

    def update_(
        self, unit: Unit, grad: torch.Tensor | LeafGrads | None, step: int, scale: float, ready
    ) -> None:
        master_row = self.reads.take_master(unit)
        tier, kinds = self.store.opt_tier, self.store.row_kinds.opt_kinds(False, unit.group)
        # rows read whole with the first piece (int8 scales), written at the end
        whole: dict[str, torch.Tensor] = {}
        for lo, hi in self.reads.pieces_of(unit):
            rows = self.reads.take_piece(unit, lo, hi)
            whole.update(
                {k: rows.pop(k) for k in [k for k in rows if self.store.row_kinds.whole_row(k)]}
            )
            stashed = rows.pop("grad", None)
            if stashed is not None and scale != 1.0:
                stashed.mul_(scale)
            # a remainder master's high half (a piece of the row, where it is lent)
            param = rows.pop("param", None)
            if param is None and self.store.row_kinds.remainder:
                param = master_row[lo:hi]
            where = compressed_at(self.store, self.decay, unit, lo)
            master = self._master_piece(rows, param, master_row, lo, hi, where is not None)
            state = tuple(
                rows[k] if k in rows else whole[k][slice(*self.store.row_kinds.span(k, lo, hi))]
                for k in kinds[1:]
            )
            update_piece_(
                self.opt,
                grad_spans(grad if stashed is None else stashed, lo, hi),
                master,
                state,
                step,
                self.decay.of(unit),
                lo,
                where,
            )
            release_through(grad, hi)
            params = self._copy_writes(
                unit, master, param, rows, lo, ready, lent=master_row is not None
            )
            if stashed is not None:
                self.pool.give(stashed)
            # the end of a pass leaves its last pieces' writes in flight (the step returns without
            # waiting for them) in the buffers the read-ahead no longer holds, so the last updates
            # wait on no write
            writes = [
                Write(tier, key(unit.group, k), unit.row, buf, True, lo) for k, buf in rows.items()
            ]
            self.writes.put([*writes, *params], self.reads.room())
        if master_row is not None:
            whole[self.store.row_kinds.lent_kind] = master_row
        if whole:
            self.writes.put(
                [
                    Write(self.store.tier_of(k), key(unit.group, k), unit.row, buf, True)
                    for k, buf in whole.items()
                ],
                self.reads.room(),
            )

    def _master_piece(self, rows: dict, param, master_row, lo: int, hi: int, compressed: bool):
        """The master of the piece: the fp32 master read (or lent whole), or ``param`` and the
        remainder (``masters.piece_master``: joined, or the halves themselves for compressed
        moments)."""
        if param is None:
            return rows["master"] if master_row is None else master_row[lo:hi]
        return piece_master(self.pool, param, rows["remainder"], compressed)

    def _copy_writes(
        self, unit: Unit, master: torch.Tensor, param, rows: dict, lo: int, ready, lent: bool
    ) -> list[Write]:
        """The writes of the piece's 16-bit copy: cast from ``master``, or (remainder) split with
        the remainder, the scratch master given back (none where the param row is ``lent`` whole:
        split into it, written whole after the last piece). Called before any buffer goes to the
        write-behind."""
        if param is None:
            return self.cast.writes(unit, master, lo, ready)
        stored_(self.pool, master, param, rows["remainder"])
        return [] if lent else self.cast.writes16(unit, param, lo, ready)


def compressed_at(store: Store, decay: DecayCache, unit: Unit, lo: int) -> Compressed | None:
    """The piece at ``lo`` of ``unit``'s shard for its compressed moments: its element in the unit's
    padded row (blocks and rounding are keyed by it), the unit's index as seed, their format; None
    with fp32 moments."""
    if unit.group not in store.row_kinds.compressed:
        return None
    return Compressed(
        decay.row_offset(unit) + lo, unit.index, store.row_kinds.moments_of(unit.group)
    )


def piece_state(store: Store, rows: dict, kinds: list[str], lo: int, hi: int) -> tuple:
    """The rows ``kinds`` of elements ``[lo, hi)`` of a shard, from ``rows`` (kind -> the whole
    row): each row's span of them (``RowKinds.span``: a per-block scale row's blocks)."""
    return tuple(rows[k][slice(*store.row_kinds.span(k, lo, hi))] for k in kinds)


def release_through(grad, end: int) -> None:
    """A ``LeafGrads`` gives up the leaves an update is past (flat offset ``end``: one rank, shard =
    layout)."""
    if isinstance(grad, LeafGrads):
        grad.release_through(end)
