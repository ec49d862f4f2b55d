"""The disk side of a save: row snapshots in, chunk files out, with a bounded amount in flight.

Chunks are written straight from the snapshot's memory (``chunkio``: O_DIRECT from aligned memory, or
tensorstore with ``can_reference_source_data_indefinitely``), so a snapshot is given back to the
staging pool only once its chunks are durable (each chunk file is fsynced). While the queue is empty
the writer retires finished writes, so the copier, waiting for staging room, always gets it back.
"""

from __future__ import annotations

import collections
import threading
from queue import Empty, Queue


class RowWriter:
    def __init__(self, arrays: dict, ranges: dict, pool, queue: Queue, abort: threading.Event,
                 inflight_bytes: int, copy_error):
        self.arrays = arrays
        self.ranges = ranges              # group -> [lo, hi): the elements this rank writes (rows.py)
        self.pool, self.queue, self.abort = pool, queue, abort
        self.inflight_bytes = inflight_bytes
        self.copy_error = copy_error      # callable: the copier's exception, if it failed
        self.pending: collections.deque = collections.deque()
        self.in_flight = 0

    def write_all(self, n_rows: int) -> int:
        """Write ``n_rows`` snapshots as they arrive; returns the bytes written by this rank."""
        written = 0
        for _ in range(n_rows):
            snap = self._next_snapshot()
            a, b = self.ranges[snap.group]
            futures = [self.arrays[(snap.group, k)].write_from(snap.row, a, t[: b - a])
                       for k, t in snap.tensors.items() if b > a]
            nbytes = sum((b - a) * t.element_size() for t in snap.tensors.values())
            self.pending.append((futures, snap))
            self.in_flight += nbytes
            written += nbytes
            while self.in_flight > self.inflight_bytes and len(self.pending) > 1:
                self._retire_oldest()
        while self.pending:
            self._retire_oldest()
        return written

    def _retire_oldest(self) -> None:
        futures, snap = self.pending.popleft()
        for f in futures:
            f.result()   # sync: the row's chunks are durable
        a, b = self.ranges[snap.group]
        self.in_flight -= sum((b - a) * t.element_size() for t in snap.tensors.values())
        if snap.pooled:
            self.pool.give(snap.group, snap.tensors)

    def _next_snapshot(self):
        while True:
            if self.abort.is_set():
                error = self.copy_error()
                raise RuntimeError(f"taking a row snapshot failed: {error!r}") from error
            try:
                return self.queue.get(timeout=0.002 if self.pending else 0.05)
            except Empty:
                if self.pending:
                    self._retire_oldest()   # nothing new: make room for the copier meanwhile
