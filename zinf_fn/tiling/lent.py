"""A linear over a weight lent in the form it is stored in (``sources.LentWeight``: a frozen
linear's NF4 codes, ``formats.nf4_linear.CodedMatrix``), under autograd: what ``tiling.linear``
runs for one.

The op computes from the stored form in forward (``LentWeight.linear``) and for the input's
gradient in backward (``grad_input``); the weight takes no gradient (it is frozen). It saves the
stored bytes as its one saved tensor, so a block recorded for a later pull-back (``scan.tape``)
drops them and rebuilds them on the refetched layer, as it does a weight of values; no reference to
the forward's bytes stays in the graph.
"""

from __future__ import annotations

import torch

_NOTHING = torch.empty(0, dtype=torch.uint8)  # what the graph's copy of a weight points to


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
        return w.linear(x, b)

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
        dx = ctx.w.on(stored).grad_input(g) if ctx.needs_input_grad[0] else None
        db = g.sum(0) if ctx.bias and ctx.needs_input_grad[1] else None
        return dx, db, None, None
