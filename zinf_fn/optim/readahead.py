"""Read-ahead and write-behind of per-unit rows, for tiers that keep nothing resident (NVMe).

The optimizer side of a step touches the units in an order known before the step starts: in the
one-pass path the gradients arrive head, blocks L-1..0, embed (the reverse scan), and the clipped
second pass walks the units in scan order. ``ReadAhead`` reads the master, moment (and stashed
gradient) rows of the units ``depth`` positions ahead of the one being updated, into pool buffers,
so the update of unit l finds its state already in memory. ``WriteBehind`` writes updated rows out
from those buffers and returns each buffer to the pool only once its write completed, keeping at
most ``limit`` units' writes in flight; with depth 0 both degrade to synchronous I/O.

    plain loop this equals (per unit, in order):
        rows = {kind: tier.read(kind, unit)}; update(rows); for kind: tier.write(kind, unit, rows[kind])
"""

from __future__ import annotations

import threading

import torch

from ..offload.buffers import BufferPool
from ..store import Store, Unit, key
from ..trace import WaitClock


class ReadAhead:
    """Reads ``kinds`` rows of the units of ``order`` up to ``depth`` units ahead of the one taken."""

    def __init__(self, store: Store, pool: BufferPool, device: torch.device, depth: int):
        self.store, self.pool, self.device, self.depth = store, pool, device, depth
        self._lock = threading.Lock()
        self._order: list[Unit] = []
        self._position: dict[tuple, int] = {}
        self._kinds: list[str] = []
        self._issued = 0
        self._reads: dict[int, list] = {}
        self.waits = WaitClock()   # the runtime's: counts only when the update runs on the compute thread

    def begin(self, order: list[Unit], kinds: list[str]) -> None:
        """Start a pass over ``order``; the first ``depth`` units' reads are issued now."""
        with self._lock:
            assert not self._reads, "ReadAhead.begin while reads of the previous pass are pending"
            self._order, self._kinds, self._issued = list(order), list(kinds), 0
            self._position = {(u.group, u.row): p for p, u in enumerate(self._order)}
            self._issue_until(self.depth - 1)

    def take(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The rows of ``unit`` (pool buffers the caller hands on to ``WriteBehind`` or gives back).

        A unit outside the pass's order (a tile of a tiled leaf, updated as its gradient completes) is
        read on demand.
        """
        with self._lock:
            position = self._position.get((unit.group, unit.row))
            if position is None:
                entry = self._read(unit)
            else:
                self._issue_until(position + self.depth)
                entry = self._reads.pop((unit.group, unit.row))
        error = None
        with self.waits.waiting(f"read state {unit.name}"):
            for _, _, future in entry:
                try:
                    future.result()   # sync: the unit's rows are read before it is updated
                except Exception as e:  # noqa: BLE001 - wait for every read of the entry, then raise
                    error = error or e
        if error is not None:
            for _, buf, _ in entry:
                self.pool.give(buf)
            raise error
        return {kind: buf for kind, buf, _ in entry}

    def abort(self) -> None:
        """An aborted pass: wait for the reads issued but not taken and give their buffers back."""
        with self._lock:
            entries, self._reads = list(self._reads.values()), {}
        for entry in entries:
            for _, buf, future in entry:
                try:
                    future.result()
                except Exception:  # noqa: BLE001, S110 - the step already failed
                    pass
                self.pool.give(buf)

    def _issue_until(self, last: int) -> None:
        while self._issued <= min(last, len(self._order) - 1):
            unit = self._order[self._issued]
            self._reads[(unit.group, unit.row)] = self._read(unit)
            self._issued += 1

    def _read(self, unit: Unit) -> list:
        """Issue the reads of one unit's rows into pool buffers: [(kind, buffer, future)]."""
        n = self.store.group_of(unit).part.shard_numel
        entry = []
        for kind in self._kinds:
            buf = self.pool.take(n, torch.float32, self.device)
            entry.append((kind, buf, self.store.opt_tier.read_(key(unit.group, kind), unit.row, buf)))
        return entry
