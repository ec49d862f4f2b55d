"""Reading a Hugging Face ``config.json`` dict into ``llama.Config`` keyword arguments, and back.

Supported: the ``model_type`` s of ``layers.hf_families.FAMILIES`` (Llama, Mistral, Qwen2, Qwen3,
Phi-3, Gemma 3 text; the mixtures of experts Qwen3-MoE, Mixtral, OLMoE and gpt-oss, their MoE
fields read by ``layers.moe_config``), sliding windows of any length included. Anything the
functional model would
compute differently from transformers is refused with a ``ValueError`` naming the field, what was
expected and what came, rather than loaded and trained silently wrong.

``hf_config_dict`` is the way back: a ``llama.Config`` as the ``config.json`` dict transformers
writes, its rotary settings in both spellings (the same values), so that transformers 4 and 5 read
them alike.

Both spellings of the rotary settings are read: transformers >= 5's ``rope_parameters`` (with
``rope_theta`` inside; Gemma 3: one per layer type) and the older top-level ``rope_theta`` plus
``rope_scaling`` (``type`` or ``rope_type``); as in transformers, ``rope_scaling`` wins when both
are present.
"""

from __future__ import annotations

from collections.abc import Mapping

from layers import moe_config, yarn
from layers.decoder import FULL, SLIDING
from layers.hf_families import ACTIVATIONS, PLAIN_VARIANTS, Family
from layers.hf_families import FAMILIES as _FAMILIES
from layers.hf_names import saved_dtype
from layers.rope import ROPE_TYPES, Rope

FAMILIES = tuple(_FAMILIES)
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_MOE_FIELDS = (
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
_GEMMA_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # Gemma3TextConfig.default_theta


class _Fields:
    """A config.json dict read with its family's defaults for the fields it leaves out (or null)."""

    def __init__(self, hf: Mapping, family: Family):
        self.hf, self.family = hf, family

    def __call__(self, name: str):
        value = self.hf.get(name)
        return value if value is not None else self.family.defaults.get(name)


def config_kwargs(hf: Mapping) -> dict:
    """``llama.Config`` keyword arguments for the transformers config dict ``hf`` (``config.json``'s
    content)."""
    if not isinstance(hf, Mapping):
        raise TypeError(
            f"llama.Config.from_hf: expected the config.json dict, got {type(hf).__name__}"
        )
    moe_config.refuse_unsupported(hf)  # by field name, whatever the model_type
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json: model_type: expected one of {FAMILIES}, got {model_type!r}")
    family = _FAMILIES[model_type]
    get = _Fields(hf, family)
    _refuse_unsupported(hf, get)
    missing = [name for name in _REQUIRED if name not in hf]
    if missing:
        raise ValueError(
            f"config.json: missing field(s) {missing} (model_type {model_type!r} "
            f"needs {list(_REQUIRED)})"
        )
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
        **_ropes(hf, get),
        **_biases(hf, family),
        **family.variants,
        **_windows(get, family, hf["num_hidden_layers"]),
        "activation": ACTIVATIONS[get(family.activation_field) or "silu"],
        "query_pre_attn_scalar": get("query_pre_attn_scalar"),  # as given: Gemma3 wants an int
        "logit_softcap": _number(get("final_logit_softcapping")),
        "clip_qkv": _number(get("clip_qkv")) if family.clip_qkv else None,
        "pad_token_id": get("pad_token_id"),
        "tie_embeddings": bool(get("tie_word_embeddings")),
        "init_std": float(hf.get("initializer_range", 0.02)),
        "family": model_type,
        "hf_dtype": saved_dtype(hf),
        **_moe(hf),
    }


def _moe(hf: Mapping) -> dict:
    """``moe``, ``aux_loss`` and ``aux_coef`` of a mixture-of-experts family; {} for a dense one."""
    if hf["model_type"] not in moe_config.MOE_FAMILIES:
        return {}
    aux = moe_config.aux_config(hf)
    return {"moe": moe_config.block_config(hf), "aux_loss": aux.on, "aux_coef": aux.coef}


def _number(value) -> float | None:
    return None if value is None else float(value)


def _biases(hf: Mapping, family: Family) -> dict:
    """qkv_bias, o_bias, mlp_bias as the family's config says them."""
    attention = family.attention_bias and bool(hf.get("attention_bias", False))
    return {
        "qkv_bias": attention or family.variants.get("qkv_bias", False),
        "o_bias": attention,
        "mlp_bias": family.mlp_bias and bool(hf.get("mlp_bias", False)),
    }


