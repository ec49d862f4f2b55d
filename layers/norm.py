"""Normalisation layers over the last dimension: LayerNorm ``{"w", "b"}`` and RMSNorm ``{"w"}``.

Both call the same functional ops as ``nn.LayerNorm`` / ``nn.RMSNorm`` (``F.layer_norm``,
``F.rms_norm``), so outputs and gradients match those modules bitwise. ``"w"`` is ``weight``,
``"b"`` is ``bias``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-5


def layernorm_init(d: int, bias: bool = True, device: torch.device | str | None = None) -> dict:
    """Return ``{"w": ones(d), "b": zeros(d)}`` in fp32; no ``"b"`` when ``bias=False``. Not
    random."""
    if d <= 0:
        raise ValueError(f"layernorm_init: expected a positive width d, got {d}")
    params = {"w": torch.ones(d, dtype=torch.float32, device=device)}
    if bias:
        params["b"] = torch.zeros(d, dtype=torch.float32, device=device)
    return params


def layernorm(params: dict, x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * w + b`` over the last dimension; shape and dtype of
    ``x``."""
    w = params["w"]
    return F.layer_norm(x, w.shape, w, params.get("b"), eps)


def rmsnorm_init(d: int, device: torch.device | str | None = None) -> dict:
    """Return ``{"w": ones(d)}`` in fp32. Not random."""
    if d <= 0:
        raise ValueError(f"rmsnorm_init: expected a positive width d, got {d}")
    return {"w": torch.ones(d, dtype=torch.float32, device=device)}


def rmsnorm(params: dict, x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * w`` over the last dimension; shape and dtype of ``x``."""
    w = params["w"]
    return F.rms_norm(x, w.shape, w, eps)
