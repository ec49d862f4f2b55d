"""Which rows this rank holds, and a unit's weights gathered over the ranks or loaded from its
weights (``HeldRows``, one part of ``zinf_fn.state.StateView``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..formats.frozen import FrozenLeaves, FrozenUnit
from ..layout import rows as unit_tensors
from ..layout.units import Unit, units
from ..partition.comm import Comm
from ..runtime import Runtime
from ..store import Store
from ..tiling.layout import TileLayout, TileUnit
from ..train import TrainState


class Row(NamedTuple):
    group: str
    row: int
    unit: Unit | TileUnit | FrozenUnit  # the unit (or tile, or frozen row) the row belongs to


class HeldRows:
    """The part of ``StateView`` that says which rows this rank holds (in the order a step updates
    them) and gathers a row or a unit's weights over the ranks (collectives), or loads them. It
    reads the runtime's sharding and comm, and the row shapes of the view it is part of
    (``RowShapes``: ``n_layers``, ``tiles``, ``frozen``)."""

    state: TrainState
    _runtime: Runtime
    _store: Store
    n_layers: int
    tiles: TileLayout
    frozen: FrozenLeaves

    @property
    def comm(self) -> Comm:
        return self._runtime.comm

    def all_rows(self) -> list[Row]:
        """Every row, in the order a step updates them (reverse scan: head, blocks L-1..0, embed;
        each unit's tiles, then its frozen row, before it)."""
        out = []
        for unit in reversed(units(self.n_layers)):
            out += [Row(t.group, t.row, t) for t in reversed(self.tiles.units([unit]))]
            out += [Row(f.group, f.row, f) for f in self.frozen.companions([unit])]
            out.append(Row(unit.group, unit.row, unit))
        return out

    def rows(self) -> list[Row]:
        """The rows this rank holds (all of them in allgather mode, its units' in broadcast
        mode)."""
        return [r for r in self.all_rows() if self._runtime.sharding.holds(r.unit)]

    def holds(self, unit: Unit | TileUnit) -> bool:
        return self._runtime.sharding.holds(unit)

    def element_range(self, group: str) -> tuple[int, int]:
        """[lo, hi) of the real elements of ``group``'s rows that this rank's tier rows hold."""
        part = self._store.groups[group].part
        lo, hi = self._runtime.sharding.local_range(part)
        hi = min(hi, part.numel)
        return min(lo, hi), hi

    def gather_row(self, kind: str, unit: Unit | TileUnit) -> torch.Tensor:
        """``unit``'s row of ``kind`` gathered over ranks: flat fp32 on the CPU, padding cut.
        Collective. "master" of a remainder master is joined from the param and remainder rows
        (``optim.remainder``); "remainder" comes back as its int16 bits. The "master" of a frozen
        group (``is_frozen``) is its param row upcast: a frozen leaf keeps its 16-bit copy only; a
        quantized frozen row (``Config.frozen_storage``) comes back as its uint8 bytes
        (``gather_unit`` / ``gather_params`` dequantize them)."""
        return unit_tensors.gather_row(self._store, self._runtime.sharding, kind, unit)

    def leaf_shapes(self, unit: Unit) -> dict[str, tuple[int, ...]]:
        """Key path in ``unit``'s tree -> shape of each of its weights (a tiled weight whole)."""
        return unit_tensors.leaf_shapes(self, unit)

    def gather_unit(self, kind: str, unit: Unit) -> dict[str, torch.Tensor]:
        """Key path -> ``unit``'s weight of ``kind`` ("master", "param") gathered over ranks, fp32
        on the CPU: tiled weights whole, frozen leaves from their frozen row. Collective (one unit
        in memory)."""
        return unit_tensors.gather_unit(self, kind, unit)

    def load_unit_(self, unit: Unit, source: Callable[[str], torch.Tensor]) -> None:
        """Set every row of ``unit`` (its group's, its frozen row, its tiles) from ``source(path)``,
        each weight whole, as ``zf.init`` writes rows (``load_row_``); every rank calls it with the
        same weights."""
        unit_tensors.load_unit_(self, unit, source)
