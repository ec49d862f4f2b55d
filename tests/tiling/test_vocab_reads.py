"""What the vocabulary's tiled ops read: a frozen tiled head reads each tile once (its pull-back to
h is summed in forward, ``tiling.cross_entropy``), a tiled embedding's backward reads none
(``tiling.vocab``), counted on the op's source and on the engine's fetches; and the frozen head's
gradient equals ``F.cross_entropy``'s, its training the same across placements.

Tolerances. The frozen head's dh is the same fp32 products ``p_v W_v`` as F.cross_entropy's
backward summed in another order (a running sum over tiles, rescaled by exp(m_old - m_new), then
divided by the row's sum once): entries are O(1e-2) over a vocabulary of 67, so 1e-6 absolute is
~100 ulps of headroom over the few-ulp reassociation (as tests/tiling/test_tiling.py's head). The
loss is computed as before (1e-6 relative: the online log-sum-exp). Placements move storage only:
bitwise.
"""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
import torch.nn.functional as F
from engine_internals import log_fetches
from llama_reference import VOCAB_TILED, placement_config, train_untiled
from reference import make_batches
from tile_sources import RecordingSource

import zinf_fn as zf
from layers import llama, lora
from zinf_fn import tiling
from zinf_fn.tiling.layout import TileUnit


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def frozen_source(w: torch.Tensor, n_tiles: int) -> RecordingSource:
    """A recording source whose anchor takes no gradient: a frozen tiled weight, as the engine's."""
    src = RecordingSource(tiling.tile(w, n_tiles, axis=0))
    src.anchor = torch.zeros(0)
    return src


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n_tiles", [1, 4, 16])
def test_a_frozen_head_reads_each_tile_once_and_equals_cross_entropy(n_tiles, reduction):
    vocab, d = 67, 24  # prime: unequal tiles
    w, h = _rand(vocab, d, seed=7) * 0.5, _rand(3, 7, d, seed=8)
    targets = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(9))
    targets[0, :2] = -100
    src = frozen_source(w, n_tiles)
    ht = h.clone().requires_grad_(True)
    loss = tiling.linear_cross_entropy(ht, src, targets, reduction=reduction)
    forward = len(src.log)
    (3.0 * loss).backward()  # a loss gradient other than one
    assert [t for op, t in src.log if op == "fetch"] == list(range(n_tiles))
    assert src.log[forward:] == [] and src.grads == {}  # backward: no fetch, no tile gradient
    h0 = h.clone().requires_grad_(True)
    logits = F.linear(h0, w).reshape(-1, vocab)
    loss0 = F.cross_entropy(logits, targets.reshape(-1), reduction=reduction)
    (3.0 * loss0).backward()
    torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=0)
    # "sum": the entries are the mean's times the valid targets, and so is the bound
    scale = (targets != -100).sum().item() if reduction == "sum" else 1
    torch.testing.assert_close(ht.grad, h0.grad, rtol=0, atol=1e-6 * scale)


def test_frozen_plain_tiles_pull_back_as_the_source_does():
    """Tiles as tensors that take no gradient take the same path: dh equals the source's bitwise."""
    w, h = _rand(40, 8, seed=1), _rand(10, 8, seed=2)
    targets = torch.randint(0, 40, (10,), generator=torch.Generator().manual_seed(3))
    grads = []
    for weight in (tiling.tile(w, 4, axis=0), frozen_source(w, 4)):
        ht = h.clone().requires_grad_(True)
        tiling.linear_cross_entropy(ht, weight, targets).backward()
        grads.append(ht.grad)
    assert torch.equal(*grads)


def test_under_no_grad_a_frozen_head_makes_the_same_loss():
    w, h = _rand(40, 8, seed=1), _rand(10, 8, seed=2).requires_grad_(True)
    targets = torch.randint(0, 40, (10,), generator=torch.Generator().manual_seed(3))
    recorded = tiling.linear_cross_entropy(h, frozen_source(w, 4), targets)
    with torch.no_grad():
        plain = tiling.linear_cross_entropy(h, frozen_source(w, 4), targets)
    assert torch.equal(recorded.detach(), plain)


