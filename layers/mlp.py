"""The transformer feed-forward block: ``proj(gelu(fc(x)))`` over ``{"fc", "proj"}``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from layers import linear


def init(
    gen: torch.Generator,
    d: int,
    hidden: int,
    bias: bool = True,
    std: float = 0.02,
    proj_std: float = 0.02,
    tiles: int = 1,
) -> dict:
    """Return ``{"fc": linear(d -> hidden, std), "proj": linear(hidden -> d, proj_std)}`` from
    ``gen``.

    ``tiles > 1`` tiles both weights over the hidden features: ``fc`` over its outputs, ``proj``
    over its inputs, so each tile of either is a ``(hidden / tiles) x d`` slab.
    """
    return {
        "fc": linear.init(gen, d, hidden, bias=bias, std=std, tiles=tiles, tile_axis=0),
        "proj": linear.init(gen, hidden, d, bias=bias, std=proj_std, tiles=tiles, tile_axis=1),
    }


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU exactly as transformers computes it (``NewGELUActivation``,
    ``"gelu_new"``): the same ops in the same order, so values agree bitwise
    (``F.gelu(approximate="tanh")`` rounds apart)."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": gelu_new,
}  # "gelu": the exact (erf) GELU, as ``nn.GELU()``


def apply(params: dict, x: torch.Tensor, activation: str = "gelu") -> torch.Tensor:
    """``(..., d) -> (..., d)``: ``proj(act(fc(x)))`` with ``act = ACTIVATIONS[activation]``."""
    return linear.apply(params["proj"], ACTIVATIONS[activation](linear.apply(params["fc"], x)))
