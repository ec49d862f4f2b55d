"""A vocabulary table tiled over its rows, looked up by the rows the tokens use.

An embedding of V rows (151,936 x 2048 is 1.2 GB in fp32) declared as ``tile(w, T, axis=0)`` is
T fetch units of the engine, as any tile is. ``embedding(ids, w)`` equals ``F.embedding(ids, w)``
over

- a plain ``(V, D)`` tensor: ``F.embedding`` (the slow twin),
- a ``RowTiles`` of tensors: the rows gathered tile by tile, each tile's gradient through autograd
  (a tile no id falls in gets a zero gradient, as its rows of ``F.embedding``'s do),
- a ``TileSource`` (the engine's handle): the tiles holding the ids are told first
  (``TileSource.will_use``: over data-parallel ranks the union of every rank's, as experts are),
  then fetched one at a time, their rows copied out, released. A tile no id falls in is never
  fetched. The backward fetches no tile (a row's gradient is the output's gradient rows added at
  its ids, ``index_add_``, which needs no weight): for each used tile, in reverse, it writes the
  gradient into a buffer the engine lends (``TileSource.grad_out``) or a fresh one and emits it;
  the tile plan plans no backward read of it (``tiling.plan.backward_reads``). The engine sends
  the zero gradient of a trained tile no id used
  when the unit is released (``tiling.leaf_tiles.LeafTiles.flush``), so AdamW moves it as torch
  moves a parameter whose gradient is zero. A frozen table's source makes no gradient.

``padding_idx``: that row's positions get no gradient, as in ``F.embedding(padding_idx=...)``.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .ops import _as_tiles, _emit, _Tiles, _wants, _weight_grads


class _Lookup(NamedTuple):
    """Where a batch's ids fall: positions sorted by tile (``order``), each tile's slice of them
    (``starts``), the tiles the op computes (``used``, increasing)."""

    ids: torch.Tensor  # (N,) the ids, flat
    order: torch.Tensor  # (N,) positions grouped by tile, in position order within a tile
    starts: list[int]  # tile t's positions are order[starts[t]:starts[t + 1]]
    used: tuple[int, ...]

    def positions(self, t: int) -> torch.Tensor:
        return self.order[self.starts[t] : self.starts[t + 1]]


def _lookup(ids: torch.Tensor, tiles: _Tiles) -> _Lookup:
    """The ids' tiles; over a source, the tiles every rank computes (``TileSource.will_use``)."""
    flat = ids.reshape(-1)
    bounds = torch.tensor(tiles.offsets()[1:], dtype=flat.dtype, device=flat.device)
    which = torch.bucketize(flat, bounds, right=True)  # (N,) the tile of each id
    order = torch.argsort(which, stable=True)
    # sync: the per-tile counts decide the slices and the fetches, so they come to the host once
    counts = torch.bincount(which, minlength=tiles.n_tiles).tolist()
    used = tuple(t for t, count in enumerate(counts) if count)
    if tiles.source is not None:  # the union of every rank's: a collective there
        used = tuple(tiles.source.will_use(used))
    return _Lookup(flat, order, [0, *itertools.accumulate(counts)], used)


class _TiledEmbedding(torch.autograd.Function):
    """``F.embedding(ids, W)`` with W in row tiles; saves the ids, never a weight."""

    @staticmethod
    def forward(ids, padding_idx, look: _Lookup, tiles: _Tiles, *weights):
        offs = tiles.offsets()
        d = tiles.shapes[0][1]
        out = None
        for t in look.used:
            w = tiles.get(weights, t)  # (V_t, D)
            if out is None:
                out = w.new_empty(look.ids.shape[0], d)  # (N, D) in the table's dtype
            pos = look.positions(t)
            out.index_copy_(0, pos, w.index_select(0, look.ids.index_select(0, pos) - offs[t]))
            tiles.drop(t)
        if out is None:  # no ids
            out = weights[0].new_empty(0, d)
        return out.reshape(*ids.shape, d)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _ids, padding_idx, look, tiles, *weights = inputs
        ctx.tiles, ctx.padding_idx, ctx.look, ctx.weight_inputs = (
            tiles,
            padding_idx,
            look,
            tuple(weights),
        )
        ctx.save_for_backward(*(weights if tiles.source is None else ()))

    @staticmethod
    def backward(ctx, grad_out):
        tiles: _Tiles = ctx.tiles
        weights = ctx.saved_tensors if tiles.source is None else ()
        look: _Lookup = ctx.look
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (N, D)
        grads = [None] * tiles.n_tiles
        offs = tiles.offsets()
        for t in reversed(look.used):
            if not _wants(ctx, tiles, 4, t):
                continue
            pos = look.positions(t)  # no fetch: the gradient needs no row of the table
            if ctx.padding_idx is not None:
                pos = pos[look.ids.index_select(0, pos) != ctx.padding_idx]
            dw = _zero_grad(tiles, t, g2)
            dw.index_add_(0, look.ids.index_select(0, pos) - offs[t], g2.index_select(0, pos))
            _emit(tiles, grads, t, dw)
        if tiles.source is None:  # a tile no id fell in: the zeros F.embedding's rows get
            for t in range(tiles.n_tiles):
                if grads[t] is None and ctx.needs_input_grad[4 + t]:
                    grads[t] = torch.zeros_like(weights[t])
        return (None, None, None, None, *_weight_grads(tiles, ctx.weight_inputs, grads))


def _zero_grad(tiles: _Tiles, t: int, like: torch.Tensor) -> torch.Tensor:
    """A zeroed gradient of tile t in ``like``'s dtype: the source's lent buffer, or a fresh
    tensor."""
    out = tiles.grad_out(t, like.dtype)
    if out is not None:
        return out.zero_()
    return like.new_zeros(tiles.shapes[t])


def embedding(ids: torch.Tensor, w, padding_idx: int | None = None) -> torch.Tensor:
    """Rows of ``W`` (V, D) at integer ``ids`` (...): ``(...) -> (..., D)`` in ``W``'s dtype;
    equals ``F.embedding(ids, W, padding_idx)`` bitwise, forward and backward.

    ``w`` is a tensor, a ``RowTiles`` over the vocabulary or a row-tiled ``TileSource``; tiled,
    only the tiles holding some id are fetched (module docstring).
    """
    if isinstance(w, torch.Tensor):
        return F.embedding(ids, w, padding_idx=padding_idx)
    tiles, weights = _as_tiles(w)
    if tiles.axis != 0 or len(tiles.shapes[0]) != 2:
        raise ValueError(
            "tiling.embedding: the table must be tiled over its rows (RowTiles of (V_t, D) "
            f"tiles, axis 0), got tiles of shape {tiles.shapes[0]} over axis {tiles.axis}"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"tiling.embedding: ids must be an integer tensor, got {ids.dtype}")
    look = _lookup(ids, tiles)  # before the first fetch: the source is told what comes
    return _TiledEmbedding.apply(ids, padding_idx, look, tiles, *weights)
