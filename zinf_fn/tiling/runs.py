"""Runs of small tiles: adjacent tiles of one leaf that the tile prefetcher fetches as one item.

A tile is a fetch unit of its own (its own row, pool buffer, gradient and update), but a small one
costs more in hand-offs than in bytes: each prefetched item is a job on the fetch thread, a future,
a window step. The tile plan (``tiling.plan.step_tile_plan``) is cut into runs of consecutive ops of
one leaf and direction, adjacent tiles, at most ``overlap.tile_runs.tile_run`` of them (one tile
where a tile is large, or nothing is fetched ahead), never across a unit's section; the prefetcher's
window runs over the runs, and the tiles of a run wait, fetched, until the op asks for each
(``ReadyTiles``). Where its rows are in memory on the compute device a run is cast in one call
(``Fetcher.fetch_run``), and its gradients go to their update as one
(``overlap.tile_runs.update_run``, ``tiling.runtime.LeafTiles``).

    the plain loop a run equals:   for unit in run.units: yield fetcher.fetch(unit)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ..overlap.fetch import Fetcher, Layer
from .layout import TileOp, TileUnit


class TileRun(NamedTuple):
    """Adjacent tiles of one leaf fetched as one item; ``group`` and ``row`` (the rows of its tiles)
    name it as ``Prefetcher.replan`` compares items."""

    group: str
    row: tuple[int, ...]
    units: tuple[TileUnit, ...]


class Runs(NamedTuple):
    """The step's tile plan cut into runs: the runs, the run of each op, and the first op of each
    run."""

    runs: list[TileRun]
    run_of: list[int]
    start: list[int]

    def before(self, position: int) -> int:
        """How many runs start before op ``position`` (runs never cross a section: a section's end
        is a run's start)."""
        return self.run_of[position] if position < len(self.run_of) else len(self.runs)


def cut_runs(
    ops: list[TileOp], sections: list[tuple[int, int]], length: Callable[[TileUnit], int]
) -> Runs:
    """``ops`` cut into runs of at most ``length(first unit)`` consecutive ops of one leaf and
    direction, adjacent tiles, each inside one of ``sections``."""
    ends = {end for _, end in sections}
    runs, run_of, start = [], [], []
    for j, op in enumerate(ops):
        last = ops[j - 1] if j else None
        joins = (
            last is not None
            and j not in ends
            and last.unit.group == op.unit.group
            and last.direction == op.direction
            and abs(last.unit.tile - op.unit.tile) == 1
            and j - start[-1] < length(ops[start[-1]].unit)
        )
        if joins:
            run = runs[-1]
            runs[-1] = TileRun(run.group, (*run.row, op.unit.row), (*run.units, op.unit))
        else:
            runs.append(TileRun(op.unit.group, (op.unit.row,), (op.unit,)))
            start.append(j)
        run_of.append(len(runs) - 1)
    return Runs(runs, run_of, start)


class RunFetcher:
    """What the tile prefetcher fetches through: a run's tiles in order, each its own ``Layer`` and
    pool buffer (``Fetcher.fetch_run``: one cast call for the run where its rows are in memory on
    the compute device); ``release`` gives every tile of a run back (a run fetched ahead that nobody
    took)."""

    def __init__(self, fetcher: Fetcher):
        self.fetcher = fetcher

    def fetch(self, run: TileRun) -> tuple[Layer, ...]:
        return self.fetcher.fetch_run(run.units)

    def release(self, layers: tuple[Layer, ...]) -> None:
        for layer in layers:
            self.fetcher.release(layer)


class ReadyTiles:
    """Tiles of runs taken from the prefetcher and not yet asked for: ``(group, row)`` -> its
    ``Layer``."""

    def __init__(self, fetcher: Fetcher):
        self.fetcher, self._ready = fetcher, {}

    def pop(self, key: tuple[str, int]) -> Layer | None:
        return self._ready.pop(key, None)

    def keep(self, layers: tuple[Layer, ...], taken: Layer) -> None:
        """The tiles of a run just taken, but ``taken``; one still kept of an earlier run (a plan
        that mispredicted) is given back."""
        for layer in layers:
            if layer is not taken:
                old = self._ready.pop((layer.unit.group, layer.unit.row), None)
                if old is not None:
                    self.fetcher.release(old)
                self._ready[(layer.unit.group, layer.unit.row)] = layer

    def release(self, group: str | None = None) -> None:
        """Give back the tiles of ``group`` (None: every group) nobody asked for (a plan that
        mispredicted)."""
        for k in [k for k in self._ready if group is None or k[0] == group]:
            self.fetcher.release(self._ready.pop(k))
