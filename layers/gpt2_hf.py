"""GPT-2 (transformers' ``GPT2LMHeadModel``) as ``layers.gpt``: its config.json fields and tensor
names.

GPT-2 is ``gpt.Config(activation="gelu_new", norm_eps=layer_norm_epsilon,
tie_embeddings=tie_word_embeddings)`` with biases everywhere: the same attention scale
(``1/sqrt(head_dim)``), fused qkv layout and pre-norm blocks as ``layers.gpt``. Its ``Conv1D``
weights are stored ``(d_in, d_out)``, the transpose of ``nn.Linear``'s: ``transposed(name)`` says
which, and importers / exporters transpose those on the way in and out. A tied model (the default)
has no ``lm_head.weight`` in its files: the head reads ``wte``.

Dropout (``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``) is not computed: the engine trains GPT-2
as transformers does with dropout 0 (the exported config.json keeps the imported values). Refused
with a ``ValueError`` naming the field: other activations, ``scale_attn_weights=False``,
``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``, cross-attention.
"""

from __future__ import annotations

from collections.abc import Mapping

from layers import gpt, mlp
from layers.hf_names import saved_dtype, translate

# transformers' GPT2Config defaults, for fields a config.json leaves out
_DEFAULTS = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
}
_REFUSED = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}  # field -> the only value computed as transformers does

# (HF name, engine key path); "{i}" is the layer index
HF_NAMES = (
    ("transformer.wte.weight", "embed.tok.w"),
    ("transformer.wpe.weight", "embed.pos.w"),
    *(
        (f"transformer.h.{{i}}.{hf}.{p}", f"blocks.{{i}}.{ours}.{q}")
        for hf, ours in (
            ("ln_1", "ln1"),
            ("attn.c_attn", "attn.qkv"),
            ("attn.c_proj", "attn.proj"),
            ("ln_2", "ln2"),
            ("mlp.c_fc", "mlp.fc"),
            ("mlp.c_proj", "mlp.proj"),
        )
        for p, q in (("weight", "w"), ("bias", "b"))
    ),
    ("transformer.ln_f.weight", "head.ln_f.w"),
    ("transformer.ln_f.bias", "head.ln_f.b"),
    ("lm_head.weight", "head.lm_head.w"),
)
_TO_OURS = dict(HF_NAMES)
_TO_HF = {ours: hf for hf, ours in HF_NAMES}
_CONV1D = {
    f"transformer.h.{{i}}.{m}.weight"
    for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
}


def config_from_hf(hf: Mapping, **overrides) -> gpt.Config:
    """The ``gpt.Config`` of a GPT-2 ``config.json`` dict; ``overrides`` replace fields afterwards
    (e.g. ``mlp_tiles=2``). Raises ``ValueError`` naming the field for what ``layers.gpt`` does not
    compute."""
    if not isinstance(hf, Mapping):
        raise TypeError(f"gpt2 config: expected the config.json dict, got {type(hf).__name__}")
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"config.json: model_type: expected 'gpt2', got {hf.get('model_type')!r}")
    for field, value in _REFUSED.items():
        if field in hf and hf[field] != value:
            raise ValueError(
                f"config.json: {field}: expected {value} (what layers.gpt computes), got "
                f"{hf[field]!r}"
            )
    get = lambda name: hf[name] if hf.get(name) is not None else _DEFAULTS[name]  # noqa: E731
    d, act = get("n_embd"), get("activation_function")
    if act not in mlp.ACTIVATIONS:
        raise ValueError(
            f"config.json: activation_function: expected one of {sorted(mlp.ACTIVATIONS)}, "
            f"got {act!r}"
        )
    inner = get("n_inner") or 4 * d
    if inner % d:
        raise ValueError(f"config.json: n_inner: expected a multiple of n_embd={d}, got {inner}")
    fields = dict(
        vocab_size=get("vocab_size"),
        d_model=d,
        n_heads=get("n_head"),
        n_layers=get("n_layer"),
        seq_len=get("n_positions"),
        mlp_ratio=inner // d,
        bias=True,
        activation=act,
        norm_eps=float(get("layer_norm_epsilon")),
        tie_embeddings=bool(get("tie_word_embeddings")),
        hf_dtype=saved_dtype(hf),
    )
    return gpt.Config(**{**fields, **overrides})


def config_to_hf(cfg: gpt.Config) -> dict:
    """The ``GPT2Config`` ``config.json`` dict of ``cfg`` (tiling factors are the engine's and not
    written). Raises ``ValueError`` for a bias-free model, which GPT-2's Conv1D cannot express."""
    if not cfg.bias:
        raise ValueError(
            "gpt2 config: GPT-2 has biases in every layer; expected gpt.Config(bias=True), got "
            "False"
        )
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.mlp_ratio * cfg.d_model,
        "activation_function": cfg.activation,
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def hf_names(cfg: gpt.Config) -> list[str]:
    """Every tensor name of ``cfg``'s GPT-2 as ``save_pretrained`` writes them, in module order
    (tied: no ``lm_head.weight``)."""
    layer = [hf for hf, ours in HF_NAMES if ours.startswith("blocks.")]
    names = [hf for hf, ours in HF_NAMES if ours.startswith("embed.")]
    names += [name.format(i=i) for i in range(cfg.n_layers) for name in layer]
    names += ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    return names + ([] if cfg.tie_embeddings else ["lm_head.weight"])


def hf_to_ours(name: str) -> str:
    """An HF GPT-2 name -> the engine's key path (``transformer.h.3.mlp.c_fc.weight`` ->
    ``blocks.3.mlp.fc.w``)."""
    return translate(name, _TO_OURS, "transformer.h.", "gpt2", "GPT-2", "HF")


def ours_to_hf(path: str) -> str:
    """The engine's key path -> the HF GPT-2 name; the inverse of ``hf_to_ours``."""
    return translate(path, _TO_HF, "blocks.", "gpt2", "GPT-2", "engine")


def transposed(name: str) -> bool:
    """Whether HF stores tensor ``name`` transposed against ``layers.gpt`` (a Conv1D weight,
    ``(d_in, d_out)``)."""
    parts = name.split(".")
    return (
        len(parts) > 3
        and parts[2].isdigit()
        and ".".join([*parts[:2], "{i}", *parts[3:]]) in _CONV1D
    )
