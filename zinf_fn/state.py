"""The public state interface: what checkpoints/, tests and users reach of a ``TrainState``'s engine.

Everything outside the engine goes through ``StateView`` (``zinf_fn.state.view(state)``), never
``state.runtime.<internals>``::

    v = view(state)
    v.groups                 {name: Group(name, rows, spec, part)}: "embed", "blocks", "head" and one group
                             per tiled leaf ("blocks:mlp.fc.w", row = layer * n_tiles + t)
    v.kinds()                the state kinds of every group: "param", "master", "opt.0", ... (+ "grad")
    v.dtype(kind)            param_dtype for "param", fp32 for the optimizer's kinds
    v.tiles                  the tile layout (tiling.layout.TileLayout): which leaves are tiled, how
    v.ties                   the model's tied weights (``zf.Tie``): each is stored once, in the "embed" group
    v.rows()                 the rows this rank holds, in the order a step updates them (``Row``)
    v.element_range(group)   [lo, hi) of the real elements of the group's flat buffer that this rank's
                             rows hold; element e of a row is ``buffer[e - lo]``
    v.view / read_ / write_  one row of one kind: a zero-copy view (memory tiers, else None), or a
                             read into / write from a buffer the caller owns (futures; ``.result()`` waits)
    v.load_row_(unit, flat)  a unit's full flat fp32 parameters in: master, fresh optimizer state, param copy
    v.save_guard(guard)      while in the context, ``guard(unit)`` runs before a step changes any row of
                             ``unit`` (a save in flight copies out the rows it has not written yet)
    v.flush()                the last step's write-behind is on disk; raises its first failed write
    v.close()                flush, then stop the state's workers and close its tiers
    v.comm                   the collectives of the state's ranks (rank, world_size, all_gather_object, ...)
    v.gather_row(kind, unit) one row (a unit's or a tile's) gathered over ranks: flat fp32 on the CPU,
                             padding cut (a collective: one layer in memory, where gather_params is all)

A *row* is one unit's flat buffer in its group's arrays. Who holds which part of it is the partition
mode: "allgather" (every rank a shard of every row: elements ``[r * S, (r + 1) * S)`` of the padded
buffer) or "broadcast" (the owner of a unit holds its rows whole). The padding past ``numel`` is zeros.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, NamedTuple

import torch

from .partition.comm import Comm
from .partition.shards import partition
from .planner import gather_params, gather_row
from .store import Group
from .tiling.layout import TileLayout, TileUnit
from .train import TrainState, empty_state, init_unit
from .units import BLOCKS, EMBED, HEAD, Unit, key, stage_rows, unit_name, units

__all__ = ["BLOCKS", "EMBED", "HEAD", "Row", "StateView", "TileLayout", "TileUnit", "TrainState", "Unit",
           "empty_state", "gather_params", "init_unit", "shard_numel", "stage_rows", "unit_name", "units", "view"]


class Row(NamedTuple):
    group: str
    row: int
    unit: Unit | TileUnit    # the unit (or tile) the row belongs to


class StateView:
    """The engine of one ``TrainState`` as checkpoints and tests see it; see the module docstring."""

    def __init__(self, state: TrainState):
        self.state = state
        self._runtime = state.runtime
        self._store = state.runtime.store

    # -- layout --------------------------------------------------------------------------------------
    @property
    def groups(self) -> dict[str, Group]:
        return self._store.groups

    @property
    def param_dtype(self) -> torch.dtype:
        return self._store.param_dtype

    @property
    def n_opt_leaves(self) -> int:
        return self._store.n_opt_leaves

    @property
    def n_layers(self) -> int:
        return self.state.model.n_layers

    @property
    def tiles(self) -> TileLayout:
        return self._runtime.tiles.layout

    @property
    def ties(self) -> tuple:
        """The model's ``zf.Tie`` s: the head reads these embed leaves; they have rows in "embed" only."""
        return self.state.model.ties

    @property
    def comm(self) -> Comm:
        return self._runtime.comm

    @property
    def identity(self) -> object:
        """One object per engine (the same for every state of a run): a key for caches kept across steps."""
        return self._store

    def kinds(self, grads: bool = False) -> list[str]:
        """"param", "master", "opt.<i>" (and "grad" with ``grads``, when the state has grad arrays)."""
        return ["param", *self._store.opt_kinds(None if grads else False)]

    def dtype(self, kind: str) -> torch.dtype:
        return self._store.param_dtype if kind == "param" else torch.float32

    def device(self, kind: str) -> torch.device:
        """Where the tier of ``kind`` keeps its rows (a read or write buffer may live anywhere)."""
        return self._store.tier_of(kind).device

    # -- rows this rank holds ------------------------------------------------------------------------
    def all_rows(self) -> list[Row]:
        """Every row, in the order a step updates them (reverse scan: head, blocks L-1..0, embed; each
        unit's tiles before it)."""
        out = []
        for unit in reversed(units(self.n_layers)):
            out += [Row(t.group, t.row, t) for t in reversed(self.tiles.units([unit]))]
            out.append(Row(unit.group, unit.row, unit))
        return out

    def rows(self) -> list[Row]:
        """The rows this rank holds (all of them in allgather mode, its units' in broadcast mode)."""
        return [r for r in self.all_rows() if self._runtime.sharding.holds(r.unit)]

    def holds(self, unit: Unit | TileUnit) -> bool:
        return self._runtime.sharding.holds(unit)

    def element_range(self, group: str) -> tuple[int, int]:
        """[lo, hi) of the real elements of ``group``'s rows that this rank's tier rows hold."""
        part = self._store.groups[group].part
        lo, hi = self._runtime.sharding.local_range(part)
        hi = min(hi, part.numel)
        return min(lo, hi), hi

    def shard_numel(self, group: str) -> int:
        """Elements of one of this rank's rows of ``group`` (padding included)."""
        return self._store.groups[group].part.shard_numel

    # -- read and write ------------------------------------------------------------------------------
    def view(self, kind: str, group: str, row: int) -> torch.Tensor | None:
        """Row ``row`` of ``group``'s ``kind`` array itself (memory tiers), or None (NVMe: nothing resident)."""
        return self._store.tier_of(kind).view(key(group, kind), row)

    def read_(self, kind: str, group: str, row: int, out: torch.Tensor) -> Future:
        """Copy the row into ``out`` (``shard_numel`` elements of ``dtype(kind)``); keep ``out`` until done."""
        return self._store.tier_of(kind).read_(key(group, kind), row, out)

    def write_(self, kind: str, group: str, row: int, src: torch.Tensor) -> Future:
        """Copy ``src`` into the row; keep ``src`` untouched until the future is done."""
        return self._store.tier_of(kind).write_(key(group, kind), row, src)

    def load_row_(self, unit: Unit | TileUnit, flat: torch.Tensor) -> None:
        """Set a unit's parameters from its padded flat fp32 buffer (every rank passes the whole buffer):
        this rank's part becomes the master, the optimizer state starts afresh, the param copy is cast."""
        self._runtime.load_row_(unit, flat)

    # -- guards and flushes --------------------------------------------------------------------------
    @contextlib.contextmanager
    def save_guard(self, guard: Callable[[Any], None]) -> Iterator[None]:
        """While inside, every step runs ``guard(unit)`` before it changes a row of ``unit``."""
        self.add_save_guard(guard)
        try:
            yield
        finally:
            self.remove_save_guard(guard)

    def add_save_guard(self, guard: Callable[[Any], None]) -> None:
        self._store.write_guards.append(guard)

    def remove_save_guard(self, guard: Callable[[Any], None]) -> None:
        """Remove ``guard`` if it is installed (a no-op otherwise)."""
        if guard in self._store.write_guards:
            self._store.write_guards.remove(guard)

    def flush(self) -> None:
        """sync: the last step's write-behind is on disk; raises its first failed write (layer and state)."""
        self._runtime.flush()

    def close(self) -> None:
        """Flush (raising a failed write), then stop the state's workers and close its tiers (files stay)."""
        self._runtime.close()

    def gather_row(self, kind: str, unit: Unit | TileUnit) -> torch.Tensor:
        """``unit``'s row of ``kind`` gathered over ranks: flat fp32 on the CPU, padding cut. Collective."""
        return gather_row(self._runtime, kind, unit)


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of each rank's row of a ``numel``-element flat buffer split over ``world_size`` ranks (the
    allgather partition; a save at another world size wrote rows of this size)."""
    return partition(numel, world_size).shard_numel


def view(state: TrainState) -> StateView:
    """The public interface of ``state``'s engine."""
    if not isinstance(state, TrainState):
        raise TypeError(f"zinf_fn.state.view expects a zf.TrainState (from zf.init or zf.train_step), got "
                        f"{type(state).__name__}")
    return StateView(state)
