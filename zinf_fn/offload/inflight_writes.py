"""The rows an NVMe tier is writing, ordered: a read of a span whose write is in flight is served
from that write's source buffer, and a second write of an overlapping span waits for the first
(``offload.nvme``'s ``read_`` / ``write_``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from ..io.futures import settle


class InflightWrites:
    """The spans of rows whose write is in flight, with the buffer each is written from.

    A span is ``[lo, hi)`` elements of a row (the whole row, or a piece of it). ``read_`` serves the
    part of a read that such spans cover from their buffers; ``track`` removes a span (under the
    same lock) before the write's future completes, so a buffer is never read after its owner saw
    the write complete and reused it. ``begin`` makes a write wait for an earlier one of an
    overlapping span.
    """

    def __init__(self):
        self._lock = threading.Lock()
        # (key, row) -> [(lo, hi, src, done event)]
        self._rows: dict[tuple[str, int], list[tuple]] = {}

    def read_(self, key: str, row: int, start: int, out: torch.Tensor) -> list[tuple[int, int]]:
        """Copy what writes in flight hold of elements ``[start, start + len(out))`` of the row into
        ``out``; returns the spans (element offsets in the row) left to read from the disk."""
        lo, hi = start, start + out.numel()
        with self._lock:  # sync: no write completes (nor its buffer is reused) during the copies
            covered = sorted(
                (
                    (max(a, lo), min(b, hi), src, a)
                    for a, b, src, _ in self._rows.get((key, row), ())
                    if a < hi and b > lo
                ),
                key=lambda span: span[0],
            )
            for a, b, src, origin in covered:
                out[a - lo : b - lo].copy_(src[a - origin : b - origin])
        left, cursor = [], lo
        for a, b, _, _ in covered:
            if a > cursor:
                left.append((cursor, a))
            cursor = max(cursor, b)
        return left + ([(cursor, hi)] if cursor < hi else [])

    def begin(self, key: str, row: int, start: int, src: torch.Tensor) -> tuple:
        """Register ``src`` as the content of its span of the row, once earlier writes overlapping
        it completed."""
        entry = (start, start + src.numel(), src, threading.Event())
        while True:
            with self._lock:
                spans = self._rows.setdefault((key, row), [])
                earlier = next((e for e in spans if e[0] < entry[1] and e[1] > entry[0]), None)
                if earlier is None:
                    spans.append(entry)
                    return entry
            earlier[3].wait()  # sync: two writes of one span never interleave on disk

    def track(self, key: str, row: int, entry: tuple, write: Future) -> Future:
        """The future of ``write``, completing only after its span left the in-flight set."""
        outer: Future = Future()

        # not ``write`` itself: write -> callback -> write would be a cycle
        def untrack(done: Future):
            with self._lock:
                spans = self._rows.get((key, row), [])
                spans[:] = [e for e in spans if e is not entry]
                if not spans:
                    self._rows.pop((key, row), None)
            entry[3].set()
            settle(outer, done)

        write.add_done_callback(untrack)
        return outer
