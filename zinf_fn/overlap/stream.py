"""The stream primitives of overlap: a bounded queue of writes in flight.

"""

from __future__ import annotations

import threading
from collections import deque

from ..offload.buffers import BufferPool
from ..trace import WaitClock


class WriteBehind:
    """Writes rows from pool buffers; each buffer goes back to the pool once its write completed."""

    def __init__(self, pool: BufferPool, limit: int):
        self.pool, self.limit = pool, limit
        self._lock = threading.Lock()
        self._inflight: deque[list] = deque()
        self.waits = WaitClock()

    def put(self, writes: list[tuple]) -> None:
        """Issue ``(tier, key, row, buf, pooled)`` writes of one unit; waits while over ``limit`` units."""
        group = [(tier.write_(name, row, buf), buf, pooled) for tier, name, row, buf, pooled in writes]
        with self._lock:
            self._inflight.append(group)
        self._reclaim(self.limit)

    def drain(self) -> None:
        """sync: every write issued so far has completed (raises the first failure)."""
        self._reclaim(0)

    @property
    def buffers_held(self) -> int:
        """Pool buffers of the writes not yet reclaimed (completed or not): they go back at the next put or drain."""
        with self._lock:
            return sum(1 for group in self._inflight for _, _, pooled in group if pooled)

    def _reclaim(self, keep: int) -> None:
        error = None
        while True:
            with self._lock:
                if not self._inflight or (len(self._inflight) <= keep and not _all_done(self._inflight[0])):
                    break
                group = self._inflight.popleft()
            with self.waits.waiting("write"):
                for future, buf, pooled in group:
                    try:
                        future.result()   # sync: the row is written; its buffer may be reused
                    except Exception as e:  # noqa: BLE001 - give every buffer back, then raise the first
                        error = error or e
                    if pooled:
                        self.pool.give(buf)
        if error is not None:
            raise error


def _all_done(group: list) -> bool:
    return all(getattr(future, "done", lambda: True)() for future, _, _ in group)
