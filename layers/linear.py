"""A linear layer as an ``init``/``apply`` pair over ``{"w", "b"}``.

The layout is ``torch.nn.Linear``'s, so a tree maps one-to-one onto a module's parameters:
``"w"`` is ``weight`` with shape ``(d_out, d_in)`` and ``"b"`` is ``bias`` with shape ``(d_out,)``.
With ``tiles > 1`` the weight is a ``zinf_fn.tiling.RowTiles`` (tiles over output features, axis 0)
or ``ColTiles`` (over input features, axis 1) of the same values; the engine then fetches it tile by
tile.

A linear that ``layers.lora`` adapted also holds ``"lora_a"`` (r, d_in) and ``"lora_b"`` (d_out, r),
and the model's block apply (``lora.bind``) adds ``"lora_scale"``, the float alpha / r, before
calling here; ``apply`` then adds PEFT's ``lora.Linear`` term ``(x @ A.T @ B.T) * scale`` to the
base output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zinf_fn import tiling


def init(
    gen: torch.Generator,
    d_in: int,
    d_out: int,
    bias: bool = True,
    std: float = 0.02,
    tiles: int = 1,
    tile_axis: int = 0,
) -> dict:
    """Return ``{"w": (d_out, d_in) ~ N(0, std), "b": (d_out,) zeros}`` in fp32 (no ``"b"`` if not
    ``bias``).

    The weight is drawn from ``gen`` (on ``gen``'s device), so the same generator state gives the
    same weights. ``tiles > 1`` returns ``"w"`` as ``tiling.tile(w, tiles, tile_axis)``: the same
    values in ``tiles`` pieces along ``tile_axis`` (0: output features, 1: input features).
    """
    if d_in <= 0 or d_out <= 0:
        raise ValueError(
            f"linear.init: expected positive d_in and d_out, got d_in={d_in}, d_out={d_out}"
        )
    # scaled in place (the same values as ``* std``): a vocabulary head is not held twice
    w = torch.randn(d_out, d_in, generator=gen, device=gen.device, dtype=torch.float32).mul_(std)
    params = {"w": w if tiles == 1 else tiling.tile(w, tiles, tile_axis)}
    if bias:
        params["b"] = torch.zeros(d_out, device=gen.device, dtype=torch.float32)
    return params


def apply(params: dict, x: torch.Tensor) -> torch.Tensor:
    """``x @ w.T + b`` over the last dimension: ``(..., d_in) -> (..., d_out)``; equals
    ``nn.Linear``.

    A tiled ``"w"`` (tiles, or the engine's tile handle) runs ``tiling.linear`` one tile at a time.
    With LoRA leaves (``"lora_a"``, ``"lora_b"``, ``"lora_scale"``; see the module docstring) the
    result is PEFT's ``base(x) + lora_B(lora_A(x)) * scaling``, the same ops in the same order (no
    dropout).
    """
    w = params["w"]
    y = (
        F.linear(x, w, params.get("b"))
        if isinstance(w, torch.Tensor)
        else tiling.linear(x, w, params.get("b"))
    )
    if "lora_a" not in params:
        return y
    scale = params.get("lora_scale")
    if not isinstance(scale, float):
        raise ValueError(
            "linear.apply: a linear with LoRA leaves needs the float 'lora_scale' (alpha / rank) "
            "in "
            f"its dict, got {scale!r}; run the model that layers.lora.apply returned (its block "
            "apply "
            "adds it), or put a block tree through lora.bind(model.config, tree) first"
        )
    return (
        y + F.linear(F.linear(x, params["lora_a"]), params["lora_b"]) * scale
    )  # (..., r) -> (..., d_out)
