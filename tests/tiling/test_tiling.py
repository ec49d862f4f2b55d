"""Tiled ops (``zinf_fn.tiling``) against their untiled torch twins, without the engine.

Tolerances. A tiled op runs the same fp32 products as the untiled one; only the order of the sums
differs (tiles over input features split each dot product into T partial sums; tiles over output
features split the sums of the input gradient; BLAS picks blockings by shape). For a sum of K terms
both orders are within gamma_K = K * u * sum|terms| of the exact value (u = 2**-24, Higham's bound),
so every element is compared against ``2 * K * u * (|a| @ |b|)``: the rigorous bound, computed from
the operands, instead of a guessed rtol. The tiled head's online log-sum-exp rescales running sums
by exp(m_old - m_new) once per tile: a few ulps of the loss, checked at 1e-6 relative.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F
from tile_sources import LendingSource, RecordingSource
from torch.utils._python_dispatch import TorchDispatchMode

from layers import gpt, linear
from zinf_fn import tiling
from zinf_fn.model import plain_loss

U = 2.0**-24


def assert_within_sum_bound(got, want, abs_product, k):
    """|got - want| <= 2 K u (|a| @ |b|) elementwise (+ one ulp of the value for the final
    rounding)."""
    bound = 2 * k * U * abs_product + U * want.abs() + 1e-30
    excess = ((got - want).abs() - bound).max()
    assert excess <= 0, f"exceeds the fp32 summation bound by {excess}"


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _linear_case(d_in, d_out, n_tiles, axis, seed=0):
    w, b, x = (
        _rand(d_out, d_in, seed=seed),
        _rand(d_out, seed=seed + 1),
        _rand(3, 5, d_in, seed=seed + 2),
    )
    u = _rand(3, 5, d_out, seed=seed + 3)  # a fixed cotangent
    tiled = tiling.tile(w, n_tiles, axis)
    tiles = [t.clone().requires_grad_(True) for t in tiled.tiles]
    xt = x.clone().requires_grad_(True)
    y = tiling.linear(xt, type(tiled)(tuple(tiles)), b)
    (y * u).sum().backward()
    w0, x0 = w.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y0 = F.linear(x0, w0, b)
    (y0 * u).sum().backward()
    return (
        (x, w, u),
        (y, xt.grad, torch.cat([t.grad for t in tiles], dim=axis)),
        (y0, x0.grad, w0.grad),
    )


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("n_tiles", [1, 2, 4, 16])
def test_tiled_linear_equals_f_linear(axis, n_tiles):
    """37 -> 53 features: neither divides by 2, 4 or 16, so the tiles differ in size."""
    (x, w, u), (y, dx, dw), (y0, dx0, dw0) = _linear_case(37, 53, n_tiles, axis)
    x2, u2 = x.reshape(-1, 37), u.reshape(-1, 53)
    assert_within_sum_bound(y, y0, (x.abs() @ w.abs().T), k=37)
    assert_within_sum_bound(dx, dx0, (u.abs() @ w.abs()), k=53)
    assert_within_sum_bound(dw, dw0, (u2.abs().T @ x2.abs()), k=15)
    assert [t.shape[axis] for t in tiling.tile(w, n_tiles, axis).tiles] == tiling.tile_sizes(
        w.shape[axis], n_tiles
    )


def test_tiled_linear_under_func_vjp():
    """The Functions are setup_context style, so torch.func.vjp works too (the engine pulls back
    with plain autograd, ``scan.tape.pull_back``) and gives the same grads."""
    w, x = _rand(20, 12, seed=1), _rand(6, 12, seed=2)
    tiled = tiling.tile(w, 3, axis=1)
    out, vjp_fn = torch.func.vjp(
        lambda ts, x: tiling.linear(x, tiling.ColTiles(tuple(ts))), list(tiled.tiles), x
    )
    d_tiles, dx = vjp_fn(torch.ones_like(out))
    assert_within_sum_bound(
        torch.cat(d_tiles, dim=1), torch.ones(6, 20).T @ x, torch.ones(20, 6) @ x.abs(), k=6
    )
    assert_within_sum_bound(dx, torch.ones(6, 20) @ w, torch.ones(6, 20) @ w.abs(), k=20)


def test_source_tiles_fetched_one_at_a_time_and_grads_emitted_per_tile():
    w, x = _rand(40, 24, seed=3), _rand(4, 24, seed=4)
    src = RecordingSource(tiling.tile(w, 4, axis=0))
    y = tiling.linear(x.clone().requires_grad_(True), src)
    y.sum().backward()
    fwd = [e for t in range(4) for e in (("fetch", t), ("release", t))]
    bwd = [e for t in reversed(range(4)) for e in (("fetch", t), ("grad", t), ("release", t))]
    assert src.log == fwd + bwd and src.peak_live == 1
    full = torch.cat([src.grads[t] for t in range(4)])
    assert_within_sum_bound(full, torch.ones(4, 40).T @ x, torch.ones(40, 4) @ x.abs(), k=4)


@pytest.mark.parametrize("axis", [0, 1])
def test_source_gradients_written_into_lent_buffers(axis):
    """The op writes each tile's gradient into the buffer ``grad_out`` lends (no copy), and asks for
    it only after its last read of that tile (the engine lends the tile's own buffer), so the values
    are those of F.linear."""
    w, x, u = _rand(40, 24, seed=3), _rand(4, 24, seed=4), _rand(4, 40, seed=5)
    src = LendingSource(tiling.tile(w, 4, axis=axis))
    xt = x.clone().requires_grad_(True)
    (tiling.linear(xt, src) * u).sum().backward()
    bwd = [
        e
        for t in reversed(range(4))
        for e in (("fetch", t), ("grad_out", t), ("grad", t), ("release", t))
    ]
    assert src.log[8:] == bwd and src.peak_live == 1
    full = torch.cat([src.grads[t] for t in range(4)], dim=axis)
    assert_within_sum_bound(full, u.T @ x, u.abs().T @ x.abs(), k=4)
    assert_within_sum_bound(xt.grad, u @ w, u.abs() @ w.abs(), k=40)


def test_source_op_stays_on_tape_when_its_input_needs_no_grad():
    """The anchor input keeps a tiled op in the graph: its tiles get gradients even for a constant
    input."""
    src = RecordingSource(tiling.tile(_rand(8, 6, seed=5), 2, axis=1))
    y = tiling.linear(_rand(3, 6, seed=6), src)  # the input does not require grad
    assert y.requires_grad
    y.sum().backward()
    assert sorted(src.grads) == [0, 1] and src.anchor.grad.shape == (0,)


@pytest.mark.parametrize("axis", [0, 1])
def test_checkpoint_recompute_stops_before_a_source_linear_it_does_not_need(axis):
    """Under ``torch.utils.checkpoint`` (non-reentrant, what ``scan.tape`` records a block with) the
    recompute stops once every saved tensor exists again: a source linear's input is saved before
    its tiled forward runs (``_SaveInput``), so a trailing linear is never recomputed: no tile is
    fetched for it in backward but its backward's own. Gradients within the summation bound of
    F.linear's, as in the plain case."""
    w, x, u = _rand(40, 24, seed=3), _rand(4, 24, seed=4), _rand(4, 40, seed=5)
    src = RecordingSource(tiling.tile(w, 4, axis=axis))
    xt = x.clone().requires_grad_(True)
    y = torch.utils.checkpoint.checkpoint(
        lambda v: tiling.linear(torch.tanh(v), src), xt, use_reentrant=False
    )
    (y * u).sum().backward()
    fwd = [e for t in range(4) for e in (("fetch", t), ("release", t))]
    bwd = [e for t in reversed(range(4)) for e in (("fetch", t), ("grad", t), ("release", t))]
    assert src.log == fwd + bwd  # no recompute fetches between them
    h = torch.tanh(x)
    full = torch.cat([src.grads[t] for t in range(4)], dim=axis)
    assert_within_sum_bound(full, u.T @ h, u.abs().T @ h.abs(), k=4)
    dh = (1 - h * h) * (u @ w)
    assert_within_sum_bound(xt.grad, dh, (1 - h * h) * (u.abs() @ w.abs()), k=40)


def _head_case(n_tiles, vocab=67, d=24):
    w, h = _rand(vocab, d, seed=7) * 0.5, _rand(3, 7, d, seed=8)
    targets = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(9))
    targets[0, :2] = -100  # ignored positions, as F.cross_entropy's default ignore_index
    tiled = tiling.tile(w, n_tiles, axis=0)
    tiles = [t.clone().requires_grad_(True) for t in tiled.tiles]
    ht = h.clone().requires_grad_(True)
    loss = tiling.linear_cross_entropy(ht, tiling.RowTiles(tuple(tiles)), targets)
    loss.backward()
    w0, h0 = w.clone().requires_grad_(True), h.clone().requires_grad_(True)
    loss0 = F.cross_entropy(F.linear(h0, w0).reshape(-1, vocab), targets.reshape(-1))
    loss0.backward()
    return (loss, ht.grad, torch.cat([t.grad for t in tiles])), (loss0, h0.grad, w0.grad)


