"""Consistent rows while training goes on: each row of the states is copied out exactly once, before
anybody changes it.

A *row* is one layer's shard of every saved state kind (16-bit param, fp32 master, optimizer leaves) on
this rank. A save takes every row once, into a ``Snapshot`` that the disk writer consumes. Two takers
race for rows:

- the copier thread walks the rows in the order the next step updates them (head, blocks L-1..0,
  embed), copying each into a staging buffer;
- the write guard (``Store.write_guards``), called by the updater right before a step changes a unit,
  takes that unit's row itself if the copier has not reached it (copy-on-write).

So a step never changes a row the save still needs, and a save never tears. RAM is bounded by the
staging budget: when it is used up, the copier, or the guard (and with it the step), waits for the
writer to free a buffer. That wait is the time training is blocked by ``save_async``; with a budget
that holds the rank's states (the default up to 1 GiB) it is only the memcpy of rows the step reaches
before the copier does. A synchronous save (no training meanwhile) takes memory-tier rows as views,
and streams rows of other tiers (NVMe) through the same bounded pool: layer by layer, never the whole
model in RAM.
"""

from __future__ import annotations

import threading
import time
from queue import Queue
from typing import NamedTuple

import torch

from zinf_fn.io.buffers import aligned_empty
from zinf_fn.state import StateView

RowId = tuple[str, int]   # (group, row)


class Snapshot(NamedTuple):
    group: str
    row: int
    tensors: dict          # kind -> this rank's full shard row (shard_numel elements)
    pooled: bool           # tensors came from the staging pool and go back after writing


class SaveAborted(RuntimeError):
    pass


class StagingPool:
    """Host buffers for row snapshots: at most ``budget`` bytes made (always room for one row); reused."""

    def __init__(self, budget: int):
        self.budget = budget
        self._free: dict[str, list[dict]] = {}
        self._made = 0
        self.peak = 0
        self._cond = threading.Condition()

    def take(self, group: str, layout: dict, abort: threading.Event) -> dict:
        """Buffers for one row of ``group``: ``layout`` is kind -> (numel, dtype, device)."""
        need = sum(n * dtype.itemsize for n, dtype, _ in layout.values())
        with self._cond:
            while True:
                if abort.is_set():
                    raise SaveAborted("the save failed; see its handle's result()")
                if self._free.get(group):
                    return self._free[group].pop()
                self._drop_other_groups(group, need)
                if self._made + need <= self.budget or self._made == 0:
                    self._made += need
                    self.peak = max(self.peak, self._made)
                    break
                self._cond.wait(0.05)   # sync: wait for the writer to give a row back
        return {kind: _host_buffer(n, dtype, device) for kind, (n, dtype, device) in layout.items()}

    def give(self, group: str, tensors: dict) -> None:
        with self._cond:
            self._free.setdefault(group, []).append(tensors)
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _drop_other_groups(self, group: str, need: int) -> None:
        """Free idle buffers of other groups while the budget has no room for ``need`` bytes."""
        for other, free in self._free.items():
            while other != group and free and self._made + need > self.budget:
                row = free.pop()
                self._made -= sum(t.numel() * t.element_size() for t in row.values())


def _host_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Page-aligned (the writer then moves its chunks with O_DIRECT, no copy); pinned for a GPU's rows."""
    pin = torch.cuda.is_available() and device.type == "cuda"
    return aligned_empty(numel, dtype, pin=pin)


class RowSnapshotter:
    """Takes each row once (copier or guard, whoever comes first) and queues it for the writer."""

    def __init__(self, store: StateView, kinds: list[str], order: list[RowId], pool: StagingPool, queue: Queue,
                 views: bool = False):
        self.store, self.kinds, self.order = store, kinds, order
        self.pool, self.queue = pool, queue
        self.views = views            # take memory-tier rows as views: only when nobody trains meanwhile
        self.abort = threading.Event()
        self._taken: dict[RowId, threading.Event] = {}
        self._lock = threading.Lock()
        self.guard_s = 0.0            # time the training spent in the guard (copying or waiting)
        self.guard_copies = 0

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
        """Copy row ``rid`` out unless someone did; with ``wait``, return only once its copy exists."""
        with self._lock:
            event = self._taken.get(rid)
            mine = event is None
            if mine:
                event = self._taken[rid] = threading.Event()
        if not mine:
            while wait and not event.wait(0.05) and not self.abort.is_set():
                pass   # sync: the other taker is copying this row right now
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
        if self.views:
            views = {k: store.view(k, group, row) for k in self.kinds}
            if all(v is not None and v.device.type == "cpu" for v in views.values()):
                return Snapshot(group, row, views, pooled=False)
        n = store.shard_numel(group)
        layout = {k: (n, store.dtype(k), store.device(k)) for k in self.kinds}
        bufs = self.pool.take(group, layout, self.abort)
        for kind in self.kinds:
            self._read_row_(kind, group, row, bufs[kind])
        return Snapshot(group, row, bufs, pooled=True)

    def _read_row_(self, kind: str, group: str, row: int, out: torch.Tensor) -> None:
        view = self.store.view(kind, group, row)
        if view is not None:
            out.copy_(view)        # a memory tier: a memcpy (device -> host when the tier is on a GPU)
            if view.device.type == "cuda":
                torch.cuda.current_stream(view.device).synchronize()   # sync: the copy landed in host memory
        else:
            self.store.read_(kind, group, row, out).result()   # sync: the row is in our buffer
