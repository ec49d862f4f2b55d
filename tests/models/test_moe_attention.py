"""gpt-oss's attention pieces against transformers: sinks attention (layers.sinks) with q/k/v/o
biases and YaRN rope (layers.yarn), and YaRN's frequencies for other rope parameters.

Tolerance: the same fp32 ops as HF's eager gpt-oss attention (projections, rotation, scores, the
sink column, softmax); the only differences are GQA's repeat (a copy either way) and the einops
reshapes, so the outputs agree to a few ulps; 1e-5 of the largest magnitude leaves a wide margin.
Frequencies and cos/sin are computed by the same ops as HF's and compared bitwise.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from einops import rearrange
from transformers.modeling_rope_utils import _compute_yarn_parameters
from transformers.models.gpt_oss import modeling_gpt_oss

from layers import linear, rope, sinks, yarn

TOL = 1e-5
T = 9


def gpt_oss_config(**rope_parameters):
    extra = {"rope_parameters": rope_parameters} if rope_parameters else {}
    config = transformers.GptOssConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        max_position_embeddings=64,
        **extra,
    )
    config._attn_implementation = "eager"
    return config


def hf_attention(config):
    attention = modeling_gpt_oss.GptOssAttention(config, layer_idx=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in attention.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return attention


def allowed(window: int | None) -> torch.Tensor:
    """(1, 1, T, T) bool: causal, and within ``window`` positions (HF: kv_idx > q_idx - window)."""
    q = torch.arange(T)[:, None]
    kv = torch.arange(T)[None, :]
    keep = kv <= q
    if window is not None:
        keep = keep & (kv > q - window)
    return keep[None, None]


def ours(attention, config, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Our gpt-oss attention from HF's weights: biased projections, YaRN rope, sinks."""

    def proj(module, h):
        return linear.apply({"w": module.weight, "b": module.bias}, h)

    dh = config.head_dim
    q = rearrange(proj(attention.q_proj, x), "b t (h d) -> b h t d", d=dh)  # (B, H, T, Dh)
    k = rearrange(proj(attention.k_proj, x), "b t (g d) -> b g t d", d=dh)  # (B, G, T, Dh)
    v = rearrange(proj(attention.v_proj, x), "b t (g d) -> b g t d", d=dh)  # (B, G, T, Dh)
    rotary = yarn.from_hf(config.rope_parameters, config.max_position_embeddings)
    cos, sin = yarn.cos_sin(rotary, dh, T, x.device, x.dtype)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    y = sinks.attend(q, k, v, attention.sinks, dh**-0.5, mask)
    return proj(attention.o_proj, rearrange(y, "b h t d -> b t (h d)"))


@pytest.mark.parametrize("window", [None, 3])
def test_sinks_attention_equals_hf(window):
    config = gpt_oss_config()
    attention = hf_attention(config)
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(T)[None].expand(2, -1)
    cos_sin = modeling_gpt_oss.GptOssRotaryEmbedding(config)(x, position_ids)
    mask = allowed(window)
    additive = torch.zeros(1, 1, T, T).masked_fill(~mask, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want, _ = attention(x, cos_sin, additive)
        got = ours(attention, config, x, mask)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= TOL


def test_sinks_take_probability_mass():
    """A large sink logit makes the output vanish; a very negative one gives plain softmax
    attention."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen) for _ in range(3))
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    assert torch.allclose(sinks.attend(q, k, v, torch.full((2,), -1e4), 0.5), plain, atol=1e-6)
    assert sinks.attend(q, k, v, torch.full((2,), 1e4), 0.5).abs().max() < 1e-6


ROPE_CASES = {
    "gpt_oss": {},  # the config's own: factor 32, truncate False, beta 32/1
    "truncated": {
        "rope_type": "yarn",
        "rope_theta": 10_000.0,
        "factor": 4.0,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "original_max_position_embeddings": 16,
    },
    "mscale": {
        "rope_type": "yarn",
        "rope_theta": 50_000.0,
        "factor": 8.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "original_max_position_embeddings": 16,
    },
    "attention_factor": {
        "rope_type": "yarn",
        "rope_theta": 10_000.0,
        "factor": 2.0,
        "attention_factor": 0.8,
        "original_max_position_embeddings": 32,
    },
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_yarn_equals_hf(case):
    config = gpt_oss_config(**ROPE_CASES[case])
    want_freq, want_factor = _compute_yarn_parameters(config)
    rotary = yarn.from_hf(config.rope_parameters, config.max_position_embeddings)
    assert torch.equal(yarn.inv_freq(rotary, config.head_dim), want_freq)
    assert yarn.attention_factor(rotary) == want_factor
    x = torch.zeros(1, T, 32)
    want_cos, want_sin = modeling_gpt_oss.GptOssRotaryEmbedding(config)(x, torch.arange(T)[None])
    cos, sin = yarn.cos_sin(rotary, config.head_dim, T, x.device, x.dtype)  # (T, Dh): halves twice
    assert torch.equal(cos, torch.cat((want_cos[0], want_cos[0]), dim=-1))
    assert torch.equal(sin, torch.cat((want_sin[0], want_sin[0]), dim=-1))


def test_yarn_refuses_partial_rotation():
    params = {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 2.0,
        "original_max_position_embeddings": 8,
        "partial_rotary_factor": 0.5,
    }
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        yarn.from_hf(params, 64)