def _windows(get: _Fields, family: Family, n_layers: int) -> dict:
    """``sliding_window`` and ``layer_types`` (None: every layer slides) as the family's config
    class derives them; no window at all is ``{"sliding_window": None, "layer_types": None}``."""
    window = get("sliding_window")
    if family.windows == "none" or (
        family.windows in ("typed", "gated") and not get("use_sliding_window")
    ):
        window = None
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(
            f"config.json: sliding_window: expected null or a positive int, got {window!r}"
        )
    types = get("layer_types")
    if types is None and family.windows == "typed":
        types = [SLIDING if i >= get("max_window_layers") else FULL for i in range(n_layers)]
    elif types is None and family.windows == "pattern":
        pattern = get("sliding_window_pattern")
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
    if types is not None and (
        len(types) != n_layers or any(t not in (SLIDING, FULL) for t in types)
    ):
        raise ValueError(
            f"config.json: layer_types: expected {n_layers} (num_hidden_layers) of "
            f"{(SLIDING, FULL)}, got {types!r}"
        )
    if family.windows == "pattern":  # Gemma: a layer's type picks its rope too, window or not
        return {"sliding_window": window, "layer_types": tuple(types)}
    if window is None or types is None or all(t == SLIDING for t in types):
        return {"sliding_window": window, "layer_types": None}
    return {"sliding_window": window, "layer_types": tuple(types)}


def hf_config_dict(cfg) -> dict:
    """The transformers ``config.json`` dict of a ``llama.Config`` (its ``family``'s config class).

    Tiling factors are the engine's own and are not written. Raises ``ValueError`` for variants or
    biases the family's config cannot express (e.g. Llama's ``attention_bias`` is q, k, v and o
    together, Qwen2 has q, k, v biases only, Mistral none; only Gemma 3 has (1 + w) norms).
    """
    family = _FAMILIES[cfg.family]
    _check_expressible(cfg, family)
    activation = {ours: hf for hf, ours in ACTIVATIONS.items()}[cfg.activation]
    out = {
        "architectures": [family.architecture],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        **_ropes_to_hf(cfg),
        family.activation_field: activation,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": cfg.tie_embeddings,
        **_windows_to_hf(cfg, family),
    }
    if family.attention_bias:
        out["attention_bias"] = cfg.o_bias
    if family.mlp_bias:
        out["mlp_bias"] = cfg.mlp_bias
    if cfg.moe is not None:
        aux = moe_config.AuxConfig(cfg.aux_loss, cfg.aux_coef)
        out.update(moe_config.block_fields(cfg.moe, cfg.family, aux))
    if family.clip_qkv:
        out["clip_qkv"] = cfg.clip_qkv
    if cfg.family == "gemma3_text":
        out.update(
            query_pre_attn_scalar=cfg.query_pre_attn_scalar,
            final_logit_softcapping=cfg.logit_softcap,
        )
    return out


def _windows_to_hf(cfg, family: Family) -> dict:
    """The config.json window fields of ``cfg`` in its family's spelling."""
    types = list(cfg.layer_types or [SLIDING if cfg.sliding_window else FULL] * cfg.n_layers)
    if family.windows == "all":
        return {"sliding_window": cfg.sliding_window}
    if family.windows == "gated":
        return {
            "use_sliding_window": cfg.sliding_window is not None,
            "sliding_window": cfg.sliding_window,
        }
    if family.windows == "typed":
        return {
            "use_sliding_window": cfg.sliding_window is not None,
            "layer_types": types,
            "sliding_window": cfg.sliding_window,
            "max_window_layers": cfg.n_layers,
        }
    if family.windows == "pattern":
        return {"sliding_window": cfg.sliding_window, "layer_types": types}
    return {}


