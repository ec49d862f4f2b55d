"""Which rank stores which part of a unit, and how a unit is rebuilt and its gradient reduced.

Two modes (``Config.partition``):

``"allgather"`` (bandwidth-centric, the default). Every unit's padded flat buffer is split into N
equal
    shards and rank r stores shard r of *every* unit in its own tiers. A unit is rebuilt by one
    allgather, in which every rank's tier link delivers 1/N of the bytes at once; its gradient
    leaves by one reduce-scatter (mean over ranks) straight into each rank's shard.

``"broadcast"`` (the ZeRO-Offload-style baseline, kept to be compared against). Unit u is owned
whole
    by rank ``owner_of(u.index, N)`` (round-robin over the scan order); only the owner stores its
    rows (param, master, moments: the tier arrays hold the owned rows only, other ranks hold
    *nothing* for that unit). It is rebuilt by a broadcast from the owner, so one link carries all
    the bytes; its gradient is reduced (mean) to the owner, which alone runs its optimizer update.

Both give the same training: the same sums of the same per-rank gradients, only reduced in a
different order (so equal to rounding, not bitwise).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..layout.units import Unit, units
from ..offload.protocol import Tier
from .comm import Comm
from .shards import Partition, owner_of, partition


class Sharding(Protocol):
    comm: Comm

    def partition(self, numel: int, align: int = 1) -> Partition: ...
    def holds(self, unit: Unit) -> bool: ...
    def local_range(self, part: Partition) -> tuple[int, int]: ...
    def gather_(self, full: torch.Tensor, shard: torch.Tensor | None, unit: Unit) -> None: ...
    def reduce_mean_(self, out: torch.Tensor, full: torch.Tensor, unit: Unit) -> bool: ...
    def wrap_tier(self, tier: Tier) -> Tier: ...
    def add_rows(self, group: str, units_of_group: list) -> None: ...


class AllgatherSharding:
    """Shard r of every unit on rank r; one allgather in, one reduce-scatter (mean) out."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def partition(self, numel: int, align: int = 1) -> Partition:
        return partition(numel, self.comm.world_size, align)

    def holds(self, unit: Unit) -> bool:
        return True

    def local_range(self, part: Partition) -> tuple[int, int]:
        """[start, end) of the padded flat buffer that this rank's row of every unit holds."""
        return part.shard_range(self.comm.rank)

    def gather_(self, full, shard, unit):
        """Rebuild ``full`` (padded numel) from every rank's ``shard``."""
        # sync: the whole unit is needed before compute
        self.comm.all_gather_(full, shard, unit.name)

    def reduce_mean_(self, out, full, unit):
        """``out`` <- this rank's shard of the mean over ranks of ``full``; always held, returns
        True."""
        # sync: the shard is complete after this
        self.comm.reduce_scatter_mean_(out, full, unit.name)
        return True

    def wrap_tier(self, tier: Tier) -> Tier:
        return tier

    def add_rows(self, group, units_of_group):
        """A group added after construction (a tiled leaf's tiles): every rank stores a shard of
        every row."""


class BroadcastSharding:
    """Unit u owned whole by rank ``u.index % N``; a broadcast in, a reduce (mean) to the owner
    out."""

    def __init__(self, comm: Comm, n_layers: int):
        self.comm = comm
        self.owned_rows: dict[str, list[int]] = {}
        for unit in units(n_layers):
            if self.holds(unit):
                self.owned_rows.setdefault(unit.group, []).append(unit.row)

    def owner(self, unit: Unit) -> int:
        return owner_of(unit.index, self.comm.world_size)

    def partition(self, numel: int, align: int = 1) -> Partition:
        return partition(numel, 1, align)  # one "shard": the whole unit, on its owner

    def holds(self, unit: Unit) -> bool:
        return self.owner(unit) == self.comm.rank

    def local_range(self, part: Partition) -> tuple[int, int]:
        return 0, part.shard_numel

    def gather_(self, full, shard, unit):
        """The owner copies its row into ``full`` and broadcasts it; the others receive it."""
        if shard is not None and shard.data_ptr() != full.data_ptr():
            full.copy_(shard)
        self.comm.broadcast_(full, self.owner(unit), unit.name)  # sync: the whole unit has arrived

    def reduce_mean_(self, out, full, unit):
        """Mean over ranks of ``full`` into ``out`` on the owner (True); others get nothing
        (False)."""
        self.comm.reduce_mean_(full, self.owner(unit), unit.name)  # sync: the owner has the sum
        if not self.holds(unit):
            return False
        out.copy_(full)
        return True

    def wrap_tier(self, tier: Tier) -> Tier:
        return OwnedRowsTier(tier, self.owned_rows, self.comm.rank)

    def add_rows(self, group, units_of_group):
        """A group added after construction (a tiled leaf's tiles, which carry their layer's
        ``index``): this rank owns the rows of the units it holds. Call before the group's arrays
        are allocated."""
        self.owned_rows[group] = [u.row for u in units_of_group if self.holds(u)]


def make_sharding(mode: str, comm: Comm, n_layers: int) -> Sharding:
    if mode == "allgather":
        return AllgatherSharding(comm)
    if mode == "broadcast":
        return BroadcastSharding(comm, n_layers)
    raise ValueError(f"unknown partition mode {mode!r}; expected 'allgather' or 'broadcast'")


class OwnedRowsTier:
    """A tier that stores only the rows this rank owns: global row -> position among the owned rows.

    Arrays of a group this rank owns no row of are not allocated at all. Touching a row of another
    rank is an internal error (the runtime asks ``Sharding.holds`` first).
    """

    def __init__(self, inner: Tier, owned_rows: dict[str, list[int]], rank: int):
        self.inner, self.rank = inner, rank
        self.name, self.device = inner.name, inner.device
        # shared with the sharding: groups added later (tiles) appear in it
        self._owned = owned_rows
        self._local: dict[str, dict[int, int]] = {}
        self._keys: list[str] = []

    def _index(self, group: str) -> dict[int, int]:
        rows = self._owned.get(group, [])
        if len(self._local.get(group, ())) != len(rows):
            self._local[group] = {row: i for i, row in enumerate(rows)}
        return self._local.get(group, {})

    def allocate(self, key, rows, numel, dtype):
        self._keys.append(key)
        owned = len(self._index(key.split("/")[0]))
        if owned:
            self.inner.allocate(key, owned, numel, dtype)

    def drop(self, key):
        self._keys.remove(key)
        if key in self.inner.keys():
            self.inner.drop(key)

    def _row(self, key: str, row: int) -> int:
        local = self._index(key.split("/")[0])
        assert row in local, f"rank {self.rank} does not own row {row} of {key!r} (broadcast mode)"
        return local[row]

    def view(self, key, row):
        return self.inner.view(key, self._row(key, row))

    def keep(self, key, row):
        if row in self._index(key.split("/")[0]):  # a row of another rank is not here to keep
            self.inner.keep(key, self._row(key, row))

    def read_(self, key, row, out, start=0):
        return self.inner.read_(key, self._row(key, row), out, start)

    def write_(self, key, row, src, start=0):
        return self.inner.write_(key, self._row(key, row), src, start)

    def keys(self):
        return list(self._keys)

    def counters(self):
        return self.inner.counters()

    def count_view_io(self, read=0, written=0):
        self.inner.count_view_io(read, written)

    def close(self):
        self.inner.close()
