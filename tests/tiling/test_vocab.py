"""The vocabulary tiled over its rows: ``tiling.embedding`` equals ``F.embedding``, a llama whose
embedding is tiled (``embed_tiles``) trains bitwise like the untiled one (every placement,
grad_accum 2, world 2, a frozen embedding under LoRA), a tile no id falls in is never fetched yet
moves as torch's AdamW moves a weight whose gradient is zero, and tables drawn tile by tile
(``vocab_tile_seeds``, ``tiling.Deferred``) train as the same tiles made up front.

No tolerance: a row's gradient is the same ``index_add`` of the same output rows in the same order
(``F.embedding``'s CPU backward adds them in position order too), and a tile's AdamW update is the
same elementwise update as its rows of the whole table's, so losses and weights agree bitwise.
"""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
import torch.nn.functional as F
from dist_utils import rank_part, run_world
from engine_internals import log_fetches
from llama_reference import placement_config
from reference import make_batches
from tile_sources import LendingSource, RecordingSource

import zinf_fn as zf
from layers import llama, lora
from zinf_fn import tiling
from zinf_fn.model import Stage
from zinf_fn.tiling.layout import TileUnit

CFG = llama.Config(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=8)
TILED = dataclasses.replace(CFG, embed_tiles=3)  # 22, 21, 21 rows: uneven
STEPS = 3
LR, WD = 3e-3, 0.1


def untiled(tree):
    return optree.tree_map(tiling.untile, tree, is_leaf=tiling.is_tiled)


# -- the op ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("source", [None, RecordingSource, LendingSource])
def test_tiled_embedding_equals_f_embedding(padding_idx, source):
    """Forward rows and the table's gradient bitwise, for tiles as tensors and over a source; a
    source is told the tiles holding the ids before the first fetch and fetches only those."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(50, 8, generator=gen)
    ids = torch.randint(0, 26, (3, 7), generator=gen)  # tiles 0 and 1 of 4 (13 rows each)
    ids[0, 0] = 3
    whole = w.clone().requires_grad_(True)
    want = F.embedding(ids, whole, padding_idx=padding_idx)
    g = torch.randn(want.shape, generator=gen)
    want.backward(g)
    tiles = tiling.tile(w, 4, axis=0)
    if source is None:
        parts = tuple(t.clone().requires_grad_(True) for t in tiles.tiles)
        got = tiling.embedding(ids, tiling.RowTiles(parts), padding_idx)
        got.backward(g)
        grads = [p.grad for p in parts]
    else:
        src = source(tiles)
        got = tiling.embedding(ids, src, padding_idx)
        got.backward(g)
        assert src.log[0] == ("will_use", (0, 1))
        assert {t for op, t in src.log[1:] if op == "fetch"} == {0, 1}
        grads = [src.grads.get(t, torch.zeros_like(tiles.tiles[t])) for t in range(4)]
    assert torch.equal(got, want)
    assert torch.equal(torch.cat(grads), whole.grad)


def test_tiled_embedding_refuses_column_tiles():
    with pytest.raises(ValueError, match="tiled over its rows"):
        tiling.embedding(torch.zeros(2, dtype=torch.long), tiling.tile(torch.zeros(4, 6), 2, 1))


# -- the engine ------------------------------------------------------------------------------------


def banded_batches(n: int, batch: int = 4) -> list[dict]:
    """Batches whose first half of rows takes ids in [0, 16) (tile 0 of ``TILED``), the second
    half in [43, 64) (tile 2): tile 1 is never used; targets over the whole vocabulary."""
    out = []
    for b in make_batches(CFG, n, batch, seed=1):
        inputs = b["inputs"] % 16
        inputs[batch // 2 :] = 43 + b["inputs"][batch // 2 :] % 21
        out.append({"inputs": inputs, "targets": b["targets"]})
    return out


def train(model: zf.Model, config: zf.Config, batches, rank: int = 0, world: int = 1):
    """(losses, final weights untiled) of training ``model`` on ``batches``."""
    state = zf.init(model, zf.adamw(lr=LR, weight_decay=WD), config, seed=0)
    losses = []
    for b in batches:
        state, metrics = zf.train_step(state, rank_part(b, rank, world))
        losses.append(metrics["loss"])
    final = untiled(zf.gather_params(state))
    zf.close(state)
    return losses, [x.numpy() for x in optree.tree_leaves(final)]


def assert_same(a, b) -> None:
    assert a[0] == b[0]
    assert all((x == y).all() for x, y in zip(a[1], b[1], strict=True))


CASES = {"none": ("none", 1, False), "cpu-accum-2": ("cpu", 2, False), "nvme": ("nvme", 1, False)}
CASES["nvme-lora"] = ("nvme", 1, True)  # a frozen tiled embedding: no gradient, no update


@pytest.mark.parametrize("case", CASES)
def test_a_tiled_embedding_trains_bitwise_like_the_whole_one(case, tmp_path):
    placement, k, adapted = CASES[case]
    results = []
    for cfg in (CFG, TILED):
        path = tmp_path / str(cfg.embed_tiles)
        path.mkdir()
        config = placement_config(placement, path, grad_accum=k)
        model = llama.model(cfg)
        if adapted:
            model = lora.apply(model, rank=2, alpha=4, targets=("attn.q", "attn.v"))
        results.append(train(model, config, make_batches(CFG, STEPS, 4, seed=1)))
    assert_same(*results)


def _world_train(rank: int, world_size: int, cfg: llama.Config):
    config = zf.Config(
        offload_params="cpu", offload_optimizer="cpu", param_dtype=torch.float32, prefetch_depth=2
    )
    return train(llama.model(cfg), config, banded_batches(STEPS), rank, world_size)


def _world_run(rank: int, world_size: int) -> tuple:
    """This rank's (tiled, whole) runs, in one world."""
    return _world_train(rank, world_size, TILED), _world_train(rank, world_size, CFG)


