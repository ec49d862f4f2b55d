"""Causal multi-head self-attention over ``{"qkv": linear(d, 3d), "proj": linear(d, d)}``.

The fused ``qkv`` output is laid out as ``(three, heads, head_dim)`` along its last dimension, the
layout nanoGPT gets from ``qkv.split(d, dim=2)`` followed by a per-head view.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from layers import linear


def init(
    gen: torch.Generator,
    d: int,
    bias: bool = True,
    std: float = 0.02,
    proj_std: float = 0.02,
    tiles: int = 1,
) -> dict:
    """Return ``{"qkv": linear(d -> 3d, std), "proj": linear(d -> d, proj_std)}`` drawn from
    ``gen``.

    GPT-2 scales the output projection down with depth: pass ``proj_std = 0.02 / sqrt(2 *
    n_layers)``. ``tiles > 1`` tiles ``qkv`` over its output features and ``proj`` over its input
    features.
    """
    return {
        "qkv": linear.init(gen, d, 3 * d, bias=bias, std=std, tiles=tiles, tile_axis=0),
        "proj": linear.init(gen, d, d, bias=bias, std=proj_std, tiles=tiles, tile_axis=1),
    }


def apply(
    params: dict, x: torch.Tensor, n_heads: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal self-attention: ``(B, T, d) -> (B, T, d)``; position t attends to positions ``<= t``
    (with ``mask`` (B, 1, T, T) bool, e.g. ``packing.mask``: to the keys it allows)."""
    d = x.shape[-1]
    if d % n_heads != 0:
        raise ValueError(f"attention.apply: width {d} is not divisible by n_heads={n_heads}")
    qkv = linear.apply(params["qkv"], x)  # (B, T, 3d)
    q, k, v = rearrange(
        qkv, "b t (three h d) -> three b h t d", three=3, h=n_heads
    )  # 3 x (B, H, T, d/H)
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None
    )  # (B, H, T, d/H)
    y = rearrange(y, "b h t d -> b t (h d)")  # (B, T, d)
    return linear.apply(params["proj"], y)
