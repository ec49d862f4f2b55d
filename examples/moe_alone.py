"""The ``--moe`` run's compute timed alone, in RAM, for its roofline: the step's active experts
(``active_experts_seconds``, what ``roofline_ratio`` divides by) and the rest of its compute
(``other_compute_seconds``: attention, norms, router and LoRA of every layer, the head and the
embedding), each as the step computes it on the step's tokens, timed the same way: the best of
``ROUNDS`` rounds (on a shared machine a round is often preempted, never shortened) over distinct
copies of the weights where the step reads more weights than the caches hold (``COLD_BYTES``).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import optree
import torch

from layers import decoder, llama, moe
from zinf_fn.formats import nf4_linear
from zinf_fn.model import Model, block_apply, is_trainable
from zinf_fn.planner.experts import touched_share
from zinf_fn.tiling import RowTiles
from zinf_fn.tiling.held import HeldTiles

# the bytes of distinct weights a timing reads (at most a layer's active experts, the head's
# tiles): more than the caches hold, as a step's weights come from RAM
COLD_BYTES = 256 << 20
ROUNDS = 10
ROUNDS_PER_ROWS = 3  # an expert timed at each of a step's row counts (up to ~32 of them)


def best_seconds(one_round: Callable[[], None], rounds: int = 0) -> float:
    """The fewest seconds ``one_round()`` took in ``rounds`` calls (``ROUNDS`` where 0)."""
    best = float("inf")
    for _ in range(rounds or ROUNDS):
        t0 = time.perf_counter()
        one_round()
        best = min(best, time.perf_counter() - t0)
    return best


def active_experts_seconds(
    cfg: llama.Config, tokens: int, lent: bool = False, routed: int = 0, rows: list[int] = ()
) -> float:
    """The compute of a step's active experts timed alone, each forward and backward (to its
    input) as the step computes them: ``moe.expert_apply``, which over a frozen NF4 base
    (``lent``) is one ``tiling.expert_swiglu`` node computing from each weight's NF4 codes
    (``formats.nf4_linear``), else ``F.linear`` in fp32. ``rows``: the rows of each expert call of
    the step (``moe_run.expert_rows``): each distinct count timed once and weighted by its calls
    (a product's time is not linear in its rows: flat while the decode of the codes dominates,
    then growing with the multiply-adds); else the ``routed`` experts the step computed (its
    ``experts_routed``; 0: the experts a layer's ``tokens`` touch under uniform routing, times the
    layers) on an equal share of the ``tokens * top_k`` rows each layer routes. Each round runs
    once over distinct copies of an expert's weights, as the step reads each active expert once,
    from RAM it was just fetched into, not from the cache (``COLD_BYTES`` of them: the cache a
    repeated expert would sit in is never the step's case)."""
    block = cfg.moe
    one = dataclasses.replace(block, n_experts=1, top_k=1, stream_experts=False)
    if rows:
        calls = collections.Counter(rows)
        kept = {r: _n_copies(block, lent, n, COLD_BYTES // 4) for r, n in calls.items()}
        copies = _copies(one, lent, max(kept.values()))  # made once, each count a prefix of them
        return sum(
            n * _expert_seconds(one, copies[: kept[r]], r, ROUNDS_PER_ROWS)
            for r, n in calls.items()
        )
    if not routed:
        share = touched_share(block.top_k, block.n_experts, tokens)
        routed = max(1, round(block.n_experts * share)) * cfg.n_layers
    mean = max(1, round(tokens * block.top_k * cfg.n_layers / routed))
    copies = _copies(one, lent, _n_copies(block, lent, routed, COLD_BYTES))
    return _expert_seconds(one, copies, mean, ROUNDS) * routed


def _n_copies(block: moe.Config, lent: bool, most: int, cold: int) -> int:
    """Distinct copies of an expert's weights a timing goes over: ``cold`` bytes of them, at most
    ``most`` (the calls it stands for), at least 1."""
    bytes_one = 3 * block.d_model * block.d_ff * (0.5 if lent else 4)
    return max(1, min(most, 1 + int(cold // bytes_one)))


def _copies(one: moe.Config, lent: bool, n: int) -> list[dict]:
    """``n`` distinct copies of one expert's weights (``one``: the block as a single expert)."""
    params = moe.init(one, torch.Generator().manual_seed(0))["experts"]
    return [_copy(params, lent) for _ in range(n)]


def _expert_seconds(one: moe.Config, copies: list[dict], rows: int, rounds: int) -> float:
    """One expert's forward and backward on ``rows`` rows: the best of ``rounds`` rounds over
    ``copies`` of its weights, per copy."""
    x = torch.randn(rows, one.d_model, requires_grad=True)

    def one_round():
        for expert in copies:
            moe.expert_apply(one, expert, 0, x).sum().backward()

    return best_seconds(one_round, rounds) / len(copies)


def _copy(params: dict, lent: bool) -> dict:
    """An expert's ``{"gate_up": {"w"}, "down": {"w"}}`` in memory of its own: each stacked weight
    (1, d_out, d_in) cloned, or with ``lent`` as the engine lends a frozen NF4 expert to its op
    (its bf16 values' NF4 codes, ``nf4_linear.CodedMatrix``, behind a frozen tile source)."""
    return {
        name: {"w": _codes(leaf["w"]) if lent else leaf["w"].clone()}
        for name, leaf in params.items()
    }


def _codes(w: torch.Tensor) -> HeldTiles:
    """One expert's stacked weight (1, d_out, d_in) as the engine lends a frozen NF4 expert to its
    op: its NF4 codes (``coded``) behind a tile source."""
    return HeldTiles(RowTiles((coded(w),)), torch.zeros(0))


def coded(w: torch.Tensor) -> nf4_linear.CodedMatrix:
    """A frozen weight as the engine lends it to its op as NF4: its bf16 values' codes."""
    return nf4_linear.CodedMatrix.of(w, torch.bfloat16)


def without_experts(cfg: llama.Config) -> llama.Config:
    """``cfg`` as one dense layer whose MLP is a width-1 stand-in: a block of it computes what a
    MoE layer computes besides its router and experts (attention, norms; LoRA, once applied)."""
    return dataclasses.replace(cfg, moe=None, d_ff=1, n_layers=1)


def other_compute_seconds(
    model: Model, cfg: llama.Config, shape: tuple[int, int], lent: bool = False
) -> float:
    """The step's compute besides its experts' products, timed alone in RAM on ``shape`` (B, T)
    tokens: ``cfg.n_layers`` x one layer's (``layer_seconds``; ``model`` is the run's model made
    over ``without_experts(cfg)``, ``lent``: its frozen linears lent as NF4 codes) plus the head's
    and the embedding's (``vocab_seconds``). Not in it: the experts' gather and scatter of their
    rows (``moe.experts_apply``'s sort, ``index_select``, ``cat``), the update and the engine's own
    work."""
    layer = layer_seconds(model, cfg.moe, shape, lent)
    return cfg.n_layers * layer + vocab_seconds(cfg, shape)


def layer_seconds(
    model: Model, block: moe.Config, shape: tuple[int, int], lent: bool = False
) -> float:
    """One layer's compute besides its experts, forward and backward (to its input and its
    trainable leaves) on ``shape`` (B, T) tokens: block 0 of ``model`` (``without_experts``) in
    fp32, its frozen linears as the step computes them (``lent``: their NF4 codes, as the engine
    lends those ``Model.takes_lent`` names to the fused kernels; else decoded from their codes),
    then ``block``'s router on its output."""
    gen = torch.Generator().manual_seed(0)
    params = with_grads(model, model.block.init(gen, 0), lent)
    router = {"w": torch.randn(block.n_experts, block.d_model, generator=gen) * block.init_std}
    apply = block_apply(model, 0)
    x = torch.randn(*shape, block.d_model, requires_grad=True)

    def one_round():
        y = apply(params, x)  # (B, T, D)
        routing = moe.route(block, router, y.reshape(-1, block.d_model))
        (y.sum() + routing.weights.sum()).backward()

    return best_seconds(one_round)


def with_grads(model: Model, tree: dict, lent: bool = False) -> dict:
    """Block 0's ``tree`` with its trainable leaves (``is_trainable``) requiring a gradient and,
    with ``lent``, the frozen ones the model takes lent (``Model.takes_lent``) as their NF4 codes
    (``coded``)."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree)
    for k, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
        key = ".".join(["blocks", "0", *map(str, path)])
        trains = is_trainable(model, key)
        leaf.requires_grad_(trains)
        if lent and not trains and _takes_lent(model, key, leaf):
            leaves[k] = coded(leaf)
    return optree.tree_unflatten(spec, leaves)


def _takes_lent(model: Model, key: str, leaf: torch.Tensor) -> bool:
    """Whether the engine lends frozen ``leaf`` (block 0's, at ``key``, stored NF4) to its op as
    its codes (``nf4_linear.lends_block_leaf``, the layout step's rule)."""
    shape = tuple(leaf.shape)
    return nf4_linear.lends_block_leaf(model.takes_lent, key, "nf4", shape, leaf.device, leaf.dtype)


def vocab_seconds(cfg: llama.Config, shape: tuple[int, int]) -> float:
    """The frozen head's forward and backward (``llama.head_apply``: its norm and
    ``tiling.linear_cross_entropy`` over bf16 row tiles lent as stored, as a LoRA run's head is)
    and the embedding's forward (``llama.embed_tokens``) on ``shape`` (B, T) tokens of byte ids.
    The head is timed over ``COLD_BYTES`` of its ``head_tiles`` tiles and scaled to all of them."""
    rows = -(-cfg.vocab_size // cfg.head_tiles)
    n = min(cfg.head_tiles, 1 + COLD_BYTES // (rows * cfg.d_model * 2))
    part = dataclasses.replace(cfg, vocab_size=n * rows, head_tiles=n, embed_tiles=n)
    gen = torch.Generator().manual_seed(0)
    tiles = RowTiles(tuple(_bf16_rows(rows, cfg, gen) for _ in range(n)))
    head = {"norm": decoder.norm_init(cfg.d_model, cfg.norm_style), "lm_head": {"w": tiles}}
    ids = torch.randint(0, min(256, n * rows), shape, generator=gen)
    batch = {"inputs": ids, "targets": ids.roll(-1, dims=1)}
    x = torch.randn(*shape, cfg.d_model, requires_grad=True)

    def head_round():
        loss = llama.head_apply(part, head, x, batch)
        (loss.sum if cfg.token_loss else loss).backward()

    def embed_round():
        llama.embed_tokens(part, tiles, ids)

    return best_seconds(head_round) * cfg.head_tiles / n + best_seconds(embed_round)


def _bf16_rows(rows: int, cfg: llama.Config, gen: torch.Generator) -> torch.Tensor:
    """A (rows, D) tile ~ N(0, init_std) stored in bf16, as the frozen head's tiles are."""
    w = torch.randn(rows, cfg.d_model, generator=gen).mul_(cfg.init_std)
    return w.to(torch.bfloat16)
