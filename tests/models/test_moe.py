"""layers.moe and layers.moe_aux against transformers' sparse-MoE blocks and load-balancing loss.

Every family's block (Qwen3-MoE with and without renormalised top-k weights, Mixtral, OLMoE,
gpt-oss's GptOssMLP) gets the same fp32 weights and tokens as ours: 21 tokens over 6 experts, top-k
2 or 3. Tolerances: outputs and gradients are the same fp32 ops as HF's per expert; what differs is
the order of a few sums (a token's k expert outputs: HF adds them in expert order, ours in rank
order; the matmuls' reductions: gpt-oss's one fused (D, 2I) product split after, ours two (I, D)
products), a few ulps, so 1e-5 of the largest magnitude holds with a wide margin.
"""

from __future__ import annotations

import pytest
import torch
from moe_reference import FAMILIES, block_config, hf_block, hf_grads, hf_router, ours_from_hf_block
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from layers import moe, moe_aux
from zinf_fn.tiling import experts as tiling_experts

TOL = 1e-5  # relative to the largest magnitude; see the module docstring


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def tokens(seed: int = 1) -> torch.Tensor:
    """(3, 7, 16) fp32, scaled so that gpt-oss's clamp (limit 7) is reached."""
    return torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(seed)) * 3.0


def hf_apply(name: str, block, x: torch.Tensor) -> torch.Tensor:
    out = block(x)
    return out[0] if name == "gpt_oss" else out  # GptOssMLP returns (hidden, router_scores)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_block_equals_hf(name):
    block = hf_block(name)
    cfg = block_config(name)
    x = tokens()
    with torch.no_grad():
        want = hf_apply(name, block, x)
        got, logits = moe.apply(cfg, ours_from_hf_block(name, block), x)
    assert got.shape == want.shape and logits.shape == (21, cfg.n_experts)
    assert rel_err(got, want) <= TOL


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_router_equals_hf(name):
    block = hf_block(name)
    cfg = block_config(name)
    x = tokens().reshape(-1, 16)
    with torch.no_grad():
        want_logits, want_weights, want_experts = hf_router(name, block)(x)
        got = moe.route(cfg, ours_from_hf_block(name, block)["router"], x)
    assert torch.equal(got.experts, want_experts)  # the same logits, so the same top-k choices
    assert torch.equal(got.logits, want_logits)  # the same F.linear
    assert rel_err(got.weights, want_weights) <= TOL
    assert len(set(got.experts.reshape(-1).tolist())) > 1  # the batch spreads over several experts


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gradients_equal_hf(name):
    block = hf_block(name)
    cfg = block_config(name)
    tree = ours_from_hf_block(name, block)
    x_hf = tokens().requires_grad_(True)
    x_ours = tokens().requires_grad_(True)
    grad_out = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(2))
    (hf_apply(name, block, x_hf) * grad_out).sum().backward()
    leaves = [leaf.requires_grad_(True) for leaf in _leaves(tree)]
    y, _ = moe.apply(cfg, tree, x_ours)
    got = torch.autograd.grad((y * grad_out).sum(), [x_ours, *leaves])
    assert rel_err(got[0], x_hf.grad) <= TOL
    for ours, ref in zip(got[1:], _leaves(hf_grads(name, block)), strict=True):
        assert rel_err(ours, ref) <= TOL


def test_gpt_oss_clamp_is_reached():
    """The gpt-oss comparisons above run through the clamp, not only its linear part."""
    block = hf_block("gpt_oss")
    tree = ours_from_hf_block("gpt_oss", block)
    gate_up = torch.einsum("nd,eid->nei", tokens().reshape(-1, 16), tree["experts"]["gate_up"]["w"])
    gate = gate_up[..., : gate_up.shape[-1] // 2]  # (N, E, I): the gate rows come first
    assert (gate > block.experts.limit).any()


def test_each_expert_computes_only_its_tokens(monkeypatch):
    """Grouped dispatch: every expert runs once on exactly the tokens routed to it, never on all
    N."""
    name = "qwen3_moe"
    cfg = block_config(name)
    tree = ours_from_hf_block(name, hf_block(name))
    x = tokens().reshape(-1, 16)
    calls = []
    original = tiling_experts.expert_swiglu  # each expert of tiling.experts_swiglu's, in turn

    def recording(rows, gate_up, down, e):
        calls.append((e, rows.shape[0]))
        return original(rows, gate_up, down, e)

    monkeypatch.setattr(tiling_experts, "expert_swiglu", recording)
    with torch.no_grad():
        routing = moe.route(cfg, tree["router"], x)
        moe.experts_apply(cfg, tree["experts"], x, routing)
    chosen = torch.bincount(routing.experts.reshape(-1), minlength=cfg.n_experts).tolist()
    assert calls == [(e, count) for e, count in enumerate(chosen) if count]
    assert sum(count for _, count in calls) == x.shape[0] * cfg.top_k


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_aux_loss_equals_hf(name):
    """Three layers' router logits through the carry's accumulator equal HF's
    load_balancing_loss_func, value and gradient (HF sums counts and probabilities over layers
    before the product)."""
    cfg = block_config(name)
    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(21, cfg.n_experts, generator=gen).requires_grad_(True) for _ in range(3)]
    want = load_balancing_loss_func(tuple(logits), cfg.n_experts, cfg.top_k)
    want_grads = torch.autograd.grad(want, logits)
    stats = moe_aux.zeros_stats(cfg.n_experts)
    for layer_logits in logits:
        stats = moe_aux.accumulate(stats, layer_logits, cfg.top_k)
    got = moe_aux.aux_loss(stats, rows=3 * 21)
    assert rel_err(got, want) <= TOL
    for ours, ref in zip(torch.autograd.grad(got, logits), want_grads, strict=True):
        assert rel_err(ours, ref) <= TOL


def test_aux_accumulator_is_checked():
    with pytest.raises(ValueError, match="zeros_stats"):
        moe_aux.accumulate(moe_aux.zeros_stats(4), torch.zeros(5, 6), 2)


def _leaves(tree: dict) -> list[torch.Tensor]:
    """The tree's tensors in a fixed order (router, then gate_up, down; weight before bias)."""
    order = [("router",), ("experts", "gate_up"), ("experts", "down")]
    out = []
    for path in order:
        node = tree
        for key in path:
            node = node[key]
        out += [node[key] for key in ("w", "b") if key in node]
    return out
