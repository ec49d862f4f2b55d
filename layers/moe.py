"""A mixture-of-experts feed-forward block: a top-k router and E SwiGLU experts, grouped by expert.

The tree, E experts of width I over a model of width D (the ``nn.Linear`` layout, one expert a slice
along dim 0 of every expert leaf, so a layout can cut the leaves by expert and fetch experts as
units)::

    {"router":  {"w": (E, D), "b"?: (E,)},
     "experts": {"gate_up": {"w": (E, 2I, D), "b"?: (E, 2I)},   # gate rows first, then up
                 "down":    {"w": (E, D, I), "b"?: (E, D)}}}

``gate_up`` is the layout transformers 5 holds Qwen3-MoE, Mixtral and OLMoE experts in
(``experts.gate_up_proj``), one product per expert for both halves; it is also the tensor PEFT's
``target_parameters`` adapts, so a LoRA on ``gate_up`` maps onto PEFT's one to one.

Routing, as transformers computes it (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``,
``OlmoeTopKRouter``, ``GptOssTopKRouter``): logits ``x @ router.w.T (+ router.b)``; then either a
softmax over the E experts in fp32, the top-k of those probabilities, renormalised to sum 1 when
``norm_topk_prob``; or (gpt-oss, ``softmax_after_topk``) the top-k of the logits and a softmax over
those k. Expert e computes ``down(act(gate(x)) * up(x))`` on the tokens routed to it only (never a
dense all-experts product): ``act = silu``, or gpt-oss's clamped form when ``swiglu_limit`` is set
(``clamped_swiglu``). Each token's output is the routing-weighted sum of its k experts' outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from layers import linear
from zinf_fn import tiling


@dataclass(frozen=True)
class Config:
    """One MoE block's hyper-parameters (HF names in brackets); ints positive, top_k <= n_experts.

    n_experts [num_experts, num_local_experts], top_k [num_experts_per_tok], d_model [hidden_size],
    d_ff [moe_intermediate_size, intermediate_size: one expert's width], norm_topk_prob
    [norm_topk_prob; Mixtral always True], softmax_after_topk (gpt-oss: softmax over the k chosen
    logits), router_bias and expert_bias (gpt-oss: biases on the router and on every expert
    projection), swiglu_limit [swiglu_limit; None: plain SwiGLU] and swiglu_alpha (gpt-oss's clamped
    SwiGLU; the alpha 1.702 is transformers' constant), init_std [initializer_range];
    stream_experts: every expert of the stacked weights is a tile of its own (a fetch unit of the
    engine), each initialised alone (``init``).
    """

    n_experts: int = 4
    top_k: int = 2
    d_model: int = 64
    d_ff: int = 32
    norm_topk_prob: bool = False
    softmax_after_topk: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    init_std: float = 0.02
    stream_experts: bool = False

    def __post_init__(self):
        for name in ("n_experts", "top_k", "d_model", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"moe.Config: {name} must be a positive int, got {value!r}")
        if self.top_k > self.n_experts:
            raise ValueError(
                f"moe.Config: top_k={self.top_k} exceeds n_experts={self.n_experts}; "
                "a token is routed to at most every expert"
            )
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(
                f"moe.Config: swiglu_limit must be > 0 or None, got {self.swiglu_limit}"
            )


class Routing(NamedTuple):
    """A router's decision for N tokens: ``logits`` (N, E) in the input's dtype (what the aux loss
    reads), ``weights`` (N, k) in the input's dtype and ``experts`` (N, k) int64, expert
    ``experts[n, j]`` weighted by ``weights[n, j]``."""

    logits: torch.Tensor
    weights: torch.Tensor
    experts: torch.Tensor


def init(cfg: Config, gen: torch.Generator) -> dict:
    """The block's tree (module docstring) in fp32: matrices N(0, init_std), biases 0.

    Each expert's slice of a stacked weight is drawn from a generator of its own, seeded from
    ``gen`` (``expert_seeds``), so the values do not depend on how the experts are held: with
    ``stream_experts`` the stacked weights are ``RowTiles`` of one ``tiling.Deferred`` tile per
    expert (made one at a time by ``zf.init``, never the whole layer), equal bitwise to the slices
    of the stacked tensors of the same seed without it.
    """
    e, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff
    router = linear.init(gen, d, e, bias=cfg.router_bias, std=cfg.init_std)
    return {
        "router": router,
        "experts": {
            "gate_up": _stacked_init(cfg, expert_seeds(gen, e), 2 * f, d, gen.device),
            "down": _stacked_init(cfg, expert_seeds(gen, e), d, f, gen.device),
        },
    }


def expert_seeds(gen: torch.Generator, n_experts: int) -> torch.Tensor:
    """One seed per expert for one stacked weight, (E,) int64 drawn from ``gen`` (advancing it);
    read only when an expert is made, so a streamed tree's shapes can be learnt on fake tensors."""
    return torch.randint(0, 2**62, (n_experts,), generator=gen, device=gen.device)


def _stacked_init(
    cfg: Config, seeds: torch.Tensor, d_out: int, d_in: int, device: torch.device
) -> dict:
    """E linears stacked along dim 0: ``{"w": (E, d_out, d_in) ~ N(0, init_std), "b"?: (E,
    d_out)}``, biases zero; expert e's slice of ``w`` made by ``_expert_weight`` from ``seeds[e]``,
    a ``tiling.Deferred`` tile of shape (1, d_out, d_in) each with ``stream_experts``."""
    shape = (1, d_out, d_in)
    makers = [
        partial(_expert_weight, seeds, e, shape, cfg.init_std, device) for e in range(len(seeds))
    ]
    if cfg.stream_experts:
        w = tiling.RowTiles(tuple(tiling.Deferred(shape, make) for make in makers))
    else:
        w = torch.empty(len(seeds), d_out, d_in, device=device, dtype=torch.float32)
        for e, make in enumerate(makers):
            w[e : e + 1] = make()
    if not cfg.expert_bias:
        return {"w": w}
    return {"w": w, "b": torch.zeros(len(seeds), d_out, device=device, dtype=torch.float32)}


def _expert_weight(
    seeds: torch.Tensor, e: int, shape: tuple[int, ...], std: float, device: torch.device
) -> torch.Tensor:
    """Expert ``e``'s weight ``shape`` ~ N(0, std) in fp32, from a generator seeded with
    ``seeds[e]``."""
    gen = torch.Generator(device=device).manual_seed(int(seeds[e]))
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(std)


def route(cfg: Config, params: dict, x: torch.Tensor) -> Routing:
    """The router's choice for tokens ``x`` (N, D); ``params``: ``{"w", "b"?}``."""
    logits = linear.apply(params, x)  # (N, E)
    if cfg.softmax_after_topk:
        top, experts = torch.topk(logits, cfg.top_k, dim=-1)  # 2 x (N, k)
        return Routing(logits, F.softmax(top, dim=1, dtype=top.dtype), experts)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
    top, experts = torch.topk(probs, cfg.top_k, dim=-1)  # 2 x (N, k)
    if cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return Routing(logits, top.to(logits.dtype), experts)


def apply(cfg: Config, params: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, logits)``: the block over ``x`` (..., D) -> y (..., D), and the router logits (N, E) of
    its N = prod(...) tokens (for ``layers.moe_aux``)."""
    tokens = x.reshape(-1, x.shape[-1])  # (N, D)
    routing = route(cfg, params["router"], tokens)
    y = experts_apply(cfg, params["experts"], tokens, routing)  # (N, D)
    return y.reshape(x.shape), routing.logits


def experts_apply(cfg: Config, params: dict, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each expert on its own tokens: (N, D) -> (N, D), the ``routing.weights``-weighted sum over
    each token's k experts.

    The N*k (token, expert) pairs are grouped by expert (stable: token order kept within an
    expert), the experts in the order they are computed (``tiling.will_use``'s: increasing, or, for
    the engine's streamed experts, those whose fetches it started first ahead of the others; each
    expert computes the same rows whatever the order, so the result does not depend on it);
    their rows are gathered into that order at once (``index_select`` by the permutation), expert e
    computes only its slice of them, and experts no token chose are never touched. The weighted
    outputs go back to pair order by a gather with the inverse permutation and are summed over each
    token's k pairs. Both gathers are by permutations, whose gradients write each row once, and a
    token's k rows are summed in a fixed order: no scatter-add of repeated indices, so the result
    and its gradient are the same on every run and device (``index_add``'s atomics on CUDA are not).
    Streamed experts are told which experts come, in order, before the first (``tiling.will_use``:
    over several data-parallel ranks every rank computes the union of their experts, some on no
    rows, as each expert's fetch is a collective).
    """
    n, k = routing.experts.shape
    flat = routing.experts.reshape(-1)  # (N*k,) expert of pair p = n*k + j
    # sync: the per-expert counts decide the slices, so they come to the host once per block
    counts = torch.bincount(flat, minlength=cfg.n_experts).tolist()
    used = [e for e, count in enumerate(counts) if count]
    # streamed experts: the union of every data-parallel rank's (an expert may have no rows here),
    # in the order they are computed (the engine's: those whose fetches it started first)
    used = tiling.will_use((params["gate_up"]["w"], params["down"]["w"]), used)
    place = torch.full((cfg.n_experts,), cfg.n_experts, dtype=torch.long)
    place[list(used)] = torch.arange(len(used))
    order = torch.argsort(place[flat], stable=True)  # (N*k,) pairs grouped by expert, in turn
    # every pair's row at once, in the sorted order (a permutation: its backward writes each row
    # once, then sums a token's k rows), expert e's rows a slice of it: not one zero-filled (N, D)
    # gradient and one index_add per expert
    pairs_x = x.unsqueeze(1).expand(n, k, x.shape[-1]).reshape(n * k, -1)  # (N*k, D) pair order
    # the used experts' rows in turn: every pair's (an unused expert has none)
    outputs = routed_apply(cfg, params, pairs_x.index_select(0, order), used, counts)
    weights = routing.weights.reshape(-1).index_select(0, order)  # (N*k,) in the sorted order
    weighted = (outputs * weights[:, None]).to(x.dtype)  # (N*k, D) in sorted order
    pairs = weighted.index_select(0, torch.argsort(order))  # (N*k, D) back in pair order
    return pairs.reshape(n, k, -1).sum(dim=1)  # (N, D)


_LINEARS = ("gate_up", "down")  # an expert's stacked linears, in the order it applies them


def routed_apply(
    cfg: Config, params: dict, x: torch.Tensor, used: Sequence[int], counts: Sequence[int]
) -> torch.Tensor:
    """The ``used`` experts (in the order given) each on its rows of x (M, D), ``counts[e]`` rows of
    expert e in turn -> (M, D); one ``tiling.experts_swiglu`` where the experts are their two
    weights and the activation plain silu (then one op over a layer's frozen experts, two computed
    at once), ``expert_apply`` expert by expert elsewhere."""
    rows = [counts[e] for e in used]
    if _plain_swiglu(cfg, params):
        return tiling.experts_swiglu(x, rows, params["gate_up"]["w"], params["down"]["w"], used)
    split = torch.split(x, rows)
    outs = [expert_apply(cfg, params, e, r) for e, r in zip(used, split, strict=True)]
    return torch.cat(outs) if outs else x.new_zeros(x.shape)


def _plain_swiglu(cfg: Config, params: dict) -> bool:
    """Whether an expert is its two weights only and the activation plain silu."""
    return cfg.swiglu_limit is None and all(set(params[name]) == {"w"} for name in _LINEARS)


def expert_apply(cfg: Config, params: dict, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` (slice e of every leaf) on its tokens x (n, D): ``down(act(gate) * up)``; one
    ``tiling.expert_swiglu`` where the expert is its two weights and the activation plain silu
    (then one op over a frozen expert's weights, ``tiling.experts``)."""
    if _plain_swiglu(cfg, params):
        return tiling.expert_swiglu(x, params["gate_up"]["w"], params["down"]["w"], e)
    gate, up = _expert_linear(params["gate_up"], e, x).chunk(2, dim=-1)  # 2 x (n, I)
    if cfg.swiglu_limit is None:
        hidden = F.silu(gate) * up
    else:
        hidden = clamped_swiglu(gate, up, cfg.swiglu_limit, cfg.swiglu_alpha)
    return _expert_linear(params["down"], e, hidden)


def _expert_linear(params: dict, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s slice of a stacked linear ``{"w": (E, out, in), "b"?: (E, out)}`` over x
    (n, in) -> (n, out). With LoRA leaves ``"lora_a"`` (E, r, in), ``"lora_b"`` (E, out, r) and the
    float ``"lora_scale"`` (``layers.moe_lora``) it adds ``(x @ A[e].T @ B[e].T) * scale``, what
    PEFT's ``target_parameters`` adapter adds to the stacked tensor, expert by expert."""
    bias = params["b"][e] if "b" in params else None
    y = tiling.expert_linear(x, params["w"], e, bias)  # F.linear(x, w[e], bias)
    if "lora_a" not in params:
        return y
    scale = params.get("lora_scale")
    if not isinstance(scale, float):
        raise ValueError(
            f"moe: an expert linear with LoRA leaves needs the float 'lora_scale' "
            f"(alpha / rank) in its dict, got {scale!r}"
        )
    low_rank = F.linear(x, params["lora_a"][e])  # (n, r)
    return y + F.linear(low_rank, params["lora_b"][e]) * scale


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float
) -> torch.Tensor:
    """gpt-oss's activation (``GptOssExperts._apply_gate``): gate clamped above at ``limit``, up to
    ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``; shape of ``gate``."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu
