"""A GPT-2 style decoder as a ``zinf_fn.model.Model``: token+position embedding, pre-norm blocks, LM
head.

Full parameter trees, as ``zinf_fn.model.plain_loss`` takes them::

    {"embed":  {"tok": {"w": (V, D)}, "pos": {"w": (seq_len, D)}},
     "blocks": [{"ln1": {"w", "b"}, "attn": {"qkv": {"w", "b"}, "proj": {"w", "b"}},
                 "ln2": {"w", "b"}, "mlp": {"fc": {"w", "b"}, "proj": {"w", "b"}}}, ...],   #
                 n_layers
     "head":   {"ln_f": {"w", "b"}, "lm_head": {"w": (V, D)}}}

With ``Config(tie_embeddings=True)`` (GPT-2's head) ``lm_head.w`` is ``embed.tok.w`` itself: the
model declares ``zf.Tie("tok.w", "lm_head.w")``, ``head_init`` leaves it out, and the engine stores
and updates it once. GPT-2 itself is ``Config(tie_embeddings=True, activation="gelu_new")``: its
attention scale (``1/sqrt(head_dim)``) and layernorms (``norm_eps``, 1e-5) are these already.

Linear weights use ``nn.Linear``'s ``(d_out, d_in)`` layout; with ``Config(bias=False)`` every
``"b"`` is absent. A batch is ``{"inputs": (B, T) int, "targets": (B, T) int}`` with ``T <=
seq_len`` (targets -100 are ignored), and optionally ``"segments": (B, T) int`` for packed examples
(``layers.packing``).

Tiling (``zinf_fn.tiling``): ``attn_tiles``/``mlp_tiles`` > 1 turn ``attn.qkv.w``/``mlp.fc.w`` into
``RowTiles`` (over output features) and ``attn.proj.w``/``mlp.proj.w`` into ``ColTiles`` (over input
features); ``head_tiles`` > 1 turns ``lm_head.w`` into ``RowTiles`` over the vocabulary and the loss
into ``tiling.linear_cross_entropy``, so the (B*T, V) logits never exist. The values are those of
the untiled model with the same seed; the engine fetches each tile just before use.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from layers import attention, embedding, linear, mlp, packing
from layers.batch import check_batch, check_tokens, count_targets
from layers.norm import layernorm, layernorm_init
from layers.stages import TIED_HEAD, bound_model
from zinf_fn import tiling
from zinf_fn.model import Model, TokenLoss, with_ties


@dataclass(frozen=True)
class Config:
    """GPT hyper-parameters; every field a positive int (``bias`` a bool), ``d_model % n_heads ==
    0``.

    ``attn_tiles``, ``mlp_tiles``, ``head_tiles``: tiling factors (1: untiled) of the attention
    projections, the MLP projections and the vocabulary head; at most the dimension they split.
    ``tie_embeddings``: the head reads the token embedding (no ``lm_head.w`` of its own;
    ``head_tiles`` must be 1). ``activation``: the MLP's, ``"gelu"`` (erf) or ``"gelu_new"``
    (GPT-2's tanh form, as transformers computes it). ``norm_eps``: every layernorm's epsilon
    (GPT-2's ``layer_norm_epsilon``). ``hf_dtype``: the dtype of the GPT-2 weights the config was
    read with (``config.json``'s ``dtype``; None for a model not from Hugging Face), which
    ``checkpoints.to_hf`` writes by default; not compared. ``token_loss`` (the default): the head
    returns ``zf.TokenLoss(sum, count)`` over the targets != -100, so the engine averages over the
    global batch's target tokens, as transformers' Trainer and torchtune do (masked fine-tuning
    data; where nothing is masked and grad_accum is a power of two, bitwise the mean); False: each
    micro-batch's mean, averaged.
    """

    vocab_size: int = 256
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    seq_len: int = 128
    mlp_ratio: int = 4
    bias: bool = True
    attn_tiles: int = 1
    mlp_tiles: int = 1
    head_tiles: int = 1
    tie_embeddings: bool = False
    activation: str = "gelu"
    norm_eps: float = 1e-5
    hf_dtype: str | None = field(default=None, compare=False)
    token_loss: bool = True

    def __post_init__(self):
        ints = (
            "vocab_size",
            "d_model",
            "n_heads",
            "n_layers",
            "seq_len",
            "mlp_ratio",
            "attn_tiles",
            "mlp_tiles",
            "head_tiles",
        )
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"gpt.Config: {name} must be a positive int, got {value!r}")
        for name in ("bias", "tie_embeddings", "token_loss"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"gpt.Config: {name} must be a bool, got {getattr(self, name)!r}")
        if self.activation not in mlp.ACTIVATIONS:
            raise ValueError(
                f"gpt.Config: activation must be one of {sorted(mlp.ACTIVATIONS)}, "
                f"got {self.activation!r}"
            )
        if (
            isinstance(self.norm_eps, bool)
            or not isinstance(self.norm_eps, (int, float))
            or not self.norm_eps > 0
        ):
            raise ValueError(
                f"gpt.Config: norm_eps must be a positive float, got {self.norm_eps!r}"
            )
        if self.tie_embeddings and self.head_tiles != 1:
            raise ValueError(
                f"gpt.Config: a tied head (tie_embeddings=True) reads the untiled token embedding; "
                f"expected head_tiles=1, got {self.head_tiles}"
            )
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"gpt.Config: d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                f"(e.g. d_model={self.n_heads * max(1, self.d_model // self.n_heads)})"
            )
        limits = {
            "attn_tiles": self.d_model,
            "mlp_tiles": self.mlp_ratio * self.d_model,
            "head_tiles": self.vocab_size,
        }
        for name, limit in limits.items():
            if getattr(self, name) > limit:
                raise ValueError(
                    f"gpt.Config: {name}={getattr(self, name)} exceeds {limit}, the dimension it "
                    "splits"
                )


def model(cfg: Config) -> Model:
    """The GPT as three stages over ``cfg``; see the module docstring for trees and batches."""
    if not isinstance(cfg, Config):
        raise TypeError(f"gpt.model: expected a gpt.Config, got {type(cfg).__name__}")
    return bound_model(cfg, sys.modules[__name__], cfg.tie_embeddings)


def embed_init(cfg: Config, gen: torch.Generator) -> dict:
    """``{"tok": {"w": (V, D)}, "pos": {"w": (seq_len, D)}}``, both N(0, 0.02), fp32."""
    return {
        "tok": embedding.init(gen, cfg.vocab_size, cfg.d_model),
        "pos": embedding.init(gen, cfg.seq_len, cfg.d_model),
    }


def embed_apply(cfg: Config, params: dict, batch: dict):
    """Validate ``batch`` and return the carry ``tok[inputs] + pos[:T]``: (B, T, D) in the params'
    dtype; with ``batch["segments"]`` (packed examples) ``{"x": tok[inputs] + pos[each example's
    positions], "segments"}``."""
    check_batch(batch, cfg.seq_len)
    return _embed_tokens(params, batch["inputs"], batch.get("segments"))


# the weights of a block's linears, passed to ``linear.apply`` only: ``zf.Model.takes_lent``
LINEARS = ("attn.qkv.w", "attn.proj.w", "mlp.fc.w", "mlp.proj.w")


def block_init(cfg: Config, gen: torch.Generator, i: int) -> dict:
    """Layer ``i``'s tree (the same structure for every ``i``); output projections use
    0.02/sqrt(2L)."""
    if not 0 <= i < cfg.n_layers:
        raise ValueError(f"gpt.block_init: layer index must be in [0, {cfg.n_layers}), got {i}")
    d, proj_std = cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layers)
    return {
        "ln1": layernorm_init(d, cfg.bias, device=gen.device),
        "attn": attention.init(gen, d, cfg.bias, proj_std=proj_std, tiles=cfg.attn_tiles),
        "ln2": layernorm_init(d, cfg.bias, device=gen.device),
        "mlp": mlp.init(
            gen, d, cfg.mlp_ratio * d, cfg.bias, proj_std=proj_std, tiles=cfg.mlp_tiles
        ),
    }


def block_apply(cfg: Config, params: dict, carry):
    """Pre-norm residual block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``; (B, T, D) -> (B, T,
    D). A carry ``{"x", "segments"}`` (packed examples) attends within each example only and comes
    back so."""
    x, segments = packing.split(carry)
    mask = None if segments is None else packing.mask(segments)  # (B, 1, T, T)
    x = x + attention.apply(
        params["attn"], layernorm(params["ln1"], x, cfg.norm_eps), cfg.n_heads, mask
    )
    return packing.join(
        x + mlp.apply(params["mlp"], layernorm(params["ln2"], x, cfg.norm_eps), cfg.activation),
        segments,
    )


def head_init(cfg: Config, gen: torch.Generator) -> dict:
    """``{"ln_f": layernorm, "lm_head": {"w": (V, D)}}``: a bias-free output projection; tied:
    ``{"ln_f"}`` only (the engine puts the token embedding in as ``lm_head.w``)."""
    ln_f = layernorm_init(cfg.d_model, cfg.bias, device=gen.device)
    if cfg.tie_embeddings:
        return {"ln_f": ln_f}
    return {
        "ln_f": ln_f,
        "lm_head": linear.init(
            gen, cfg.d_model, cfg.vocab_size, bias=False, tiles=cfg.head_tiles, tile_axis=0
        ),
    }


def head_apply(cfg: Config, params: dict, x, batch: dict):
    """Mean next-token cross-entropy of ``batch["targets"]`` (a 0-d fp32 tensor; targets -100
    ignored); logits go to fp32 first. ``cfg.token_loss``: ``zf.TokenLoss`` (the summed
    cross-entropy, the target count)."""
    check_batch(batch, cfg.seq_len)
    x, _ = packing.split(x)  # a packed carry {"x", "segments"}
    targets = batch["targets"]
    if x.shape[:2] != targets.shape:
        raise ValueError(
            f"gpt.head_apply: carry is {tuple(x.shape)}, expected (B, T, D) with (B, T) = "
            f"{tuple(targets.shape)} from batch['targets']"
        )
    w = params["lm_head"]["w"]
    reduction = "sum" if cfg.token_loss else "mean"
    if not isinstance(w, torch.Tensor):  # tiled: logits one (B*T, V/T) tile at a time, never whole
        loss = tiling.linear_cross_entropy(
            layernorm(params["ln_f"], x, cfg.norm_eps), w, targets, reduction=reduction
        )
    else:
        logits = _head_logits(cfg, params, x).float()  # (B, T, V)
        loss = F.cross_entropy(
            logits.reshape(-1, cfg.vocab_size), targets.reshape(-1), reduction=reduction
        )  # (B*T, V) vs (B*T,)
    return TokenLoss(loss, count_targets(batch)) if cfg.token_loss else loss


def logits(
    params: dict, cfg: Config, inputs: torch.Tensor, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """Next-token logits (B, T, V) in fp32 over a full tree ``{"embed", "blocks": [...], "head"}``;
    ``segments`` (B, T): packed examples, each attending within itself."""
    check_tokens("inputs", inputs, cfg.seq_len)
    if len(params["blocks"]) != cfg.n_layers:
        raise ValueError(
            f"gpt.logits: expected {cfg.n_layers} block trees, got {len(params['blocks'])}"
        )
    x = _embed_tokens(params["embed"], inputs, segments)
    for layer_params in params["blocks"]:
        x = block_apply(cfg, layer_params, x)
    x, _ = packing.split(x)
    head = with_ties(
        TIED_HEAD if cfg.tie_embeddings else (), params["head"], params["embed"]
    )  # tied: embed.tok.w
    return _head_logits(cfg, head, x).float()


@torch.no_grad()
def generate(
    params: dict,
    cfg: Config,
    prompt: torch.Tensor,
    n_new: int,
    gen: torch.Generator | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Append ``n_new`` sampled tokens to ``prompt`` (B, T0): returns (B, T0 + n_new) on prompt's
    device.

    Each step sees only the last ``seq_len`` tokens. ``temperature`` > 0 samples from
    ``softmax(logits / temperature)`` with ``gen``; ``temperature == 0`` takes the argmax.
    """
    check_tokens("prompt", prompt, seq_len=None)
    if n_new < 0 or temperature < 0:
        raise ValueError(
            f"gpt.generate: expected n_new >= 0, temperature >= 0; got {n_new}, {temperature}"
        )
    tokens = prompt
    for _ in range(n_new):
        last = logits(params, cfg, tokens[:, -cfg.seq_len :])[:, -1, :]  # (B, V)
        if temperature == 0:
            nxt = last.argmax(dim=-1, keepdim=True)  # (B, 1)
        else:
            nxt = torch.multinomial(
                F.softmax(last / temperature, dim=-1), 1, generator=gen
            )  # (B, 1)
        tokens = torch.cat([tokens, nxt.to(tokens.dtype)], dim=1)
    return tokens


def _embed_tokens(params: dict, inputs: torch.Tensor, segments: torch.Tensor | None = None):
    t = inputs.shape[1]
    if segments is None:
        return embedding.apply(params["tok"], inputs) + params["pos"]["w"][:t]  # (B, T, D) + (T, D)
    x = (
        embedding.apply(params["tok"], inputs) + params["pos"]["w"][packing.positions(segments)]
    )  # (B, T, D) * 2
    return packing.join(x, segments)


def _head_logits(cfg: Config, params: dict, x: torch.Tensor) -> torch.Tensor:
    return linear.apply(params["lm_head"], layernorm(params["ln_f"], x, cfg.norm_eps))  # (B, T, V)
