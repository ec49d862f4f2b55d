"""The compute thread's CPU per ``Prefetcher.get``: what handing an item to the fetch threads
costs the thread that computes.

A prefetcher with the runtime's two threads (an issue thread and a fetch thread) runs a plan of
``--items`` units ``--depth`` ahead over a fetcher that does nothing (its ``start`` and ``fetch``
return at once), as the tile prefetcher runs a step's streamed experts; between two ``get`` the
caller computes for ``--compute-us`` microseconds (a busy loop, outside the figure), long enough
for both threads to go idle, as they do between experts, so that every hand-off wakes one. The
figure is the calling thread's CPU (``time.thread_time``) inside ``get`` (its wait for the item,
its window's step and the issue of the item entering the window), per item: the best of
``--rounds``.

    python benchmarks/prefetch_handoff.py
    python benchmarks/prefetch_handoff.py --items 4000 --depth 10 --compute-us 300 --rounds 5
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor

from zinf_fn.layout.units import Unit
from zinf_fn.overlap.plan import PassPlan
from zinf_fn.overlap.prefetch import Prefetcher


class NoFetch:
    """A fetcher that moves nothing: ``start`` returns a token, ``fetch`` the unit."""

    cancellable = True

    def start(self, unit: Unit) -> str:
        return "reads"

    def fetch(self, unit: Unit, started=None) -> Unit:
        return unit

    def release(self, layer) -> None:
        pass

    def abandon(self, started) -> None:
        pass


def busy(seconds: float) -> None:
    """The caller's compute: a busy loop of ``seconds`` of wall time."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def cpu_per_get(items: int, depth: int, compute_s: float) -> float:
    """The calling thread's CPU seconds inside ``get``, per item, over one plan of ``items``."""
    units = [Unit(j + 1, "blocks", j) for j in range(items)]
    fetcher = NoFetch()

    def start(j: int):
        return functools.partial(fetcher.start, units[j])

    with (
        ThreadPoolExecutor(1, thread_name_prefix="issue") as issuer,
        ThreadPoolExecutor(1, thread_name_prefix="fetch") as executor,
    ):
        prefetcher = Prefetcher(PassPlan(units), fetcher, depth, executor, start, issuer=issuer)
        spent = 0.0
        for j in range(items):
            busy(compute_s)
            t0 = time.thread_time()
            prefetcher.get(j)
            spent += time.thread_time() - t0
        prefetcher.close()
    return spent / items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=3000)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--compute-us", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    best = min(
        cpu_per_get(args.items, args.depth, args.compute_us * 1e-6) for _ in range(args.rounds)
    )
    print(json.dumps({**vars(args), "cpu_us_per_get": round(best * 1e6, 1)}))


if __name__ == "__main__":
    main()
