"""The variants the decoder (``layers.llama``) is assembled from: norms, attention, gated MLP, and
which window and rope a layer has.

Each variant is chosen by a field of ``llama.Config`` (never by a family's name), so a family is a
mapping of its HF config onto these fields (``layers.hf_config``):

    norm_style      "rms": HF's ``LlamaRMSNorm`` (normalise in fp32, cast back, times w)
                    "rms_1p": ``Gemma3RMSNorm`` (normalise in fp32, times (1 + w) in fp32, cast
                    back); "rms_w32": ``GptOssRMSNorm`` (normalise in fp32, times w, cast back)
    qk_norm         a norm of ``norm_style`` over each head's q and k, before rope (Qwen3, Gemma 3);
                    with ``qk_norm_whole`` over the whole q and k projections (OLMoE)
    clip_qkv        q, k and v clamped to [-c, c] after the projections and whole-width norms
                    (OLMoE)
    activation      the gated MLP's ``act`` in ``down(act(gate(x)) * up(x))``: "silu" (SwiGLU) or
                    "gelu_tanh" (``gelu_pytorch_tanh``, GeGLU)
    query_pre_attn_scalar   the attention scale is its ``** -0.5`` (Gemma); None: ``head_dim``'s
    attn_sinks      a learned logit per head joins each query's softmax (gpt-oss, ``layers.sinks``)
    rope            a ``rope.Rope`` or a ``yarn.Yarn`` (gpt-oss's YaRN), the same cos/sin layout
    sliding_window, layer_types, rope_local   ``layer_window`` / ``layer_rope`` below

A layer's window and rope depend on its index only (``zf.Model(layer_index=True)``); its tree does
not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from layers import linear, packing, rope, sinks, yarn

NORM_STYLES = ("rms", "rms_1p", "rms_w32")
ACTIVATIONS = ("silu", "gelu_tanh")
SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)


def norm_init(d: int, style: str, device: torch.device | str | None = None) -> dict:
    """``{"w": (d,)}`` in fp32: ones for "rms" (the identity), zeros for "rms_1p" (scale 1 + w)."""
    if d <= 0:
        raise ValueError(f"decoder.norm_init: expected a positive width d, got {d}")
    fill = 0.0 if style == "rms_1p" else 1.0
    return {"w": torch.full((d,), fill, dtype=torch.float32, device=device)}


def norm(params: dict, x: torch.Tensor, eps: float, style: str = "rms") -> torch.Tensor:
    """RMSNorm over the last dimension as transformers computes it for ``style``; x's shape, dtype.

    "rms" applies ``w`` after the cast back (``LlamaRMSNorm``), "rms_1p" ``1 + w`` before it
    (``Gemma3RMSNorm``); ``layers.norm.rmsnorm`` (``F.rms_norm``) differs from both in bf16.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if style == "rms_1p":
        return (h * (1.0 + params["w"].float())).to(x.dtype)
    if style == "rms_w32":  # gpt-oss: times w before the cast back
        return (params["w"] * h).to(x.dtype)
    return params["w"] * h.to(x.dtype)


def layer_window(cfg, i: int) -> int | None:
    """Layer ``i``'s sliding window (it attends to itself and the window - 1 positions before), or
    None (full causal): ``cfg.sliding_window`` for every layer when ``cfg.layer_types`` is None
    (Mistral, Phi-3), else for the layers typed "sliding_attention" only (Qwen2/3, Gemma 3)."""
    if cfg.sliding_window is None:
        return None
    if cfg.layer_types is None or cfg.layer_types[i] == SLIDING:
        return cfg.sliding_window
    return None


def layer_rope(cfg, i: int) -> rope.Rope:
    """Layer ``i``'s rotary settings: ``cfg.rope_local`` on a sliding layer where it is set (Gemma
    3's local layers), else ``cfg.rope``."""
    if cfg.rope_local is not None and cfg.layer_types is not None and cfg.layer_types[i] == SLIDING:
        return cfg.rope_local  # by the layer's type, as Gemma3RotaryEmbedding: window or not
    return cfg.rope


