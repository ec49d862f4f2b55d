"""Experts as tiles: one expert's slice of a stacked expert weight, fetched only when its tokens
use it.

A mixture of experts stacks its E experts' linears along dim 0, ``(E, d_out, d_in)``
(``layers.moe``). Declared as ``tile(w, E, axis=0)`` (a ``RowTiles`` of E tiles ``(1, d_out,
d_in)``), each expert is a fetch unit of the engine, as any tile is (``tiling.layout``), and
``expert_linear(x, w, e, b)`` computes ``F.linear(x, w[e], b)`` over

- a plain stacked tensor: ``F.linear`` on the slice (the slow twin),
- a ``RowTiles`` of tensors: ``F.linear`` on tile e, with autograd,
- a ``TileSource`` (the engine's handle): an autograd Function that fetches tile e just before its
  product and releases it right after, in forward and in backward, saving only its input rows,
  never the weight; tile e's gradient goes to ``source.emit_grad``. A frozen expert stored as NF4
  codes is fetched as its codes (``sources.LentWeight``: its read policy lends them,
  ``GroupPolicy.codes``), whose own fused products (``formats.nf4_linear``) stand for ``F.linear``
  and ``g @ W``: never decoded.

``expert_swiglu(x, gate_up, down, e)`` is a whole SwiGLU expert, ``down(silu(gate) * up)``: over
the engine's sources of frozen weights (nothing on the expert trains: LoRA on attention only) one
autograd Function, which fetches and releases each weight around its product as the two
``expert_linear`` calls do (its twin, elsewhere) and saves only the gate_up product: one node per
expert in place of the two products' and the activation's.

An expert no token was routed to is never called, so it is never fetched, in forward or backward
(over several data-parallel ranks: an expert no rank's tokens chose, ``will_use``); the engine
sends the zero gradient of a trained expert no micro-batch used when the unit is released
(``tiling.leaf_tiles.LeafTiles.flush``), so its optimizer update still runs, as torch's AdamW moves
a parameter whose gradient is zero. ``will_use(sources, experts)`` tells the sources which experts
the routing chose, in the order they will be computed (the tile prefetcher then fetches those,
ahead).

The products are the same ``F.linear`` calls on the same rows in every case, and the backward the
same ``mm`` calls autograd makes for ``F.linear``, so the three agree bitwise; a weight lent as
NF4 codes gives the same weights' products summed in the fused kernel's order (fp32 rounding apart).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .deferred import made
from .ops import RowTiles, is_tiled
from .sources import TileSource, is_source


class _ExpertLinear(torch.autograd.Function):
    """``F.linear(x, W_e, b)`` with ``W_e`` tile e ``(1, d_out, d_in)`` of a ``TileSource``."""

    @staticmethod
    def forward(x, b, anchor, source: TileSource, e: int):
        w = source.fetch(e)  # (1, d_out, d_in), or its stored codes lent
        y = _linear(x, w, b)  # (n, d_out)
        source.release(e)
        return y

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, _b, _anchor, source, e = inputs
        ctx.source, ctx.e = source, e
        ctx.save_for_backward(x)  # never the fetched weight

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        source, e = ctx.source, ctx.e
        want_x, want_b, want_w = ctx.needs_input_grad[:3]
        w = source.fetch(e)  # (1, d_out, d_in), fetched again
        # the products autograd makes for F.linear: dx = g @ W, dW = g^T @ x, db = sum_n g
        dx = _grad_input(grad_y, w) if want_x else None
        db = grad_y.sum(0) if want_b else None
        if want_w:  # after the last read of w: the buffer lent for the gradient may be w's own
            if not isinstance(w, torch.Tensor):
                raise RuntimeError(f"expert {e}: a weight lent as its codes is frozen, no dW")
            out = source.grad_out(e, x.dtype)
            dw = torch.mm(grad_y.T, x, out=None if out is None else out[0])  # (d_out, d_in)
            source.emit_grad(e, dw.view(source.tile_shape(e)))
        source.release(e)
        d_anchor = torch.zeros_like(ctx.source.anchor) if want_w else None
        return dx, db, d_anchor, None, None


class _FrozenSwiGLU(torch.autograd.Function):
    """Expert e's ``down(silu(gate) * up)``, ``gate, up = gate_up(x)``, over two ``TileSource``s
    whose tiles do not train: one node, each weight fetched just before its product and released
    right after (forward: gate_up then down; backward: down then gate_up), saving the gate_up
    product (n, 2I) only, never a weight."""

    @staticmethod
    def forward(ctx, x, gate_up: TileSource, down: TileSource, e: int):
        gu = _fetched(gate_up, e, x, forward=True)  # (n, 2I)
        ctx.sources = (gate_up, down)
        ctx.e = e
        ctx.save_for_backward(gu)
        return _fetched(down, e, _swiglu(gu), forward=True)  # (n, D)

    @staticmethod
    def backward(ctx, grad_y):
        (gu,) = ctx.saved_tensors
        gate_up, down = ctx.sources
        gate, up = gu.chunk(2, dim=-1)  # 2 x (n, I)
        d_hidden = _fetched(down, ctx.e, grad_y, forward=False)  # (n, I)
        # what autograd computes for F.silu(gate) * up and the chunk: bitwise the twin's
        d_gate = torch.ops.aten.silu_backward(d_hidden * up, gate)
        d_gu = torch.cat((d_gate, d_hidden * F.silu(gate)), dim=-1)  # (n, 2I)
        return _fetched(gate_up, ctx.e, d_gu, forward=False), None, None, None


def _swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a gate_up product (n, 2I), gate its first I columns."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def _fetched(source: TileSource, e: int, a: torch.Tensor, forward: bool) -> torch.Tensor:
    """``F.linear(a, W_e)`` (``forward``) or ``a @ W_e`` of tile e of ``source``, fetched for the
    product and released after it."""
    w = source.fetch(e)  # (1, d_out, d_in), or its stored codes lent
    out = _linear(a, w, None) if forward else _grad_input(a, w)
    source.release(e)
    return out


def _linear(x: torch.Tensor, w, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w[0], b)`` of a fetched tile ``w`` (1, d_out, d_in), or a ``LentWeight``'s
    own product from its stored form."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w[0], b)
    return w.linear(x, b)


def _grad_input(grad_y: torch.Tensor, w) -> torch.Tensor:
    """``grad_y @ w[0]`` (n, d_in) of a fetched tile ``w``, or a ``LentWeight``'s own."""
    if isinstance(w, torch.Tensor):
        return grad_y.mm(w[0])
    return w.grad_input(grad_y)


