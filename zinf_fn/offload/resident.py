"""Rows an NVMe tier keeps a copy of in memory, written through: the rows a step needs before it can
hide a read.

A step's forward starts with the embedding and the first block; nothing computes before their fetch
that could hide its read, and the update that wrote their 16-bit copies ended the step before. The
runtime marks those rows (``Tier.keep``); the tier then copies every write of them into a buffer of
its own as the write is issued (the disk gets the same bytes) and serves a read from that copy once
the writes have covered the span it reads. The copy is what the disk holds, or will hold once the
writes in flight complete: every write of the row goes through the tier, so it is never stale,
whoever wrote.

Before a row is written whole in this process (a rerun that opened existing files) its reads go to
the disk. A read served here is counted like every read, and apart (``bytes_read_resident``): the
part that skipped the disk.
"""

from __future__ import annotations

import threading

import torch

from ..io.buffers import aligned_empty


class ResidentRows:
    """The kept rows of one tier: ``(key, row)`` -> (copy, the spans written so far)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, int], tuple[torch.Tensor, list[list[int]]]] = {}

    def keep(self, key: str, row: int, numel: int, dtype: torch.dtype) -> None:
        with self._lock:
            if (key, row) not in self._rows:
                self._rows[(key, row)] = (aligned_empty(numel, dtype), [])

    def __contains__(self, key_row: tuple[str, int]) -> bool:
        return key_row in self._rows

    def write(self, key: str, row: int, start: int, src: torch.Tensor) -> None:
        """Copy ``src`` into elements ``[start, start + len(src))`` of the kept row (call in the
        order the writes reach the disk); a row not kept is ignored."""
        entry = self._rows.get((key, row))
        if entry is None:
            return
        copy, spans = entry
        with self._lock:  # sync: a read copies either all of this write or none of it
            copy[start : start + src.numel()].copy_(src)
            _cover(spans, start, start + src.numel())

    def forget(self, key: str, row: int) -> None:
        """A write of the row failed (the disk may hold anything there): serve no read from the copy
        until the row is written whole again."""
        entry = self._rows.get((key, row))
        if entry is not None:
            with self._lock:
                entry[1].clear()

    def read(self, key: str, row: int, start: int, out: torch.Tensor) -> bool:
        """Fill ``out`` from elements ``[start, start + len(out))`` of the kept row; False (nothing
        copied) where the row is not kept or the writes so far do not cover that span."""
        entry = self._rows.get((key, row))
        if entry is None:
            return False
        copy, spans = entry
        with self._lock:
            end = start + out.numel()
            if not any(lo <= start and end <= hi for lo, hi in spans):
                return False
            out.copy_(copy[start:end])
        return True


def _cover(spans: list[list[int]], lo: int, hi: int) -> None:
    """Add ``[lo, hi)`` to ``spans`` (sorted, disjoint, merged where they touch)."""
    merged = [lo, hi]
    keep = []
    for span in spans:
        if span[1] < merged[0] or span[0] > merged[1]:
            keep.append(span)
        else:
            merged = [min(merged[0], span[0]), max(merged[1], span[1])]
    spans[:] = sorted([*keep, merged])