def attention(
    cfg, params: dict, x: torch.Tensor, segments: torch.Tensor | None, i: int
) -> torch.Tensor:
    """Layer ``i``'s causal rotary grouped-query attention: (B, T, D) -> (B, T, D); query head h
    reads kv head h // (H/G). ``segments`` (B, T): a position attends only to earlier positions of
    its own segment (and of its window), its rotary position counted from the segment's start."""
    t, dh = x.shape[1], cfg.head_dim
    q = linear.apply(params["q"], x)  # (B, T, H*Dh)
    k = linear.apply(params["k"], x)  # (B, T, G*Dh)
    if cfg.qk_norm and cfg.qk_norm_whole:  # OLMoE: over the whole projection, before the heads
        q = norm(params["q_norm"], q, cfg.norm_eps, cfg.norm_style)
        k = norm(params["k_norm"], k, cfg.norm_eps, cfg.norm_style)
    v = linear.apply(params["v"], x)  # (B, T, G*Dh)
    if cfg.clip_qkv is not None:  # OLMoE: HF clamps the three after the projections and norms
        q = q.clamp(-cfg.clip_qkv, cfg.clip_qkv)
        k = k.clamp(-cfg.clip_qkv, cfg.clip_qkv)
        v = v.clamp(-cfg.clip_qkv, cfg.clip_qkv)
    q = rearrange(q, "b t (h d) -> b t h d", d=dh)  # (B, T, H, Dh)
    k = rearrange(k, "b t (g d) -> b t g d", d=dh)  # (B, T, G, Dh)
    v = rearrange(v, "b t (g d) -> b g t d", d=dh)  # (B, G, T, Dh)
    if cfg.qk_norm and not cfg.qk_norm_whole:  # per head, before rope, over the (B, T, H, Dh) view
        q = norm(params["q_norm"], q, cfg.norm_eps, cfg.norm_style)
        k = norm(params["k_norm"], k, cfg.norm_eps, cfg.norm_style)
    q = rearrange(q, "b t h d -> b h t d")  # (B, H, T, Dh)
    k = rearrange(k, "b t g d -> b g t d")  # (B, G, T, Dh)
    window = layer_window(cfg, i)
    window = window if window is not None and window < t else None  # a window >= T is full causal
    cos, sin, mask = _positions(layer_rope(cfg, i), dh, x, segments, window)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    scale = (cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else dh) ** -0.5
    if cfg.attn_sinks:
        mask = mask if mask is None or mask.dim() == 4 else mask[None, None]  # (B or 1, 1, T, T)
        y = sinks.attend(q, k, v, params["sinks"], scale, mask)  # (B, H, T, Dh)
    else:
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=cfg.n_kv_heads != cfg.n_heads,
        )
    y = rearrange(y, "b h t d -> b t (h d)")  # (B, T, H*Dh)
    return linear.apply(params["o"], y)  # (B, T, D)


def _positions(
    settings: rope.Rope | yarn.Yarn,
    dh: int,
    x: torch.Tensor,
    segments: torch.Tensor | None,
    window: int | None,
):
    """``(cos, sin, mask)`` of a row: rotary tables (T, Dh) and no mask (plain causal) or a banded
    one (T, T); packed, tables (B, 1, T, Dh) at per-example positions and the mask (B, 1, T, T)."""
    t = x.shape[1]
    tables = yarn if isinstance(settings, yarn.Yarn) else rope
    if segments is not None:
        cos, sin = tables.cos_sin_at(settings, dh, packing.positions(segments), x.dtype)
        return cos, sin, packing.mask(segments, window)
    cos, sin = tables.cos_sin(settings, dh, t, x.device, x.dtype)
    mask = None if window is None else packing.causal_mask(t, window, x.device)
    return cos, sin, mask


def gated_mlp(cfg, params: dict, x: torch.Tensor) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))``: (..., D) -> (..., D); act by ``cfg.activation``."""
    gate = linear.apply(params["gate"], x)
    if cfg.activation == "gelu_tanh":
        gate = F.gelu(gate, approximate="tanh")  # transformers' gelu_pytorch_tanh
    else:
        gate = F.silu(gate)
    return linear.apply(params["down"], gate * linear.apply(params["up"], x))
