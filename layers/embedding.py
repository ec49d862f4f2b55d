"""A lookup table as an ``init``/``apply`` pair over ``{"w"}``; ``"w"`` is
``nn.Embedding.weight``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def init(gen: torch.Generator, n: int, d: int, std: float = 0.02) -> dict:
    """Return ``{"w": (n, d) ~ N(0, std)}`` in fp32, drawn from ``gen`` (on ``gen``'s device)."""
    if n <= 0 or d <= 0:
        raise ValueError(f"embedding.init: expected positive n and d, got n={n}, d={d}")
    # scaled in place: a 152k vocabulary's table is 1.2 GB, not held twice
    return {"w": torch.randn(n, d, generator=gen, device=gen.device, dtype=torch.float32).mul_(std)}


def apply(params: dict, idx: torch.Tensor) -> torch.Tensor:
    """Rows of ``w`` at integer indices: ``(...,) -> (..., d)`` in ``w``'s dtype; equals
    ``nn.Embedding``."""
    return F.embedding(idx, params["w"])
