"""A linear over a weight lent in the form it is stored in (``sources.LentWeight``: a frozen
linear's NF4 codes, ``formats.nf4_linear.CodedMatrix``), under autograd: what ``tiling.linear``
runs for one.

The op computes from the stored form in forward (``LentWeight.linear``) and for the input's
gradient in backward (``grad_input``); a big weight's products at rows the kernels compute on one
thread as two halves at once, one on the side thread (``two_at_once``), each column the whole
product's bits: forward two halves of W's rows (``linear_rows``), backward of W's columns
(``grad_input_columns``). The weight takes no gradient (it is frozen). It saves the
stored bytes as its one saved tensor, so a block recorded for a later pull-back (``scan.tape``)
drops them and rebuilds them on the refetched layer, as it does a weight of values; no reference to
the forward's bytes stays in the graph.
"""

from __future__ import annotations

import functools

import torch

from . import two_at_once

_NOTHING = torch.empty(0, dtype=torch.uint8)  # what the graph's copy of a weight points to
# a forward product over a lent weight of at least this many elements, of rows the kernels compute
# on one thread, runs as two halves of W's rows at once, one on the side thread (two_at_once): a
# 30B attention's q and o (8M each) are; its k and v (1M) are not worth the hand-off
SPLIT_WEIGHTS = 1 << 22


def lent_linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, b)`` of a ``LentWeight`` ``w`` (W its matrix, ``(d_out, d_in)``): ``(...,
    d_in) -> (..., d_out)``; the gradients of ``x`` and ``b``, none of ``w``."""
    d_out, d_in = w.matrix
    if x.shape[-1] != d_in:
        raise ValueError(
            f"tiling.linear: input has {x.shape[-1]} features, the lent weight of shape "
            f"{tuple(w.shape)} takes {d_in}"
        )
    y = _LentLinear.apply(x.reshape(-1, d_in), b, w.stored, w)  # (n, d_out)
    return y.view(*x.shape[:-1], d_out)


class _LentLinear(torch.autograd.Function):
    """``w.linear(x, b)`` of x (n, d_in); backward: ``w.grad_input(g)`` and the bias's sum, from the
    stored bytes saved (``stored``: ``w.stored``, an input so that the tape sees it)."""

    @staticmethod
    def forward(x: torch.Tensor, b: torch.Tensor | None, stored: torch.Tensor, w) -> torch.Tensor:
        d_out, _ = w.matrix
        y = _in_halves(w, x, w.linear_rows, d_out // 2, d_out)
        if y is None:
            return w.linear(x, b)
        return y if b is None else y.add_(b)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, b, stored, w = inputs
        ctx.save_for_backward(stored)
        ctx.w = w.on(_NOTHING)  # its shape and dtype; the bytes come back from saved_tensors
        ctx.bias = b is not None

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (stored,) = ctx.saved_tensors
        g = g.contiguous()
        dx = _grad_input(ctx.w.on(stored), g) if ctx.needs_input_grad[0] else None
        db = g.sum(0) if ctx.bias and ctx.needs_input_grad[1] else None
        return dx, db, None, None


def _grad_input(w, g: torch.Tensor) -> torch.Tensor:
    """``w.grad_input(g)``, a big weight's as two halves of W's columns (cut where its parts may
    be: a multiple of ``w.column_block``)."""
    _, d_in = w.matrix
    half = d_in // 2 // w.column_block * w.column_block
    dx = _in_halves(w, g, w.grad_input_columns, half, d_in)
    return w.grad_input(g) if dx is None else dx


def _in_halves(w, a: torch.Tensor, part, half: int, width: int) -> torch.Tensor | None:
    """``part(a, 0, half)`` and ``part(a, half, width)`` at once (``two_at_once.both``), joined
    side by side: the whole product's columns, each its bits; None where the weight is small
    (under ``SPLIT_WEIGHTS``), its products at ``a``'s rows are not on one thread, ``half`` cuts
    nothing, or the kernels refused a part (a scale not finite): the caller's whole product."""
    d_out, d_in = w.matrix
    if d_out * d_in < SPLIT_WEIGHTS or not 0 < half < width or not w.one_thread(a.shape[0]):
        return None
    halves = two_at_once.both(
        functools.partial(part, a, 0, half), functools.partial(part, a, half, width)
    )
    if any(p is None for p in halves):
        return None
    return torch.cat(halves, dim=1)
