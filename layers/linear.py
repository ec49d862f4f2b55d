"""A linear layer as an ``init``/``apply`` pair over ``{"w", "b"}``.

The layout is ``torch.nn.Linear``'s, so a tree maps one-to-one onto a module's parameters:
``"w"`` is ``weight`` with shape ``(d_out, d_in)`` and ``"b"`` is ``bias`` with shape ``(d_out,)``.
With ``tiles > 1`` the weight is a ``zinf_fn.tiling.RowTiles`` (tiles over output features, axis 0) or
``ColTiles`` (over input features, axis 1) of the same values; the engine then fetches it tile by tile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zinf_fn import tiling


def init(gen: torch.Generator, d_in: int, d_out: int, bias: bool = True, std: float = 0.02,
         tiles: int = 1, tile_axis: int = 0) -> dict:
    """Return ``{"w": (d_out, d_in) ~ N(0, std), "b": (d_out,) zeros}`` in fp32 (no ``"b"`` if not ``bias``).

    The weight is drawn from ``gen`` (on ``gen``'s device), so the same generator state gives the same
    weights. ``tiles > 1`` returns ``"w"`` as ``tiling.tile(w, tiles, tile_axis)``: the same values in
    ``tiles`` pieces along ``tile_axis`` (0: output features, 1: input features).
    """
    if d_in <= 0 or d_out <= 0:
        raise ValueError(f"linear.init: expected positive d_in and d_out, got d_in={d_in}, d_out={d_out}")
    w = torch.randn(d_out, d_in, generator=gen, device=gen.device, dtype=torch.float32) * std
    params = {"w": w if tiles == 1 else tiling.tile(w, tiles, tile_axis)}
    if bias:
        params["b"] = torch.zeros(d_out, device=gen.device, dtype=torch.float32)
    return params


def apply(params: dict, x: torch.Tensor) -> torch.Tensor:
    """``x @ w.T + b`` over the last dimension: ``(..., d_in) -> (..., d_out)``; equals ``nn.Linear``.

    A tiled ``"w"`` (tiles, or the engine's tile handle) runs ``tiling.linear`` one tile at a time.
    """
    w = params["w"]
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, params.get("b"))
    return tiling.linear(x, w, params.get("b"))
