"""Frozen streamed tiles a training step keeps from their forward fetch into their backward.

A LoRA base's expert (a streamed tile group never written after init, ``overlap.tile_runs.
keeps_tiles``) is fetched in the forward for the tokens routed to it and again in the backward for
their input gradient: the same bytes read twice a step. With ``Config.keep_tiles`` bytes, the first
tiles a step's forward units fetch are kept as they are released (``Fetcher.release(keep=True)``:
the fetcher holds the layer, its buffers out), while the budget holds one more of each group
(``overlap.tile_runs.kept_tiles``: so many of each); the backward's fetch of such a tile reads
nothing and takes the kept layer (``Fetcher._row_layer``; the prefetcher's reads, issued through
``Fetcher.start``, skip it too), and the kept tiles of a layer go back to the pool as that layer's
backward unit leaves (``forget``; the rest at the step's end: an evaluation keeps nothing, a failed
step gives them back). Which tiles are kept is decided at their fetch, in the order the compute
thread fetches them, and nothing but the reads depends on it: a kept tile's values are the ones a
backward read would bring (its rows are never written), so the step's bits are the same with any
budget.

The earliest fetched are kept, not the last layers': the bytes saved are the same, the budget's
buffers are out from the step's first layer either way (the pool reserves them), and no kept tile is
ever given back to make room. A tile whose backward fetch was issued before its forward release
(the last layer's, read ahead across the turn) reads again: kept or not, it is read right.
"""

from __future__ import annotations

from ..layout.units import Unit
from ..overlap.fetch import Fetcher, Layer

Key = tuple[str, int]  # a tile's (group, row)


class KeptTiles:
    """One training step's kept tiles: which are claimed (at their forward fetch), kept (at their
    release) and by which unit, so that each layer's go back as its backward unit leaves."""

    def __init__(self, fetcher: Fetcher, limits: dict[str, int]):
        """``limits``: tiles of each group the step may keep (``overlap.tile_runs.kept_tiles``; a
        group not in it keeps none)."""
        self.fetcher, self.limits = fetcher, limits
        self.count = dict.fromkeys(limits, 0)
        self.claimed: set[Key] = set()  # claimed, not released yet
        self.taken: set[Key] = set()  # claimed or kept
        self.by_unit: dict[Unit, list[Key]] = {}

    def claim(self, unit: Unit, layer: Layer) -> None:
        """Forward unit ``unit`` fetched tile ``layer``: claimed, to be kept at its release, where
        its group keeps tiles, it was fetched (``owned``: not a kept one handed out again) and not
        claimed already, and its group's count has room."""
        group = layer.unit.group
        key = (group, layer.unit.row)
        full = self.count.get(group, 0) >= self.limits.get(group, 0)
        if not layer.owned or full or key in self.taken:
            return
        self.count[group] += 1
        self.claimed.add(key)
        self.taken.add(key)
        self.by_unit.setdefault(unit, []).append(key)

    def release(self, layer: Layer) -> None:
        """Tile ``layer`` given back: kept by the fetcher where it is claimed (the first owned layer
        of its row released; a later micro-batch's fetch takes it), else back to the pool."""
        key = (layer.unit.group, layer.unit.row)
        keep = layer.owned and key in self.claimed
        if keep:
            self.claimed.discard(key)
        self.fetcher.release(layer, keep=keep)

    def forget(self, unit: Unit) -> None:
        """``unit``'s backward is done (or the step ends): its kept tiles' buffers back."""
        for group, row in self.by_unit.pop(unit, ()):
            self.claimed.discard((group, row))
            self.taken.discard((group, row))
            self.count[group] -= 1
            self.fetcher.forget(group, row)

    def close(self) -> None:
        """The step's end: every tile still kept goes back."""
        for unit in list(self.by_unit):
            self.forget(unit)
