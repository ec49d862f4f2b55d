"""The decoder's Hugging Face tensor names per family (``model_type``), as plain data.

A family's table lists (HF name, engine key path) pairs in its ``state_dict`` order, ``{i}`` a
layer index; biases are listed and kept where the Config has them. Where HF stores several of our
leaves in one tensor (Phi-3's ``qkv_proj`` = q, k, v and ``gate_up_proj`` = gate, up, concatenated
along the output features), ``FUSED`` names the parts and ``fused_parts`` their rows: importers cut
the tensor, exporters concatenate the parts again.
"""

from __future__ import annotations

from layers import moe_names
from layers.hf_names import translate

_W_B = (("weight", "w"), ("bias", "b"))
EMBED = (("model.embed_tokens.weight", "embed.tok.w"),)
HEAD = (("model.norm.weight", "head.norm.w"), ("lm_head.weight", "head.lm_head.w"))
_LAYER = "model.layers.{i}."
_ATTN = tuple(
    (f"{_LAYER}self_attn.{p}_proj.{hf}", f"blocks.{{i}}.attn.{p}.{ours}")
    for p in "qkvo"
    for hf, ours in _W_B
)
_QK_NORM = tuple(
    (f"{_LAYER}self_attn.{p}_norm.weight", f"blocks.{{i}}.attn.{p}_norm.w") for p in "qk"
)
_MLP = tuple(
    (f"{_LAYER}mlp.{p}_proj.{hf}", f"blocks.{{i}}.mlp.{p}.{ours}")
    for p in ("gate", "up", "down")
    for hf, ours in _W_B
)
_NORMS = (
    (f"{_LAYER}input_layernorm.weight", "blocks.{i}.attn_norm.w"),
    (f"{_LAYER}post_attention_layernorm.weight", "blocks.{i}.mlp_norm.w"),
)
_GEMMA_NORMS = (
    (f"{_LAYER}input_layernorm.weight", "blocks.{i}.attn_norm.w"),
    (f"{_LAYER}post_attention_layernorm.weight", "blocks.{i}.attn_post_norm.w"),
    (f"{_LAYER}pre_feedforward_layernorm.weight", "blocks.{i}.mlp_norm.w"),
    (f"{_LAYER}post_feedforward_layernorm.weight", "blocks.{i}.mlp_post_norm.w"),
)
_PHI3_QKV = f"{_LAYER}self_attn.qkv_proj.weight"
_PHI3_GATE_UP = f"{_LAYER}mlp.gate_up_proj.weight"
_PHI3 = (
    (f"{_LAYER}self_attn.o_proj.weight", "blocks.{i}.attn.o.w"),
    (_PHI3_QKV, None),
    (_PHI3_GATE_UP, None),
    (f"{_LAYER}mlp.down_proj.weight", "blocks.{i}.mlp.down.w"),
)


def moe_leaves(family: str) -> tuple[tuple[str, str], ...]:
    """(virtual HF name, key path) of each stacked MoE leaf: the leaf's path under the layer's HF
    prefix stands for the per-expert tensors its ``moe_names`` rule reads (``moe_hf_names``)."""
    return tuple(
        (f"{_LAYER}{leaf}", f"blocks.{{i}}.{leaf}")
        for leaf in moe_names.leaf_paths(moe_names.RULES[family])
    )


HF_NAMES = (*EMBED, *_ATTN, *_MLP, *_NORMS, *HEAD)  # Llama, Mistral, Qwen2
TABLES = {
    "llama": HF_NAMES,
    "mistral": HF_NAMES,
    "qwen2": HF_NAMES,
    "qwen3": (*EMBED, *_ATTN, *_QK_NORM, *_MLP, *_NORMS, *HEAD),
    "gemma3_text": (*EMBED, *_ATTN, *_QK_NORM, *_MLP, *_GEMMA_NORMS, *HEAD),
    "phi3": (*EMBED, *_PHI3, *_NORMS, *HEAD),
    "qwen3_moe": (*EMBED, *_ATTN, *_QK_NORM, *moe_leaves("qwen3_moe"), *_NORMS, *HEAD),
    "mixtral": (*EMBED, *_ATTN, *moe_leaves("mixtral"), *_NORMS, *HEAD),
    "olmoe": (*EMBED, *_ATTN, *_QK_NORM, *moe_leaves("olmoe"), *_NORMS, *HEAD),
    "gpt_oss": (*EMBED, *_ATTN, *moe_leaves("gpt_oss"), *_NORMS, *HEAD),
}
# fused HF tensor -> the leaves (inside a block) it concatenates along its output features, in order
FUSED = {_PHI3_QKV: ("attn.q.w", "attn.k.w", "attn.v.w"), _PHI3_GATE_UP: ("mlp.gate.w", "mlp.up.w")}

