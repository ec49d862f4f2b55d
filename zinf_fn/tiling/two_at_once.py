"""Two jobs of a list computed at once, one on a side thread, their inputs fetched in order here.

A layer's frozen experts (``tiling.experts.experts_swiglu``) are independent products of a few
rows each: the fused NF4 kernels run such a product on one thread (``formats.nf4_kernels.
ONE_THREAD_ROWS``), since one OpenMP region per product, a few milliseconds each, puts the compute
thread to sleep and back at its wake-up and end barrier while the engine's fetch, issue and I/O
threads take the other core. Whole experts are coarser: ``each`` hands one job at a time to a side
thread while this thread computes the next ones, and takes the side's result back when it is done,
never waiting for it before the end. What stays on this thread, in the list's order: every
``fetch`` (the tile plan's order, and over data-parallel ranks each fetch's collective) and every
``release`` of a job this thread computed; a side job's inputs are released here too, once it is
done. Each job is computed by the same kernels on either thread, so the results do not depend on
which ran it; a job ``side_ok`` refuses (many rows: its product takes both cores itself) runs here.

Two jobs at once hold the inputs of two: the fetcher's demand counts them
(``overlap.tile_runs.EXPERTS_AT_ONCE``). The side thread runs its job under ``torch.no_grad``
(grad mode is per thread; the caller's is that of an autograd Function's forward or backward,
which record nothing).
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any

import torch


@functools.cache
def _side() -> concurrent.futures.ThreadPoolExecutor:
    """The one side thread, for the process (idle between layers; made on first use)."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zinf-side")


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
    if jobs < 2 or torch.get_num_threads() < 2:  # a side thread would share this one's core
        side_ok = _never
    side: tuple[int, Any, concurrent.futures.Future] | None = None
    try:
        for j in range(jobs):
            held = fetch(j)
            if side is None and j + 1 < jobs and side_ok(j, held):
                side = (j, held, _side().submit(_no_grad, compute, j, held))
                continue
            try:
                out[j] = compute(j, held)
            finally:
                release(j, held)
            if side is not None and side[2].done():
                done, side = side, None
                _take(done, out, release)
    except BaseException:
        if side is not None:  # its inputs stay valid until it ends: wait, release, keep our error
            concurrent.futures.wait([side[2]])
            release(side[0], side[1])
        raise
    if side is not None:
        _take(side, out, release)
    return out


def _take(side: tuple[int, Any, concurrent.futures.Future], out: list, release) -> None:
    """The side job's result into ``out`` (waiting for it), its inputs released."""
    j, held, future = side
    try:
        out[j] = future.result()  # sync: the side thread's job, done or nearly
    finally:
        release(j, held)


def _never(j: int, held: Any) -> bool:
    return False
