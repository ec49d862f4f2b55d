"""The router's load-balancing loss as transformers computes it, carried through the layer scan.

transformers' ``load_balancing_loss_func`` (Switch Transformer eqs. 4-6, the same function in the
Qwen3-MoE, Mixtral, OLMoE and gpt-oss modelling files) is not a sum of per-layer losses: over the L
layers' router logits (N, E) it sums, per expert e, the top-k assignments ``C_e`` and the softmax
probabilities ``P_e`` across all layers and tokens, then returns ``E * sum_e (C_e / R) * (P_e / R)``
with R = L * N rows. So what a layer hands on is its two (E,) sums: the carry holds one fp32
accumulator ``stats`` (2, E), row 0 the assignment counts (no gradient, as HF's ``histc``) and row 1
the probability sums (the gradient's path to the routers). The embed stage puts ``zeros_stats`` in
the carry, every MoE block adds ``layer_stats`` of its logits (so every block has the same carry
structure), and the head adds ``coef * aux_loss(stats, L * N)`` to the cross-entropy when the
model's aux-loss flag is on (HF's ``output_router_logits=True``, coefficient
``router_aux_loss_coef``); off, the loss is the cross-entropy alone, HF's default.

Layers are summed in layer order from zeros, as HF's loop does. HF's optional ``attention_mask``
weighting is not taken: the engine's batches carry no padding mask, as HF's loss is called without
one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def zeros_stats(n_experts: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The accumulator before the first layer: (2, E) fp32 zeros on ``device``."""
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts <= 0:
        raise ValueError(
            f"moe_aux.zeros_stats: n_experts must be a positive int, got {n_experts!r}"
        )
    return torch.zeros(2, n_experts, dtype=torch.float32, device=device)


def layer_stats(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """One layer's (2, E) fp32 sums over its router ``logits`` (N, E): row 0 how many of the N
    tokens' top-k (of the softmax, as HF re-derives it) chose each expert, row 1 the softmax
    probabilities summed over the tokens. Counts are exact in fp32 below 2**24 a layer."""
    probs = F.softmax(logits.float(), dim=-1)  # (N, E)
    _, chosen = torch.topk(probs, top_k, dim=-1)  # (N, k)
    ones = torch.ones(chosen.numel(), dtype=torch.float32, device=logits.device)
    counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
    counts = counts.scatter_add_(0, chosen.reshape(-1), ones)  # (E,) no gradient, as HF's histc
    return torch.stack((counts, probs.sum(dim=0)))  # (2, E)


def accumulate(stats: torch.Tensor, logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """``stats + layer_stats(logits, top_k)``, (2, E) fp32: what an MoE block carries on."""
    if stats.shape != (2, logits.shape[-1]):
        raise ValueError(
            f"moe_aux.accumulate: expected stats of shape (2, {logits.shape[-1]}) for "
            f"router logits of {logits.shape[-1]} experts, got {tuple(stats.shape)}; "
            "start the carry with "
            "moe_aux.zeros_stats(n_experts)"
        )
    return stats + layer_stats(logits, top_k)


def aux_loss(stats: torch.Tensor, rows: int) -> torch.Tensor:
    """HF's ``load_balancing_loss_func`` from the accumulated ``stats`` (2, E) of ``rows`` = L * N
    router rows (L layers of N tokens): ``E * sum_e (counts_e / rows) * (probs_e / rows)``; a 0-d
    fp32 tensor."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
        raise ValueError(
            f"moe_aux.aux_loss: rows must be a positive int (layers x tokens), got {rows!r}"
        )
    tokens_per_expert = stats[0] / float(rows)
    prob_per_expert = stats[1] / float(rows)
    n_experts = stats.shape[-1]
    return torch.sum(tokens_per_expert * prob_per_expert.unsqueeze(0)) * n_experts
