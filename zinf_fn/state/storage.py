"""A state's rows in their tiers: a row viewed, read, written or loaded, where each kind lives and
what it weighs (``RowStorage``, one part of ``zinf_fn.state.StateView``)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from ..layout.units import Unit, key
from ..observe import counters
from ..runtime import Runtime
from ..store import Store
from ..tiling.layout import TileUnit
from ..train import TrainState


class RowStorage:
    """The part of ``StateView`` that reaches the rows in their tiers: one row viewed, read into or
    written from a caller's buffer, a unit's row loaded as ``zf.init`` writes it, and where each
    kind lives. It reads the store's tiers and the runtime (its fetcher forgets a row written)."""

    state: TrainState
    _runtime: Runtime
    _store: Store

    def device(self, kind: str) -> torch.device:
        """Where the tier of ``kind`` keeps its rows (a read or write buffer may live anywhere)."""
        return self._store.tier_of(kind).device

    def view(self, kind: str, group: str, row: int) -> torch.Tensor | None:
        """Row ``row`` of ``group``'s ``kind`` array itself (memory tiers), or None (NVMe: nothing
        resident)."""
        return self._store.tier_of(kind).view(key(group, kind), row)

    def read_(self, kind: str, group: str, row: int, out: torch.Tensor) -> Future:
        """Copy the row into ``out`` (``row_numel(kind, group)`` elements of ``dtype(kind,
        group)``); keep ``out`` until done."""
        return self._store.tier_of(kind).read_(key(group, kind), row, out)

    def write_(self, kind: str, group: str, row: int, src: torch.Tensor) -> Future:
        """Copy ``src`` into the row; keep ``src`` untouched until the future is done."""
        self._runtime.fetcher.forget(group, row)  # a layer the fetcher holds is of the row before
        return self._store.tier_of(kind).write_(key(group, kind), row, src)

    def load_row_(self, unit: Unit | TileUnit, flat: torch.Tensor) -> None:
        """Set a unit's parameters from its padded flat fp32 buffer (every rank passes the whole
        buffer): this rank's part becomes the master, the optimizer state starts afresh, the param
        copy is cast."""
        self._runtime.load_row_(unit, flat)

    @property
    def param_is_master(self) -> bool:
        """Whether each group's param array *is* its master array (no second fp32 copy is
        stored)."""
        return self._store.row_kinds.param_is_master

    def shares_master(self, group: str) -> bool:
        """Whether ``group``'s param array is its master array (``param_is_master`` and the group
        trains)."""
        return self._store.row_kinds.shares_master(group)

    def state_bytes(self) -> int:
        """Bytes of this rank's model states over all tiers (a param array that is the master counts
        once)."""
        return self._store.state_bytes()

    def tier_name(self, kind: str) -> str:
        """The placement of the tier holding ``kind``: "none", "cpu", "nvme", or a split such as
        "cpu+nvme"."""
        return self._store.tier_of(kind).name

    def placement_of(self, kind: str, unit: Unit | TileUnit) -> str:
        """Where ``unit``'s row of ``kind`` lives: "none", "cpu" or "nvme" (a spilled kind names the
        member tier of that row; ``Store.placement_of``, the engine's and the planner's one
        answer)."""
        return self._store.placement_of(kind, unit)

    def nvme_engine(self, kind: str) -> str | None:
        """The engine of the NVMe tier holding ``kind`` ("direct", "tensorstore"); None where it is
        not on NVMe."""
        return counters.nvme_engine(self._store.tier_of(kind))

    def wrap_tier_(self, kind: str, wrap: Callable[[Any], Any]) -> Any:
        """Replace the tier that holds ``kind`` (and every kind it shares) with ``wrap(tier)``;
        returns the wrapper. For tests and benchmarks (a throttled link, an injected fault), between
        steps: the engine reaches its tiers through the store, so the next step reads and writes
        through the wrapper."""
        return self._store.wrap_tier_(kind, wrap)
