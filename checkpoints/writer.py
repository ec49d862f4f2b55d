"""The disk side of a save: row snapshots in, chunk files out, with a bounded amount in flight.

Chunks are written straight from the snapshot's memory (``chunkio``: O_DIRECT from aligned memory,
or tensorstore with ``can_reference_source_data_indefinitely``), so a snapshot is given back to the
staging pool only once its chunks are durable (each chunk file is fsynced). While the queue is empty
the writer retires finished writes, so the copier, waiting for staging room, always gets it back.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from queue import Empty, Queue
from typing import NamedTuple

from zinf_fn.overlap.stream import InFlight

from .snapshot import Snapshot


class PendingWrite(NamedTuple):
    """One row snapshot being written: its chunks' futures, and the snapshot (given back once they
    resolve)."""

    futures: list[Future]
    snapshot: Snapshot


def _width(span: tuple[int, int]) -> int:
    return span[1] - span[0]


class RowWriter:
    """Writes the row snapshots of one save with at most ``inflight_bytes`` in flight (an
    ``InFlight`` queue weighted by bytes: the newest write always runs, however large)."""

    def __init__(
        self,
        arrays: dict,
        ranges: dict,
        pool,
        queue: Queue,
        abort: threading.Event,
        inflight_bytes: int,
        copy_error,
    ):
        self.arrays = arrays
        self.ranges = ranges  # (group, kind) -> [lo, hi): the elements this rank writes (rows.py)
        self.pool, self.queue, self.abort = pool, queue, abort
        self.copy_error = copy_error  # callable: the copier's exception, if it failed
        self.pending: InFlight[PendingWrite] = InFlight(
            self._retire, inflight_bytes, weight=self._nbytes
        )

    def write_all(self, n_rows: int) -> int:
        """Write ``n_rows`` snapshots as they arrive; returns the bytes written by this rank."""
        written = 0
        for _ in range(n_rows):
            snap = self._next_snapshot()
            futures = []
            for kind, t in snap.tensors.items():
                a, b = self.ranges[(snap.group, kind)]
                if b > a:
                    futures.append(
                        self.arrays[(snap.group, kind)].write_from(snap.row, a, t[: b - a])
                    )
            entry = PendingWrite(futures, snap)
            written += self._nbytes(entry)
            self.pending.put(entry)  # sync: retires the oldest writes past the byte budget
        self.pending.drain()  # sync: every row's chunks are durable
        return written

    def _nbytes(self, entry: PendingWrite) -> int:
        group = entry.snapshot.group
        return sum(
            _width(self.ranges[(group, k)]) * t.element_size()
            for k, t in entry.snapshot.tensors.items()
        )

    def _retire(self, entry: PendingWrite) -> None:
        for f in entry.futures:
            f.result()  # sync: the row's chunks are durable
        if entry.snapshot.pooled:
            self.pool.give(entry.snapshot.tensors)

    def _next_snapshot(self):
        while True:
            if self.abort.is_set():
                error = self.copy_error()
                raise RuntimeError(f"taking a row snapshot failed: {error!r}") from error
            try:
                return self.queue.get(timeout=0.002 if len(self.pending) else 0.05)
            except Empty:
                self.pending.retire_oldest()  # nothing new: make room for the copier meanwhile
