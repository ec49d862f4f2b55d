"""The update queue: each unit's update runs in a background worker, a bounded backlog behind the
backward.

The updates of a step run in the order their gradients arrive, on ``workers`` threads (0: on the
caller's thread, at once). The gradients waiting for their update are bounded by weight
(``InFlight``): a ``submit`` past the bound waits for the oldest update, so the backward pass never
runs further ahead of the optimizer than the bound allows.

    plain loop this equals:   for unit, grad in gradients: update(unit, grad)
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from ..observe.trace import WaitClock
from ..overlap.stream import InFlight


class Pending(NamedTuple):
    """An update submitted and not retired: its future and the weight of its gradient (bytes)."""

    future: Future
    weight: int


class UpdateQueue:
    """Runs updates on ``workers`` threads with at most ``limit_bytes`` of gradients waiting (and
    always the newest, however heavy); ``waits`` counts the compute thread's time blocked on
    them."""

    def __init__(self, workers: int, limit_bytes: int, waits: WaitClock):
        self.waits = waits
        self._executor = (
            ThreadPoolExecutor(workers, thread_name_prefix="zinf-update") if workers else None
        )
        self._pending: InFlight[Pending] = InFlight(
            self._retire, limit_bytes, finished=_finished, weight=lambda pending: pending.weight
        )

    def submit(self, update: Callable[..., None], weight: int, *args) -> None:
        """Run ``update(*args)`` in a worker (on this thread where there is none)."""
        if self._executor is None:
            update(*args)
            return
        # sync: backpressure when the updates fell behind the backward pass
        self._pending.put(Pending(self._executor.submit(update, *args), weight))

    def wait_backlog(self, limit: int) -> None:
        """sync: block until at most ``limit`` submitted updates are unfinished (bounds grad shards
        in flight)."""
        with self.waits.waiting("update backlog"):
            self._pending.wait_running(limit)

    def wait(self) -> None:
        """sync: every submitted update ran (raises the first error)."""
        with self.waits.waiting("updates"):
            self._pending.drain()

    def abandon(self) -> None:
        """Let running updates finish, swallowing their errors (after a failed step)."""
        self._pending.abandon()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _retire(self, pending: Pending) -> None:
        with self.waits.waiting("update"):
            pending.future.result()  # sync: the update ran (raises its error)


def _finished(pending: Pending) -> bool:
    return pending.future.done()
