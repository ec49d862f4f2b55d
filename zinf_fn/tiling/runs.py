"""Runs of small tiles: adjacent tiles of one leaf that the tile prefetcher fetches as one item.

A tile is a fetch unit of its own (its own row, pool buffer, gradient and update), but a small one
costs more in hand-offs than in bytes: each prefetched item is a job on the fetch thread, a future,
a window step. The tile plan (``tiling.plan.step_tile_plan``) is cut into runs of consecutive ops of
one leaf and direction, adjacent tiles, at most ``overlap.tile_runs.tile_run`` of them (one tile
where a tile is large, or nothing is fetched ahead), never across a unit's section; the prefetcher's
window runs over the runs, and the tiles of a run wait, fetched, until the op asks for each
(``ReadyTiles``). Where its rows are in memory on the compute device a run is cast in one call
(``Fetcher.fetch_run``), and its gradients go to their update as one
(``overlap.tile_runs.update_run``, ``tiling.leaf_tiles.LeafTiles``).

    the plain loop a run equals:   for unit in run.units: yield fetcher.fetch(unit)
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import NamedTuple

from ..overlap.fetch import Fetcher, Layer
from .layout import TileOp, TileUnit


class TileRun(NamedTuple):
    """Adjacent tiles of one leaf fetched as one item; ``group`` and ``row`` (the rows of its tiles)
    name it as ``Prefetcher.revise`` compares items."""

    group: str
    row: tuple[int, ...]
    units: tuple[TileUnit, ...]


class SectionRuns(NamedTuple):
    """One section of the tile plan (one unit fetch's ops) cut into runs: its ops, its runs, the
    run of each op and the first op of each run (indices within the section)."""

    ops: list[TileOp]
    runs: list[TileRun]
    run_of: list[int]
    start: list[int]


def cut_section(
    ops: list[TileOp], length: Callable[[TileUnit], int], cut_at: int | None = None
) -> SectionRuns:
    """One section's ``ops`` cut into runs of at most ``length(first unit)`` consecutive ops of one
    leaf and direction, adjacent tiles; a run also starts at op ``cut_at`` if given."""
    runs, run_of, start = [], [], []
    for j, op in enumerate(ops):
        last = ops[j - 1] if j else None
        joins = (
            last is not None
            and j != cut_at
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
    return SectionRuns(ops, runs, run_of, start)


class Runs(Sequence):
    """The step's tile plan cut into runs, section by section (a run never crosses a section), read
    as one plan: ``ops[j]``, ``runs[r]``, ``run_of[j]`` (the run of op j) and ``start[r]`` (the
    first op of run r) in step-wide positions. As a sequence, its runs: the tile prefetcher's
    items (a revision of its ``overlap.plan.PassPlan``).

    Immutable: ``replaced`` gives a new plan with some sections cut anew, sharing the others, in
    time linear in the number of sections, not of ops (a routed pass, ``tiling.routed``, rewrites
    one or two sections of a step's many while the step runs)."""

    def __init__(self, parts: list[SectionRuns]):
        self.parts = parts
        self.op_base = [0, *accumulate(len(p.ops) for p in parts)]
        self.run_base = [0, *accumulate(len(p.runs) for p in parts)]
        self.ops = _View(self, _op)
        self.runs = _View(self, _run)
        self.run_of = _View(self, _run_of)
        self.start = _View(self, _start)

    def __len__(self) -> int:
        return len(self.runs)

    def __getitem__(self, r: int) -> TileRun:
        return self.runs[r]

    def section(self, i: int) -> tuple[int, int]:
        """[start, end) of section i's ops."""
        return self.op_base[i], self.op_base[i + 1]

    def before(self, position: int) -> int:
        """How many runs start before op ``position`` (a section's end is a run's start)."""
        return self.run_of[position] if position < self.op_base[-1] else self.run_base[-1]

    def replaced(self, changed: dict[int, SectionRuns]) -> Runs:
        """This plan with sections ``changed`` (index -> its new cut) in place of theirs."""
        return Runs([changed.get(i, part) for i, part in enumerate(self.parts)])


def _op(runs: Runs, j: int) -> TileOp:
    s = bisect_right(runs.op_base, j) - 1
    return runs.parts[s].ops[j - runs.op_base[s]]


def _run(runs: Runs, r: int) -> TileRun:
    s = bisect_right(runs.run_base, r) - 1
    return runs.parts[s].runs[r - runs.run_base[s]]


def _run_of(runs: Runs, j: int) -> int:
    s = bisect_right(runs.op_base, j) - 1
    return runs.run_base[s] + runs.parts[s].run_of[j - runs.op_base[s]]


def _start(runs: Runs, r: int) -> int:
    s = bisect_right(runs.run_base, r) - 1
    return runs.op_base[s] + runs.parts[s].start[r - runs.run_base[s]]


class _View(Sequence):
    """A step-wide sequence over a ``Runs``' sections (``get(runs, index)``)."""

    def __init__(self, runs: Runs, get: Callable):
        self._runs, self._get = runs, get
        self._n = runs.op_base[-1] if get in (_op, _run_of) else runs.run_base[-1]

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int):
        if not 0 <= index < self._n:
            raise IndexError(index)
        return self._get(self._runs, index)


def cut_runs(
    ops: list[TileOp], sections: list[tuple[int, int]], length: Callable[[TileUnit], int]
) -> Runs:
    """``ops`` cut into runs of at most ``length(first unit)`` consecutive ops of one leaf and
    direction, adjacent tiles, each inside one of ``sections`` (which cover ``ops`` in order)."""
    return Runs([cut_section(ops[start:end], length) for start, end in sections])


class RunFetcher:
    """What the tile prefetcher fetches through: a run's tiles in order, each its own ``Layer`` and
    pool buffer (``Fetcher.fetch_run``: one cast call for the run where its rows are in memory on
    the compute device); ``release`` gives every tile of a run back (a run fetched ahead that nobody
    took)."""

    def __init__(self, fetcher: Fetcher):
        self.fetcher = fetcher

    def fetch(self, run: TileRun, started: tuple | None = None) -> tuple[Layer, ...]:
        """``run``'s tiles; ``started``: their reads issued as the run entered the window
        (``start``)."""
        return self.fetcher.fetch_run(run.units, started)

    def start(self, run: TileRun) -> tuple | None:
        """Issue the tier reads of ``run``'s tiles now (``Fetcher.start``, each its staging
        buffer), for ``fetch`` to complete; None where none of them reads anything."""
        started = tuple(self.fetcher.start(unit) for unit in run.units)
        return None if all(s is None for s in started) else started

    def release(self, layers: tuple[Layer, ...]) -> None:
        for layer in layers:
            self.fetcher.release(layer)

    @property
    def cancellable(self) -> bool:
        """Whether a run fetched ahead may be cancelled on this rank alone
        (``Fetcher.cancellable``)."""
        return self.fetcher.cancellable

    def abandon(self, started: tuple | None) -> None:
        """sync: the reads ``start`` issued for a run whose fetch will not run landed, their
        buffers back (``Fetcher.abandon``, tile by tile)."""
        for reads in () if started is None else started:
            self.fetcher.abandon(reads)


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
