"""The stream primitives of overlap that move writes and work in flight: a bounded queue of work in
flight and a write-behind (the read-ahead window is ``overlap.window.Window``).

``InFlight``  operations started in order and retired oldest first by one retire loop, which each
              bound asks in its own words: at most ``limit`` (by count or weight) queued (``put``),
              at most ``keep`` queued past a room of bytes (``press``: the write-behind), at most
              ``limit`` unfinished (``wait_running``: the updates' backlog, ``optim.queue``); also
              the checkpoint writer.
``WriteBehind`` tier writes (``offload.transfers.Write``) from pool buffers on an ``InFlight``: each
              buffer goes back to the pool once its write completed.

Both give every buffer back when a pass is abandoned (``abandon``), whatever failed.

    the plain loop an InFlight equals: for op in ops: retire(start(op))
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from ..io.buffers import BufferPool
from ..layout.demand import Buffers, Demand, Sizing, pieces_held, shared
from ..observe.trace import WaitClock
from ..offload.transfers import Transfer, Write
from ..store import Store

T = TypeVar("T")
# buffers per (numel, dtype) a caller holds fewer of than at its most
Room = dict[tuple[int, torch.dtype], int]


class InFlight(Generic[T]):
    """Operations in flight, oldest first: ``put`` retires the oldest while more than ``limit`` are
    queued.

    ``retire(ticket)`` waits for one operation and cleans up after it (gives its buffers back),
    raising its error; ``finished(ticket)``, when given, lets operations that already completed
    retire early, without waiting. ``weight(ticket)``, when given, counts operations by weight
    (bytes) instead of one each; a weighted queue always keeps its newest operation running, however
    heavy. Every retiring call retires all it should and then raises the first error. Thread-safe:
    operations may be put from several threads."""

    def __init__(
        self,
        retire: Callable[[T], None],
        limit: int,
        finished: Callable[[T], bool] | None = None,
        weight: Callable[[T], int] | None = None,
    ):
        self.limit = limit
        self._retire, self._finished = retire, finished
        self._weight_of = weight or (lambda ticket: 1)
        self._floor = 0 if weight is None else 1  # operations kept however heavy the load
        self._queue: deque[T] = deque()
        self._load = 0
        self._lock = threading.Lock()

    def put(self, ticket: T, limit: int | None = None) -> None:
        """Queue ``ticket``, then retire the oldest while more than ``limit`` (default
        ``self.limit``) are queued."""
        with self._lock:
            self._queue.append(ticket)
            self._load += self._weight_of(ticket)
        # sync: backpressure, bounded in flight
        self.retire_until(self.limit if limit is None else limit)

    def retire_until(self, keep: int, floor: int | None = None) -> None:
        """Retire the oldest operations until at most ``keep`` (weight) are queued, or only
        ``floor`` operations are (and the oldest has not finished)."""
        floor = self._floor if floor is None else floor
        self._retire_while(
            lambda queue: (self._load > keep and len(queue) > floor) or self._done(queue[0])
        )

    def retire_oldest(self) -> None:
        """Retire the oldest operation, if any (waiting for it): room for the next one."""
        with self._lock:
            oldest = self._queue[0] if self._queue else None
        self._retire_while(lambda queue: queue[0] is oldest)

    def press(self, keep: int, fits: Callable[[list[T]], bool]) -> None:
        """Retire the oldest until at most ``keep`` operations are queued, or those older than the
        newest ``keep`` ``fits`` (a room the caller has): a write-behind's bound, which may run over
        by what its caller holds fewer of elsewhere."""

        def due(queue) -> bool:
            beyond = len(queue) - keep
            return beyond > 0 and not fits([queue[i] for i in range(beyond)])

        self._retire_while(due)

    def wait_running(self, limit: int) -> None:
        """Retire the oldest until at most ``limit`` of the operations queued have not finished
        (those that finished retire as they come: they cost no wait)."""
        self._retire_while(
            lambda queue: sum(not self._done(t) for t in queue) > limit or self._done(queue[0])
        )

    def drain(self) -> None:
        """sync: every operation put so far is retired; raises the first failure."""
        self.retire_until(0, floor=0)

    def abandon(self) -> None:
        """Retire everything, swallowing errors (after a failed step: only the buffers matter)."""
        try:
            self.drain()
        except Exception:  # the step already failed with its own error
            pass

    def _retire_while(self, due: Callable[[deque[T]], bool]) -> None:
        """The one retire loop: retire the oldest operation while ``due(queue)`` (asked under the
        lock, the queue not empty); every due operation retires, then the first error is raised."""
        error = None
        while True:
            with self._lock:
                if not self._queue or not due(self._queue):
                    break
                ticket = self._queue.popleft()
                self._load -= self._weight_of(ticket)
            try:
                self._retire(ticket)  # sync: the operation completed (or it raises)
            except Exception as e:  # retire every operation due, then raise the first error
                error = error or e
        if error is not None:
            raise error

    def tickets(self) -> list[T]:
        """The operations in flight, oldest first (a snapshot)."""
        with self._lock:
            return list(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def _done(self, ticket: T) -> bool:
        return self._finished is not None and self._finished(ticket)


class WriteBehind:
    """Writes rows from pool buffers; each buffer goes back to the pool once its write completed.

    At most ``limit`` units' writes stay in flight (0: every write completes before ``put``
    returns). ``waits`` counts the compute thread's time blocked on them."""

    def __init__(self, pool: BufferPool, limit: int, waits: WaitClock | None = None):
        self.pool, self.limit = pool, limit
        self.waits = waits or WaitClock()
        self._inflight: InFlight[list[Transfer]] = InFlight(self._retire, limit, _all_done)

    def put(self, writes: list[Write], room: Room | None = None) -> None:
        """Issue the writes of one unit or piece; waits while over ``limit`` of them are in flight
        and the older ones do not fit ``room`` (buffers the caller holds fewer of elsewhere: reads
        ahead it no longer needs, ``optim.readahead.ReadAhead.room``)."""
        group = [
            Transfer(w.buf, w.tier.write_(w.key, w.row, w.buf, w.start), w.pooled) for w in writes
        ]
        # retires what completed; the bound is below
        self._inflight.put(group, len(self._inflight) + 1)
        self.press(room)

    def press(self, room: Room | None = None) -> None:
        """sync: retire the oldest writes until at most ``limit`` are in flight or the older ones
        fit ``room``; ``press()`` brings a write-behind that used a room back to ``limit``."""
        # sync: backpressure
        self._inflight.press(self.limit, lambda older: fits(older, room or {}))

    def drain(self) -> None:
        """sync: every write issued so far has completed (raises the first failure)."""
        self._inflight.drain()

    def abandon(self) -> None:
        """Wait for every write in flight and give its buffers back, swallowing errors."""
        self._inflight.abandon()

    @property
    def buffers_held(self) -> int:
        """Pool buffers of the writes not yet reclaimed (completed or not): they go back at the next
        put or drain."""
        return sum(1 for group in self._inflight.tickets() for t in group if t.pooled)

    def _retire(self, group: list[Transfer]) -> None:
        error = None
        with self.waits.waiting("write"):
            for t in group:
                try:
                    t.future.result()  # sync: the row is written; its buffer may be reused
                except Exception as e:  # give every buffer back, then raise the first
                    error = error or e
                if t.pooled:
                    self.pool.give(t.buf)
        if error is not None:
            raise error


