"""Each functional layer against its ``torch.nn`` twin, and ``gpt.model`` against
``reference.RefGPT``.

Where both sides run the same torch ops on the same values (linear, embedding, norms, MLP, and the
whole GPT) outputs and gradients are compared bitwise; a tolerance appears only where the op order
really differs, with the reason next to it.
"""

from __future__ import annotations

import math

import optree
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import (
    MLP,
    CausalSelfAttention,
    RefGPT,
    grad_tree,
    load_tree,
    make_batches,
    names_from_tree,
    tree_from_module,
    tree_from_names,
    tree_to_state_dict,
)

from layers import attention, embedding, gpt, linear, mlp
from layers.norm import layernorm, layernorm_init, rmsnorm, rmsnorm_init
from zinf_fn.model import plain_loss

TINY = gpt.Config(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)


def full_tree(cfg: gpt.Config, seed: int = 0) -> dict:
    m = gpt.model(cfg)
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": m.embed.init(gen),
        "blocks": [m.block.init(gen, i) for i in range(m.n_layers)],
        "head": m.head.init(gen),
    }


def randomize(tree, seed: int = 1):
    """Same structure, every leaf random: so ones/zeros inits cannot hide a swapped weight and
    bias."""
    gen = torch.Generator().manual_seed(seed)
    return optree.tree_map(lambda t: torch.randn(t.shape, generator=gen) * 0.5, tree)


def _cotangent(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(2))


def functional_vjp(fn, tree: dict, x: torch.Tensor):
    """``fn(tree, x)``, then the gradients of ``<out, u>`` for a fixed random ``u``: (out, d_tree,
    d_x)."""
    params = optree.tree_map(lambda t: t.detach().clone().requires_grad_(True), tree)
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    out = fn(params, x)
    (out * _cotangent(out.shape)).sum().backward()
    return out.detach(), optree.tree_map(lambda p: p.grad, params), x.grad


def module_vjp(module: nn.Module, tree: dict, x: torch.Tensor):
    """Load ``tree`` into ``module`` (strict) and return the same triple as ``functional_vjp``."""
    module.load_state_dict(names_from_tree(tree), strict=True)
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    out = module(x)
    (out * _cotangent(out.shape)).sum().backward()
    return out.detach(), tree_from_names({n: p.grad for n, p in module.named_parameters()}), x.grad


def assert_bitwise(got, want):
    """Same tree structure and every tensor leaf bitwise equal (``None`` leaves must match)."""
    assert optree.tree_structure(got, none_is_leaf=True) == optree.tree_structure(
        want, none_is_leaf=True
    )
    for a, b in zip(
        optree.tree_leaves(got, none_is_leaf=True),
        optree.tree_leaves(want, none_is_leaf=True),
        strict=True,
    ):
        assert (a is None and b is None) or torch.equal(a, b), (a - b).abs().max()


def x_of(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(4))


# Where the functional layer calls the same torch op as the module on the same values (F.linear,
# F.embedding, F.layer_norm, F.rms_norm, SDPA), fp32 results are deterministic: compare bitwise.


@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_nn_linear(bias):
    tree = randomize(linear.init(torch.Generator().manual_seed(0), 8, 6, bias=bias))
    assert tree["w"].shape == (6, 8) and ("b" in tree) == bias
    x = x_of(3, 5, 8)
    assert_bitwise(
        functional_vjp(linear.apply, tree, x), module_vjp(nn.Linear(8, 6, bias=bias), tree, x)
    )


def test_linear_init_stats_and_zero_bias():
    p = linear.init(torch.Generator().manual_seed(0), 256, 128, std=0.05)
    assert p["w"].dtype == torch.float32 and torch.equal(p["b"], torch.zeros(128))
    assert (
        abs(p["w"].std().item() - 0.05) < 0.05 * 0.05
    )  # 32k samples: the std estimate is within ~0.4%


