"""The prefetcher that runs a plan ahead of compute: the one prefetcher of layers
(``plan_prefetcher``) and of tiles (``tiling.step_tiles``), over a ``Fetcher``.

It materialises unit ``plan[i + 1 .. i + depth]`` in a background thread while the caller computes
with ``plan[i]``; with depth 0 every fetch happens on demand.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, NamedTuple

from ..io.futures import done
from ..layout.units import Unit
from .fetch import Fetcher, Layer
from .plan import FetchOp, PassPlan
from .window import Window


class Ticket(NamedTuple):
    """One fetch issued ahead: its future (the layer) and the tier reads ``start`` issued for it
    (None: none; a future of them where an ``issuer`` thread issues them), which
    ``Fetcher.abandon`` gives back where the fetch is cancelled."""

    future: Future
    started: Any = None


class Prefetcher:
    """Runs ``fetcher.fetch`` over a plan's units up to ``depth`` ahead of the consumer (a
    ``window.Window``): the one prefetcher of layers (``plan_prefetcher``) and of tiles
    (``tiling.step_tiles``).

    ``plan`` (an ``overlap.plan.PassPlan``) holds the units by position; ``get(j)`` returns
    ``plan[j]`` materialised, issued ahead or now, and moves the window on to ``j + 1``;
    ``revise(units, moved, cause)`` appends a revision to the plan and follows it;
    ``fetch_unplanned(unit)`` serves a unit the plan does not hold (queued behind the fetches
    issued). ``start(j)``, when given, makes the job that issues item j's tier reads (a callable of
    no arguments, with the item as the plan holds it when it enters the window), run at once, so
    that the reads of several units are in flight together (``Fetcher.start``); the fetch thread
    completes them. With depth 0 (or no fetch thread) every fetch runs on demand, on the caller's
    thread. ``wait_s``: how long ``get`` waited for its item (exposed I/O); ``refill_s``: how long
    ``get`` then took to issue the window's next items (the caller's own work, not a wait: on the
    30B step's tiles about 60 us a take, most of what was counted as a wait before). A fetch issued
    ahead that the plan no longer holds is cancelled where it has not begun (queued behind the
    others on the fetch thread) and the fetcher allows it (``fetcher.cancellable``: one rank; with
    several each fetch is a collective that every rank runs), its reads given back once they land
    (``fetcher.abandon``); else waited for and released. So a revision on one rank never waits for
    the fetches queued before the one it drops.

    ``issuer`` (a thread of its own: the runtime's issue thread): ``start(j)``'s job runs there
    instead of on the caller's thread, in the order issued, and that thread then queues item j's
    fetch on the fetch thread, its reads in flight. The caller (the compute thread) hands each item
    over once: one job, one wake-up; the reads' requests, pool buffers and I/O jobs are made
    beside its compute. Every fetch, an unplanned one too, reaches the fetch thread through the
    issuer, so the fetches run in the order the caller issued them (with several ranks, each a
    collective). A revision made before the job runs changes nothing of it: its item was taken
    when it was made. ``settle`` waits for the reads queued so far to be issued.
    """

    def __init__(
        self,
        plan: PassPlan,
        fetcher: Fetcher,
        depth: int,
        executor: ThreadPoolExecutor | None,
        start: Callable[[int], Any] | None = None,
        further: Callable[[int], bool] | None = None,
        reach: int = 0,
        issuer: ThreadPoolExecutor | None = None,
    ):
        """``further`` and ``reach``: the window widens past ``depth`` over the items ``further``
        lets in, up to ``reach`` ahead (``window.Window``: the tile prefetcher's streamed
        experts); ``issuer``: the thread ``start`` runs on (None: the caller's)."""
        self.plan = plan
        self.fetcher = fetcher
        self._executor = executor if depth > 0 else None
        self._start = start
        self._issuer = issuer
        self._issuing: Future | None = None  # the last ``start`` queued on the issuer
        ahead = depth if self._executor else 0
        self._window: Window[Ticket] = Window(
            plan,
            self._issue,
            self._drop,
            ahead,
            further=further if ahead else None,
            reach=reach,
        )
        self.unplanned = 0
        self.wait_s = 0.0
        self.refill_s = 0.0

    @property
    def prefetched(self) -> int:
        """Units taken that were issued ahead."""
        return self._window.prefetched

    @property
    def on_demand(self) -> int:
        """Units fetched when asked for: the plan's not issued ahead, and the unplanned."""
        return self._window.on_demand + self.unplanned

    @property
    def wasted(self) -> int:
        """Units issued ahead that nobody took (a plan that mispredicted)."""
        return self._window.wasted

    @property
    def cursor(self) -> int:
        """The plan position the window issues ahead of: the one after the last taken."""
        return self._window.cursor

    def get(self, j: int) -> Layer:
        t0 = time.perf_counter()
        layer = self._window.take(j).future.result()  # sync: wait for the prefetched unit
        t1 = time.perf_counter()
        self._window.advance(j + 1)
        self.wait_s += t1 - t0
        self.refill_s += time.perf_counter() - t1
        return layer

    def fetch_unplanned(self, unit: Unit) -> Layer:
        self.unplanned += 1
        return self._submit(unit).future.result()  # sync: the unit is gathered and cast

    def revise(self, units: Sequence, moved: int, cause: str) -> None:
        """Append the revision ``units`` to the plan (``PassPlan.revise``) and follow it: the
        cursor's position is ``moved`` fewer (items behind it left out); a fetch issued ahead stays
        where the new plan has the same unit at its position, or else at the first position of the
        window that plans that unit; the others are given back, and the window refilled."""
        old = self.plan.now
        self.plan.revise(units, moved, cause)
        self._window.replanned()
        window = self._window.span(max(0, self.cursor - moved))

        def key(unit) -> tuple:
            return (unit.group, unit.row)

        def where(j: int) -> int | None:
            was = j + moved
            if not 0 <= was < len(old):
                return None
            if key(units[j]) == key(old[was]):
                return j
            return next((k for k in window if key(units[k]) == key(old[was])), None)

        self._window.follow(where, moved)

    def refill(self) -> None:
        """Keep exactly the plan window [cursor, cursor + depth) in flight; drop what fell out of
        it."""
        self._window.advance(self._window.cursor)

    def close(self) -> None:
        """Wait for and release whatever was fetched ahead but not consumed (the end of a pass, or
        an aborted one)."""
        self._window.close()

    def settle(self) -> None:
        """sync: the reads queued on the issuer so far are issued (their errors stay with their
        fetches), so that reads issued next by the caller queue behind them at the disk."""
        if self._issuing is not None:
            wait([self._issuing])

    def _issue(self, j: int) -> Ticket:
        if self._start is None or self._executor is None:
            return self._submit(self.plan[j])
        job = self._start(j)  # item j as the plan holds it now
        if self._issuer is None:
            return self._submit(self.plan[j], job())
        return self._relay(self.plan[j], job)

    def _submit(self, unit: Unit, started=None) -> Ticket:
        if self._executor is None:
            return Ticket(done(self.fetcher.fetch(unit)))
        if self._issuer is not None:  # behind the fetches the issuer has yet to queue
            return self._relay(unit, None)
        return Ticket(self._executor.submit(self.fetcher.fetch, unit, started), started)

    def _relay(self, unit: Unit, job: Callable[[], Any] | None) -> Ticket:
        """``unit``'s fetch handed to the issuer in one job: there ``job`` issues its reads (None:
        none to issue), then its fetch is queued on the fetch thread; the ticket's future is the
        fetch's (``_issue_then_fetch``), its ``started`` the job's (the reads it issued)."""
        fetched: Future = Future()
        self._issuing = self._issuer.submit(self._issue_then_fetch, unit, job, fetched)
        return Ticket(fetched, self._issuing)

    def _issue_then_fetch(self, unit: Unit, job: Callable[[], Any] | None, fetched: Future):
        """On the issuer: ``unit``'s reads issued, then its fetch queued on the fetch thread to
        complete ``fetched``; returns the reads (``_drop`` gives them back where the fetch is
        cancelled); an issue that fails, or a fetch thread that takes no more jobs (shut down),
        is the fetch's error (raised at its ``get``) and this job's, the reads issued given back."""
        started = None
        try:
            started = None if job is None else job()
            self._executor.submit(self._fetch_into, fetched, unit, started)
        except BaseException as e:
            if started is not None:
                self.fetcher.abandon(started)  # sync: the reads landed, their buffers back
            if fetched.set_running_or_notify_cancel():
                fetched.set_exception(e)
            raise
        return started

    def _fetch_into(self, fetched: Future, unit: Unit, started) -> None:
        """On the fetch thread: ``unit``'s fetch into ``fetched``, its reads in flight; nothing
        where the fetch was cancelled (its reads are the dropper's: ``_drop``)."""
        if not fetched.set_running_or_notify_cancel():
            return
        try:
            layer = self.fetcher.fetch(unit, started)
        except BaseException as e:  # the caller's get raises it
            fetched.set_exception(e)
        else:
            fetched.set_result(layer)

    def _drop(self, ticket: Ticket) -> None:
        """A fetch nobody will take: cancelled where it has not begun (its reads given back once
        they land), else waited for and its layer released."""
        if self.fetcher.cancellable and ticket.future.cancel():
            started = ticket.started
            if isinstance(started, Future):  # on the issuer: not issued, or issued (or failed)
                started = None if started.cancel() else started.result()
            self.fetcher.abandon(started)  # sync: the reads landed, their buffers back
            return
        # sync: the fetch completed before its buffers go back
        self.fetcher.release(ticket.future.result())


def plan_prefetcher(
    plan: list[FetchOp],
    fetcher: Fetcher,
    depth: int,
    executor: ThreadPoolExecutor | None,
    issuer: ThreadPoolExecutor | None = None,
) -> Prefetcher:
    """The layers' prefetcher of a step's plan: the tier reads of the next ``depth`` units run
    concurrently, issued on ``issuer`` (None: on the caller's thread; the runtime has one where a
    param row is on NVMe), and a backward fetch may cast the master its update reads ahead
    (``Fetcher.start(derive=True)``)."""

    def start(j: int):
        return functools.partial(fetcher.start, plan[j].unit, derive=plan[j].phase == "backward")

    units = PassPlan([op.unit for op in plan])
    return Prefetcher(units, fetcher, depth, executor, start, issuer=issuer)