_TO_OURS = {
    family: {hf: ours for hf, ours in table if ours is not None} for family, table in TABLES.items()
}
_TO_HF = {family: {ours: hf for hf, ours in table.items()} for family, table in _TO_OURS.items()}


def hf_to_ours(name: str, family: str = "llama") -> str:
    """An HF state_dict name of ``family`` -> the engine's key path
    (``model.layers.3.mlp.up_proj.weight`` -> ``blocks.3.mlp.up.w``). Raises ``ValueError`` naming
    ``name`` for anything outside the family's table (a fused name included: see ``fused_parts``);
    pass as ``rename=`` to ``checkpoints.from_state_dict`` / ``from_safetensors``."""
    return translate(name, _TO_OURS[family], "model.layers.", family, _what(family), "HF")


def ours_to_hf(path: str, family: str = "llama") -> str:
    """The engine's key path -> the HF state_dict name of ``family``; ``hf_to_ours`` inverted."""
    return translate(path, _TO_HF[family], "blocks.", family, _what(family), "engine")


def _what(family: str) -> str:
    return "Llama-family" if TABLES[family] is HF_NAMES else family


def fused_parts(cfg, name: str) -> tuple[tuple[str, int], ...]:
    """``((engine key path, rows), ...)`` of the leaves the HF tensor ``name`` of ``cfg``'s family
    concatenates along dim 0 (``model.layers.3.self_attn.qkv_proj.weight`` -> q, k, v of
    ``blocks.3``);
    ``()`` for a tensor that is one leaf."""
    parts = name.split(".")
    if len(parts) < 3 or not parts[2].isdigit() or cfg.family != "phi3":
        return ()
    template = ".".join([*parts[:2], "{i}", *parts[3:]])
    if template not in FUSED:
        return ()
    rows = {
        "attn.q.w": cfg.n_heads * cfg.head_dim,
        "attn.k.w": cfg.n_kv_heads * cfg.head_dim,
        "attn.v.w": cfg.n_kv_heads * cfg.head_dim,
        "mlp.gate.w": cfg.d_ff,
        "mlp.up.w": cfg.d_ff,
    }
    return tuple((f"blocks.{parts[2]}.{leaf}", rows[leaf]) for leaf in FUSED[template])


def moe_hf_names(cfg) -> list[str]:
    """The per-expert (or fused) HF names of one MoE layer of ``cfg``, ``{i}`` the layer."""
    rules = moe_names.RULES[cfg.family]
    return [f"{_LAYER}{name}" for name in moe_names.hf_names(rules, cfg.moe.n_experts)]


def hf_names(cfg) -> list[str]:
    """Every HF tensor name of ``cfg``'s model in its family's ``state_dict`` order (module order),
    as
    ``save_pretrained`` writes them: biases only where ``cfg`` has them; a tied model has no
    ``lm_head.weight``."""
    has_bias = {
        "q": cfg.qkv_bias,
        "k": cfg.qkv_bias,
        "v": cfg.qkv_bias,
        "o": cfg.o_bias,
        "gate": cfg.mlp_bias,
        "up": cfg.mlp_bias,
        "down": cfg.mlp_bias,
    }
    table = TABLES[cfg.family]
    stacked = {hf for hf, _ in moe_leaves(cfg.family)} if cfg.moe is not None else set()
    layer = [
        hf
        for hf, ours in table
        if hf.startswith(_LAYER)
        and hf not in stacked
        and (ours is None or not ours.endswith(".b") or has_bias[ours.split(".")[-2]])
    ]
    if cfg.moe is not None:  # the virtual stacked names -> what save_pretrained writes
        layer += moe_hf_names(cfg)
    names = [name.format(i=i) for i in range(cfg.n_layers) for name in layer]
    head = [hf for hf, _ in HEAD if hf != "lm_head.weight" or not cfg.tie_embeddings]
    return [hf for hf, _ in EMBED] + names + head
