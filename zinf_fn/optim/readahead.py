"""Read-ahead of the optimizer's per-unit rows, for tiers that keep nothing resident (NVMe).

The optimizer side of a step touches the units in an order known before the step starts: in the
one-pass path the gradients arrive head, blocks L-1..0, embed (the reverse scan), and the clipped
second pass walks the units in scan order. ``ReadAhead`` reads the master, moment (and stashed
gradient) rows of the units ``depth`` positions ahead of the one being updated, into pool buffers,
so the update of unit l finds its state already in memory. ``overlap.stream.WriteBehind`` writes the
updated rows out from those buffers and returns each buffer to the pool only once its write
completed, keeping at most ``depth`` units' writes in flight; with depth 0 both degrade to
synchronous I/O.

    plain loop this equals (per unit, in order):
        rows = {kind: tier.read(kind, unit)}; update(rows); for kind: tier.write(kind, unit, rows[kind])
"""

from __future__ import annotations

import threading

import torch

from ..offload.buffers import BufferPool
from ..overlap.stream import Window
from ..store import Store, Unit, key
from ..trace import WaitClock


class ReadAhead:
    """Reads ``kinds`` rows of the units of ``order`` up to ``depth`` units ahead of the one taken (a
    ``stream.Window`` over the pass's order); ``waits`` counts the compute thread's time blocked on them."""

    def __init__(self, store: Store, pool: BufferPool, device: torch.device, depth: int, waits: WaitClock):
        self.store, self.pool, self.device, self.depth = store, pool, device, depth
        self._lock = threading.Lock()
        self._order: list[Unit] = []
        self._position: dict[tuple, int] = {}
        self._kinds: list[str] = []
        self._window: Window[list] = Window(0, self._issue, self._give_back, depth)
        self.waits = waits   # counts only when the update runs on the compute thread

    def begin(self, order: list[Unit], kinds: list[str]) -> None:
        """Start a pass over ``order``; the first ``depth`` units' reads are issued now."""
        with self._lock:
            assert not self._window.outstanding, "ReadAhead.begin while reads of the previous pass are pending"
            self._order, self._kinds = list(order), list(kinds)
            self._position = {(u.group, u.row): p for p, u in enumerate(self._order)}
            # Several update workers may take a little out of order: reads issued behind the cursor stay.
            self._window = Window(len(self._order), self._issue, self._give_back, self.depth, keep_behind=True)
            self._window.advance(0)

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
                entry = self._window.take(position)
                self._window.advance(max(self._window.cursor, position + 1))
        with self.waits.waiting(f"read state {unit.name}"):
            _wait_all(entry, self.pool, give_back=False)   # sync: the unit's rows are read before it is updated
        return {kind: buf for kind, buf, _ in entry}

    def master_of(self, unit: Unit) -> tuple[torch.Tensor, object] | None:
        """``unit``'s master row as this pass reads it ahead for its update: ``(buffer, future)``, issued now
        if the window has not reached it yet; None where the unit is outside the pass's order, its update
        took its rows already, or nothing is read ahead (depth 0, or a pass without the master).

        Until the update takes the unit, the buffer holds the master as it was before this step changed
        it, so a reader that is done with it by then (the backward fetch, ``overlap.fetch``) may share it.
        """
        with self._lock:
            position = self._position.get((unit.group, unit.row))
            if position is None or self.depth == 0 or "master" not in self._kinds:
                return None
            if self._window.peek(position) is None and position >= self._window.cursor:
                # Step the cursor to bring ``position`` in: every item from the update's cursor through it is
                # issued in order, none is dropped (the window keeps what is behind its cursor).
                for cursor in range(self._window.cursor + 1, position - self.depth + 2):
                    self._window.advance(cursor)
            entry = self._window.peek(position)
        if entry is None:   # taken: its update has begun
            return None
        _, buf, future = entry[self._kinds.index("master")]
        return buf, future

    def abort(self) -> None:
        """An aborted pass: wait for the reads issued but not taken and give their buffers back."""
        with self._lock:
            self._window.close()

    def _issue(self, position: int) -> list:
        return self._read(self._order[position])

    def _give_back(self, entry: list) -> None:
        _wait_all(entry, self.pool, give_back=True)

    def _read(self, unit: Unit) -> list:
        """Issue the reads of one unit's rows into pool buffers: [(kind, buffer, future)]."""
        n = self.store.group_of(unit).part.shard_numel
        entry = []
        for kind in self._kinds:
            buf = self.pool.take(n, torch.float32, self.device)
            entry.append((kind, buf, self.store.opt_tier.read_(key(unit.group, kind), unit.row, buf)))
        return entry


def _wait_all(entry: list, pool: BufferPool, give_back: bool) -> None:
    """Wait for every read of one unit; on a failure (or with ``give_back``) its buffers go back to the pool,
    then the first error is raised."""
    error = None
    for _, _, future in entry:
        try:
            future.result()   # sync: every read of the unit has completed
        except Exception as e:  # wait for every read of the entry, then raise
            error = error or e
    if error is not None or give_back:
        for _, buf, _ in entry:
            pool.give(buf)
    if error is not None:
        raise error
