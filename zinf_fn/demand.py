"""What a streaming part costs: the buffers it holds at its peak and the bytes it moves per step.

Each streaming part of the engine (the fetcher, the gradient backlog, the optimizer read-ahead, the
write-behind, the kept rows, activation offload) declares its cost in a pure ``demand(layout, ...)``
beside its class, as a ``Demand``. The planner's memory model (``zinf_fn.planner.memory``) and the
runtime's buffer pool limit are sums of these, never a second count. This module imports nothing of
the engine: every part builds on it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Buffers(NamedTuple):
    """``count`` pool buffers of ``numel`` x ``dtype`` a part holds at once at its peak, in host memory
    ("host") or on the compute device ("device"; the host itself on CPU compute)."""

    numel: int
    dtype: torch.dtype
    count: int
    where: str = "host"

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize * self.count


class Demand(NamedTuple):
    """One part's cost: its pool buffers, the bytes it holds outside the pool (``held``, host memory) and the
    NVMe bytes it moves per step (this rank; read in forward, read in backward, written)."""

    part: str
    buffers: tuple[Buffers, ...] = ()
    held: int = 0
    read_forward: int = 0
    read_backward: int = 0
    written: int = 0

    def bytes(self, where: str) -> int:
        """Bytes the part holds in ``where`` ("host" or "device") at its peak."""
        return sum(b.nbytes for b in self.buffers if b.where == where) + (self.held if where == "host" else 0)


def pieces_held(shard: int, piece: int, rows: int, window: int) -> list[tuple[int, int]]:
    """``(numel, count)`` of the pieces a window of ``window`` consecutive pieces holds at most, over ``rows`` rows
    of ``shard`` elements cut in pieces of ``piece`` (``optim.pieces``): full pieces, and the shorter last
    piece of each row where ``piece`` does not divide ``shard`` (a pool key of its own). Of ``k`` pieces a
    row, ``window`` consecutive ones hold at most ``ceil(window / k)`` last pieces and ``window - window // k``
    full ones (each count at its own most: a key's peak)."""
    per_row = -(-shard // piece)
    if not rows or not window:
        return []
    if shard <= piece or shard % piece == 0:
        return [(min(shard, piece), min(rows * per_row, window))]
    fulls, tails = min(rows * (per_row - 1), window - window // per_row), min(rows, -(-window // per_row))
    return [(piece, fulls), (shard % piece, tails)]


def pool_counts(demands: list[Demand], cpu_compute: bool) -> dict[tuple[int, torch.dtype, str], int]:
    """Pool buffers the parts hold together at their peak, per (numel, dtype, where); on CPU compute the
    device is the host, so "device" buffers are counted as "host" ones (the pool keys them alike)."""
    out: dict[tuple[int, torch.dtype, str], int] = {}
    for demand in demands:
        for b in demand.buffers:
            where = "host" if cpu_compute else b.where
            out[(b.numel, b.dtype, where)] = out.get((b.numel, b.dtype, where), 0) + b.count
    return out


def per_dtype(held: list[tuple[int, int]], dtypes: list[torch.dtype]) -> list[Buffers]:
    """The buffers of ``held`` pieces (``pieces_held``) of one row of each of ``dtypes`` (one per kind), one
    ``Buffers`` per (numel, dtype): the kinds of one dtype share a pool key."""
    counts: dict[torch.dtype, int] = {}
    for dtype in dtypes:
        counts[dtype] = counts.get(dtype, 0) + 1
    return [Buffers(n, dtype, c * m) for n, c in held for dtype, m in counts.items()]