def test_embedding_matches_nn_embedding():
    tree = randomize(embedding.init(torch.Generator().manual_seed(0), 10, 4))
    idx = torch.tensor([[1, 3, 3], [9, 0, 1]])  # repeated ids: gradient rows must accumulate
    assert_bitwise(
        functional_vjp(embedding.apply, tree, idx), module_vjp(nn.Embedding(10, 4), tree, idx)
    )


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_matches_nn_layernorm(bias):
    tree = randomize(layernorm_init(8, bias=bias))
    x = x_of(2, 3, 8)
    assert_bitwise(
        functional_vjp(layernorm, tree, x),
        module_vjp(nn.LayerNorm(8, eps=1e-5, bias=bias), tree, x),
    )


def test_rmsnorm_matches_nn_rmsnorm():
    tree = randomize(rmsnorm_init(8))
    x = x_of(2, 3, 8)
    got = functional_vjp(rmsnorm, tree, x)
    assert_bitwise(got, module_vjp(nn.RMSNorm(8, eps=1e-5), tree, x))
    # The formula itself, in a different op order from the fused kernel: fp32 rounding, ~1e-6
    # relative.
    manual = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * tree["w"]
    torch.testing.assert_close(got[0], manual, rtol=1e-5, atol=1e-6)


def test_attention_matches_reference_module():
    tree = randomize(attention.init(torch.Generator().manual_seed(0), 32, proj_std=0.01), seed=3)
    x = x_of(2, 7, 32)
    got = functional_vjp(lambda p, x: attention.apply(p, x, n_heads=4), tree, x)
    # Only the head split differs (einops vs split+view: same values, different views), so bitwise.
    assert_bitwise(got, module_vjp(CausalSelfAttention(TINY), tree, x))


def test_attention_is_causal_softmax_attention():
    tree = randomize(attention.init(torch.Generator().manual_seed(0), 32), seed=3)
    x = x_of(2, 7, 32)
    q, k, v = (
        linear.apply(tree["qkv"], x).view(2, 7, 3, 4, 8).permute(2, 0, 3, 1, 4)
    )  # 3 x (B, H, T, Dh)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)  # (B, H, T, T)
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, 32)  # (B, T, D)
    want = linear.apply(tree["proj"], y)
    # SDPA's fused kernel orders the sums differently from this naive form: fp32 rounding only.
    torch.testing.assert_close(attention.apply(tree, x, n_heads=4), want, rtol=1e-5, atol=1e-5)


def test_mlp_matches_reference_module():
    tree = randomize(mlp.init(torch.Generator().manual_seed(0), 32, 128), seed=3)
    x = x_of(2, 7, 32)
    assert_bitwise(functional_vjp(mlp.apply, tree, x), module_vjp(MLP(TINY), tree, x))


@pytest.mark.parametrize("bias", [True, False])
def test_gpt_loss_and_grads_match_reference(bias):
    cfg = gpt.Config(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=16, bias=bias)
    m = gpt.model(cfg)
    full = randomize(full_tree(cfg), seed=5)
    full = optree.tree_map(lambda t: t * 0.2, full)  # keep activations in a realistic range
    batch = make_batches(cfg, 1, batch_size=3, seed=0)[0]
    ref = load_tree(RefGPT(cfg), full)

    params = optree.tree_map(lambda t: t.clone().requires_grad_(True), full)
    loss = plain_loss(m, params, batch)
    loss.backward()
    ref_loss = ref(batch["inputs"], batch["targets"])
    ref_loss.backward()

    # fp32 on both sides with the same ops in the same order: bitwise equal, not merely close.
    assert loss.shape == () and loss.dtype == torch.float32
    assert torch.equal(loss, ref_loss)
    assert_bitwise(optree.tree_map(lambda p: p.grad, params), grad_tree(ref))


def test_tree_state_dict_roundtrip_names():
    full = full_tree(TINY)
    sd = tree_to_state_dict(full)
    assert set(sd) == {n for n, _ in RefGPT(TINY).named_parameters()}
    assert sd["tok_emb.weight"] is full["embed"]["tok"]["w"]
    assert sd["blocks.1.attn.qkv.bias"] is full["blocks"][1]["attn"]["qkv"]["b"]
    assert sd["lm_head.weight"] is full["head"]["lm_head"]["w"]
    back = tree_from_module(load_tree(RefGPT(TINY), full))
    assert_bitwise(back, full)


