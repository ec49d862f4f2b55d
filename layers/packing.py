"""Packed rows: several examples in one sequence, told apart by ``segments`` (B, T) ids, one run per
example.

A model that reads them attends only within an example (``mask``) and counts each example's
positions from 0 (``positions``), so a packed example computes what it computes alone. Used by
``layers.llama`` (rotary positions) and ``layers.gpt`` (learned positions).
"""

from __future__ import annotations

import torch


def positions(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) positions counted from the start of each run of equal ``segments`` ids (0 at each
    start)."""
    t = segments.shape[1]
    index = torch.arange(t, device=segments.device).expand_as(segments)  # (B, T)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values  # (B, T)


def mask(segments: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(B, 1, T, T) bool: query t may attend key s iff ``causal_mask`` allows it (s <= t, and with a
    ``window`` s > t - window) and both lie in the same segment."""
    allowed = causal_mask(segments.shape[1], window, segments.device)  # (T, T)
    return ((segments[:, :, None] == segments[:, None, :]) & allowed)[:, None]  # (B, 1, T, T)


def causal_mask(t: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(T, T) bool: query t may attend key s iff s <= t and, with a ``window`` w, s > t - w: itself
    and the w - 1 keys before it, as transformers' ``sliding_window_overlay`` (``kv_idx > q_idx -
    w``)."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()  # (T, T)
    return causal if window is None else causal.triu(1 - window)


def split(carry) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, segments)`` of a packed carry ``{"x", "segments"}``; ``(carry, None)`` of a plain
    tensor."""
    return (carry["x"], carry["segments"]) if isinstance(carry, dict) else (carry, None)


def join(x: torch.Tensor, segments: torch.Tensor | None):
    """The carry of ``x``: ``{"x", "segments"}`` when packed, else ``x`` itself (the unpacked path
    unchanged)."""
    return x if segments is None else {"x": x, "segments": segments}
