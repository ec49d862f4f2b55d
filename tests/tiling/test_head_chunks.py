"""The vocabulary head's products over cache-sized chunks of a tile, and a frozen head's 16-bit
tiles lent to the op as stored (``tiling.cross_entropy._Chunks``,
``layout.policy.GroupPolicy.lent_as``).

Tolerances. Chunked, the logits are the same fp32 dot products as the untiled op's (BLAS picks its
blocking by shape, so a logit may differ in its last bits) and the online log-sum-exp rescales once
per chunk instead of once per tile: a reassociation of fp32 sums, the loss within 1e-6 relative and
the gradients within 1e-6 absolute, as the head's tests in tests/tiling/test_tiling.py (entries
O(1e-2) over a vocabulary of 67: ~100 ulps of headroom over the few-ulp differences). A 16-bit tile
cast by the op a chunk at a time holds the values the fetcher's cast makes (bf16 to fp32 is exact)
and runs the same chunks: bitwise. Placements move storage only: bitwise.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_world
from llama_reference import VOCAB_TILED, train_untiled
from reference import make_batches
from side_threads import StartedSide

import zinf_fn as zf
from layers import llama, lora
from zinf_fn import tiling
from zinf_fn.layout import build
from zinf_fn.planner.sizes import plan_config
from zinf_fn.tiling import cross_entropy, two_at_once
from zinf_fn.tiling.held import HeldTiles

VOCAB, D = 67, 24  # prime: unequal tiles, and chunks of 5 rows end unequally in every tile


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def five_rows(monkeypatch):
    """Chunks of 5 fp32 rows of D (``cross_entropy.CHUNK_BYTES``): several per tile."""
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", 5 * D * 4)


def _case(reduction: str = "mean"):
    """(W (VOCAB, D), h (3, 7, D), targets (3, 7) with 2 ignored)."""
    w, h = _rand(VOCAB, D, seed=7) * 0.5, _rand(3, 7, D, seed=8)
    targets = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(9))
    targets[0, :2] = -100
    return w, h, targets


def _tiled(w, h, targets, n_tiles: int, trains: bool, reduction: str = "mean"):
    """(loss, dh, dW or None) of the tiled head over ``n_tiles`` tiles of ``w`` (as they are: a
    16-bit W's tiles stay 16-bit), its tiles trained or frozen."""
    tiles = [t.requires_grad_(trains) for t in tiling.tile(w, n_tiles, axis=0).tiles]
    ht = h.clone().requires_grad_(True)
    loss = tiling.linear_cross_entropy(ht, tiling.RowTiles(tuple(tiles)), targets, -100, reduction)
    (3.0 * loss).backward()  # a loss gradient other than one
    dw = torch.cat([t.grad for t in tiles]) if trains else None
    return loss.detach(), ht.grad, dw


@pytest.mark.parametrize("trains", [False, True], ids=["frozen", "trained"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n_tiles", [1, 4])
def test_a_chunked_head_equals_cross_entropy(five_rows, n_tiles, reduction, trains):
    """Both paths, the frozen head's pull-back made in forward and the trained head's backward
    over its tiles, against ``F.cross_entropy`` on the full logits."""
    w, h, targets = _case()
    loss, dh, dw = _tiled(w, h, targets, n_tiles, trains, reduction)
    w0, h0 = w.clone().requires_grad_(True), h.clone().requires_grad_(True)
    logits = F.linear(h0, w0).reshape(-1, VOCAB)
    loss0 = F.cross_entropy(logits, targets.reshape(-1), reduction=reduction)
    (3.0 * loss0).backward()
    torch.testing.assert_close(loss, loss0.detach(), rtol=1e-6, atol=0)
    # "sum": the entries are the mean's times the valid targets, and so is the bound
    scale = (targets != -100).sum().item() if reduction == "sum" else 1
    torch.testing.assert_close(dh, h0.grad, rtol=0, atol=1e-6 * scale)
    if trains:
        torch.testing.assert_close(dw, w0.grad, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunks", "whole-tiles"])
def test_a_16bit_frozen_tile_computes_as_its_fp32_cast(monkeypatch, chunked):
    """bf16 tiles lent as stored, cast by the op a chunk at a time, against the same tiles cast
    to fp32 first (the fetcher's cast): loss and dh bitwise."""
    if chunked:
        monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", 5 * D * 4)
    w, h, targets = _case()
    w16 = w.to(torch.bfloat16)
    lent = _tiled(w16, h, targets, 4, trains=False)
    cast = _tiled(w16.float(), h, targets, 4, trains=False)
    assert torch.equal(lent[0], cast[0]) and torch.equal(lent[1], cast[1])


def test_a_one_thread_forward_takes_two_lanes_one_on_the_side_thread(five_rows, monkeypatch):
    """At rows the forward computes on one thread (``ONE_THREAD_ROWS``), each tile's chunks go in
    two halves to two online log-sum-exps, merged at the end, one half on the side thread
    (``two_at_once``): bitwise the run with torch on one thread (both halves on the compute thread),
    and the side thread ran halves; within the tolerances above of ``F.cross_entropy`` (the
    chunked test runs these rows too)."""
    w, h, targets = _case()
    assert h.shape[0] * h.shape[1] <= cross_entropy.ONE_THREAD_ROWS
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = _tiled(w, h, targets, 4, trains=False)
    finally:
        torch.set_num_threads(before)
    ran: list = []
    side = StartedSide(ran)
    monkeypatch.setattr(two_at_once, "side_thread", lambda: side)
    try:
        together = _tiled(w, h, targets, 4, trains=False)
    finally:
        side.shutdown()
    assert torch.equal(together[0], alone[0]) and torch.equal(together[1], alone[1])
    assert torch.get_num_threads() < 2 or len(ran) == 4  # a half of each tile


# -- the engine ------------------------------------------------------------------------------------

CFG = VOCAB_TILED
STEPS = 3
HEAD_TILES = "head:lm_head.w"


def _lora() -> zf.Model:
    return lora.apply(llama.model(CFG), rank=2, alpha=4, targets=("attn.q", "attn.v"))


def _config(placement: str, tmp_path=None, **kw) -> zf.Config:
    """bf16 params (the frozen head's tiles 16-bit) unless ``kw`` says otherwise, fp32 compute on
    the CPU, every tier at ``placement``."""
    nvme = {"nvme_path": str(tmp_path)} if placement == "nvme" else {}
    return zf.Config(offload_params=placement, offload_optimizer=placement, **nvme, **kw)


def _train(placement: str, tmp_path) -> tuple[list, list]:
    """(losses, the final weights as arrays) of STEPS LoRA steps at ``placement``."""
    tmp_path.mkdir()
    losses, final = train_untiled(_lora(), _config(placement, tmp_path), CFG, STEPS)
    return losses, [x.numpy() for x in optree.tree_leaves(final)]


def test_the_layout_lends_a_frozen_16bit_head_as_stored():
    """bf16 params, fp32 compute on the CPU: the frozen head's tiles are lent as stored, gathered
    as bf16 (so its fetch buffers are, ``GroupPolicy.gathered_as``); a trained head's, an fp32
    head's and the embedding's are cast."""
    policies = build.layout(_lora(), zf.adamw(), _config("cpu")).store.row_kinds.policies
    assert policies[HEAD_TILES].lent_as == torch.bfloat16
    assert policies[HEAD_TILES].gathered_as(torch.float32) == torch.bfloat16
    assert "lent to the op as stored (bfloat16)" in policies[HEAD_TILES].describe()
    assert policies["embed:tok.w"].lent_as is None
    trained = build.layout(llama.model(CFG), zf.adamw(), _config("cpu"))
    stored32 = build.layout(_lora(), zf.adamw(), _config("cpu", param_dtype=torch.float32))
    for other in (trained, stored32):
        assert other.store.row_kinds.policy(HEAD_TILES).lent_as is None


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_the_planner_times_a_lent_head_on_its_stored_tiles(param_dtype, monkeypatch):
    """The planner's timed head (``planner.compute.time_stages``) gets the tiles the step's op
    gets: bf16 where the layout lends them as stored, the compute dtype where the fetcher casts."""
    seen = []
    real = HeldTiles.fetch

    def spy(self, t):
        tile = real(self, t)
        seen.append(tile.dtype)
        return tile

    monkeypatch.setattr(HeldTiles, "fetch", spy)
    batch = make_batches(CFG, 1, 2, seed=1)[0]
    config = _config("cpu", param_dtype=param_dtype)
    work = plan_config(_lora(), zf.adamw(), config, batch).work
    assert work.forward_s > 0 and len(seen) > 0
    # each timed run of the frozen head fetches its tiles once (no backward reads them)
    assert (seen.count(torch.bfloat16) >= CFG.head_tiles) == (param_dtype == torch.bfloat16)


def test_a_lent_head_trains_bitwise_as_the_cast_one_at_every_placement(five_rows, tmp_path):
    """LoRA over a frozen bf16 tiled head at none / cpu / nvme, its tiles lent as stored, and at
    cpu with the fetcher casting them (``_lent_as`` answering None): every run bitwise the same."""
    runs = [_train(placement, tmp_path / placement) for placement in ("none", "cpu", "nvme")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "_lent_as", _never)
        runs.append(_train("cpu", tmp_path / "cast"))
    for got in runs[1:]:
        assert got[0] == runs[0][0]
        assert all((x == y).all() for x, y in zip(got[1], runs[0][1], strict=True))


def _never(*_args) -> None:
    """``build._lent_as`` answering None: every tile cast by the fetcher, as before."""
    return None


def _world_train(rank: int, world_size: int) -> tuple[list, list]:
    """(losses, final weights) of STEPS LoRA steps of this rank at cpu, its share of each
    batch."""
    losses, final = train_untiled(_lora(), _config("cpu"), CFG, STEPS, rank, world_size)
    return losses, [x.numpy() for x in optree.tree_leaves(final)]


def _world_run(rank: int, world_size: int) -> tuple[tuple, tuple]:
    """This rank's (lent, cast) runs, one world: the head's bf16 tiles gathered over the ranks as
    stored, then cast by the fetcher."""
    lent = _world_train(rank, world_size)
    build._lent_as = _never  # a spawned process of its own: nothing to restore
    return lent, _world_train(rank, world_size)


def test_a_lent_head_world_2_trains_bitwise_as_the_cast_one():
    """Two ranks gather each frozen head tile as its bf16 row and lend it (no cast), or cast it:
    every rank's losses and weights bitwise the same."""
    for got, want in run_world(2, _world_run):
        assert got[0] == want[0]
        assert all((x == y).all() for x, y in zip(got[1], want[1], strict=True))