def _check_expressible(cfg, family: Family) -> None:
    """Raise unless the family's config class can say what ``cfg`` computes."""
    _check_bias_layout(cfg, family)
    if (cfg.moe is not None) != (cfg.family in moe_config.MOE_FAMILIES):
        raise ValueError(
            f"llama.Config.to_hf: family {cfg.family!r} cannot express moe="
            f"{cfg.moe!r}; its MLP is "
            f"{'mixture-of-experts' if cfg.moe is None else 'dense'}"
        )
    for name, plain in PLAIN_VARIANTS.items():
        want = family.variants.get(name, plain)
        if getattr(cfg, name) != want:
            raise ValueError(
                f"llama.Config.to_hf: family {cfg.family!r} cannot express {name}="
                f"{getattr(cfg, name)!r}; its config class computes {name}={want!r}"
            )
    gemma_only = {
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
        "logit_softcap": cfg.logit_softcap,
        "rope_local": cfg.rope_local,
    }
    for name, value in gemma_only.items():
        if value is not None and family.windows != "pattern":
            raise ValueError(
                f"llama.Config.to_hf: family {cfg.family!r} cannot express "
                f"{name}={value!r}; expected None (a Gemma 3 field)"
            )
    if cfg.clip_qkv is not None and not family.clip_qkv:
        raise ValueError(
            f"llama.Config.to_hf: family {cfg.family!r} cannot express clip_qkv="
            f"{cfg.clip_qkv}; expected None (OLMoE's field)"
        )
    if cfg.sliding_window is not None and family.windows == "none":
        raise ValueError(
            f"llama.Config.to_hf: family {cfg.family!r} cannot express "
            f"sliding_window={cfg.sliding_window}; expected None"
        )
    if cfg.layer_types is not None and family.windows in ("all", "gated"):
        raise ValueError(
            f"llama.Config.to_hf: family {cfg.family!r} slides every layer or none; "
            f"expected layer_types None, got {cfg.layer_types}"
        )


def _check_bias_layout(cfg, family: Family) -> None:
    biases = {"qkv_bias": cfg.qkv_bias, "o_bias": cfg.o_bias, "mlp_bias": cfg.mlp_bias}
    attention = (False, True) if family.attention_bias else (False,)
    mlp = (False, True) if family.mlp_bias else (False,)
    fixed = family.variants.get("qkv_bias", False)
    allowed = [{"qkv_bias": a or fixed, "o_bias": a, "mlp_bias": m} for a in attention for m in mlp]
    if biases not in allowed:
        raise ValueError(
            f"llama.Config.to_hf: family {cfg.family!r} cannot express biases "
            f"{biases}; expected one of {allowed} (attention_bias sets q, k, v and o "
            "together)"
        )


def _ropes(hf: Mapping, get: _Fields) -> dict:
    """``rope`` and ``rope_local`` of a config dict: Gemma 3's per layer type (``rope_parameters``
    keyed by layer type, or the older ``rope_theta`` / ``rope_scaling`` for the full layers and
    ``rope_local_base_freq`` for the sliding ones, as ``Gemma3TextConfig`` converts them), one rope
    else."""
    max_positions = get("max_position_embeddings")
    if hf.get("model_type") != "gemma3_text":
        return {"rope": rope_from_hf(hf, max_positions), "rope_local": None}
    params = dict(hf.get("rope_parameters") or {})
    full = {"rope_type": "default", **(params.get(FULL) or {}), **(hf.get("rope_scaling") or {})}
    full.setdefault("rope_theta", hf.get("rope_theta") or _GEMMA_THETA[FULL])
    local = {"rope_type": "default", **(params.get(SLIDING) or {})}
    local.setdefault("rope_theta", hf.get("rope_local_base_freq") or _GEMMA_THETA[SLIDING])
    return {
        "rope": _rope(full, f"rope_parameters.{FULL}", hf, max_positions),
        "rope_local": _rope(local, f"rope_parameters.{SLIDING}", hf, max_positions),
    }


def _ropes_to_hf(cfg) -> dict:
    if cfg.family != "gemma3_text":
        return rope_to_hf(cfg.rope)
    full = rope_to_hf(cfg.rope)["rope_parameters"]
    local = rope_to_hf(cfg.rope_local or cfg.rope)["rope_parameters"]
    return {"rope_parameters": {FULL: full, SLIDING: local}}


def rope_to_hf(rope: Rope | yarn.Yarn) -> dict:
    """The config.json rotary fields: ``rope_parameters`` as transformers >= 5 writes it
    (``rope_type``, ``rope_theta`` and the type's fields), and the older ``rope_theta`` plus
    ``rope_scaling`` (null for the default type) that transformers 4 reads."""
    if isinstance(rope, yarn.Yarn):
        return {"rope_parameters": yarn.to_hf(rope), "rope_theta": rope.theta}
    scaling = {"rope_type": rope.type}
    if rope.type in ("linear", "llama3"):
        scaling["factor"] = rope.factor
    if rope.type == "llama3":
        scaling.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    return {
        "rope_parameters": {**scaling, "rope_theta": rope.theta},
        "rope_theta": rope.theta,
        "rope_scaling": scaling if rope.type != "default" else None,
    }


