"""Memory-centric tiling: a large operator run as T sequential tiles, each tile's weight fetched
just in time.

Declaring a tiled weight: a layer's ``init`` puts a ``RowTiles`` (split along dim 0) or ``ColTiles``
(split along dim 1) node where the weight would be::

    {"fc": {"w": tile(w, 4, axis=0), "b": b}}     # w (d_out, d_in) as 4 tiles over output features

Both are NamedTuples, so optree sees their tiles as ordinary leaves (``"fc.w.0.3"``); the engine
(``zinf_fn.tiling.layout``) recognises them at ``zf.init`` and stores every tile as its own fetch
unit.

Running a tiled op: ``linear(x, w)`` here, ``linear_cross_entropy(h, w, targets)``
(``tiling.cross_entropy``) and ``embedding(ids, w)`` (``tiling.vocab``) accept

- a plain tensor: the untiled torch op (the slow twin),
- a ``RowTiles``/``ColTiles`` of tensors: the tiled op with autograd returning each tile's gradient,
- a ``TileSource`` (what the engine hands ``apply`` in place of the node): each tile is fetched just
  before use and released right after, in forward and in a backward that needs it (a frozen
  head's and an embedding's fetch none), and each tile's gradient is handed to
  ``source.emit_grad`` as soon as it exists; no tile's gradient is returned through autograd.

The ops are ``torch.autograd.Function``s in the ``setup_context`` style, so they run under plain
autograd and under ``torch.func.vjp`` alike. They save only the input activations, never a weight.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .deferred import is_deferred, made
from .lent import lent_linear
from .sources import TileSource, is_lent, is_source


class RowTiles(NamedTuple):
    """A weight split along dim 0 into ``len(tiles)`` tiles (a linear's output features, a
    vocabulary)."""

    tiles: tuple[torch.Tensor, ...]
    axis = 0


class ColTiles(NamedTuple):
    """A weight split along dim 1 into ``len(tiles)`` tiles (a linear's input features)."""

    tiles: tuple[torch.Tensor, ...]
    axis = 1


TILED = (RowTiles, ColTiles)


def is_tiled(x) -> bool:
    """True for a ``RowTiles`` / ``ColTiles`` node (the declaration in a parameter tree)."""
    return isinstance(x, TILED)


def tile(w: torch.Tensor, n_tiles: int, axis: int = 0) -> RowTiles | ColTiles:
    """Split ``w`` into ``n_tiles`` contiguous tiles along ``axis`` (0 or 1), as
    ``torch.tensor_split``.

    Sizes differ by at most one when ``n_tiles`` does not divide the dimension (the first tiles are
    the larger); every tile is non-empty, so ``1 <= n_tiles <= w.shape[axis]``.
    """
    if axis not in (0, 1) or w.ndim < axis + 1:
        raise ValueError(
            f"tiling.tile: axis must be 0 or 1 and within w.ndim={w.ndim}, got axis={axis}"
        )
    if (
        isinstance(n_tiles, bool)
        or not isinstance(n_tiles, int)
        or not 1 <= n_tiles <= w.shape[axis]
    ):
        raise ValueError(
            f"tiling.tile: n_tiles must be an int in [1, {w.shape[axis]}] (dim {axis} of shape "
            f"{tuple(w.shape)}), got {n_tiles!r}"
        )
    parts = tuple(
        p.clone(memory_format=torch.contiguous_format)
        for p in torch.tensor_split(w, n_tiles, dim=axis)
    )
    return RowTiles(parts) if axis == 0 else ColTiles(parts)


def untile(w) -> torch.Tensor:
    """The full weight of a ``RowTiles``/``ColTiles`` (a plain tensor is returned as it is); its
    ``Deferred`` tiles are made one at a time into the result."""
    if not is_tiled(w):
        return w
    if not any(map(is_deferred, w.tiles)):
        return torch.cat(list(w.tiles), dim=w.axis)
    first = made(w.tiles[0])
    shape = list(first.shape)
    shape[w.axis] = sum(t.shape[w.axis] for t in w.tiles)
    out = first.new_empty(shape)
    start = 0
    for t in w.tiles:
        size = t.shape[w.axis]
        out.narrow(w.axis, start, size).copy_(first if t is w.tiles[0] else made(t))
        start += size
    return out


def tile_sizes(n: int, n_tiles: int) -> list[int]:
    """Sizes of ``torch.tensor_split(range(n), n_tiles)``: the first ``n % n_tiles`` one larger."""
    base, extra = divmod(n, n_tiles)
    return [base + (1 if t < extra else 0) for t in range(n_tiles)]


# -- the tiles an op sees
# ----------------------------------------------------------------------------


class _Tiles(NamedTuple):
    """What an autograd Function needs about its weight: where tiles come from and where grads
    go."""

    axis: int
    n_tiles: int
    shapes: tuple[tuple[int, ...], ...]
    source: TileSource | None  # None: the tiles are the Function's own tensor inputs
    saved: SavedInput | None = None  # where a linear over a source finds its input in backward

    def get(self, weights: tuple, t: int) -> torch.Tensor:
        return weights[t] if self.source is None else self.source.fetch(t)

    def drop(self, t: int) -> None:
        if self.source is not None:
            self.source.release(t)

    def grad_out(self, t: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where tile t's gradient may be written (the source's own buffer), or None: a fresh
        tensor."""
        return None if self.source is None else self.source.grad_out(t, dtype)

    def offsets(self) -> list[int]:
        out, acc = [], 0
        for shape in self.shapes:
            out.append(acc)
            acc += shape[self.axis]
        return out


def _as_tiles(w) -> tuple[_Tiles, tuple]:
    """(description, the tensors to pass into the Function) for a RowTiles/ColTiles or a
    TileSource."""
    if is_tiled(w):  # a Deferred tile (declared by an init) is made here: the plain twin
        shapes = tuple(tuple(t.shape) for t in w.tiles)
        return _Tiles(w.axis, len(w.tiles), shapes, None), tuple(map(made, w.tiles))
    if is_source(w):
        shapes = tuple(tuple(w.tile_shape(t)) for t in range(w.n_tiles))
        return _Tiles(w.axis, w.n_tiles, shapes, w), (w.anchor,)
    raise TypeError(f"expected a RowTiles/ColTiles node or a TileSource, got {type(w).__name__}")


def _weight_grads(tiles: _Tiles, weights: tuple, grads: list) -> tuple:
    """The Function's gradients for its weight inputs: the tiles' own, or a zero for the anchor."""
    if tiles.source is None:
        return tuple(grads)
    return (torch.zeros_like(weights[0]),)


def _emit(tiles: _Tiles, grads: list, t: int, g: torch.Tensor) -> None:
    if tiles.source is not None:
        tiles.source.emit_grad(t, g)
    else:
        grads[t] = g


def _row_tile_back(
    tiles: _Tiles,
    grads: list,
    t: int,
    g: torch.Tensor,
    w: torch.Tensor,
    x2: torch.Tensor,
    dx: torch.Tensor | None,
    wanted: bool,
) -> None:
    """The pull-back of row tile ``w`` (d_out_t, d_in) from its output's gradient ``g`` (N,
    d_out_t): ``dx += g @ w`` where the input's gradient is made (``dx`` not None), and ``dW_t = g^T
    x2`` (d_out_t, d_in) emitted if wanted."""
    if dx is not None:
        dx.addmm_(g, w)
    if wanted:
        _emit(tiles, grads, t, torch.mm(g.T, x2, out=tiles.grad_out(t, x2.dtype)))


def _wants(ctx, tiles: _Tiles, first: int, t: int) -> bool:
    """Whether tile t's gradient is computed: its own input's (``first`` + t) needs one, or for a
    source the anchor's (``first``): a frozen tiled weight's anchor takes none
    (``requires_grad=False``), no dW is made."""
    return ctx.needs_input_grad[first + (t if tiles.source is None else 0)]


def _backward_tiles(ctx, first_weight: int):
    """What both Functions' backwards start from: (the tiles, the saved weight inputs (plain tiles;
    none over a source), the tiles' offsets, one gradient slot per tile, whether each tile's
    gradient is wanted). ``first_weight``: the position of the first weight among the Function's
    inputs."""
    tiles: _Tiles = ctx.tiles
    weights = ctx.saved_tensors[-len(ctx.weight_inputs) :] if tiles.source is None else ()
    wanted = [_wants(ctx, tiles, first_weight, t) for t in range(tiles.n_tiles)]
    return tiles, weights, tiles.offsets(), [None] * tiles.n_tiles, wanted


class SavedInput:
    """Where ``_SaveInput`` puts its autograd context, for the tiled linear after it to read x
    from."""

    ctx = None


class _SaveInput(torch.autograd.Function):
    """The identity on x that saves x, run just before a tiled linear over a ``TileSource``.

    That linear reads its input from here in backward instead of saving it itself. A Function saves
    in ``setup_context``, after its forward has run, so a recompute that needs x (``scan.tape``: a
    block's graph recorded in forward is recomputed in backward until the last tensor it saved
    exists again) would run the whole tiled forward, refetching every tile, for an output nothing
    reads (a block's last linear). Saved here, x exists before the tiled forward starts, and the
    recompute stops before it. ``anchor`` (the source's, a differentiated input) keeps the node on
    the tape.
    """

    @staticmethod
    def forward(x, anchor, saved: SavedInput):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, _anchor, saved = inputs
        ctx.save_for_backward(x)
        saved.ctx = ctx

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


# -- tiled linear
# ------------------------------------------------------------------------------------


class _TiledLinear(torch.autograd.Function):
    """``x @ W.T`` with W in tiles along its output (axis 0) or input (axis 1) features."""

    @staticmethod
    def forward(x, tiles: _Tiles, *weights):
        x2 = x.reshape(-1, x.shape[-1])  # (N, d_in)
        offs = tiles.offsets()
        if tiles.axis == 0:
            y = x2.new_empty(x2.shape[0], sum(s[0] for s in tiles.shapes))  # (N, d_out)
            for t in range(tiles.n_tiles):
                w = tiles.get(weights, t)  # (d_out_t, d_in)
                # BLAS writes the strided block
                torch.mm(x2, w.T, out=y[:, offs[t] : offs[t] + w.shape[0]])
                tiles.drop(t)
        else:
            y = None
            for t in range(tiles.n_tiles):
                w = tiles.get(weights, t)  # (d_out, d_in_t)
                part = x2[:, offs[t] : offs[t] + w.shape[1]]  # (N, d_in_t)
                y = part @ w.T if y is None else y.addmm_(part, w.T)
                tiles.drop(t)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, tiles, *weights = inputs
        ctx.tiles, ctx.weight_inputs = tiles, tuple(weights)
        if tiles.saved is None:  # over a source, x is saved by the _SaveInput before it
            # never a fetched tile
            ctx.save_for_backward(x, *(weights if tiles.source is None else ()))

    @staticmethod
    def backward(ctx, grad_y):
        tiles, weights, offs, grads, wanted = _backward_tiles(ctx, 2)
        saved = tiles.saved
        # may run a tape's recompute
        x = ctx.saved_tensors[0] if saved is None else saved.ctx.saved_tensors[0]
        # (N, d_in), (N, d_out)
        x2, g2 = x.reshape(-1, x.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])
        want_x = ctx.needs_input_grad[0] and (saved is None or saved.ctx.needs_input_grad[0])
        dx = None
        if want_x:  # axis 1: every column block of dx is written whole by one tile
            dx = torch.zeros_like(x2) if tiles.axis == 0 else torch.empty_like(x2)
        for t in reversed(range(tiles.n_tiles)):
            w = tiles.get(weights, t)
            if tiles.axis == 0:
                _row_tile_back(
                    tiles, grads, t, g2[:, offs[t] : offs[t] + w.shape[0]], w, x2, dx, wanted[t]
                )
            else:
                sl = slice(offs[t], offs[t] + w.shape[1])
                if want_x:
                    torch.mm(g2, w, out=dx[:, sl])  # (N, d_in_t)
                if wanted[t]:
                    _emit(
                        tiles, grads, t, torch.mm(g2.T, x2[:, sl], out=tiles.grad_out(t, x2.dtype))
                    )  # dW_t
            tiles.drop(t)
        d_x = dx.reshape(x.shape) if want_x else None
        return (d_x, None, *_weight_grads(tiles, ctx.weight_inputs, grads))


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + b``: ``(..., d_in) -> (..., d_out)`` with ``W`` of shape ``(d_out, d_in)`` in
    nn.Linear layout.

    ``w`` is a tensor (plain ``F.linear``), a ``RowTiles`` (tiles over output features), a
    ``ColTiles`` (tiles over input features), a ``TileSource`` or a ``LentWeight`` (its stored
    form computed from, ``tiling.lent``). Tiled, only one tile of ``W`` is needed at a time in
    forward and in backward; the result equals ``F.linear`` up to the order of fp32 sums.
    """
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    if is_lent(w):
        return lent_linear(x, w, b)
    tiles, weights = _as_tiles(w)
    if len(tiles.shapes[0]) != 2:
        raise ValueError(
            f"tiling.linear: tiles must be 2-D (d_out, d_in), got tile shape {tiles.shapes[0]}"
        )
    d_in = sum(s[1] for s in tiles.shapes) if tiles.axis == 1 else tiles.shapes[0][1]
    if x.shape[-1] != d_in:
        raise ValueError(
            f"tiling.linear: input has {x.shape[-1]} features, the tiled weight takes {d_in}"
        )
    if tiles.source is not None:  # x saved before the tiled forward runs (see _SaveInput)
        tiles = tiles._replace(saved=SavedInput())
        x = _SaveInput.apply(x, weights[0], tiles.saved)
    y = _TiledLinear.apply(x, tiles, *weights)
    return y if b is None else y + b
