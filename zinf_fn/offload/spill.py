"""Spillover: one state kind's rows split over two tiers, behind the one ``Tier`` interface.

A ``SpillTier`` holds the rows of the units before ``first_spilled`` (scan order: 0 the embedding,
1..L the blocks, L+1 the head; a tile row goes with the unit it belongs to) in its ``fast`` member
and
the rest in its ``slow`` member, each member array holding only its own rows, in order::

    blocks/master, 4 layers, first_spilled=3:  rows 0, 1 (units 1, 2) -> fast rows 0, 1
                                               rows 2, 3 (units 3, 4) -> slow rows 0, 1

Every read, write and view is routed to the member that holds the row (``placement_of``: the
one answer the updater and the planner ask too), so the bytes a row holds and moves are the same as
in a single-tier placement; the rest of the engine never sees the split.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import NamedTuple

import torch

from ..layout.units import unit_of_row
from .protocol import Tier


class Split(NamedTuple):
    """Where one state kind's rows live: in ``fast`` ("none", "cpu" or "nvme") for the units before
    ``first_spilled`` (scan order, ``zinf_fn.layout.units``), in ``slow`` from it on; ``slow`` None:
    no spill."""

    fast: str
    slow: str | None = None
    first_spilled: int = 0


def placement_of(split: Split, unit_index: int) -> str:
    """The placement ("none", "cpu" or "nvme") of the rows of unit ``unit_index`` (a tile's: its
    unit's) under ``split``: the one answer to "where does this row live?" (the spill tier, the
    updater and the planner ask it)."""
    return (
        split.slow if split.slow is not None and unit_index >= split.first_spilled else split.fast
    )


class SpillTier:
    """Rows of units ``< split.first_spilled`` in ``fast``, the others in ``slow`` (see the module
    docstring); ``split`` names the members' placements."""

    def __init__(self, fast: Tier, slow: Tier, split: Split, n_layers: int):
        self.fast, self.slow, self.split, self.n_layers = fast, slow, split, n_layers
        self.name = f"{fast.name}+{slow.name}"
        # Buffers a caller stages rows in live where the slowest member wants them (NVMe reads into
        # host memory).
        self.device = slow.device if slow.device.type == "cpu" else fast.device
        self._routes: dict[str, list[tuple[Tier, int]]] = {}

    def split_rows(self, key: str, rows: int) -> tuple[int, int]:
        """Rows of ``key`` (an array of ``rows`` rows) in the fast and in the slow member."""
        fast = sum(self._in_fast(key, r, rows) for r in range(rows))
        return fast, rows - fast

    def _in_fast(self, key: str, row: int, rows: int) -> bool:
        unit = unit_of_row(key.split("/")[0], row, rows, self.n_layers)
        return placement_of(self.split, unit) == self.split.fast

    def allocate(self, key, rows, numel, dtype):
        if key in self._routes:
            raise ValueError(f"tier {self.name!r}: array {key!r} already exists")
        route, counts = [], {id(self.fast): 0, id(self.slow): 0}
        for r in range(rows):
            member = self.fast if self._in_fast(key, r, rows) else self.slow
            route.append((member, counts[id(member)]))
            counts[id(member)] += 1
        for member in (self.fast, self.slow):
            if counts[id(member)]:
                member.allocate(key, counts[id(member)], numel, dtype)
        self._routes[key] = route

    def drop(self, key):
        for member in {id(m): m for m, _ in self._routes.pop(key)}.values():
            member.drop(key)

    def view(self, key, row) -> torch.Tensor | None:
        member, local = self._routes[key][row]
        return member.view(key, local)

    def keep(self, key, row) -> None:
        member, local = self._routes[key][row]
        member.keep(key, local)

    def read_(self, key, row, out, start=0) -> Future:
        member, local = self._routes[key][row]
        return member.read_(key, local, out, start)

    def write_(self, key, row, src, start=0) -> Future:
        member, local = self._routes[key][row]
        return member.write_(key, local, src, start)

    def keys(self):
        return list(self._routes)

    def counters(self) -> dict[str, int]:
        """Both members' counters summed, and each member's own as ``"<member>.<counter>"``."""
        out: dict[str, int] = {}
        for member in (self.fast, self.slow):
            for name, value in member.counters().items():
                out[name] = out.get(name, 0) + value
                out[f"{member.name}.{name}"] = value
        return out

    def count_view_io(self, read=0, written=0):
        # the fast member is a memory tier (a view came from it)
        self.fast.count_view_io(read, written)

    def close(self):
        try:
            self.fast.close()
        finally:
            self.slow.close()