def test_a_tiled_embeddings_backward_fetches_no_tile():
    """The ids' tiles are fetched once, in forward; the backward writes every used tile's gradient
    (``F.embedding``'s, bitwise) without fetching any."""
    w = _rand(50, 8, seed=0)
    ids = torch.randint(0, 26, (3, 7), generator=torch.Generator().manual_seed(1))
    src = RecordingSource(tiling.tile(w, 4, axis=0))
    out = tiling.embedding(ids, src)
    forward = len(src.log)
    g = _rand(*out.shape, seed=2)
    out.backward(g)
    assert [op for op, _ in src.log[forward:]] == ["grad", "grad"]  # tiles 1, 0: no fetch
    whole = w.clone().requires_grad_(True)
    F.embedding(ids, whole).backward(g)
    grads = [src.grads.get(t, torch.zeros(13, 8)) for t in range(4)]
    assert torch.equal(torch.cat(grads)[: whole.shape[0]], whole.grad)


# -- the engine ------------------------------------------------------------------------------------

CFG = VOCAB_TILED
STEPS = 3


def lora_model(cfg: llama.Config) -> zf.Model:
    return lora.apply(llama.model(cfg), rank=2, alpha=4, targets=("attn.q", "attn.v"))


def counted_step(model: zf.Model, config: zf.Config) -> list[TileUnit]:
    """The vocabulary tiles the engine fetched in its second training step."""
    state = zf.init(model, zf.adamw(lr=3e-3), config, seed=0)
    batches = make_batches(CFG, 2, 4, seed=1)
    state, _ = zf.train_step(state, batches[0])
    log: list = []
    log_fetches(state, log)
    state, _ = zf.train_step(state, batches[1])
    zf.close(state)
    return [u for _, u in log if isinstance(u, TileUnit) and u.stage in ("embed", "head")]


def test_the_engine_reads_a_frozen_head_once_and_no_tile_for_an_embeddings_backward():
    """Counted on the engine's fetches: a frozen head's 4 tiles once a step, a trained one's twice
    (forward, then backward in reverse); a trained embedding's tiles once per unit fetch (the
    forward and its backward unit's recompute), none for its backward."""
    config = zf.Config(param_dtype=torch.float32, prefetch_depth=0)
    frozen = counted_step(lora_model(CFG), config)
    trained = counted_step(llama.model(CFG), config)
    head = [u.tile for u in frozen if u.stage == "head"]
    assert head == [0, 1, 2, 3]
    assert [u.tile for u in trained if u.stage == "head"] == [0, 1, 2, 3, 3, 2, 1, 0]
    embed = [u.tile for u in trained if u.stage == "embed"]
    assert embed == [0, 1, 2, 0, 1, 2]  # forward, then the backward unit's recompute
    assert [u.tile for u in frozen if u.stage == "embed"] == [0, 1, 2]  # frozen: forward only


def train(model: zf.Model, config: zf.Config):
    losses, final = train_untiled(model, config, CFG, STEPS)
    return losses, [x.numpy() for x in optree.tree_leaves(final)]


PLACEMENTS = ("none", "cpu", "nvme")


def test_a_frozen_tiled_head_trains_bitwise_across_placements(tmp_path):
    """LoRA over a tiled head and embedding: every placement trains bitwise the same."""
    results = []
    for placement in PLACEMENTS:
        (tmp_path / placement).mkdir()
        results.append(train(lora_model(CFG), placement_config(placement, tmp_path / placement)))
    for got in results[1:]:
        assert got[0] == results[0][0]
        assert all((x == y).all() for x, y in zip(got[1], results[0][1], strict=True))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_frozen_tiled_head_trains_as_the_whole_head(grad_accum, tmp_path):
    """Against the untiled head and embedding: losses within 1e-6 relative and weights within 1e-6
    (the reassociated dh, module docstring)."""
    whole = dataclasses.replace(CFG, head_tiles=1, embed_tiles=1)
    config = placement_config("cpu", tmp_path, grad_accum=grad_accum)
    got, want = (train(lora_model(cfg), config) for cfg in (CFG, whole))
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for x, y in zip(got[1], want[1], strict=True):
        assert abs(x - y).max() <= 1e-6
