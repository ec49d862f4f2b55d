"""Reading a Hugging Face ``config.json`` dict into ``llama.Config`` keyword arguments.

Supported: ``model_type`` "llama" (``LlamaConfig``), "mistral" (``MistralConfig`` without sliding window, or
one at least as long as the sequence) and "qwen2" (``Qwen2Config`` without sliding window). Anything the
functional model would compute differently from transformers is refused with a ``ValueError`` naming the
field, what was expected and what came, rather than loaded and trained silently wrong.

``hf_config_dict`` is the way back: a ``llama.Config`` as the ``config.json`` dict transformers writes,
its rotary settings in both spellings (the same values), so that transformers 4 and 5 read them alike.

Both spellings of the rotary settings are read: transformers >= 5's ``rope_parameters`` (with
``rope_theta`` inside) and the older top-level ``rope_theta`` plus ``rope_scaling`` (``type`` or
``rope_type``); as in transformers, ``rope_scaling`` wins when both are present.
"""

from __future__ import annotations

from collections.abc import Mapping

from layers.hf_names import saved_dtype
from layers.rope import ROPE_TYPES, Rope

FAMILIES = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# What a family's config class assumes when config.json leaves a field out (transformers' defaults).
_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
               "moe_intermediate_size", "shared_expert_intermediate_size")


def config_kwargs(hf: Mapping, seq_len: int | None = None) -> dict:
    """``llama.Config`` keyword arguments for the transformers config dict ``hf`` (``config.json``'s content);
    ``seq_len``: the sequence length the model will be built with, if not ``max_position_embeddings``."""
    if not isinstance(hf, Mapping):
        raise TypeError(f"llama.Config.from_hf: expected the config.json dict, got {type(hf).__name__}")
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"config.json: model_type: expected one of {FAMILIES}, got {family!r}")
    _refuse_unsupported(hf, family)
    missing = [name for name in _REQUIRED if name not in hf]
    if missing:
        raise ValueError(f"config.json: missing field(s) {missing} (model_type {family!r} needs {list(_REQUIRED)})")
    get = lambda name: hf[name] if hf.get(name) is not None else _DEFAULTS[family].get(name)
    _check_sliding_window(hf, seq_len or get("max_position_embeddings"))
    n_heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "d_model": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // n_heads,
        "d_ff": hf["intermediate_size"],
        "seq_len": get("max_position_embeddings"),
        "norm_eps": float(get("rms_norm_eps")),
        "rope": rope_from_hf(hf, get("max_position_embeddings")),
        "qkv_bias": family == "qwen2" or bool(hf.get("attention_bias", False)),
        "o_bias": family == "llama" and bool(hf.get("attention_bias", False)),
        "mlp_bias": family == "llama" and bool(hf.get("mlp_bias", False)),
        "pad_token_id": hf.get("pad_token_id"),
        "tie_embeddings": bool(get("tie_word_embeddings")),
        "init_std": float(hf.get("initializer_range", 0.02)),
        "family": family,
        "hf_dtype": saved_dtype(hf),
    }


def hf_config_dict(cfg) -> dict:
    """The transformers ``config.json`` dict of a ``llama.Config`` (its ``family``'s config class).

    Tiling factors are the engine's own and are not written. Raises ``ValueError`` for biases the
    family's config cannot express: Llama's ``attention_bias`` is q, k, v and o together, Qwen2 has
    q, k, v biases only, Mistral none.
    """
    _check_bias_layout(cfg)
    out = {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
        **rope_to_hf(cfg.rope), "hidden_act": "silu", "attention_dropout": 0.0,
        "initializer_range": cfg.init_std, "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": cfg.tie_embeddings,
    }
    if cfg.family == "llama":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    elif cfg.family == "mistral":
        out.update(sliding_window=None)
    else:
        out.update(sliding_window=None, use_sliding_window=False)
    return out


def rope_to_hf(rope: Rope) -> dict:
    """The config.json rotary fields: ``rope_parameters`` as transformers >= 5 writes it (``rope_type``,
    ``rope_theta`` and the type's fields), and the older ``rope_theta`` plus ``rope_scaling`` (null for
    the default type) that transformers 4 reads."""
    scaling = {"rope_type": rope.type}
    if rope.type in ("linear", "llama3"):
        scaling["factor"] = rope.factor
    if rope.type == "llama3":
        scaling.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                       original_max_position_embeddings=rope.original_max_position_embeddings)
    return {"rope_parameters": {**scaling, "rope_theta": rope.theta}, "rope_theta": rope.theta,
            "rope_scaling": scaling if rope.type != "default" else None}


