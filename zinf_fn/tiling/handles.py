"""The handle a tiled op sees in place of a tiled weight during a step (a ``tiling.TileSource``),
bound late to the live unit's tiles (``tiling.step_tiles.StepTiles``): a block's graph recorded in
forward fetches and emits through the backward unit's tiles when it is pulled back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .layout import TiledLeaf
from .leaf_tiles import LeafTiles
from .sources import LentWeight

if TYPE_CHECKING:
    from .step_tiles import StepTiles


class TileHandle:
    """What ``apply`` sees in place of a tiled weight: a ``tiling.TileSource`` over the live unit's
    ``LeafTiles``.

    It is bound late: each call goes to the leaf's tiles of the unit of its stage live *now*, which
    must be the same layer. So a block's graph recorded in forward (``scan.tape``), whose tiled ops
    hold the forward's handles, fetches and emits through the backward unit's tiles when it is
    pulled back.
    """

    def __init__(
        self, step: StepTiles, leaf: TiledLeaf, index: int, layer: int, anchor: torch.Tensor
    ):
        self._step, self._leaf, self._index, self._layer, self.anchor = (
            step,
            leaf,
            index,
            layer,
            anchor,
        )
        self.axis, self.n_tiles = leaf.axis, leaf.n_tiles

    def _tiles(self) -> LeafTiles:
        live = self._step.active.get(self._leaf.stage)
        tiles = live[self._index] if live else None
        if tiles is None or tiles.units[0].layer != self._layer:
            raise RuntimeError(
                f"{self!r} was used while layer {self._layer} of {self._leaf.stage!r} is not "
                "materialised: a tiled op runs only inside its stage's apply or its "
                "backward"
            )
        return tiles

    def tile_shape(self, t: int) -> tuple[int, ...]:
        return self._leaf.shapes[t]

    def fetch(self, t: int) -> torch.Tensor | LentWeight:
        return self._tiles().fetch(t)

    def release(self, t: int) -> None:
        self._tiles().release(t)

    def grad_out(self, t: int, dtype: torch.dtype) -> torch.Tensor | None:
        return self._tiles().grad_out(t, dtype)

    def emit_grad(self, t: int, grad: torch.Tensor) -> None:
        self._tiles().emit_grad(t, grad)

    def will_use(self, tiles: tuple[int, ...], others: tuple = ()) -> tuple[int, ...]:
        """``tiling.TileSource.will_use``: the tiles every rank fetches (the union), and a hint to
        the tile prefetcher (``StepTiles.will_use``)."""
        return self._step.will_use(self._tiles(), tiles, [other._tiles() for other in others])

    def __repr__(self) -> str:
        return f"TileHandle({self._leaf.describe()}, layer {self._layer})"
