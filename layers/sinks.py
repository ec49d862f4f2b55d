"""Attention with sinks (gpt-oss): a learned logit per head joins each query's softmax, then goes.

A head h's sink ``s_h`` is an extra key every query sees with score ``s_h`` and a zero value: it
takes probability mass from the real keys (a query may attend to "nothing") without adding to the
output. This follows transformers' ``eager_attention_forward`` of ``modeling_gpt_oss`` op for op:
scores ``q @ k.T * scale`` plus the additive mask, the sink logit appended, the row maximum
subtracted, a softmax, the sink column dropped, ``@ v``. The block's tree adds ``"sinks": (H,)`` to
its attention dict (HF's ``self_attn.sinks``); the projections and their biases are
``layers.linear`` as elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def init(gen: torch.Generator, n_heads: int, std: float = 0.02) -> torch.Tensor:
    """The sink logits before training: (H,) fp32 ~ N(0, std) from ``gen``, as HF's
    ``_init_weights``."""
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads <= 0:
        raise ValueError(f"sinks.init: n_heads must be a positive int, got {n_heads!r}")
    return torch.randn(n_heads, generator=gen, device=gen.device, dtype=torch.float32) * std


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention with a sink per head: q (B, H, T, Dh), k and v (B, G, S, Dh) (query head h
    reads key/value head h // (H/G)), ``sinks`` (H,), ``mask`` (B or 1, 1, T, S) bool, True where a
    query may attend (None: causal over T = S). Returns (B, H, T, Dh) in v's dtype."""
    n_heads, t = q.shape[1], q.shape[2]
    if sinks.shape != (n_heads,):
        raise ValueError(
            f"sinks.attend: expected sinks of shape ({n_heads},), one per query head, "
            "got "
            f"{tuple(sinks.shape)}"
        )
    if n_heads % k.shape[1]:
        raise ValueError(
            f"sinks.attend: {n_heads} query heads are not a multiple of {k.shape[1]} kv heads"
        )
    k = k.repeat_interleave(n_heads // k.shape[1], dim=1)  # (B, H, S, Dh), as HF's repeat_kv
    v = v.repeat_interleave(n_heads // v.shape[1], dim=1)  # (B, H, S, Dh)
    if mask is None:
        mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # (B, H, T, S)
    scores = scores + additive_mask(mask, scores.dtype)
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, t, -1)  # (B, H, T, 1)
    logits = torch.cat([scores, sink.to(scores.dtype)], dim=-1)  # (B, H, T, S + 1)
    logits = logits - logits.max(dim=-1, keepdim=True).values  # HF's guard against bf16 overflow
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # (B, H, T, S): sink dropped
    return torch.matmul(probs.to(v.dtype), v)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: attend) as transformers' additive one: 0 where allowed, the dtype's most
    negative finite value where not; shape of ``mask``."""
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=mask.device)
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), blocked)