def test_a_tiled_embedding_world_2_matches_the_whole_one():
    """Rank 0's ids fall in tile 0 only, rank 1's in tile 2 only: both fetch the union {0, 2} (each
    computing the other's tile on no rows), so both reduce-scatter the same tiles in the same
    order, and the gradients sum as the whole table's do."""
    for got, want in run_world(2, _world_run):
        assert_same(got, want)


def test_an_untouched_tile_is_not_fetched_and_moves_as_adamw():
    """One step whose ids fall in tiles 0 and 2: the embedding's units fetch tiles 0 and 2 only;
    tile 1's rows move as ``torch.optim.AdamW(fused=True)`` moves them on a zero gradient (the
    weight decays, the moments stay zero), bitwise."""
    config = zf.Config(param_dtype=torch.float32, prefetch_depth=0)
    state = zf.init(llama.model(TILED), zf.adamw(lr=LR, weight_decay=WD), config, seed=0)
    before = zf.gather_params(state)["embed"]["tok"]["w"]
    log = []
    log_fetches(state, log)
    state, _ = zf.train_step(state, banded_batches(1)[0])
    fetched = {u.tile for _, u in log if isinstance(u, TileUnit) and u.stage == "embed"}
    assert fetched == {0, 2}
    after = zf.gather_params(state)["embed"]["tok"]["w"]
    w = before.tiles[1].clone().requires_grad_(True)
    opt = torch.optim.AdamW([w], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD, fused=True)
    w.grad = torch.zeros_like(w)
    opt.step()
    assert torch.equal(after.tiles[1], w.detach())
    assert not torch.equal(after.tiles[0], before.tiles[0])
    zf.close(state)


# -- tables drawn tile by tile ---------------------------------------------------------------------

SEEDED = dataclasses.replace(CFG, embed_tiles=3, head_tiles=4, vocab_tile_seeds=True)


def made_up_front(model: zf.Model) -> zf.Model:
    """``model`` whose embedding and head trees come with every tile made (no ``Deferred``)."""

    def made(init):
        def init_made(gen):
            return tiling.materialize(init(gen))

        return init_made

    return model._replace(
        embed=Stage(made(model.embed.init), model.embed.apply),
        head=Stage(made(model.head.init), model.head.apply),
    )


def test_seeded_vocabulary_tiles_train_as_the_same_tiles_made_up_front(tmp_path):
    """``vocab_tile_seeds``: the embedding's and the head's tiles are ``Deferred`` (made one at a
    time by ``zf.init``), and the model trains bitwise as the one whose tiles are made at once."""
    model = llama.model(SEEDED)
    tree = model.head.init(torch.Generator().manual_seed(0))
    assert all(map(tiling.is_deferred, tree["lm_head"]["w"].tiles))
    assert all(map(tiling.is_deferred, model.embed.init(torch.Generator())["tok"]["w"].tiles))
    results = []
    for name, m in (("deferred", model), ("made", made_up_front(model))):
        (tmp_path / name).mkdir()
        config = zf.Config(
            offload_params="nvme",
            offload_optimizer="nvme",
            param_dtype=torch.float32,
            nvme_path=str(tmp_path / name),
        )
        results.append(train(m, config, make_batches(CFG, STEPS, 4, seed=1)))
    assert_same(*results)


def test_seeded_tiles_and_a_tied_tiled_embedding_are_refused():
    with pytest.raises(ValueError, match="embed_tiles=1"):
        llama.Config(tie_embeddings=True, embed_tiles=2)
    with pytest.raises(ValueError, match="vocab_tile_seeds=False"):
        llama.Config(tie_embeddings=True, vocab_tile_seeds=True)
