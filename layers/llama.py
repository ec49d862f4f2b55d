"""The Llama family (Llama 2/3, Mistral with a sliding window no shorter than the sequence, Qwen2) as a zf.Model.

Pre-norm decoder: token embedding, then per block ``x + attn(rmsnorm(x))`` and ``x + swiglu(rmsnorm(x))``
with rotary grouped-query attention, then a final RMSNorm and an LM head (untied, or with
``tie_embeddings`` the token embedding itself, through ``zf.Tie``). Full parameter trees, as
``zinf_fn.model.plain_loss`` takes them (H heads, G = n_kv_heads key/value heads, Dh = head_dim)::

    {"embed":  {"tok": {"w": (V, D)}},
     "blocks": [{"attn_norm": {"w": (D,)},
                 "attn": {"q": {"w": (H*Dh, D), "b"?}, "k": {"w": (G*Dh, D), "b"?}, "v": {"w": (G*Dh, D), "b"?},
                          "o": {"w": (D, H*Dh), "b"?}},
                 "mlp_norm": {"w": (D,)},
                 "mlp": {"gate": {"w": (F, D)}, "up": {"w": (F, D)}, "down": {"w": (D, F)}}}, ...],  # n_layers
     "head":   {"norm": {"w": (D,)}, "lm_head": {"w": (V, D)}}}

Every tensor is the Hugging Face one as it is (``nn.Linear`` layout, q/k in HF's ``rotate_half`` layout):
``HF_NAMES`` maps the names, ``hf_to_ours``/``ours_to_hf`` apply it (``rename=hf_to_ours`` for
``checkpoints.from_state_dict``). A batch is ``{"inputs": (B, T) int, "targets": (B, T) int}``, T <= seq_len;
the loss is the mean cross-entropy of ``targets`` over all B*T positions (targets -100 ignored), which is HF's
``LlamaForCausalLM(input_ids=inputs, labels=..., shift_labels=targets).loss``. An optional
``"segments": (B, T) int`` packs several examples in a row (``layers.packing``: attention and rotary
positions per example); ``token_loss=True`` makes the head return ``zf.TokenLoss(sum, count)``.

Numerics follow transformers op for op (RMSNorm in fp32 with the weight applied after the cast back,
rotary angles in fp32, SDPA with ``scale = Dh**-0.5``), so fp32 logits agree with HF's to rounding.
Tiling (``zinf_fn.tiling``), as in ``layers.gpt``: ``mlp_tiles`` > 1 turns ``mlp.gate.w``/``mlp.up.w`` into
``RowTiles`` and ``mlp.down.w`` into ``ColTiles`` over the hidden features; ``head_tiles`` > 1 tiles
``lm_head.w`` over the vocabulary and the loss becomes ``tiling.linear_cross_entropy``. HF weights are
given whole; ``checkpoints.from_state_dict`` cuts them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange

from layers import embedding, linear, packing, rope
from layers.batch import check_batch, check_tokens, count_targets
from layers.hf_config import FAMILIES, config_kwargs, hf_config_dict
from layers.hf_names import translate
from layers.norm import rmsnorm_init
from layers.stages import TIED_HEAD, bound_model
from zinf_fn import tiling
from zinf_fn.model import Model, TokenLoss, with_ties


@dataclass(frozen=True)
class Config:
    """Llama-family hyper-parameters (HF name in brackets); ints positive, ``n_heads % n_kv_heads == 0``.

    vocab_size [vocab_size], d_model [hidden_size], n_layers [num_hidden_layers], n_heads
    [num_attention_heads], n_kv_heads [num_key_value_heads; None: n_heads], head_dim [head_dim; None:
    d_model // n_heads], d_ff [intermediate_size], seq_len [max_position_embeddings], norm_eps [rms_norm_eps],
    rope [rope_theta, rope_scaling], qkv_bias (Qwen2, or Llama's attention_bias), o_bias (Llama's
    attention_bias), mlp_bias [mlp_bias], pad_token_id [pad_token_id: that embedding row gets no gradient,
    as in ``nn.Embedding(padding_idx=...)``], init_std [initializer_range], mlp_tiles and head_tiles (tiling
    factors of the MLP's hidden features and of the vocabulary; 1: untiled), family [model_type: "llama",
    "mistral" or "qwen2"; the same computation, kept so that ``to_hf`` writes the config class it came from].
    tie_embeddings [tie_word_embeddings]: the head reads ``embed.tok.w`` (``zf.Tie``; no ``lm_head.w``).
    hf_dtype [dtype, torch_dtype]: the dtype of the weights the config came with ("float32", "bfloat16",
    "float16" or None), which ``checkpoints.to_hf`` writes by default; no part of the computation, so not
    compared (``compare=False``).
    token_loss (not in HF's config): the head returns ``zf.TokenLoss(sum, count)`` over targets != -100, so
    the engine averages over the global batch's target tokens (masked fine-tuning data).
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
    rope: rope.Rope = field(default_factory=rope.Rope)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    pad_token_id: int | None = None
    tie_embeddings: bool = False
    init_std: float = 0.02
    mlp_tiles: int = 1
    head_tiles: int = 1
    family: str = "llama"
    hf_dtype: str | None = field(default=None, compare=False)
    token_loss: bool = False

    def __post_init__(self):
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None and isinstance(self.n_heads, int) and self.n_heads > 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "seq_len",
                     "mlp_tiles", "head_tiles"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"llama.Config: {name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"llama.Config: n_heads={self.n_heads} must be a multiple of n_kv_heads="
                             f"{self.n_kv_heads} (grouped-query attention shares each key/value head)")
        if self.head_dim % 2:
            raise ValueError(f"llama.Config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not isinstance(self.rope, rope.Rope):
            raise TypeError(f"llama.Config: rope must be a layers.rope.Rope, got {type(self.rope).__name__}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"llama.Config: pad_token_id must be in [0, {self.vocab_size}) or None, "
                             f"got {self.pad_token_id}")
        if not self.norm_eps > 0 or not self.init_std >= 0:
            raise ValueError(f"llama.Config: expected norm_eps > 0 and init_std >= 0, got norm_eps={self.norm_eps}, "
                             f"init_std={self.init_std}")
        for name, limit in (("mlp_tiles", self.d_ff), ("head_tiles", self.vocab_size)):
            if getattr(self, name) > limit:
                raise ValueError(f"llama.Config: {name}={getattr(self, name)} exceeds {limit}, the dimension it splits")
        if self.family not in FAMILIES:
            raise ValueError(f"llama.Config: family must be one of {FAMILIES} (an HF model_type), got {self.family!r}")
        if self.tie_embeddings and self.head_tiles != 1:
            raise ValueError(f"llama.Config: a tied head (tie_embeddings=True) reads the untiled token embedding; "
                             f"expected head_tiles=1, got {self.head_tiles}")

    @classmethod
    def from_hf(cls, hf_config: dict, **overrides) -> Config:
        """The Config of a transformers ``config.json`` dict (model_type llama, mistral or qwen2).

        ``overrides`` replace fields afterwards (e.g. ``seq_len=4096`` or ``head_tiles=8``). Raises
        ``ValueError`` naming the field for what this model does not compute: other model types,
        a sliding window shorter than ``seq_len`` (one at least as long attends to every earlier token, as
        full causal attention does), mixture-of-experts, rope types other than default/linear/llama3.
        """
        return cls(**{**config_kwargs(hf_config, overrides.get("seq_len")), **overrides})

    def to_hf(self) -> dict:
        """The transformers ``config.json`` dict of this model (``LlamaConfig``, ``MistralConfig`` or
        ``Qwen2Config`` by ``family``); ``Config.from_hf(cfg.to_hf())`` is ``cfg`` untiled. Raises
        ``ValueError`` for a bias layout the family's config class cannot express."""
        return hf_config_dict(self)


def model(cfg: Config) -> Model:
    """The Llama as three stages over ``cfg``; see the module docstring for trees and batches."""
    if not isinstance(cfg, Config):
        raise TypeError(f"llama.model: expected a llama.Config, got {type(cfg).__name__}")
    return bound_model(cfg, sys.modules[__name__], cfg.tie_embeddings)




def embed_init(cfg: Config, gen: torch.Generator) -> dict:
    """``{"tok": {"w": (V, D) ~ N(0, init_std)}}`` in fp32."""
    return {"tok": embedding.init(gen, cfg.vocab_size, cfg.d_model, std=cfg.init_std)}


def embed_apply(cfg: Config, params: dict, batch: dict):
    """Validate ``batch`` and return the carry ``tok[inputs]``: (B, T, D) in the params' dtype; with
    ``batch["segments"]`` (packed examples) the dict ``{"x": (B, T, D), "segments": (B, T)}``."""
    check_batch(batch, cfg.seq_len)
    x = F.embedding(batch["inputs"], params["tok"]["w"], padding_idx=cfg.pad_token_id)  # (B, T, D)
    return packing.join(x, batch.get("segments"))


def block_init(cfg: Config, gen: torch.Generator, i: int) -> dict:
    """Layer ``i``'s tree (the same structure for every ``i``): matrices N(0, init_std), biases 0, norms 1."""
    if not 0 <= i < cfg.n_layers:
        raise ValueError(f"llama.block_init: layer index must be in [0, {cfg.n_layers}), got {i}")
    d, q_dim, kv_dim, std = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.init_std
    return {
        "attn_norm": rmsnorm_init(d, device=gen.device),
        "attn": {
            "q": linear.init(gen, d, q_dim, bias=cfg.qkv_bias, std=std),
            "k": linear.init(gen, d, kv_dim, bias=cfg.qkv_bias, std=std),
            "v": linear.init(gen, d, kv_dim, bias=cfg.qkv_bias, std=std),
            "o": linear.init(gen, q_dim, d, bias=cfg.o_bias, std=std),
        },
        "mlp_norm": rmsnorm_init(d, device=gen.device),
        "mlp": {
            "gate": linear.init(gen, d, cfg.d_ff, bias=cfg.mlp_bias, std=std, tiles=cfg.mlp_tiles, tile_axis=0),
            "up": linear.init(gen, d, cfg.d_ff, bias=cfg.mlp_bias, std=std, tiles=cfg.mlp_tiles, tile_axis=0),
            "down": linear.init(gen, cfg.d_ff, d, bias=cfg.mlp_bias, std=std, tiles=cfg.mlp_tiles, tile_axis=1),
        },
    }


def block_apply(cfg: Config, params: dict, carry):
    """Pre-norm residual block: ``x + attention(norm(x))``, then ``+ swiglu(norm(x))``; (B, T, D) -> (B, T, D).
    A carry ``{"x", "segments"}`` (packed examples) attends within each example only and comes back so."""
    x, segments = packing.split(carry)
    x = x + attention(cfg, params["attn"], rmsnorm(params["attn_norm"], x, cfg.norm_eps), segments)
    x = x + swiglu(params["mlp"], rmsnorm(params["mlp_norm"], x, cfg.norm_eps))
    return packing.join(x, segments)


def attention(cfg: Config, params: dict, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """Causal rotary grouped-query attention: (B, T, D) -> (B, T, D); query head h reads kv head h // (H/G).

    ``segments`` (B, T): a position attends only to earlier positions of its own segment, and its rotary
    position counts from the segment's start (what HF computes for each example alone)."""
    t, dh = x.shape[1], cfg.head_dim
    q = rearrange(linear.apply(params["q"], x), "b t (h d) -> b h t d", d=dh)  # (B, H, T, Dh)
    k = rearrange(linear.apply(params["k"], x), "b t (g d) -> b g t d", d=dh)  # (B, G, T, Dh)
    v = rearrange(linear.apply(params["v"], x), "b t (g d) -> b g t d", d=dh)  # (B, G, T, Dh)
    if segments is None:
        cos, sin = rope.cos_sin(cfg.rope, dh, t, x.device, x.dtype)  # 2 x (T, Dh)
        mask = None
    else:
        cos, sin = rope.cos_sin_at(cfg.rope, dh, packing.positions(segments), x.dtype)  # 2 x (B, 1, T, Dh)
        mask = packing.mask(segments)  # (B, 1, T, T)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=dh**-0.5,
                                       enable_gqa=cfg.n_kv_heads != cfg.n_heads)  # (B, H, T, Dh)
    return linear.apply(params["o"], rearrange(y, "b h t d -> b t (h d)"))  # (B, T, H*Dh) -> (B, T, D)


def swiglu(params: dict, x: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``: (..., D) -> (..., D)."""
    return linear.apply(params["down"], F.silu(linear.apply(params["gate"], x)) * linear.apply(params["up"], x))


def rmsnorm(params: dict, x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``LlamaRMSNorm``: normalise in fp32, cast back to ``x``'s dtype, then scale by ``w``; shape of x.

    ``layers.norm.rmsnorm`` (``F.rms_norm``) applies ``w`` before the cast, which differs in bf16.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return params["w"] * h.to(x.dtype)


def head_init(cfg: Config, gen: torch.Generator) -> dict:
    """``{"norm": rmsnorm, "lm_head": {"w": (V, D)}}``: a bias-free output projection; tied: ``{"norm"}``
    only (the engine puts the token embedding in as ``lm_head.w``)."""
    if cfg.tie_embeddings:
        return {"norm": rmsnorm_init(cfg.d_model, device=gen.device)}
    return {
        "norm": rmsnorm_init(cfg.d_model, device=gen.device),
        "lm_head": linear.init(gen, cfg.d_model, cfg.vocab_size, bias=False, std=cfg.init_std,
                               tiles=cfg.head_tiles, tile_axis=0),
    }


def head_apply(cfg: Config, params: dict, x, batch: dict):
    """Mean next-token cross-entropy of ``batch["targets"]`` over the B*T positions whose target is not -100
    (0-d fp32; logits in fp32). ``cfg.token_loss``: ``zf.TokenLoss`` (the summed cross-entropy, the count)."""
    check_batch(batch, cfg.seq_len)
    x, _ = packing.split(x)  # a packed carry {"x", "segments"}
    targets = batch["targets"]
    if x.shape[:2] != targets.shape:
        raise ValueError(f"llama.head_apply: carry is {tuple(x.shape)}, expected (B, T, D) with (B, T) = "
                         f"{tuple(targets.shape)} from batch['targets']")
    h = rmsnorm(params["norm"], x, cfg.norm_eps)  # (B, T, D)
    if cfg.token_loss:
        total = tiling.linear_cross_entropy(h, params["lm_head"]["w"], targets, reduction="sum")
        return TokenLoss(total, count_targets(batch))
    return tiling.linear_cross_entropy(h, params["lm_head"]["w"], targets)  # tiled: never the whole (B*T, V)


def logits(params: dict, cfg: Config, inputs: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token logits (B, T, V) in fp32 over a full tree ``{"embed", "blocks": [...], "head"}``;
    ``segments`` (B, T): packed examples, each attending within itself (``attention``).

    A tiled head weight is put back together first: these logits are whole, for tests and sampling.
    """
    check_tokens("inputs", inputs, cfg.seq_len)
    if len(params["blocks"]) != cfg.n_layers:
        raise ValueError(f"llama.logits: expected {cfg.n_layers} block trees, got {len(params['blocks'])}")
    x = F.embedding(inputs, params["embed"]["tok"]["w"])  # (B, T, D)
    x = packing.join(x, segments)
    for layer_params in params["blocks"]:
        x = block_apply(cfg, layer_params, x)
    x, _ = packing.split(x)
    head = with_ties(TIED_HEAD if cfg.tie_embeddings else (), params["head"], params["embed"])   # tied: embed.tok.w
    w = tiling.untile(head["lm_head"]["w"])
    return F.linear(rmsnorm(head["norm"], x, cfg.norm_eps), w).float()  # (B, T, V)


# -- Hugging Face names ---------------------------------------------------------------------------------

# (HF state_dict name, engine key path); "{i}" is the layer index. Biases exist only where the Config has them.
HF_NAMES = (
    ("model.embed_tokens.weight", "embed.tok.w"),
    *((f"model.layers.{{i}}.self_attn.{p}_proj.{hf}", f"blocks.{{i}}.attn.{p}.{ours}")
      for p in "qkvo" for hf, ours in (("weight", "w"), ("bias", "b"))),
    *((f"model.layers.{{i}}.mlp.{p}_proj.{hf}", f"blocks.{{i}}.mlp.{p}.{ours}")
      for p in ("gate", "up", "down") for hf, ours in (("weight", "w"), ("bias", "b"))),
    ("model.layers.{i}.input_layernorm.weight", "blocks.{i}.attn_norm.w"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.mlp_norm.w"),
    ("model.norm.weight", "head.norm.w"),
    ("lm_head.weight", "head.lm_head.w"),
)

_TO_OURS = dict(HF_NAMES)
_TO_HF = {ours: hf for hf, ours in HF_NAMES}


def hf_to_ours(name: str) -> str:
    """An HF state_dict name -> the engine's key path (``model.layers.3.mlp.up_proj.weight`` -> ``blocks.3.mlp.up.w``).

    Raises ``ValueError`` naming ``name`` for anything outside ``HF_NAMES``; pass as ``rename=`` to
    ``checkpoints.from_state_dict`` / ``from_safetensors``.
    """
    return _translate(name, _TO_OURS, "model.layers.", "HF")


def ours_to_hf(path: str) -> str:
    """The engine's key path -> the HF state_dict name; the inverse of ``hf_to_ours``."""
    return _translate(path, _TO_HF, "blocks.", "engine")


def hf_names(cfg: Config) -> list[str]:
    """Every HF tensor name of ``cfg``'s model in ``LlamaForCausalLM.state_dict()``'s order (module order), as
    ``save_pretrained`` writes them: a tied model has no ``lm_head.weight``."""
    has_bias = {"q": cfg.qkv_bias, "k": cfg.qkv_bias, "v": cfg.qkv_bias, "o": cfg.o_bias,
                "gate": cfg.mlp_bias, "up": cfg.mlp_bias, "down": cfg.mlp_bias}
    layer = [hf for hf, ours in HF_NAMES if ours.startswith("blocks.")
             and (not ours.endswith(".b") or has_bias[ours.split(".")[-2]])]
    names = [name.format(i=i) for i in range(cfg.n_layers) for name in layer]
    head = [] if cfg.tie_embeddings else ["lm_head.weight"]   # tied: HF writes no lm_head.weight
    return ["model.embed_tokens.weight", *names, "model.norm.weight", *head]


def _translate(name: str, table: dict, layer_prefix: str, side: str) -> str:
    return translate(name, table, layer_prefix, "llama", "Llama-family", side)