def rope_from_hf(hf: Mapping, max_positions: int) -> Rope:
    """The ``rope.Rope`` of a config dict; refuses rope types other than ``rope.ROPE_TYPES``.

    llama3's ``original_max_position_embeddings`` is looked up as transformers does: a top-level
    field first, then the rope dict, then ``max_positions`` (the model's
    ``max_position_embeddings``).
    """
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    return _rope(params, field, hf, max_positions)


def _rope(params: Mapping, field: str, hf: Mapping, max_positions: int) -> Rope | yarn.Yarn:
    """The ``rope.Rope`` of one rope dict ``params`` (``rope_type`` or ``type``, ``rope_theta``, the
    type's fields), found at ``field`` of the config dict ``hf``."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "yarn" and hf.get("model_type") == "gpt_oss":  # tested against gpt-oss only
        return yarn.from_hf(params, max_positions)
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"config.json: {field}.rope_type: expected one of {ROPE_TYPES}, got {rope_type!r}"
        )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            "config.json: partial_rotary_factor: expected 1.0 (rotary over the "
            f"whole head), got {partial}"
        )
    kwargs = {"theta": float(params["rope_theta"]), "type": rope_type}
    if rope_type in ("linear", "llama3"):
        kwargs["factor"] = float(_rope_field(params, field, "factor"))
    if rope_type == "llama3":
        kwargs["low_freq_factor"] = float(_rope_field(params, field, "low_freq_factor"))
        kwargs["high_freq_factor"] = float(_rope_field(params, field, "high_freq_factor"))
        field_name = "original_max_position_embeddings"
        original = hf.get(field_name) or params.get(field_name)
        kwargs["original_max_position_embeddings"] = int(original or max_positions)
    return Rope(**kwargs)


def _rope_field(params: Mapping, field: str, name: str):
    if params.get(name) is None:
        raise ValueError(
            f"config.json: {field}.{name}: expected a number for rope_type "
            f"{params.get('rope_type', params.get('type'))!r}, got none"
        )
    return params[name]


# field -> the only values computed as transformers does (dropout is not computed: the engine
# recomputes each block in backward, so a mask drawn in forward would differ)
_ONLY = {
    "attention_dropout": (None, 0, 0.0),
    "resid_pdrop": (None, 0, 0.0),
    "embd_pdrop": (None, 0, 0.0),
    "attn_logit_softcapping": (None,),
    "use_bidirectional_attention": (None, False),
    "quantization_config": (None,),
    "clip_qkv": (None,),
}


def _refuse_unsupported(hf: Mapping, get: _Fields) -> None:
    """Raise for the features the decoder does not compute: MoE, dropout, other activations, ..."""
    moe = hf.get("model_type") in moe_config.MOE_FAMILIES
    for name in () if moe else _MOE_FIELDS:
        if hf.get(name) not in (None, 0):
            raise ValueError(
                f"config.json: {name}: mixture-of-experts is not supported; expected "
                f"it absent, null or 0, got {hf[name]!r}"
            )
    field = get.family.activation_field
    if (get(field) or "silu") not in ACTIVATIONS:
        raise ValueError(
            f"config.json: {field}: expected one of {tuple(ACTIVATIONS)}, got {hf[field]!r}"
        )
    for name, allowed in _ONLY.items():
        if name == "quantization_config" and _mxfp4_gpt_oss(hf):
            continue  # read by checkpoints.mxfp4: dequantized at import
        if name == "clip_qkv" and get.family.clip_qkv:
            continue  # computed (decoder.attention)
        if hf.get(name) not in allowed:
            raise ValueError(
                f"config.json: {name}: expected {' or '.join(map(repr, allowed))} "
                f"(not computed otherwise), got {hf[name]!r}"
            )


def _mxfp4_gpt_oss(hf: Mapping) -> bool:
    """Whether ``hf`` is a gpt-oss checkpoint with MXFP4 experts (``quant_method`` "mxfp4")."""
    quant = hf.get("quantization_config")
    return (
        hf.get("model_type") == "gpt_oss"
        and isinstance(quant, Mapping)
        and quant.get("quant_method") == "mxfp4"
    )
