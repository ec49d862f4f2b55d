"""Two jobs of a list computed at once, one on a side thread, their inputs fetched in order here.

A layer's frozen experts (``tiling.experts.experts_swiglu``) are independent products of a few
rows each: the fused NF4 kernels run such a product on one thread (``formats.nf4_kernels.
ONE_THREAD_ROWS``), since one OpenMP region per product, a few milliseconds each, puts the compute
thread to sleep and back at its wake-up and end barrier while the engine's fetch, issue and I/O
threads take the other core. Whole experts are coarser: ``each`` offers the jobs a side thread
may take, as they are fetched, and the side thread takes them one after the other, oldest first,
with no hand-off from this thread between them; of two waiting, this thread computes the newer
itself, so one always waits for the side thread as its job ends (a first version handed the side
one job at a time, the next only once this thread had finished its own and seen the side's done:
the side thread then ran 1.7 s of a 30B step's 6.3 s of NF4 products). A job the side thread has
not started when this thread has nothing else left (it computes only on a core no other thread
wants: ``SCHED_IDLE``) is computed here, never waited for.

What stays on this thread, in the list's order: every ``fetch`` (the tile plan's order, and over
data-parallel ranks each fetch's collective) and every ``release`` of a job this thread computed; a
side job's inputs are released here too, once it is done. Each job is computed by the same kernels
on either thread, so the results do not depend on which ran it; a job ``side_ok`` refuses (many
rows: its product takes both cores itself) runs here.

Where the side thread carries a step's parallel work (its big products paired: few rows on lent
codes), the step runs torch's own ops on the compute thread on one thread (``torch_on_one_thread``):
after each parallel op OpenMP's worker spins on the other core for a few milliseconds, and a side
thread that only takes a core no other thread wants waits that long for it (its half of a product
started 3.3-3.8 ms late after a two-thread op, 0.1-0.2 ms without). The 30B step's time did not
move beyond this machine's noise with it; the worker's 0.4 s of CPU a step is gone.
``each`` counts the threads torch had before (``threads``).

Three jobs' inputs are out at once at most (the side's, one waiting for it, this thread's): the
fetcher's demand counts them (``overlap.tile_runs.EXPERTS_AT_ONCE``). The side thread runs its
jobs under ``torch.no_grad`` (grad mode is per thread; the caller's is that of an autograd
Function's forward or backward, which record nothing).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

# on a thread within ``torch_on_one_thread``: the threads torch had before it set one
_BEFORE = threading.local()


@functools.cache
def side_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The process's one side thread, an executor of one worker (idle between layers; made on
    first use)."""
    return concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="zinf-side", initializer=_yielding
    )


def _yielding() -> None:
    """The side thread computes on a core no other thread wants: where it took a core from the
    compute thread or the engine's I/O threads, it would slow what the step waits for. Linux
    schedules it as ``SCHED_IDLE`` (the calling thread's policy only); elsewhere it keeps the
    process's."""
    if hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):  # a sandbox may refuse: then a thread like the others
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _no_grad(compute: Callable[[int, Any], Any], j: int, held: Any) -> Any:
    with torch.no_grad():
        return compute(j, held)


def each(
    jobs: int,
    fetch: Callable[[int], Any],
    compute: Callable[[int, Any], Any],
    release: Callable[[int, Any], None],
    side_ok: Callable[[int, Any], bool],
) -> list:
    """``[compute(j, fetch(j)) for j in range(jobs)]``: each ``held = fetch(j)`` in order here,
    ``release(j, held)`` here once job j is computed. A job ``side_ok(j, held)`` accepts waits for
    the side thread (where one thread is not all torch may use), which takes such jobs one after
    the other; of two waiting, this thread computes the newer, and at the end each the side has not
    started. The others are computed here."""
    out: list = [None] * jobs
    if jobs < 2 or threads() < 2:  # a side thread would share this one's core
        side_ok = _never
    side = _Side(compute)
    try:
        for j in range(jobs):
            side.collect(out, release)  # before each fetch: at most three jobs' inputs out
            held = fetch(j)
            if side_ok(j, held):
                side.offer(j, held)
                taken = side.take(waiting=2)
                if taken is None:
                    continue
                j, held = taken
            _here(j, held, out, compute, release)
        while (taken := side.take(waiting=1)) is not None:  # not started by the side: here
            _here(*taken, out, compute, release)
        side.finish(out, release)
    except BaseException:
        side.abandon(release)
        raise
    return out


