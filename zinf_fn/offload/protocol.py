"""What a tier is: where model states live (the compute device, CPU memory, or NVMe), behind one
interface.

A tier holds named 2-D arrays ``(rows, shard_numel)``: one row per layer of a layer group, each row
this rank's shard. Reads copy a row into a buffer the caller owns; writes copy a buffer into a row.
Memory tiers also hand out zero-copy views (``view``), which the runtime uses instead of a copy.

This module is the protocol and the names only: every tier (``tiers.MemoryTier``, ``nvme.NvmeTier``)
and every user of one imports it; the factory that knows them all is ``tiers.make_tier``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

import torch

PLACEMENTS = ("none", "cpu", "nvme")
# how the NVMe tier moves its rows (``NvmeTier``), same files either way
NVME_ENGINES = ("direct", "tensorstore")


class Tier(Protocol):
    name: str
    device: torch.device

    def allocate(self, key: str, rows: int, numel: int, dtype: torch.dtype) -> None: ...
    # forget an array, no I/O of it in flight: its memory is freed (an NVMe array's files stay,
    # and an ``allocate`` of the key afresh replaces them)
    def drop(self, key: str) -> None: ...
    def view(self, key: str, row: int) -> torch.Tensor | None: ...
    # hold a copy of the row in memory (NVMe; else a no-op)
    def keep(self, key: str, row: int) -> None: ...
    # elements [start, start + len(buf)) of a row: the whole row by default, a piece of it (the
    # optimizer's)
    def read_(self, key: str, row: int, out: torch.Tensor, start: int = 0) -> Future: ...
    def write_(self, key: str, row: int, src: torch.Tensor, start: int = 0) -> Future: ...
    def keys(self) -> list[str]: ...
    # cumulative "bytes_read", "bytes_written" (and tier-specific ones)
    def counters(self) -> dict[str, int]: ...
    # bytes moved through a ``view``
    def count_view_io(self, read: int = 0, written: int = 0) -> None: ...
    def close(self) -> None: ...
