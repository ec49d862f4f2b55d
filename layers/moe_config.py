"""Reading the mixture-of-experts part of a transformers ``config.json`` dict, and what is refused.

``block_config`` gives the ``layers.moe.Config`` of one MoE layer of a qwen3_moe, mixtral, olmoe or
gpt_oss model, ``aux_config`` its load-balancing loss setting, ``block_fields`` the way back (the
fields ``to_hf`` writes). ``refuse_unsupported`` names the field of a model this decoder would
compute differently from transformers: dense layers before the MoE ones (DeepSeek-V3, Kimi K2:
``first_k_dense_replace``), latent attention (MLA: ``kv_lora_rank``, ``q_lora_rank``), shared
experts, a Qwen3-MoE mixing dense and MoE layers (``mlp_only_layers``, ``decoder_sparse_step``),
Mixtral's training-time router jitter, experts whose activation is not silu. Errors are
``ValueError`` naming the field, what came and what is expected; ``checkpoints`` raises them as its
``CheckpointError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from layers import moe

MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")

# (HF fields of the expert count, the first the one transformers 5 writes; field of one expert's
# width); Qwen3-MoE files older than transformers 5 say num_experts
_SIZE_FIELDS = {
    "qwen3_moe": (("num_local_experts", "num_experts"), "moe_intermediate_size"),
    "mixtral": (("num_local_experts",), "intermediate_size"),
    "olmoe": (("num_experts", "num_local_experts"), "intermediate_size"),
    "gpt_oss": (("num_local_experts",), "intermediate_size"),
}
# transformers' defaults for fields a config.json may leave out
_DEFAULTS = {
    "qwen3_moe": {"norm_topk_prob": False, "router_aux_loss_coef": 0.001},
    "mixtral": {"router_aux_loss_coef": 0.001},
    "olmoe": {"norm_topk_prob": False, "router_aux_loss_coef": 0.01},
    "gpt_oss": {"swiglu_limit": 7.0, "router_aux_loss_coef": 0.001},
}
# field -> why it is refused when present and not None / 0 / empty (any model_type)
_REFUSED_FIELDS = {
    "first_k_dense_replace": "dense MLP layers before the MoE layers (DeepSeek-V3, Kimi K2)",
    "kv_lora_rank": "multi-head latent attention (MLA)",
    "q_lora_rank": "multi-head latent attention (MLA)",
    "n_shared_experts": "shared experts beside the routed ones",
    "shared_expert_intermediate_size": "a shared expert beside the routed ones",
}


class AuxConfig(NamedTuple):
    """The load-balancing loss: ``on`` [output_router_logits] adds ``coef`` x it to the loss
    [router_aux_loss_coef]."""

    on: bool
    coef: float


def refuse_unsupported(hf: Mapping) -> None:
    """Raise ``ValueError`` naming the first field of ``hf`` (a config.json dict) that asks for a
    MoE computation this decoder does not do; return None for a model it computes as transformers
    does."""
    for name, why in _REFUSED_FIELDS.items():
        if hf.get(name):
            raise ValueError(
                f"config.json: {name}={hf[name]!r} means {why}, which is not "
                f"supported; expected {name} absent, null or 0"
            )
    if hf.get("model_type") == "qwen3_moe":
        if hf.get("mlp_only_layers"):
            layers = hf["mlp_only_layers"]
            raise ValueError(
                f"config.json: mlp_only_layers={layers!r} mixes dense and MoE layers, "
                "which is not supported; expected [] (every layer MoE)"
            )
        if hf.get("decoder_sparse_step", 1) != 1:
            step = hf["decoder_sparse_step"]
            raise ValueError(
                f"config.json: decoder_sparse_step={step!r} makes only every n-th "
                "layer MoE, which is not supported; expected 1 (every layer MoE)"
            )
    act = hf.get("hidden_act", "silu")
    if hf.get("model_type") in ("qwen3_moe", "mixtral", "olmoe") and act != "silu":
        raise ValueError(
            f"config.json: hidden_act={act!r} is not supported for the experts; "
            "expected 'silu' (SwiGLU)"
        )
    if hf.get("model_type") == "mixtral" and hf.get("router_jitter_noise"):
        raise ValueError(
            f"config.json: router_jitter_noise={hf['router_jitter_noise']!r} "
            "multiplies the router's input by random noise in training, which is not "
            "supported; expected 0.0"
        )


def block_config(hf: Mapping) -> moe.Config:
    """The ``moe.Config`` of every MoE layer of the model ``hf`` describes (after
    ``refuse_unsupported``)."""
    family = _family(hf)
    refuse_unsupported(hf)
    experts_fields, width_field = _SIZE_FIELDS[family]
    n_experts = next((hf[name] for name in experts_fields if hf.get(name) is not None), None)
    needed = (width_field, "num_experts_per_tok", "hidden_size")
    missing = [name for name in needed if hf.get(name) is None]
    missing += [" or ".join(experts_fields)] if n_experts is None else []
    if missing:
        raise ValueError(
            f"config.json: missing field(s) {missing} (model_type {family!r} needs them)"
        )
    gpt_oss = family == "gpt_oss"
    return moe.Config(
        n_experts=n_experts,
        top_k=hf["num_experts_per_tok"],
        d_model=hf["hidden_size"],
        d_ff=hf[width_field],
        norm_topk_prob=family == "mixtral" or bool(_get(hf, family, "norm_topk_prob")),
        softmax_after_topk=gpt_oss,
        router_bias=gpt_oss,
        expert_bias=gpt_oss,
        swiglu_limit=float(_get(hf, family, "swiglu_limit")) if gpt_oss else None,
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def aux_config(hf: Mapping) -> AuxConfig:
    """Whether and how much the load-balancing loss counts, as the config.json says."""
    family = _family(hf)
    on = bool(hf.get("output_router_logits", False))
    return AuxConfig(on, float(_get(hf, family, "router_aux_loss_coef")))


def block_fields(cfg: moe.Config, family: str, aux: AuxConfig) -> dict:
    """The config.json fields of ``cfg`` and ``aux`` for ``family``; ``block_config`` of them is
    ``cfg``."""
    experts_fields, width_field = _SIZE_FIELDS[family]
    fields = {
        experts_fields[0]: cfg.n_experts,
        width_field: cfg.d_ff,
        "num_experts_per_tok": cfg.top_k,
        "output_router_logits": aux.on,
        "router_aux_loss_coef": aux.coef,
    }
    if family in ("qwen3_moe", "olmoe"):
        fields["norm_topk_prob"] = cfg.norm_topk_prob
    if family == "gpt_oss":
        fields["swiglu_limit"] = cfg.swiglu_limit
    return fields


def _family(hf: Mapping) -> str:
    family = hf.get("model_type")
    if family not in MOE_FAMILIES:
        raise ValueError(f"config.json: model_type: expected one of {MOE_FAMILIES}, got {family!r}")
    return family


def _get(hf: Mapping, family: str, name: str):
    value = hf.get(name)
    return _DEFAULTS[family].get(name) if value is None else value
