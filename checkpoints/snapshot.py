"""Consistent rows while training goes on: each row of the states is copied out exactly once, before
anybody changes it.

A *row* is one layer's shard of every saved state kind of its group (16-bit param, master or
remainder, optimizer leaves and what their format adds: ``StateView.kinds(group=)``) on this rank. A
save takes every row once, into a ``Snapshot`` that the disk writer consumes. Two takers race for
rows:

- the copier thread walks the rows in the order the next step updates them (head, blocks L-1..0,
  embed), copying each into a staging buffer;
- the write guard (``Store.write_guards``), called by the updater right before a step changes a
  unit, takes that unit's row itself if the copier has not reached it (copy-on-write).

So a step never changes a row the save still needs, and a save never tears. RAM is bounded by the
staging budget: when it is used up, the copier, or the guard (and with it the step), waits for the
writer to free a buffer. That wait is the time training is blocked by ``save_async``; with a budget
that holds the rank's states (the default up to 1 GiB) it is only the memcpy of rows the step
reaches before the copier does. A synchronous save (no training meanwhile) takes memory-tier rows as
views, and streams rows of other tiers (NVMe) through the same bounded pool: layer by layer, never
the whole model in RAM.
"""

from __future__ import annotations

import threading
import time
from queue import Queue
from typing import NamedTuple

import torch

from zinf_fn.io.buffers import BufferPool, PoolAborted
from zinf_fn.state import StateView

RowId = tuple[str, int]  # (group, row)


class Snapshot(NamedTuple):
    group: str
    row: int
    tensors: dict  # kind -> this rank's full row of that kind (``row_numel`` elements)
    pooled: bool  # tensors came from the staging pool and go back after writing (else: views)


class SaveAborted(RuntimeError):
    pass


class StagingPool:
    """Host buffers for row snapshots: the engine's buffer pool (``zinf_fn.io.BufferPool``) with a
    byte budget of ``budget`` (always room for one row), a row's buffers taken at once;
    page-aligned, so the writer moves their chunks with O_DIRECT, no copy; ``pin`` for rows that
    come from a GPU."""

    def __init__(self, budget: int, pin: bool = False):
        self.budget = budget
        self.buffers = BufferPool(limit_per_key=None, budget_bytes=budget, pin=pin)

    @property
    def peak(self) -> int:
        """The most bytes of buffers held at once."""
        return self.buffers.peak_bytes

    def take(self, layout: dict, abort: threading.Event) -> dict:
        """Host buffers for one row: ``layout`` is kind -> (numel, dtype); waits while the budget is
        used up, until ``abort`` is set (then SaveAborted)."""
        try:
            bufs = self.buffers.take_all([(n, dtype, "cpu") for n, dtype in layout.values()], abort)
        except PoolAborted:
            raise SaveAborted("the save failed; see its handle's result()") from None
        return dict(zip(layout, bufs, strict=True))

    def give(self, tensors: dict) -> None:
        self.buffers.give_all(tensors.values())

    def wake(self) -> None:
        self.buffers.wake()


class RowSnapshotter:
    """Takes each row once (copier or guard, whoever comes first) and queues it for the writer."""

    def __init__(
        self,
        store: StateView,
        kinds: dict[str, list[str]],
        order: list[RowId],
        pool: StagingPool,
        queue: Queue,
        views: bool = False,
    ):
        self.store, self.kinds, self.order = (
            store,
            kinds,
            order,
        )  # kinds: group -> the kinds saved of its rows
        self.pool, self.queue = pool, queue
        self.views = views  # take memory-tier rows as views: only when nobody trains meanwhile
        self.abort = threading.Event()
        self._taken: dict[RowId, threading.Event] = {}
        self._lock = threading.Lock()
        self.guard_s = 0.0  # time the training spent in the guard (copying or waiting)
        self.guard_copies = 0

    def skip(self, rids: list[RowId]) -> None:
        """Rows this save does not copy (linked frozen rows, ``links``): taken already, as far as
        the guard sees."""
        with self._lock:
            for rid in rids:
                self._taken[rid] = threading.Event()
                self._taken[rid].set()

    def unskip(self, rid: RowId) -> None:
        """A skipped row the copier takes after all (before it starts: ``order`` is its list)."""
        with self._lock:
            self._taken.pop(rid, None)
            self.order.append(rid)

    def guard(self, unit) -> None:
        """The write guard: returns once ``unit``'s row is safe to change."""
        rid = (unit.group, unit.row)
        with self._lock:
            event = self._taken.get(rid)
        if event is not None and event.is_set():
            return
        t0 = time.perf_counter()
        copied = self.take(rid, wait=True)
        with self._lock:
            self.guard_s += time.perf_counter() - t0
            self.guard_copies += int(copied)

    def run_copier(self) -> None:
        for rid in self.order:
            if self.abort.is_set():
                return
            self.take(rid, wait=False)

    def take(self, rid: RowId, wait: bool) -> bool:
        """Copy row ``rid`` out unless someone did; with ``wait``, return only once its copy
        exists."""
        with self._lock:
            event = self._taken.get(rid)
            mine = event is None
            if mine:
                event = self._taken[rid] = threading.Event()
        if not mine:
            while wait and not event.wait(0.05) and not self.abort.is_set():
                pass  # sync: the other taker is copying this row right now
            return False
        try:
            self.queue.put(self._copy_row(*rid))
        except SaveAborted:
            pass
        except BaseException:
            self.abort.set()
            raise
        finally:
            event.set()
        return True

    def _copy_row(self, group: str, row: int) -> Snapshot:
        store = self.store
        kinds = self.kinds[group]
        if self.views:
            views = {k: store.view(k, group, row) for k in kinds}
            if all(v is not None and v.device.type == "cpu" for v in views.values()):
                return Snapshot(group, row, views, pooled=False)
        bufs = self.pool.take(
            {k: (store.row_numel(k, group), store.dtype(k, group)) for k in kinds}, self.abort
        )
        for kind in kinds:
            self._read_row_(kind, group, row, bufs[kind])
        return Snapshot(group, row, bufs, pooled=True)

    def _read_row_(self, kind: str, group: str, row: int, out: torch.Tensor) -> None:
        view = self.store.view(kind, group, row)
        if view is not None:
            out.copy_(view)  # a memory tier: a memcpy (device -> host when the tier is on a GPU)
            if view.device.type == "cuda":
                torch.cuda.current_stream(
                    view.device
                ).synchronize()  # sync: the copy landed in host memory
        else:
            self.store.read_(kind, group, row, out).result()  # sync: the row is in our buffer
