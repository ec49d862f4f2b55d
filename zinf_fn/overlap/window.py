"""The read-ahead window of overlap: items 0..n-1 of a plan (units to fetch, optimizer rows to
read, checkpoints to restore), issued up to ``depth`` ahead of a cursor and taken by position.
Used by the prefetcher of layers and tiles (``overlap.prefetch.Prefetcher``), the optimizer
read-ahead (``optim.readahead``) and the checkpoint read-back (``offload.activations``); it gives
every item issued back when a pass is abandoned (``close``), whatever failed. The write-behind and
the queue of work in flight are ``overlap.stream``'s.

    the plain loop a Window equals:   for j in range(n): yield wait(issue(j))
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Generic, TypeVar

T = TypeVar("T")


class Window(Generic[T]):
    """Items ``0..len(plan)-1`` of a plan issued up to ``depth`` ahead of a cursor; ``take(j)``
    hands item j out.

    ``plan``: the items, by position (a list, a ``range``, or an ``overlap.plan.PassPlan`` that its
    pass revises: ``follow`` then moves the items issued to their new positions); only its length
    is read here. ``issue(j)`` starts item j and returns its ticket (a future, or a list of them);
    ``drop(ticket)`` waits for an item nobody will take and gives its buffers back (raising its
    error, if any). The caller waits for a ticket it took. ``keep_behind``: items issued behind the
    cursor stay issued (consumers that may take a little out of order, such as several update
    workers) instead of being dropped as mispredicted. ``further(j)``, when given, widens the
    window past ``depth`` over the items right after it for which it holds, up to ``reach`` items
    ahead (small items whose use is far shorter than their issue: streamed experts). Not
    thread-safe: a caller with several threads serialises its calls.

    Its state: the tickets issued and not taken (``_pending``, by position), the cursor, and the
    counts of items prefetched, issued on demand and wasted; the plan is the caller's."""

    def __init__(
        self,
        plan: Sized,
        issue: Callable[[int], T],
        drop: Callable[[T], None],
        depth: int,
        keep_behind: bool = False,
        further: Callable[[int], bool] | None = None,
        reach: int = 0,
    ):
        self.plan = plan
        self.depth = depth
        self.keep_behind = keep_behind
        self._issue = issue
        self._drop = drop
        self._further = further
        self._reach = reach
        self._pending: dict[int, T] = {}
        # positions [a, b) for which ``further`` held, as the plan is now: ``span``'s widening
        # starts past those it still covers (the window moves one item a take: ``further`` is
        # asked of the items past them only); forgotten when the plan changes (``replanned``)
        self._widened = (0, 0)
        self.cursor = 0
        self.prefetched = 0
        self.on_demand = 0
        self.wasted = 0

    @property
    def n(self) -> int:
        """The plan's items (as it is now)."""
        return len(self.plan)

    def take(self, j: int) -> T:
        """Item j's ticket: the one issued ahead, or issued now (on demand)."""
        ticket = self._pending.pop(j, None)
        if ticket is None:
            self.on_demand += 1
            return self._issue(j)
        self.prefetched += 1
        return ticket

    def peek(self, j: int) -> T | None:
        """Item j's ticket if it is issued and not taken yet, else None; changes nothing."""
        return self._pending.get(j)

    @property
    def outstanding(self) -> int:
        """Items issued and not taken yet."""
        return len(self._pending)

    def issued(self) -> list[T]:
        """The tickets of the items issued and not taken yet (a snapshot)."""
        return list(self._pending.values())

    def span(self, cursor: int) -> range:
        """The items issued ahead of ``cursor``: ``[cursor, cursor + depth)``, widened over the
        items after it that ``further`` lets in, up to ``cursor + reach``."""
        n = self.n
        end = min(cursor + self.depth, n)
        if self._further is not None:
            last = min(cursor + self._reach, n)
            first, (a, b) = end, self._widened
            if a <= end < b:  # asked before: it held up to b
                end = max(end, min(b, last))
            while end < last and self._further(end):
                end += 1
            self._widened = (a, max(b, end)) if a <= first <= b else (first, end)
        return range(cursor, end)

    def replanned(self) -> None:
        """The plan changed (a revision): what ``further`` held for is asked again."""
        self._widened = (0, 0)

    def advance(self, cursor: int) -> None:
        """Keep exactly ``span(cursor)`` issued: drop what is issued outside it, issue the rest in
        order."""
        self.cursor = cursor
        window = self.span(cursor)
        for j in [
            j for j in self._pending if j not in window and not (self.keep_behind and j < cursor)
        ]:
            # sync: a fetch the plan mispredicted, waited for and given back
            self._drop(self._pending.pop(j))
            self.wasted += 1
        for j in window:
            if j not in self._pending:
                self._pending[j] = self._issue(j)

    def follow(self, where: Callable[[int], int | None], moved: int = 0) -> None:
        """The plan was revised (``len(plan)`` items now, ``issue`` starts the new ones), the
        cursor's position moved back by ``moved`` (items behind it left out): an issued item now at
        ``j`` goes to position ``where(j)`` of the new plan (``j`` itself where it plans the same
        item); one with nowhere (None, out of range, or a position already taken) is dropped, and
        the window refilled at the cursor."""
        n = self.n
        self.replanned()
        self.cursor -= moved
        old = [(j - moved, ticket) for j, ticket in self._pending.items()]
        self._pending.clear()
        for j, ticket in old:
            to = where(j) if 0 <= j < n else None
            if to is None or not 0 <= to < n or to in self._pending:
                self._drop(ticket)  # sync: a fetch the old plan predicted
                self.wasted += 1
            else:
                self._pending[to] = ticket
        self.advance(self.cursor)

    def close(self) -> None:
        """Drop every item issued and not taken (the end of a pass, or an aborted one); errors are
        swallowed."""
        pending = list(self._pending.values())
        self._pending.clear()
        for ticket in pending:
            try:
                self._drop(ticket)  # sync: wait for the item before its buffers go back
            except Exception:  # the pass already failed or ended; do not mask its error
                pass
