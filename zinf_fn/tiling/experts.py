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

``expert_swiglu(x, gate_up, down, e)`` is a whole SwiGLU expert, ``down(silu(gate) * up)``, and
``experts_swiglu(x, counts, gate_up, down, experts)`` a layer's routed experts, each on its rows:
over the engine's sources of frozen weights (nothing on the expert trains: LoRA on attention only)
one autograd Function for them all, which fetches an expert's two weights in the order the two
``expert_linear`` calls do (its twin, elsewhere), releases them after its products, saves only the
gate_up products, and computes two experts of few rows on their lent codes at once, one on a side
thread (``two_at_once``): one node per layer in place of each expert's products and activation.

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

from . import two_at_once
from .deferred import made
from .ops import RowTiles, is_tiled
from .sources import TileSource, is_lent, is_source


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


class _FrozenExperts(torch.autograd.Function):
    """Each of a layer's frozen SwiGLU ``experts`` on its rows of ``x`` (``counts[j]`` rows of
    ``experts[j]``, in order), ``down(silu(gate) * up)``, as one autograd node over two
    ``TileSource``s whose tiles do not train. An expert's two tiles are fetched for its products
    and released after them: forward gate_up then down of each expert in turn, backward down then
    gate_up of each from the last (the order the tile plan learns), two experts of few rows
    computed at once (``two_at_once.each``). It saves each expert's gate_up product (n, 2I) only,
    never a weight."""

    @staticmethod
    def forward(ctx, x, counts, gate_up: TileSource, down: TileSource, experts):
        xs = torch.split(x, counts)
        out = _each((gate_up, down), experts, counts, lambda j, w: _forward(xs[j], *w))
        ctx.sources, ctx.experts, ctx.counts = (gate_up, down), experts, counts
        ctx.save_for_backward(*(gu for gu, _ in out))
        return torch.cat([y for _, y in out])  # (M, D): one expert at least

    @staticmethod
    def backward(ctx, grad_y):
        gate_up, down = ctx.sources
        gus = ctx.saved_tensors[::-1]
        gs = torch.split(grad_y, ctx.counts)[::-1]
        dx = _each(
            (down, gate_up),
            ctx.experts[::-1],
            ctx.counts[::-1],
            lambda j, w: _backward(gus[j], gs[j], *w),
        )
        return torch.cat(dx[::-1]), None, None, None, None


def _each(sources: tuple, experts: tuple, counts: tuple, compute) -> list:
    """``compute(j, weights)`` for each expert j, its tiles of ``sources`` fetched in that order
    and released after; two experts at once where an expert's lent weights compute its rows on one
    thread (``LentWeight.one_thread``: the fused kernels of few rows, the same products on either
    thread)."""

    def fetch(j):
        return [source.fetch(experts[j]) for source in sources]

    def release(j, _weights):
        for source in sources:
            source.release(experts[j])

    def side_ok(j, weights):
        return all(is_lent(w) and w.one_thread(counts[j]) for w in weights)

    return two_at_once.each(len(experts), fetch, compute, release, side_ok)


def _forward(x: torch.Tensor, w_gate_up, w_down) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gate_up product, the output) of one expert on its rows ``x``."""
    gu = _linear(x, w_gate_up, None)  # (n, 2I)
    return gu, _linear(_swiglu(gu), w_down, None)  # (n, D)


def _backward(gu: torch.Tensor, grad_y: torch.Tensor, w_down, w_gate_up) -> torch.Tensor:
    """dx (n, D) of one expert from its output's gradient and its saved gate_up product."""
    gate, up = gu.chunk(2, dim=-1)  # 2 x (n, I)
    d_hidden = _grad_input(grad_y, w_down)  # (n, I)
    # what autograd computes for F.silu(gate) * up and the chunk: bitwise the twin's
    d_gate = torch.ops.aten.silu_backward(d_hidden * up, gate)
    d_gu = torch.cat((d_gate, d_hidden * F.silu(gate)), dim=-1)  # (n, 2I)
    return _grad_input(d_gu, w_gate_up)


def _swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a gate_up product (n, 2I), gate its first I columns."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


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
    if not _frozen_swiglu(gate_up, down, e):
        return expert_linear(_swiglu(expert_linear(x, gate_up, e)), down, e)
    return _FrozenExperts.apply(x, (x.shape[0],), gate_up, down, (e,))


def experts_swiglu(
    x: torch.Tensor, counts: Sequence[int], gate_up, down, experts: Sequence[int]
) -> torch.Tensor:
    """Each of ``experts`` on its own rows, x ``(M, D)`` -> ``(M, D)``: ``counts[j]`` rows of
    ``experts[j]`` in turn, each slice ``expert_swiglu(rows, gate_up, down, experts[j])``.

    Over the engine's ``TileSource``s of frozen weights one autograd node for them all, which
    computes two experts at once where each is of few rows on its lent NF4 codes (one on a side
    thread, ``tiling.two_at_once``; the fetches in the order of the experts one by one); elsewhere
    the ``expert_swiglu`` calls. The same products either way: bitwise.
    """
    counts, experts = tuple(counts), tuple(experts)
    if len(counts) != len(experts) or sum(counts) != x.shape[0]:
        raise ValueError(
            f"tiling.experts_swiglu: expected a row count per expert summing to x's rows; got "
            f"{len(counts)} counts summing to {sum(counts)} for {len(experts)} experts and x of "
            f"shape {tuple(x.shape)}"
        )
    if not experts or not all(_frozen_swiglu(gate_up, down, e) for e in experts):
        rows = torch.split(x, counts)
        outs = [expert_swiglu(r, gate_up, down, e) for r, e in zip(rows, experts, strict=True)]
        return torch.cat(outs) if outs else x.new_zeros(x.shape)
    return _FrozenExperts.apply(x, counts, gate_up, down, experts)


def _frozen_swiglu(gate_up, down, e: int) -> bool:
    """Whether expert ``e`` of ``gate_up`` and ``down`` is the engine's frozen tiles (the one
    node's case); a ValueError where the two are tiles of other shapes than a SwiGLU's."""
    if not all(is_source(w) and not w.anchor.requires_grad for w in (gate_up, down)):
        return False
    _, two_i, d = _check_expert("expert_swiglu", gate_up, e)
    _, d_out, i = _check_expert("expert_swiglu", down, e)
    if two_i != 2 * i or d_out != d:
        raise ValueError(
            f"tiling.expert_swiglu: expected gate_up tiles (1, 2I, D) and down tiles (1, D, I); "
            f"got {(1, two_i, d)} and {(1, d_out, i)}: pass gate_up first"
        )
    return True


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
    in the order each expert uses them) computes, in the order it computes them: ``experts`` (those
    with tokens, increasing), on one rank the engine's sources putting first the experts its plan
    predicted (``tiling.routed.predicted_first``: their fetches started first), or
    with the engine's sources over several data-parallel ranks the union of every rank's (a
    collective: ``TileSource.will_use``; an expert in it without local tokens is computed on no
    rows, so every rank fetches the same tiles in the same order). Tensors and ``RowTiles`` give
    ``experts`` back."""
    experts = tuple(experts)
    if not is_source(sources[0]):
        return experts
    return sources[0].will_use(experts, tuple(sources[1:]))