@pytest.mark.parametrize("n_tiles", [1, 2, 4, 16])
def test_tiled_head_equals_cross_entropy_on_full_logits(n_tiles):
    """Vocabulary 67 (prime): every T gives unequal tiles; 2 of 21 targets are ignore_index.

    Loss: online vs two-pass log-sum-exp, a few ulps (1e-6 relative). Gradients: softmax - onehot
    per tile, times W or h: the products are those of F.cross_entropy's backward up to the sum order
    over the vocabulary (for dh, K=67) or the tokens (for dW, K=21); entries are O(1e-2), so 1e-6
    absolute is ~100 ulps of headroom over the observed few-ulp differences.
    """
    (loss, dh, dw), (loss0, dh0, dw0) = _head_case(n_tiles)
    torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=0)
    torch.testing.assert_close(dh, dh0, rtol=0, atol=1e-6)
    torch.testing.assert_close(dw, dw0, rtol=0, atol=1e-6)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward run through dispatch)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_tiled_head_never_makes_full_logits():
    vocab, d, n = 512, 16, 64
    w, h = _rand(vocab, d, seed=10), _rand(n, d, seed=11).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(12))
    src = RecordingSource(tiling.tile(w, 16, axis=0))
    with LargestTensor() as mode:
        tiling.linear_cross_entropy(h, src, targets).backward()
    assert mode.largest <= n * (vocab // 16)  # one (N, V/T) tile of logits at most, never (N, V)
    assert sorted(src.grads) == list(range(16)) and src.peak_live == 1
    with LargestTensor() as untiled:
        F.cross_entropy(F.linear(h, w), targets).backward()
    assert untiled.largest == n * vocab  # the twin does make them: the probe can see it


def test_tile_untile_roundtrip_and_errors():
    w = _rand(10, 7, seed=13)
    for axis in (0, 1):
        for n in (1, 3, 7):
            assert torch.equal(tiling.untile(tiling.tile(w, n, axis)), w)
    with pytest.raises(ValueError, match="n_tiles"):
        tiling.tile(w, 8, axis=1)
    with pytest.raises(ValueError, match="features"):
        tiling.linear(_rand(2, 5, seed=1), tiling.tile(w, 2, axis=0))
    with pytest.raises(ValueError, match="rows"):
        tiling.linear_cross_entropy(
            _rand(2, 7, seed=1), tiling.tile(w, 2, axis=1), torch.zeros(2, dtype=torch.long)
        )


def test_layers_linear_init_tiles_same_values():
    a = linear.init(torch.Generator().manual_seed(0), 12, 20, tiles=4, tile_axis=1)
    b = linear.init(torch.Generator().manual_seed(0), 12, 20)
    assert isinstance(a["w"], tiling.ColTiles) and len(a["w"].tiles) == 4
    assert torch.equal(tiling.untile(a["w"]), b["w"]) and torch.equal(a["b"], b["b"])


def untile_tree(tree):
    return optree.tree_map(tiling.untile, tree, is_leaf=tiling.is_tiled)


def test_tiled_gpt_plain_loss_equals_untiled():
    """The GPT with every knob tiled (non-divisible: 96/5, 128/3, 64/7) vs the same values
    untiled."""
    base = gpt.Config(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    tiled_cfg = gpt.Config(**{**base.__dict__, "attn_tiles": 5, "mlp_tiles": 3, "head_tiles": 7})
    batch = {"inputs": torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))}
    batch["targets"] = batch["inputs"].roll(-1, dims=1)
    trees = {}
    for name, cfg in (("tiled", tiled_cfg), ("plain", base)):
        m, gen = gpt.model(cfg), torch.Generator().manual_seed(0)
        full = {
            "embed": m.embed.init(gen),
            "blocks": [m.block.init(gen, i) for i in range(2)],
            "head": m.head.init(gen),
        }
        params = optree.tree_map(lambda t: t.clone().requires_grad_(True), full)
        loss = plain_loss(m, params, batch)
        loss.backward()
        trees[name] = (
            loss,
            untile_tree(optree.tree_map(lambda p: p.grad, params)),
            untile_tree(full),
        )
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            optree.tree_leaves(trees["tiled"][2]),
            optree.tree_leaves(trees["plain"][2]),
            strict=True,
        )
    )
    # Sum-order differences through 2 blocks: observed <= 1e-7 on the loss, grads O(1e-2) within
    # 1e-6.
    torch.testing.assert_close(trees["tiled"][0], trees["plain"][0], rtol=1e-6, atol=0)
    for a, b in zip(
        optree.tree_leaves(trees["tiled"][1]), optree.tree_leaves(trees["plain"][1]), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_gpt_config_tile_limits():
    with pytest.raises(ValueError, match="head_tiles"):
        gpt.Config(vocab_size=16, head_tiles=17)
    with pytest.raises(ValueError, match="attn_tiles"):
        gpt.Config(attn_tiles=0)