def demand(store: Store, sizing: Sizing) -> Demand:
    """What the optimizer's write-behind holds and writes (see ``zinf_fn.layout.demand``), per
    group, of the buffers it is handed that no stream read (``optim.stream_demand.demand`` counts
    those, and the 16-bit copies cast from them): where the params are on NVMe and the optimizer
    rows in memory, the 16-bit row an update casts (a remainder master's: every param piece of
    ``Sizing.piece_numel`` it read), from the cast until its write retires (each worker's and
    ``depth`` written, ``depth`` into the next forward and turn); with clipping, the gradients
    stashed in backward (``depth`` written, the backward holding the next one:
    ``optim.backlog.demand``). Every NVMe row of its kinds is written once per step
    (``RowKinds.row_nbytes`` each; an fp32 param row is its master: no copy of its own)."""
    depth, workers = sizing.depth, max(1, sizing.workers)
    row_kinds = store.row_kinds
    update = ("update",) if sizing.clipping else ("backward",)
    copies: list[Buffers] = []
    stashed: list[Buffers] = []
    written = 0
    # a frozen group's rows: never written
    for group in (g for g in store.groups.values() if row_kinds.policy(g.name).written):
        shard, kinds = group.part.shard_numel, row_kinds.opt_kinds(None, group.name)
        rows = store.row_units(group, sizing.n_layers)
        opt = [u for u in rows if store.placement_of("master", u) == "nvme"]
        param = [u for u in rows if store.placement_of("param", u) == "nvme"]
        in_place = sum(1 for u in param if u not in opt)
        # whole rows; a remainder's: every piece of the unit's row
        if in_place and not row_kinds.param_is_master:
            cut = sizing.piece_numel if row_kinds.remainder else shard
            for units_held, phases in ((workers + depth, update), (depth, ("forward", "turn"))):
                held = pieces_held(shard, cut, in_place, units_held * -(-shard // cut))
                copies += [Buffers(n, row_kinds.param_dtype, c, phases=phases) for n, c in held]
        # the clipped path stashes each gradient, written behind in backward
        if row_kinds.has_grad_arrays:
            stashed.append(
                Buffers(shard, torch.float32, min(group.rows, depth), phases=("backward",))
            )
        opt_bytes = sum(row_kinds.row_nbytes(k, group.name) for k in kinds)
        param_bytes = row_kinds.row_nbytes("param", group.name)
        written += len(opt) * opt_bytes + (
            len(param) * param_bytes if not row_kinds.param_is_master else 0
        )
    # one write-behind for every group: of a size, the stashes of ``depth`` writes, the copies of as
    # many units
    copies_held = copies if row_kinds.remainder else shared(copies, workers + depth)
    held = shared(stashed, depth) + copies_held
    return Demand("optimizer written behind", tuple(held), written=written)


def fits(groups: list[list[Transfer]], room: Room) -> bool:
    """Whether the pooled buffers of write ``groups`` fit ``room``, size by size: of every (numel,
    dtype) the room names, no more than it allows, and each group holds one of those (a size it does
    not name, a 16-bit copy beside the rows read, rides along with its group)."""
    held: Room = {}
    for group in groups:
        keys = [buffer_key(t.buf) for t in group if t.pooled]
        if not any(k in room for k in keys):
            return False
        for k in keys:
            held[k] = held.get(k, 0) + 1
    return all(n <= room[k] for k, n in held.items() if k in room)


def buffer_key(buf: torch.Tensor) -> tuple[int, torch.dtype]:
    """The size of a stream's buffer, as a ``Room`` counts it (a stream's buffers are on one
    device)."""
    return buf.numel(), buf.dtype


def _all_done(group: list[Transfer]) -> bool:
    return all(t.future.done() for t in group)