def _here(j: int, held: Any, out: list, compute, release) -> None:
    try:
        out[j] = compute(j, held)
    finally:
        release(j, held)


class _Side:
    """The jobs of one ``each`` the side thread may take: those offered and not started
    (``ready``) and those it computed, not yet collected here (``done``: j, inputs, result,
    error). While any wait, one drain of them is queued or running on the side thread."""

    def __init__(self, compute: Callable[[int, Any], Any]):
        self.compute, self.lock = compute, threading.Lock()
        self.ready: collections.deque = collections.deque()
        self.done: list[tuple] = []
        self.drain: concurrent.futures.Future | None = None
        self.stopped = False

    def offer(self, j: int, held: Any) -> None:
        with self.lock:
            self.ready.append((j, held))
            if self.drain is not None:
                return
            self.drain = side_thread().submit(self._drain)

    def take(self, waiting: int) -> tuple[int, Any] | None:
        """The newest job not started, where at least ``waiting`` are."""
        with self.lock:
            return self.ready.pop() if len(self.ready) >= waiting else None

    def _drain(self) -> None:
        """On the side thread: the jobs offered, one after the other, until none waits."""
        while True:
            with self.lock:
                if self.stopped or not self.ready:
                    self.drain = None
                    return
                j, held = self.ready.popleft()
            try:
                result, error = _no_grad(self.compute, j, held), None
            except BaseException as e:  # raised here by ``collect``
                result, error = None, e
            with self.lock:
                self.done.append((j, held, result, error))

    def collect(self, out: list, release) -> None:
        """The side's finished jobs: their results into ``out``, their inputs released; the first
        error raised (after every finished job's inputs are released)."""
        with self.lock:
            done, self.done = self.done, []
        error = None
        for j, held, result, e in done:
            out[j] = result
            release(j, held)
            error = error or e
        if error is not None:
            raise error

    def finish(self, out: list, release) -> None:
        """Nothing left to offer: the drain ended (``_ended``), the rest collected."""
        with self.lock:
            drain = self.drain
        _ended(drain)
        self.collect(out, release)

    def abandon(self, release) -> None:
        """An error here: the side takes no more; once its job ended, every input not released
        is (the jobs waiting, and those done)."""
        with self.lock:
            self.stopped = True
            drain, waiting = self.drain, list(self.ready)
            self.ready.clear()
        _ended(drain)
        for j, held in waiting:
            release(j, held)
        for j, held, _result, _error in self.done:
            release(j, held)
        self.done = []


def _ended(drain: concurrent.futures.Future | None) -> None:
    """``drain`` (none: none queued) over: cancelled where the side thread has not started it
    (another caller's job ahead of it: nothing waits for it), else waited for."""
    if drain is not None and not drain.cancel():
        concurrent.futures.wait([drain])


def threads() -> int:
    """torch's threads on the calling thread as ``each`` counts them: those it had before
    ``torch_on_one_thread`` set one, else torch's (``torch.set_num_threads(1)``: no side thread)."""
    return getattr(_BEFORE, "threads", None) or torch.get_num_threads()


@contextlib.contextmanager
def torch_on_one_thread(on: bool) -> Iterator[None]:
    """Within, where ``on``: torch's ops on the calling thread (a step's compute thread, or either
    of a frozen head's lanes, ``tiling.cross_entropy``) on one thread, ``each`` and ``both`` still
    handing jobs to the side thread (module docstring); torch's count as it was after. torch's
    count is per thread once a thread has run a parallel op, and a thread's first takes the
    process's last setting: an engine thread that first computes within runs one."""
    before = torch.get_num_threads()
    if not on or before < 2:  # nothing to do, or already within
        yield
        return
    torch.set_num_threads(1)
    _BEFORE.threads = before
    try:
        yield
    finally:
        _BEFORE.threads = None
        torch.set_num_threads(before)


def both(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """``(first(), second())``, ``first`` on the side thread where it is idle: ``each`` of two
    jobs with nothing to fetch or release."""
    calls = (first, second)

    def compute(j: int, _held: None) -> Any:
        return calls[j]()

    first_out, second_out = each(2, _fetch_nothing, compute, _release_nothing, _first_only)
    return first_out, second_out


def _fetch_nothing(j: int) -> None:
    return None


def _release_nothing(j: int, held: None) -> None:
    return None


def _first_only(j: int, held: None) -> bool:
    return j == 0


def _never(j: int, held: Any) -> bool:
    return False
