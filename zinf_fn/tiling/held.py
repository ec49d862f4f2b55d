"""Tiled weights held in memory behind the ``TileSource`` the engine hands a tiled op.

The planner times a tiled unit with these (``planner.compute``): its ops then take the engine's path
(a tile fetched before each use and released after, the linear's input saved before its tiled
forward, so a recorded block's recompute stops where the engine's does) without the engine, its
tiers or threads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch

from .layout import split_tiled
from .sources import LentWeight


class HeldTiles:
    """A ``tiling.TileSource`` over a ``RowTiles`` / ``ColTiles`` node in memory; gradients are
    dropped (what is timed is the op, not the update the engine sends them to). It counts what the
    op asked of it: ``fetches`` (tile fetches) and ``told`` (``will_use`` calls), as the engine's
    ``tiling.leaf_tiles.LeafTiles`` does. ``lent``: what it hands out in place of the node's
    tiles, one per tile, as the engine's fetcher lends them (a frozen NF4 node's codes,
    ``sources.LentWeight``, or a frozen head's tiles in their stored dtype); None: the tiles
    themselves."""

    def __init__(self, node, anchor: torch.Tensor, lent: Sequence | None = None):
        self.anchor = anchor
        self._tiles = node.tiles if lent is None else lent
        self.axis, self.n_tiles = node.axis, len(node.tiles)
        self.fetches = 0
        self.told = 0

    def tile_shape(self, t: int) -> tuple[int, ...]:
        return tuple(self._tiles[t].shape)

    def fetch(self, t: int) -> torch.Tensor | LentWeight:
        self.fetches += 1
        return self._tiles[t]

    def release(self, t: int) -> None:
        pass

    def grad_out(self, t: int, dtype: torch.dtype) -> torch.Tensor | None:
        return None

    def emit_grad(self, t: int, grad: torch.Tensor) -> None:
        pass

    def will_use(self, tiles: tuple[int, ...], others: tuple = ()) -> tuple[int, ...]:
        for source in (self, *others):
            source.told += 1
        return tiles


def held(
    apply: Callable,
    tree: Any,
    made: list | None = None,
    lent: Mapping[str, Sequence] | None = None,
) -> tuple[Callable, Any]:
    """(``apply`` taking ``tree``'s rest, the rest): the rest is ``tree`` with an anchor (a
    zero-size leaf) in place of each tiled node, as the engine stores a unit; the returned apply
    puts a ``HeldTiles`` over the node where its anchor is, as the engine puts its tile handle
    there (``made``: each call's appended, ``(k, source)`` for the k-th tiled node in tree order;
    ``lent``: by the node's key path, what its source hands out in place of its tiles). A tree
    without tiled nodes comes back as it is, with ``apply``."""
    lent = lent or {}
    rest, found = split_tiled(tree)
    if not found:
        return apply, tree

    def apply_held(params: Any, *args):
        leaves, treedef = optree.tree_flatten(params)
        for k, (path, index, node) in enumerate(found):
            leaves[index] = HeldTiles(node, leaves[index], lent.get(path))
            if made is not None:
                made.append((k, leaves[index]))
        return apply(optree.tree_unflatten(treedef, leaves), *args)

    return apply_held, rest
