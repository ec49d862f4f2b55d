"""Two jobs of a list computed at once, one on a side thread, their inputs fetched in order here.

A layer's frozen experts (``tiling.experts.experts_swiglu``) are independent products of a few
rows each: the fused NF4 kernels run such a product on one thread (``formats.nf4_kernels.
ONE_THREAD_ROWS``), since one OpenMP region per product, a few milliseconds each, puts the compute
thread to sleep and back at its wake-up and end barrier while the engine's fetch, issue and I/O
threads take the other core. Whole experts are coarser: ``each`` hands one job at a time to a side
thread while this thread computes the next ones, and takes the side's result back when it is done,
never waiting for it before the end; a job the side thread has not started by then (it computes
only on a core no other thread wants: ``SCHED_IDLE``) is taken back and computed here.

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

Two jobs at once hold the inputs of two: the fetcher's demand counts them
(``overlap.tile_runs.EXPERTS_AT_ONCE``). The side thread runs its job under ``torch.no_grad``
(grad mode is per thread; the caller's is that of an autograd Function's forward or backward,
which record nothing).
"""

from __future__ import annotations

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
    ``release(j, held)`` once job j is computed. A job ``side_ok(j, held)`` accepts is handed to the
    side thread where it is idle (and one thread is not all torch may use), the others computed
    here."""
    out: list = [None] * jobs
    if jobs < 2 or threads() < 2:  # a side thread would share this one's core
        side_ok = _never
    side: tuple[int, Any, concurrent.futures.Future] | None = None
    try:
        for j in range(jobs):
            held = fetch(j)
            if side is None and j + 1 < jobs and side_ok(j, held):
                side = (j, held, side_thread().submit(_no_grad, compute, j, held))
                continue
            try:
                out[j] = compute(j, held)
            finally:
                release(j, held)
            if side is not None and side[2].done():
                done, side = side, None
                _take(done, out, compute, release)
    except BaseException:
        if side is not None:  # its inputs stay valid until it ends: wait, release, keep our error
            if not side[2].cancel():
                concurrent.futures.wait([side[2]])
            release(side[0], side[1])
        raise
    if side is not None:
        _take(side, out, compute, release)
    return out


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


def _take(side: tuple, out: list, compute, release) -> None:
    """The side job's result into ``out`` (waiting for it, or computing it here where the side
    thread has not started it), its inputs released."""
    j, held, future = side
    try:  # not started yet (the side thread found no free core): computed here
        out[j] = compute(j, held) if future.cancel() else future.result()
    finally:
        release(j, held)


def _never(j: int, held: Any) -> bool:
    return False