def test_block_init_same_structure_every_layer_and_deterministic():
    cfg = gpt.Config(vocab_size=64, d_model=32, n_heads=4, n_layers=3, seq_len=16)
    m = gpt.model(cfg)
    gen = torch.Generator().manual_seed(0)
    trees = [m.block.init(gen, i) for i in range(cfg.n_layers)]
    shapes = [optree.tree_map(lambda t: (tuple(t.shape), t.dtype), t) for t in trees]
    assert all(s == shapes[0] for s in shapes)
    assert all(optree.tree_structure(t) == optree.tree_structure(trees[0]) for t in trees)
    assert trees[0]["attn"]["qkv"]["w"].shape == (96, 32) and trees[0]["mlp"]["fc"]["w"].shape == (
        128,
        32,
    )
    again = m.block.init(torch.Generator().manual_seed(0), 0)
    assert_bitwise(again, trees[0])
    with pytest.raises(ValueError, match="layer index"):
        m.block.init(gen, cfg.n_layers)


def test_embed_carry_follows_param_dtype():
    m = gpt.model(TINY)
    embed = optree.tree_map(
        lambda t: t.to(torch.bfloat16), m.embed.init(torch.Generator().manual_seed(0))
    )
    batch = make_batches(TINY, 1, batch_size=2, seed=0, seq_len=5)[0]
    x = m.embed.apply(embed, batch)
    assert x.shape == (2, 5, 32) and x.dtype == torch.bfloat16


def test_batch_validation_errors():
    m = gpt.model(TINY)
    embed = m.embed.init(torch.Generator().manual_seed(0))
    good = make_batches(TINY, 1, batch_size=2, seed=0)[0]
    with pytest.raises(TypeError, match="inputs"):
        m.embed.apply(embed, {**good, "inputs": good["inputs"].float()})
    with pytest.raises(TypeError, match="targets"):
        m.embed.apply(embed, {**good, "targets": good["targets"].float()})
    too_long = make_batches(TINY, 1, batch_size=2, seed=0, seq_len=TINY.seq_len + 1)[0]
    with pytest.raises(ValueError, match="seq_len"):
        m.embed.apply(embed, too_long)
    with pytest.raises(ValueError, match="same shape"):
        m.embed.apply(embed, {**good, "targets": good["targets"][:, :-1]})
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        m.embed.apply(embed, {"inputs": good["inputs"][0], "targets": good["targets"][0]})
    with pytest.raises(ValueError, match="missing"):
        m.embed.apply(embed, {"inputs": good["inputs"]})
    with pytest.raises(TypeError, match="dict"):
        m.embed.apply(embed, good["inputs"])


def test_config_validation():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        gpt.Config(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_layers"):
        gpt.Config(n_layers=0)
    with pytest.raises(TypeError, match="Config"):
        gpt.model({"d_model": 32})


def test_logits_agree_with_loss():
    m, full = gpt.model(TINY), full_tree(TINY)
    batch = make_batches(TINY, 1, batch_size=2, seed=1)[0]
    logits = gpt.logits(full, TINY, batch["inputs"])
    assert logits.shape == (2, TINY.seq_len, TINY.vocab_size) and logits.dtype == torch.float32
    want = F.cross_entropy(
        logits.reshape(-1, TINY.vocab_size), batch["targets"].reshape(-1)
    )  # (B*T, V)
    assert torch.equal(plain_loss(m, full, batch), want)


def test_generate_shape_crop_and_determinism():
    full = full_tree(TINY)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    n_new = 12  # 10 + 12 > seq_len 16: the context must be cropped
    out = gpt.generate(full, TINY, prompt, n_new, torch.Generator().manual_seed(0))
    assert out.shape == (1, prompt.shape[1] + n_new) and out.dtype == torch.long
    assert torch.equal(out[:, : prompt.shape[1]], prompt)
    assert 0 <= out.min() and out.max() < TINY.vocab_size
    assert torch.equal(
        out, gpt.generate(full, TINY, prompt, n_new, torch.Generator().manual_seed(0))
    )
    greedy = gpt.generate(full, TINY, prompt[:, :3], 1, temperature=0.0)
    assert greedy[0, -1] == gpt.logits(full, TINY, prompt[:, :3])[0, -1].argmax()
