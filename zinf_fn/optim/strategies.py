"""The two ways a unit's optimizer state is updated, behind one interface (``UpdateStrategy``).

``InPlaceUpdate``: the optimizer tier keeps the unit's rows in memory (cpu, device, or a row a spilled
placement keeps resident): every piece of the rows' views is updated in place, then the rows are written
back (a no-op copy for a memory tier) with their 16-bit copy. ``StreamedUpdate``: the tier keeps nothing
resident (NVMe): each piece is read ahead (``ReadAhead``), updated, and written behind (``WriteBehind``)
with its 16-bit copy. Both cut the same pieces (``optim.pieces``), so both give the same bits.

    plain loop both equal (per unit):
        for lo, hi in pieces(unit):
            update_piece_(opt, grad[lo:hi], master[lo:hi], state[lo:hi]); param[lo:hi] = master[lo:hi]
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from ..io.buffers import BufferPool
from ..offload.transfers import Write
from ..overlap.stream import WriteBehind
from ..scan.grads import LeafGrads
from ..store import Store
from ..units import Unit, key
from .decay import DecayCache
from .optimizers import Optimizer
from .paramcast import ParamCast
from .pieces import grad_spans, pieces, update_piece_
from .readahead import ReadAhead


class UpdateStrategy(Protocol):
    """Applies the optimizer to one unit's master and moments and writes them and the 16-bit copy back.

    ``grad``: the unit's gradient shard (consumed: used as scratch at most; the caller gives it back), its
    leaves, or None (its stashed gradient, which the strategy reads and scales by ``scale``). ``ready``
    (CUDA): the event after which compute is done with the unit's device rows."""

    def update_(self, unit: Unit, grad: torch.Tensor | LeafGrads | None, step: int, scale: float,
                ready) -> None: ...


class Strategies(NamedTuple):
    """The two strategies an updater chooses between, per unit (``Updater.strategy_of``)."""

    in_place: UpdateStrategy
    streamed: UpdateStrategy


class InPlaceUpdate:
    """Memory tiers: every piece of the rows' views updated in place, then the rows written back."""

    def __init__(self, store: Store, opt: Optimizer, piece_numel: int, decay: DecayCache, cast: ParamCast,
                 writes: WriteBehind):
        self.store, self.opt, self.piece_numel = store, opt, piece_numel
        self.decay, self.cast, self.writes = decay, cast, writes

    def update_(self, unit: Unit, grad: torch.Tensor | LeafGrads, step: int, scale: float, ready) -> None:
        tier, kinds = self.store.opt_tier, self.store.opt_kinds(grad_arrays=False)
        rows = {k: tier.view(key(unit.group, k), unit.row) for k in kinds}
        for lo, hi in pieces(rows["master"].numel(), self.piece_numel):
            state = tuple(rows[k][lo:hi] for k in kinds[1:])
            update_piece_(self.opt, grad_spans(grad, lo, hi), rows["master"][lo:hi], state, step,
                          self.decay.of(unit), lo)
            release_through(grad, hi)
        params = self.cast.writes(unit, rows["master"], 0, ready)
        self.writes.put([*(Write(tier, key(unit.group, k), unit.row, buf, False) for k, buf in rows.items()), *params])


class StreamedUpdate:
    """NVMe: each piece read ahead (``reads``), updated, and written behind (``writes``) with its 16-bit copy;
    a master row lent whole to the backward fetch is written whole after the last piece."""

    def __init__(self, store: Store, opt: Optimizer, reads: ReadAhead, writes: WriteBehind, decay: DecayCache,
                 cast: ParamCast, pool: BufferPool):
        self.store, self.opt, self.reads, self.writes = store, opt, reads, writes
        self.decay, self.cast, self.pool = decay, cast, pool

    def update_(self, unit: Unit, grad: torch.Tensor | LeafGrads | None, step: int, scale: float, ready) -> None:
        master_row = self.reads.take_master(unit)
        tier, kinds = self.store.opt_tier, self.store.opt_kinds(grad_arrays=False)
        for lo, hi in self.reads.pieces_of(unit):
            rows = self.reads.take_piece(unit, lo, hi)
            stashed = rows.pop("grad", None)
            if stashed is not None and scale != 1.0:
                stashed.mul_(scale)
            master = rows["master"] if master_row is None else master_row[lo:hi]
            update_piece_(self.opt, grad_spans(grad if stashed is None else stashed, lo, hi), master,
                          tuple(rows[k] for k in kinds[1:]), step, self.decay.of(unit), lo)
            release_through(grad, hi)
            params = self.cast.writes(unit, master, lo, ready)   # before any buffer goes to the write-behind
            if stashed is not None:
                self.pool.give(stashed)
            # the end of a pass leaves its last pieces' writes in flight (the step returns without waiting for
            # them) in the bytes the read-ahead no longer holds, so the last updates wait on no write
            writes = [Write(tier, key(unit.group, k), unit.row, buf, True, lo) for k, buf in rows.items()]
            self.writes.put([*writes, *params], self.reads.room_bytes())
        if master_row is not None:
            self.writes.put([Write(tier, key(unit.group, "master"), unit.row, master_row, True)],
                            self.reads.room_bytes())


def release_through(grad, end: int) -> None:
    """A ``LeafGrads`` gives up the leaves an update is past (flat offset ``end``: one rank, shard = layout)."""
    if isinstance(grad, LeafGrads):
        grad.release_through(end)