def _check_bias_layout(cfg) -> None:
    biases = {"qkv_bias": cfg.qkv_bias, "o_bias": cfg.o_bias, "mlp_bias": cfg.mlp_bias}
    allowed = {"llama": [{"qkv_bias": q, "o_bias": q, "mlp_bias": m} for q in (False, True) for m in (False, True)],
               "mistral": [{"qkv_bias": False, "o_bias": False, "mlp_bias": False}],
               "qwen2": [{"qkv_bias": True, "o_bias": False, "mlp_bias": False}]}[cfg.family]
    if biases not in allowed:
        raise ValueError(f"llama.Config.to_hf: family {cfg.family!r} cannot express biases {biases}; expected one "
                         f"of {allowed} (Llama's attention_bias sets q, k, v and o together)")


def rope_from_hf(hf: Mapping, max_positions: int) -> Rope:
    """The ``rope.Rope`` of a config dict; refuses rope types other than ``rope.ROPE_TYPES``.

    llama3's ``original_max_position_embeddings`` is looked up as transformers does: a top-level field
    first, then the rope dict, then ``max_positions`` (the model's ``max_position_embeddings``).
    """
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json: {field}.rope_type: expected one of {ROPE_TYPES}, got {rope_type!r}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json: partial_rotary_factor: expected 1.0 (rotary over the whole head), "
                         f"got {partial}")
    theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
    kwargs = {"theta": float(theta), "type": rope_type}
    if rope_type in ("linear", "llama3"):
        kwargs["factor"] = float(_rope_field(params, field, "factor"))
    if rope_type == "llama3":
        kwargs["low_freq_factor"] = float(_rope_field(params, field, "low_freq_factor"))
        kwargs["high_freq_factor"] = float(_rope_field(params, field, "high_freq_factor"))
        original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        kwargs["original_max_position_embeddings"] = int(original or max_positions)
    return Rope(**kwargs)


def _rope_field(params: Mapping, field: str, name: str):
    if params.get(name) is None:
        raise ValueError(f"config.json: {field}.{name}: expected a number for rope_type "
                         f"{params.get('rope_type', params.get('type'))!r}, got none")
    return params[name]


def _refuse_unsupported(hf: Mapping, family: str) -> None:
    """Raise for the features the functional Llama does not compute: MoE, sliding windows, dropout, ..."""
    for name in _MOE_FIELDS:
        if hf.get(name) not in (None, 0):
            raise ValueError(f"config.json: {name}: mixture-of-experts is not supported; expected it absent, "
                             f"null or 0, got {hf[name]!r}")
    if family == "qwen2":
        if hf.get("use_sliding_window"):
            raise ValueError(f"config.json: use_sliding_window: sliding-window attention is not supported; "
                             f"expected false, got {hf['use_sliding_window']!r}")
        sliding = [kind for kind in hf.get("layer_types") or () if kind != "full_attention"]
        if sliding:
            raise ValueError(f"config.json: layer_types: expected only 'full_attention', got {sorted(set(sliding))}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act: expected 'silu' (SwiGLU), got {hf['hidden_act']!r}")
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise ValueError(f"config.json: attention_dropout: expected 0.0 (dropout is not supported), "
                         f"got {hf['attention_dropout']!r}")
    if hf.get("quantization_config") is not None:
        raise ValueError("config.json: quantization_config: quantized checkpoints are not supported; expected "
                         "the field absent")


def _check_sliding_window(hf: Mapping, seq_len: int) -> None:
    """Mistral's ``sliding_window`` W lets a token see itself and the W - 1 before it: for sequences of at most
    ``seq_len <= W`` tokens that is every earlier token, full causal attention; a shorter window is refused."""
    window = hf.get("sliding_window") if hf.get("model_type") == "mistral" else None
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < seq_len:
        raise ValueError(f"config.json: sliding_window: sliding-window attention shorter than the sequence is not "
                         f"supported; expected null or an int >= the sequence length {seq_len} (then it is full "
                         f"causal attention), got {window!r}; to train on sequences of at most the window, pass "
                         f"seq_len={window!r} (llama.Config.from_hf(..., seq_len=...) or checkpoints.from_hf(..., "
                         f"overrides={{'seq_len': ...}}))")
