"""Deferred tiles: a tile declared by its shape and the function that makes it, made when needed.

A layer whose tiles together are too large to build at once (a mixture-of-experts block: 128
experts of 2048 x 768 x 3 are 2.4 GB in fp32) declares each tile as a ``Deferred`` in its
``RowTiles`` / ``ColTiles``::

    {"w": RowTiles(tuple(Deferred((1, 2 * f, d), partial(make_expert, seeds[e]))
                         for e in range(n_experts)))}

``zf.init`` reads only the shapes to lay the tile group out, then calls each tile's ``make`` when it
writes that tile's row (on a thread of its own, ``MADE_AHEAD`` tiles ahead of the row written) and
drops the tensor once written: a layer's initialisation holds 1 + ``MADE_AHEAD`` tiles at most
(``zinf_fn.tiling.layout.tile_shards``). ``make`` must return the same values every call
(a generator seeded inside it, never one shared with other tiles), so the values do not depend on
the order tiles are made in, nor on the thread. Outside the engine (a plain loop, a reference),
``materialize(tree)`` gives the tree with every deferred tile made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch


@dataclass(frozen=True)
class Deferred:
    """One tile of ``shape`` and floating ``dtype`` whose values ``make()`` returns (a fresh tensor
    of that shape and dtype, the same values on every call)."""

    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]
    dtype: torch.dtype = torch.float32

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


def is_deferred(x: Any) -> bool:
    """True for a ``Deferred`` tile."""
    return isinstance(x, Deferred)


def made(tile: torch.Tensor | Deferred, where: str = "tile") -> torch.Tensor:
    """The tensor of ``tile``: a tensor as it is, a ``Deferred`` made (and checked against its
    declared shape and dtype; ``where`` names it in the error)."""
    if not isinstance(tile, Deferred):
        return tile
    out = tile.make()
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(tile.shape):
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out)
        raise ValueError(f"{where}: a Deferred tile's make() must return a tensor of its declared "
                         f"shape {tuple(tile.shape)} and dtype {tile.dtype}, got {got}")
    if out.dtype != tile.dtype:
        raise ValueError(f"{where}: a Deferred tile declared {tile.dtype} made {out.dtype}; "
                         "declare the dtype make() returns")
    return out


def materialize(tree: Any) -> Any:
    """``tree`` with every ``Deferred`` leaf replaced by its tensor (each tile made once)."""
    return optree.tree_map(made, tree)
