"""The decoder of every HF family the project reads (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 3 text; the mixtures of experts Qwen3-MoE, Mixtral, OLMoE, gpt-oss) as a zf.Model,
assembled from the variants of ``layers.decoder`` by ``Config``'s fields (``layers.moe_decoder``:
the MLP slot as a mixture of experts).

Pre-norm decoder: token embedding (``embed_scale``: times sqrt(D), Gemma), then per block ``x +
[post_norm](attn(norm(x)))`` and ``x + [post_norm](mlp(norm(x)))`` (the post-norms with
``post_norms``, Gemma) with rotary grouped-query attention (q/k norms with ``qk_norm``; a sliding
window and a rope per layer: ``decoder.layer_window`` / ``layer_rope``) and a gated MLP, then a
final norm and an LM head (untied, or with ``tie_embeddings`` the token embedding itself, through
``zf.Tie``), its logits soft-capped with ``logit_softcap`` (Gemma). Full parameter trees, as
``zinf_fn.model.plain_loss`` takes them (H heads, G = n_kv_heads key/value heads, Dh = head_dim)::

    {"embed":  {"tok": {"w": (V, D)}},
     "blocks": [{"attn_norm": {"w": (D,)},
                 "attn": {"q": {"w": (H*Dh, D), "b"?}, "k": {"w": (G*Dh, D), "b"?}, "v": {"w":
                 (G*Dh, D), "b"?},
                          "o": {"w": (D, H*Dh), "b"?}, "q_norm"?: {"w": (Dh,)}, "k_norm"?: {"w":
                          (Dh,)}},
                 "attn_post_norm"?: {"w": (D,)},
                 "mlp_norm": {"w": (D,)},
                 "mlp": {"gate": {"w": (F, D)}, "up": {"w": (F, D)}, "down": {"w": (D, F)}},
                 "mlp_post_norm"?: {"w": (D,)}}, ...],  # n_layers
     "head":   {"norm": {"w": (D,)}, "lm_head": {"w": (V, D)}}}

Every tensor is the Hugging Face one as it is (``nn.Linear`` layout, q/k in HF's ``rotate_half``
layout; Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` are cut into q, k, v and gate, up):
``layers.decoder_names`` maps the names per family, ``hf_to_ours``/``ours_to_hf`` apply it. A batch
is ``{"inputs": (B, T) int, "targets": (B, T) int}``, T <= seq_len; the loss is the mean
cross-entropy of ``targets`` over all B*T positions (targets -100 ignored), which is HF's
``LlamaForCausalLM(input_ids=inputs, labels=..., shift_labels=targets).loss``. An optional
``"segments": (B, T) int`` packs several examples in a row (``layers.packing``: attention, windows
and rotary positions per example); ``token_loss`` (the default) makes the head return
``zf.TokenLoss(sum, count)``. The block takes its layer's index (``zf.Model(layer_index=True)``).

Numerics follow transformers op for op (norms as ``decoder.norm``, rotary angles in fp32, SDPA with
the family's scale), so fp32 logits agree with HF's to rounding. Tiling (``zinf_fn.tiling``), as in
``layers.gpt``: ``mlp_tiles`` > 1 turns ``mlp.gate.w``/``mlp.up.w`` into ``RowTiles`` and
``mlp.down.w`` into ``ColTiles`` over the hidden features; ``head_tiles`` > 1 tiles ``lm_head.w``
over the vocabulary and the loss becomes ``tiling.linear_cross_entropy``. HF weights are given
whole; ``checkpoints.from_state_dict`` cuts them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from layers import decoder, embedding, linear, moe, moe_decoder, rope, sinks, yarn
from layers.batch import check_batch, check_tokens, count_targets
from layers.decoder_names import HF_NAMES, hf_names, hf_to_ours, ours_to_hf
from layers.hf_config import FAMILIES, config_kwargs, hf_config_dict
from layers.stages import TIED_HEAD, bound_model
from zinf_fn import tiling
from zinf_fn.model import Model, TokenLoss, with_ties

__all__ = [
    "FAMILIES",
    "HF_NAMES",
    "Config",
    "hf_names",
    "hf_to_ours",
    "logits",
    "model",
    "ours_to_hf",
]


@dataclass(frozen=True)
class Config:
    """Decoder hyper-parameters (HF name in brackets); ints positive, ``n_heads % n_kv_heads == 0``.

    vocab_size [vocab_size], d_model [hidden_size], n_layers [num_hidden_layers], n_heads
    [num_attention_heads], n_kv_heads [num_key_value_heads; None: n_heads], head_dim [head_dim;
    None: d_model // n_heads], d_ff [intermediate_size], seq_len [max_position_embeddings], norm_eps
    [rms_norm_eps], rope [rope_theta, rope_scaling; Gemma 3: rope_parameters.full_attention],
    qkv_bias (Qwen2, or attention_bias), o_bias (attention_bias), mlp_bias [mlp_bias], pad_token_id
    [pad_token_id: that embedding row gets no gradient, as in ``nn.Embedding(padding_idx=...)``],
    init_std [initializer_range], mlp_tiles, head_tiles and embed_tiles (tiling factors of the
    MLP's hidden features, of the head's vocabulary and of the embedding's; 1: untiled),
    vocab_tile_seeds (a tiled embedding and head drawn tile by tile, each tile from a seed of its
    own: ``tiling.Deferred`` tiles that ``zf.init`` makes one at a time, never the whole table; the
    values then depend on the tile counts, so it is off by default), family [model_type, one of
    ``hf_config.FAMILIES``: kept so that ``to_hf`` writes the config class and the tensor names
    it came from].
    tie_embeddings [tie_word_embeddings]: the head reads ``embed.tok.w`` (``zf.Tie``; no
    ``lm_head.w``). The variants (``layers.decoder``): norm_style ("rms" | "rms_1p"), qk_norm,
    post_norms (norms after attention and MLP too), embed_scale (embedding times sqrt(d_model) in
    its dtype), activation ("silu" | "gelu_tanh") [hidden_act, hidden_activation],
    query_pre_attn_scalar, sliding_window [sliding_window], layer_types [layer_types:
    "sliding_attention" | "full_attention" per layer; None: every layer slides when sliding_window
    is set], rope_local [Gemma 3: rope_parameters.sliding_attention], logit_softcap
    [final_logit_softcapping: logits become ``c * tanh(logits / c)``]. hf_dtype [dtype,
    torch_dtype]: the dtype of the weights the config came with ("float32", "bfloat16", "float16" or
    None), which ``checkpoints.to_hf`` writes by default; no part of the computation, so not
    compared (``compare=False``). token_loss (not in HF's config; default True): the head returns
    ``zf.TokenLoss(sum, count)`` over targets != -100, so the engine averages over the global
    batch's target tokens, as transformers' Trainer does (masked fine-tuning data; where nothing is
    masked and grad_accum a power of two, bitwise the mean); False: each micro-batch's mean,
    averaged. qk_norm_whole (OLMoE): the q/k norms span the whole projection (H*Dh and G*Dh), before
    the heads are split. clip_qkv [clip_qkv] (OLMoE): q, k and v clamped to [-clip_qkv, clip_qkv]
    after their projections (and the whole-width q/k norms); None: unclamped. moe: a
    ``layers.moe.Config`` puts that mixture-of-experts block in every layer's MLP slot (Qwen3-MoE,
    Mixtral, OLMoE, gpt-oss; ``layers.moe_decoder``); aux_loss [output_router_logits] adds aux_coef
    [router_aux_loss_coef] x HF's load-balancing loss to the loss (off: the cross-entropy alone).
    attn_sinks (gpt-oss): a learned sink logit per head, ``attn.sinks`` (H,) [self_attn.sinks]; rope
    may be a ``layers.yarn.Yarn`` (rope_type "yarn").
    """

    vocab_size: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int = 172
    seq_len: int = 128
    norm_eps: float = 1e-6
    rope: rope.Rope | yarn.Yarn = field(default_factory=rope.Rope)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    pad_token_id: int | None = None
    tie_embeddings: bool = False
    init_std: float = 0.02
    mlp_tiles: int = 1
    head_tiles: int = 1
    embed_tiles: int = 1
    vocab_tile_seeds: bool = False
    family: str = "llama"
    hf_dtype: str | None = field(default=None, compare=False)
    token_loss: bool = True
    norm_style: str = "rms"
    qk_norm: bool = False
    post_norms: bool = False
    embed_scale: bool = False
    activation: str = "silu"
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local: rope.Rope | None = None
    logit_softcap: float | None = None
    qk_norm_whole: bool = False
    attn_sinks: bool = False
    clip_qkv: float | None = None
    moe: moe.Config | None = None
    aux_loss: bool = False
    aux_coef: float = 0.001

    def __post_init__(self):
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None and isinstance(self.n_heads, int) and self.n_heads > 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self._check_sizes()
        self._check_variants()

    def _check_sizes(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "d_ff",
            "seq_len",
            "mlp_tiles",
            "head_tiles",
            "embed_tiles",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"llama.Config: {name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"llama.Config: n_heads={self.n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads} (grouped-query attention shares each "
                "key/value head)"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"llama.Config: head_dim must be even for rotary embeddings, got {self.head_dim}"
            )
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"llama.Config: pad_token_id must be in [0, {self.vocab_size}) or "
                f"None, got {self.pad_token_id}"
            )
        if not self.norm_eps > 0 or not self.init_std >= 0:
            raise ValueError(
                "llama.Config: expected norm_eps > 0 and init_std >= 0, got "
                f"norm_eps={self.norm_eps}, init_std={self.init_std}"
            )
        limits = (
            ("mlp_tiles", self.d_ff),
            ("head_tiles", self.vocab_size),
            ("embed_tiles", self.vocab_size),
        )
        for name, limit in limits:
            if getattr(self, name) > limit:
                raise ValueError(
                    f"llama.Config: {name}={getattr(self, name)} exceeds {limit}, "
                    "the dimension it splits"
                )
        if self.family not in FAMILIES:
            raise ValueError(
                f"llama.Config: family must be one of {FAMILIES} (an HF model_type), "
                f"got {self.family!r}"
            )
        if self.moe is not None and (self.mlp_tiles != 1 or self.moe.d_model != self.d_model):
            raise ValueError(
                "llama.Config: an MoE model (moe set) needs mlp_tiles=1 and "
                f"moe.d_model == d_model={self.d_model}; got mlp_tiles="
                f"{self.mlp_tiles}, moe.d_model={self.moe.d_model}"
            )
        if self.head_tiles != 1 and (self.tie_embeddings or self.logit_softcap is not None):
            raise ValueError(
                "llama.Config: a tied head (tie_embeddings=True) or soft-capped "
                "logits (logit_softcap) read the untiled weight; expected "
                f"head_tiles=1, got {self.head_tiles}"
            )
        if self.vocab_tile_seeds and (self.tie_embeddings or self.logit_softcap is not None):
            raise ValueError(
                "llama.Config: vocab_tile_seeds makes the vocabulary tables tiles, which a tied "
                "head (tie_embeddings=True) and soft-capped logits (logit_softcap) cannot read; "
                "expected vocab_tile_seeds=False with those"
            )
        if self.embed_tiles != 1 and self.tie_embeddings:
            raise ValueError(
                "llama.Config: a tied embedding (tie_embeddings=True) is the head's whole weight; "
                f"expected embed_tiles=1, got {self.embed_tiles} (untie it, or leave the "
                "embedding whole)"
            )

    def _check_variants(self) -> None:
        for name in ("rope", "rope_local"):
            value = getattr(self, name)
            if not isinstance(value, (rope.Rope, yarn.Yarn)) and not (
                name == "rope_local" and value is None
            ):
                raise TypeError(
                    f"llama.Config: {name} must be a layers.rope.Rope or "
                    f"yarn.Yarn, got {type(value).__name__}"
                )
        choices = (("norm_style", decoder.NORM_STYLES), ("activation", decoder.ACTIVATIONS))
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"llama.Config: {name} must be one of {allowed}, got {getattr(self, name)!r}"
                )
        window = self.sliding_window
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise ValueError(
                f"llama.Config: sliding_window must be a positive int or None, got {window!r}"
            )
        types = self.layer_types
        if types is not None and (
            len(types) != self.n_layers or any(t not in decoder.LAYER_TYPES for t in types)
        ):
            raise ValueError(
                f"llama.Config: layer_types must be None or {self.n_layers} "
                f"(n_layers) of {decoder.LAYER_TYPES}, got {types!r}"
            )
        for name in ("query_pre_attn_scalar", "logit_softcap", "clip_qkv"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"llama.Config: {name} must be > 0 or None, got {value!r}")

    @classmethod
    def from_hf(cls, hf_config: dict, **overrides) -> Config:
        """The Config of a transformers ``config.json`` dict (a model_type of
        ``hf_config.FAMILIES``).

        ``overrides`` replace fields afterwards (e.g. ``seq_len=4096`` or ``head_tiles=8``). Raises
        ``ValueError`` naming the field for what this model does not compute: other model types,
        dense-first or latent-attention MoE (``layers.moe_config``), rope types other than
        default/linear/llama3 (and yarn for gpt-oss), dropout, attention
        soft-capping.
        """
        return cls(**{**config_kwargs(hf_config), **overrides})

    def to_hf(self) -> dict:
        """The transformers ``config.json`` dict of this model (the config class of ``family``);
        ``Config.from_hf(cfg.to_hf())`` is ``cfg`` untiled. Raises ``ValueError`` for a variant or
        bias layout the family's config class cannot express."""
        return hf_config_dict(self)


def model(cfg: Config) -> Model:
    """The decoder as three stages over ``cfg``; see the module docstring for trees and batches."""
    if not isinstance(cfg, Config):
        raise TypeError(f"llama.model: expected a llama.Config, got {type(cfg).__name__}")
    return bound_model(cfg, sys.modules[__name__], cfg.tie_embeddings, layer_index=True)


def embed_init(cfg: Config, gen: torch.Generator) -> dict:
    """``{"tok": {"w": (V, D) ~ N(0, init_std)}}`` in fp32, ``embed_tiles`` row tiles
    (``embedding.table``)."""
    tok = embedding.init(
        gen, cfg.vocab_size, cfg.d_model, cfg.init_std, cfg.embed_tiles, cfg.vocab_tile_seeds
    )
    return {"tok": tok}



def embed_apply(cfg: Config, params: dict, batch: dict):
    """Validate ``batch`` and return the carry ``tok[inputs]``: (B, T, D) in the params' dtype; with
    ``batch["segments"]`` (packed examples) the dict ``{"x": (B, T, D), "segments": (B, T)}``."""
    check_batch(batch, cfg.seq_len)
    x = embed_tokens(cfg, params["tok"]["w"], batch["inputs"])  # (B, T, D)
    return moe_decoder.join(cfg, x, batch.get("segments"), None)


def embed_tokens(cfg: Config, w, inputs: torch.Tensor) -> torch.Tensor:
    """``w[inputs]`` (B, T, D) (a tiled ``w``: only the tiles holding the inputs are read,
    ``tiling.embedding``); with ``embed_scale`` times sqrt(d_model) rounded to ``w``'s dtype
    first, as ``Gemma3TextScaledWordEmbedding`` multiplies."""
    x = tiling.embedding(inputs, w, padding_idx=cfg.pad_token_id)  # (B, T, D)
    if cfg.embed_scale:
        x = x * torch.tensor(cfg.d_model**0.5).to(x.dtype)
    return x


# the weights of a block's linears, passed to ``linear.apply`` only: ``zf.Model.takes_lent`` (not
# the router's: its logits choose the experts, so they stay the decoded weight's)
LINEARS = tuple(f"attn.{p}.w" for p in "qkvo") + tuple(f"mlp.{p}.w" for p in ("gate", "up", "down"))


def block_init(cfg: Config, gen: torch.Generator, i: int) -> dict:
    """Layer ``i``'s tree (the same structure for every ``i``): matrices N(0, init_std), biases 0,
    norms their identity (``decoder.norm_init``)."""
    if not 0 <= i < cfg.n_layers:
        raise ValueError(f"llama.block_init: layer index must be in [0, {cfg.n_layers}), got {i}")
    d, std = cfg.d_model, cfg.init_std
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = {
        "q": linear.init(gen, d, q_dim, bias=cfg.qkv_bias, std=std),
        "k": linear.init(gen, d, kv_dim, bias=cfg.qkv_bias, std=std),
        "v": linear.init(gen, d, kv_dim, bias=cfg.qkv_bias, std=std),
        "o": linear.init(gen, q_dim, d, bias=cfg.o_bias, std=std),
    }
    if cfg.qk_norm:
        attn["q_norm"] = _norm_init(cfg, q_dim if cfg.qk_norm_whole else cfg.head_dim, gen)
        attn["k_norm"] = _norm_init(cfg, kv_dim if cfg.qk_norm_whole else cfg.head_dim, gen)
    if cfg.attn_sinks:
        attn["sinks"] = sinks.init(gen, cfg.n_heads, std)
    tree = {
        "attn_norm": _norm_init(cfg, d, gen),
        "attn": attn,
        "mlp_norm": _norm_init(cfg, d, gen),
        "mlp": moe.init(cfg.moe, gen) if cfg.moe is not None else _mlp_init(cfg, gen),
    }
    if cfg.post_norms:
        tree["attn_post_norm"] = _norm_init(cfg, d, gen)
        tree["mlp_post_norm"] = _norm_init(cfg, d, gen)
    return tree


def _mlp_init(cfg: Config, gen: torch.Generator) -> dict:
    """The dense gated MLP's tree, tiled over its hidden features by ``mlp_tiles``."""
    d = cfg.d_model
    std = cfg.init_std
    tiles = cfg.mlp_tiles
    return {
        "gate": linear.init(gen, d, cfg.d_ff, bias=cfg.mlp_bias, std=std, tiles=tiles, tile_axis=0),
        "up": linear.init(gen, d, cfg.d_ff, bias=cfg.mlp_bias, std=std, tiles=tiles, tile_axis=0),
        "down": linear.init(gen, cfg.d_ff, d, bias=cfg.mlp_bias, std=std, tiles=tiles, tile_axis=1),
    }


def block_apply(cfg: Config, params: dict, carry, i: int):
    """Layer ``i``: ``x + [post_norm](attention(norm(x)))``, then ``+ [post_norm](mlp(norm(x)))``;
    (B, T, D) -> (B, T, D). A carry ``{"x", "segments"}`` (packed examples) attends within each
    example only and comes back so."""
    x, segments, stats = moe_decoder.split(carry)
    h = decoder.attention(cfg, params["attn"], _norm(cfg, params["attn_norm"], x), segments, i)
    x = x + (_norm(cfg, params["attn_post_norm"], h) if cfg.post_norms else h)
    h = _norm(cfg, params["mlp_norm"], x)
    if cfg.moe is not None:  # the router's sums join the carry (aux loss on)
        h, stats = moe_decoder.mlp_apply(cfg, params["mlp"], h, stats)
    else:
        h = decoder.gated_mlp(cfg, params["mlp"], h)
    x = x + (_norm(cfg, params["mlp_post_norm"], h) if cfg.post_norms else h)
    return moe_decoder.join(cfg, x, segments, stats)


def _norm(cfg: Config, params: dict, x: torch.Tensor) -> torch.Tensor:
    return decoder.norm(params, x, cfg.norm_eps, cfg.norm_style)


def _norm_init(cfg: Config, d: int, gen: torch.Generator) -> dict:
    return decoder.norm_init(d, cfg.norm_style, device=gen.device)


def head_init(cfg: Config, gen: torch.Generator) -> dict:
    """``{"norm": norm, "lm_head": {"w": (V, D)}}``: a bias-free output projection; tied:
    ``{"norm"}`` only (the engine puts the token embedding in as ``lm_head.w``)."""
    if cfg.tie_embeddings:
        return {"norm": _norm_init(cfg, cfg.d_model, gen)}
    w = embedding.table(
        gen, cfg.vocab_size, cfg.d_model, cfg.init_std, cfg.head_tiles, cfg.vocab_tile_seeds
    )
    return {"norm": _norm_init(cfg, cfg.d_model, gen), "lm_head": {"w": w}}


def head_apply(cfg: Config, params: dict, x, batch: dict):
    """Mean next-token cross-entropy of ``batch["targets"]`` over the B*T positions whose target is
    not -100 (0-d fp32; logits in fp32). ``cfg.token_loss``: ``zf.TokenLoss`` (the summed
    cross-entropy, the count)."""
    check_batch(batch, cfg.seq_len)
    x, _, stats = moe_decoder.split(x)  # a packed carry {"x", "segments"}, the router's sums
    targets = batch["targets"]
    if x.shape[:2] != targets.shape:
        raise ValueError(
            f"llama.head_apply: carry is {tuple(x.shape)}, expected (B, T, D) with "
            f"(B, T) = {tuple(targets.shape)} from batch['targets']"
        )
    h = _norm(cfg, params["norm"], x)  # (B, T, D)
    reduction = "sum" if cfg.token_loss else "mean"
    if cfg.logit_softcap is not None:
        capped = _softcap(cfg, F.linear(h, params["lm_head"]["w"])).float()  # (B, T, V)
        total = F.cross_entropy(
            capped.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction
        )
    else:  # tiled: never the whole (B*T, V)
        total = tiling.linear_cross_entropy(h, params["lm_head"]["w"], targets, reduction=reduction)
    loss = TokenLoss(total, count_targets(batch)) if cfg.token_loss else total
    return moe_decoder.with_aux(cfg, loss, stats, targets.numel())


def _softcap(cfg: Config, logits: torch.Tensor) -> torch.Tensor:
    """``c * tanh(logits / c)``, as Gemma's ``final_logit_softcapping``."""
    return torch.tanh(logits / cfg.logit_softcap) * cfg.logit_softcap


def logits(
    params: dict, cfg: Config, inputs: torch.Tensor, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """Next-token logits (B, T, V) in fp32 over a full tree ``{"embed", "blocks": [...], "head"}``;
    ``segments`` (B, T): packed examples, each attending within itself (``decoder.attention``).

    A tiled head weight is put back together first: these logits are whole, for tests and sampling.
    """
    check_tokens("inputs", inputs, cfg.seq_len)
    if len(params["blocks"]) != cfg.n_layers:
        raise ValueError(
            f"llama.logits: expected {cfg.n_layers} block trees, got {len(params['blocks'])}"
        )
    x = embed_tokens(cfg, params["embed"]["tok"]["w"], inputs)  # (B, T, D)
    x = moe_decoder.join(cfg, x, segments, None)
    for i, layer_params in enumerate(params["blocks"]):
        x = block_apply(cfg, layer_params, x, i)
    x, _, _ = moe_decoder.split(x)
    ties = TIED_HEAD if cfg.tie_embeddings else ()
    head = with_ties(ties, params["head"], params["embed"])  # tied: lm_head.w is embed's tok.w
    w = tiling.untile(head["lm_head"]["w"])
    out = F.linear(_norm(cfg, head["norm"], x), w)  # (B, T, V)
    return (out if cfg.logit_softcap is None else _softcap(cfg, out)).float()