def expert_linear(x: torch.Tensor, w, e: int, b: torch.Tensor | None = None) -> torch.Tensor:
    """Expert ``e``'s linear on its rows: ``F.linear(x, w[e], b)``, x ``(n, d_in)`` -> ``(n,
    d_out)``.

    ``w`` is the stacked ``(E, d_out, d_in)`` tensor, a ``RowTiles`` of E tiles ``(1, d_out,
    d_in)`` (``tile(w, E, axis=0)``) or the engine's ``TileSource`` over one; ``b`` is expert e's
    bias ``(d_out,)`` or None.
    """
    if isinstance(w, torch.Tensor):
        return F.linear(x, w[e], b)
    _check_expert("expert_linear", w, e)
    if isinstance(w, RowTiles):  # a tile declared deferred (``moe.init``) is made here
        return F.linear(x, made(w.tiles[e], "expert weight")[0], b)
    return _ExpertLinear.apply(x, b, w.anchor, w, e)


def expert_swiglu(x: torch.Tensor, gate_up, down, e: int) -> torch.Tensor:
    """Expert ``e``'s SwiGLU on its rows, x ``(n, D)`` -> ``(n, D)``: ``expert_linear(silu(gate) *
    up, down, e)`` with ``gate, up`` the halves of ``expert_linear(x, gate_up, e)``.

    ``gate_up`` and ``down`` are the stacked ``(E, 2I, D)`` and ``(E, D, I)`` weights in any form
    ``expert_linear`` takes, without biases. Over the engine's ``TileSource``s of frozen weights
    (their anchors need no gradient: nothing on the expert trains) it is one autograd node, which
    saves the gate_up product only; elsewhere its twin, the two ``expert_linear`` calls. Both make
    the same products in the same order, so they agree bitwise.
    """
    frozen = [is_source(w) and not w.anchor.requires_grad for w in (gate_up, down)]
    if not all(frozen):
        return expert_linear(_swiglu(expert_linear(x, gate_up, e)), down, e)
    _, two_i, d = _check_expert("expert_swiglu", gate_up, e)
    _, d_out, i = _check_expert("expert_swiglu", down, e)
    if two_i != 2 * i or d_out != d:
        raise ValueError(
            f"tiling.expert_swiglu: expected gate_up tiles (1, 2I, D) and down tiles (1, D, I); "
            f"got {(1, two_i, d)} and {(1, d_out, i)}: pass gate_up first"
        )
    return _FrozenSwiGLU.apply(x, gate_up, down, e)


def _check_expert(op: str, w, e: int) -> tuple[int, ...]:
    """The tile shape ``(1, d_out, d_in)`` of ``w`` (a ``RowTiles`` or ``TileSource`` of stacked
    experts, ``tile(w, E, axis=0)``, with an expert ``e``); a ValueError naming ``op`` where it is
    not one."""
    n_tiles = len(w.tiles) if is_tiled(w) else w.n_tiles
    shape = tuple(w.tiles[0].shape) if is_tiled(w) else tuple(w.tile_shape(0))
    if w.axis != 0 or len(shape) != 3 or shape[0] != 1 or not 0 <= e < n_tiles:
        raise ValueError(
            f"tiling.{op}: expected the stacked experts as tile(w, E, axis=0), one tile "
            f"(1, d_out, d_in) per expert, and 0 <= e < E; got {n_tiles} tiles over axis {w.axis} "
            f"of shape {shape} and e={e}"
        )
    return shape


def will_use(sources: Sequence, experts: Sequence[int]) -> tuple[int, ...]:
    """The experts an op over the stacked expert weights ``sources`` (one per linear of an expert,
    in the order each expert uses them) computes: ``experts`` (those with tokens, increasing), or
    with the engine's sources over several data-parallel ranks the union of every rank's (a
    collective: ``TileSource.will_use``; an expert in it without local tokens is computed on no
    rows, so every rank fetches the same tiles in the same order). Tensors and ``RowTiles`` give
    ``experts`` back."""
    experts = tuple(experts)
    if not is_source(sources[0]):
        return experts
    return sources[0].will_use(experts, tuple(sources[1:]))
