"""The transformer feed-forward block: ``proj(gelu(fc(x)))`` over ``{"fc", "proj"}``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from layers import linear


def init(
    gen: torch.Generator, d: int, hidden: int, bias: bool = True, std: float = 0.02, proj_std: float = 0.02,
    tiles: int = 1,
) -> dict:
    """Return ``{"fc": linear(d -> hidden, std), "proj": linear(hidden -> d, proj_std)}`` from ``gen``.

    ``tiles > 1`` tiles both weights over the hidden features: ``fc`` over its outputs, ``proj`` over its
    inputs, so each tile of either is a ``(hidden / tiles) x d`` slab.
    """
    return {
        "fc": linear.init(gen, d, hidden, bias=bias, std=std, tiles=tiles, tile_axis=0),
        "proj": linear.init(gen, hidden, d, bias=bias, std=proj_std, tiles=tiles, tile_axis=1),
    }


def apply(params: dict, x: torch.Tensor) -> torch.Tensor:
    """``(..., d) -> (..., d)`` with the exact (erf) GELU, as ``nn.GELU()``."""
    return linear.apply(params["proj"], F.gelu(linear.apply(params["fc"], x)))
