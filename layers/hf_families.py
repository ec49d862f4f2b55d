"""The dense decoder families as data: how each transformers ``model_type`` maps onto
``llama.Config``.

A family is its config class's defaults (what a ``config.json`` that leaves a field out means), the
decoder variants it fixes (``layers.decoder``), how it says which biases exist and which layers
slide, and its tensor names (its table in ``layers.decoder_names``). Adding a dense family is one
entry here, one table there, and whatever it computes that no variant does yet (a new variant in
``layers.decoder``).
"""

from __future__ import annotations

from typing import NamedTuple


class Family(NamedTuple):
    """One transformers model family read into ``llama.Config``."""

    architecture: str  # the ``architectures`` entry to_hf writes
    defaults: dict  # config.json fields the config class defaults when left out
    variants: dict  # llama.Config fields it fixes (norm_style, ...; Qwen2's qkv_bias)
    attention_bias: bool  # config.json's attention_bias gives q, k, v and o their biases
    mlp_bias: bool  # config.json's mlp_bias gives gate, up and down theirs
    windows: str  # which layers slide: "all" (sliding_window, every layer), "typed"
    #                          (use_sliding_window + layer_types / max_window_layers), "pattern"
    #                          (sliding_window + layer_types / sliding_window_pattern), "gated"
    #                          (every layer, when use_sliding_window), "none"
    activation_field: str = "hidden_act"
    clip_qkv: bool = False  # config.json's clip_qkv clamps q, k and v (OLMoE)


_COMMON = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False}
_QWEN = {
    **_COMMON,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
_PHI3 = {**_COMMON, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "pad_token_id": 32000}
_GEMMA3 = {
    **_COMMON,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "pad_token_id": 0,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh",
}
_GEMMA3_VARIANTS = {
    "norm_style": "rms_1p",
    "qk_norm": True,
    "post_norms": True,
    "embed_scale": True,
}

FAMILIES = {
    "llama": Family(
        "LlamaForCausalLM",
        {**_COMMON, "max_position_embeddings": 2048},
        {},
        attention_bias=True,
        mlp_bias=True,
        windows="none",
    ),
    "mistral": Family(
        "MistralForCausalLM",
        {**_COMMON, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
        {},
        attention_bias=False,
        mlp_bias=False,
        windows="all",
    ),
    "qwen2": Family(
        "Qwen2ForCausalLM",
        _QWEN,
        {"qkv_bias": True},
        attention_bias=False,
        mlp_bias=False,
        windows="typed",
    ),
    "qwen3": Family(
        "Qwen3ForCausalLM",
        _QWEN,
        {"qk_norm": True},
        attention_bias=True,
        mlp_bias=False,
        windows="typed",
    ),
    "phi3": Family(
        "Phi3ForCausalLM", _PHI3, {}, attention_bias=False, mlp_bias=False, windows="all"
    ),
    "gemma3_text": Family(
        "Gemma3ForCausalLM",
        _GEMMA3,
        _GEMMA3_VARIANTS,
        attention_bias=True,
        mlp_bias=False,
        windows="pattern",
        activation_field="hidden_activation",
    ),
    # mixtures of experts: the MLP slot is layers.moe's block (layers.moe_config reads its fields)
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM",
        {**_COMMON, "max_position_embeddings": 32768, "use_sliding_window": False},
        {"qk_norm": True},
        attention_bias=True,
        mlp_bias=False,
        windows="gated",
    ),
    "mixtral": Family(
        "MixtralForCausalLM",
        {**_COMMON, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32},
        {},
        attention_bias=False,
        mlp_bias=False,
        windows="all",
    ),
    "olmoe": Family(
        "OlmoeForCausalLM",
        {**_COMMON, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "pad_token_id": 1},
        {"qk_norm": True, "qk_norm_whole": True},
        attention_bias=True,
        mlp_bias=False,
        windows="none",
        clip_qkv=True,
    ),
    # attention sinks, q/k/v/o biases, YaRN rope, sliding and full layers alternating
    "gpt_oss": Family(
        "GptOssForCausalLM",
        {
            **_COMMON,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "sliding_window": 128,
            "sliding_window_pattern": 2,
        },
        {"attn_sinks": True, "norm_style": "rms_w32"},
        attention_bias=True,
        mlp_bias=False,
        windows="pattern",
    ),
}
# HF's activation name -> llama.Config.activation
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# The variants' values where a family does not fix them: to_hf refuses a Config that differs from
# its family's.
PLAIN_VARIANTS = {
    "norm_style": "rms",
    "qk_norm": False,
    "post_norms": False,
    "embed_scale": False,
    "qk_norm_whole": False,
    "attn_sinks": False,
}
