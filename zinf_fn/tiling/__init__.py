"""Memory-centric tiling: tiled ops (``ops``), their layout as fetch units (``layout``, ``plan``),
their runtime.

Only the ops are re-exported here: ``layers/`` imports this package and must not pull in the engine.
"""

from .cross_entropy import linear_cross_entropy
from .deferred import Deferred, is_deferred, materialize
from .experts import expert_linear, expert_swiglu, experts_swiglu, will_use
from .ops import (
    ColTiles,
    RowTiles,
    is_tiled,
    linear,
    tile,
    tile_sizes,
    untile,
)
from .sources import TileSource
from .vocab import embedding

__all__ = [
    "ColTiles",
    "Deferred",
    "RowTiles",
    "TileSource",
    "embedding",
    "expert_linear",
    "expert_swiglu",
    "experts_swiglu",
    "is_deferred",
    "is_tiled",
    "linear",
    "linear_cross_entropy",
    "materialize",
    "tile",
    "tile_sizes",
    "untile",
    "will_use",
]
