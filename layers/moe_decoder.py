"""The decoder's mixture-of-experts slot: the MLP as ``layers.moe``'s block, and the router
statistics the aux loss needs carried from the embed through every block to the head.

Chosen by ``llama.Config.moe`` (a ``moe.Config``; None: the dense gated MLP). With
``llama.Config.aux_loss`` on (HF's ``output_router_logits=True``) the carry is a dict holding
``"x"``, ``"segments"`` when packed, and ``"router"``: ``moe_aux``'s (2, E) accumulator, which every
block adds its router's sums to and the head turns into ``aux_coef`` x HF's load-balancing loss.
Off (the default), the carry is the dense decoder's and the loss is the cross-entropy alone, as
HF's default loss.
"""

from __future__ import annotations

import torch

from layers import moe, moe_aux, packing
from zinf_fn.model import TokenLoss


def carries_stats(cfg) -> bool:
    """Whether ``cfg``'s carry holds the router statistics (an MoE model with the aux loss on)."""
    return cfg.moe is not None and cfg.aux_loss


def join(cfg, x: torch.Tensor, segments: torch.Tensor | None, stats: torch.Tensor | None):
    """The carry of ``x`` (B, T, D), the packed rows' ``segments`` and the router ``stats``."""
    carry = packing.join(x, segments)
    if not carries_stats(cfg):
        return carry
    if stats is None:  # the embed: no layer counted yet
        stats = moe_aux.zeros_stats(cfg.moe.n_experts, x.device)
    return {**(carry if isinstance(carry, dict) else {"x": x}), "router": stats}


def split(carry) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(x, segments, stats)`` of a carry ``join`` made (None for what it does not hold)."""
    if not isinstance(carry, dict):
        return carry, None, None
    return carry["x"], carry.get("segments"), carry.get("router")


def mlp_apply(
    cfg, params: dict, x: torch.Tensor, stats: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The MoE block over ``x`` (B, T, D) and the statistics with this layer's router added."""
    y, logits = moe.apply(cfg.moe, params, x)
    if stats is None:
        return y, None
    return y, moe_aux.accumulate(stats, logits, cfg.moe.top_k)


def with_aux(cfg, loss, stats: torch.Tensor | None, tokens: int):
    """``loss`` plus ``aux_coef`` x the load-balancing loss of ``stats`` over the ``n_layers`` x
    ``tokens`` router rows; a ``TokenLoss`` gets it times its count, so that the engine's
    sum / count is the cross-entropy mean plus it, as HF adds it to its mean loss."""
    if stats is None:
        return loss
    aux = cfg.aux_coef * moe_aux.aux_loss(stats, cfg.n_layers * tokens)
    if isinstance(loss, TokenLoss):
        return TokenLoss(loss.sum + aux * loss.count.to(aux.dtype), loss.count)
    return loss + aux
