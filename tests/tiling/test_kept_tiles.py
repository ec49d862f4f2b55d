"""Tiled blocks that keep their activations (``Config.keep_activations``, ``scan.tape.Kept``): a
kept block's backward runs no recompute, so it fetches each tile (each touched expert) once, not
twice, and trains bitwise like the same run without it.

No tolerance: keeping the saved tensors instead of recomputing them gives the backward the same
tensors (the recompute is the same ops on the same inputs), so losses and weights agree bitwise
(as tests/engine/test_frozen_reuse.py shows for untiled blocks).
"""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
from dist_utils import rank_part, run_world
from engine_internals import log_fetches
from llama_reference import placement_config
from reference import make_batches

import zinf_fn as zf
from layers import gpt, llama, moe
from zinf_fn import tiling
from zinf_fn.tiling.layout import TileUnit

MOE = moe.Config(n_experts=8, top_k=2, d_model=32, d_ff=16, stream_experts=True)
CFG = llama.Config(
    vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2, seq_len=8, moe=MOE
)
KEEP = 1 << 30  # room for every block's activations
STEPS = 3
LR, WD = 3e-3, 0.1


def untiled(tree):
    return optree.tree_map(tiling.untile, tree, is_leaf=tiling.is_tiled)


def train(model: zf.Model, config: zf.Config, data: list, rank: int = 0, world: int = 1):
    """(losses, final weights untiled as numpy arrays, last step's metrics)."""
    state = zf.init(model, zf.adamw(lr=LR, weight_decay=WD), config, seed=0)
    losses = []
    for b in data:
        state, metrics = zf.train_step(state, rank_part(b, rank, world))
        losses.append(metrics["loss"])
    final = [x.numpy() for x in optree.tree_leaves(untiled(zf.gather_params(state)))]
    zf.close(state)
    return losses, final, metrics


def assert_same(a, b) -> None:
    assert a[0] == b[0]
    assert all((x == y).all() for x, y in zip(a[1], b[1], strict=True))


CASES = {"none": ("none", 1), "cpu-accum-2": ("cpu", 2), "nvme": ("nvme", 1)}


@pytest.mark.parametrize("case", CASES)
def test_streamed_experts_keeping_activations_train_bitwise_like_recomputing(case, tmp_path):
    """Every placement, grad_accum 2: the kept run equals the recomputing run bitwise and makes a
    third fewer tile fetches (the recompute's are gone: forward, backward, and no recompute)."""
    placement, k = CASES[case]
    results = []
    for keep in (0, KEEP):
        path = tmp_path / str(keep)
        path.mkdir()
        config = placement_config(placement, path, grad_accum=k, keep_activations=keep)
        results.append(train(llama.model(CFG), config, make_batches(CFG, STEPS, 4, seed=1)))
    assert_same(*results)
    fetched = [m["tile_fetches_prefetched"] + m["tile_fetches_on_demand"] for _, _, m in results]
    assert fetched[1] * 3 == fetched[0] * 2, fetched  # each touched expert: 2 fetches, not 3


def _world_train(rank: int, world_size: int, keep: int):
    config = zf.Config(
        offload_params="cpu",
        offload_optimizer="cpu",
        param_dtype=torch.float32,
        prefetch_depth=2,
        keep_activations=keep,
    )
    losses, final, _ = train(
        llama.model(CFG), config, make_batches(CFG, STEPS, 4, seed=1), rank, world_size
    )
    return losses, final


def _world_run(rank: int, world_size: int) -> tuple:
    """This rank's kept and recomputing runs, in one world."""
    return _world_train(rank, world_size, KEEP), _world_train(rank, world_size, 0)


def test_kept_streamed_experts_world_2_match_recomputing():
    """Two ranks, each its half of the batch: the kept run equals the recomputing one bitwise (the
    union of both ranks' experts is fetched in the backward as in the forward)."""
    for kept, recomputed in run_world(2, _world_run):
        assert_same(kept, recomputed)


ONE = dataclasses.replace(CFG, n_layers=1, moe=dataclasses.replace(MOE, top_k=1))


def _tokens(n: int) -> dict:
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, ONE.vocab_size, (1, n + 1), generator=gen)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.mark.parametrize("keep", [0, KEEP])
def test_a_kept_block_fetches_each_touched_expert_once_in_backward(keep):
    """One block, 4 tokens top-1 of 8 experts, every fetch on demand (``prefetch_depth`` 0, so the
    log is the ops' own requests): the forward fetches each touched expert's two linears once; the
    backward fetches them once more where the block kept its activations, twice (the recompute's
    and the backward's) where it did not."""
    config = zf.Config(param_dtype=torch.float32, prefetch_depth=0, keep_activations=keep)
    state = zf.init(llama.model(ONE), zf.adamw(lr=LR, weight_decay=WD), config, seed=0)
    log: list = []
    log_fetches(state, log)
    state, _ = zf.train_step(state, _tokens(4))
    zf.close(state)
    tiles = [(u.path, u.tile) for _, u in log if isinstance(u, TileUnit)]
    touched = sorted(set(tiles))
    assert 0 < len(touched) <= 2 * 4  # two linears of at most 4 experts
    times = 2 if keep else 3  # forward + backward, plus the recompute where not kept
    assert sorted(tiles) == sorted(touched * times)


GPT = gpt.Config(
    vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=16, attn_tiles=2, mlp_tiles=3
)


def test_tiled_linears_keeping_activations_train_bitwise_like_recomputing():
    """A GPT with tiled attention and MLP linears (``tiling.linear`` over the engine's tiles),
    grad_accum 2: kept equals recomputed bitwise, with a third fewer tile fetches."""
    results = []
    for keep in (0, KEEP):
        config = zf.Config(param_dtype=torch.float32, grad_accum=2, keep_activations=keep)
        results.append(train(gpt.model(GPT), config, make_batches(GPT, STEPS, 4, seed=1)))
    assert_same(*results)
    fetched = [m["tile_fetches_prefetched"] + m["tile_fetches_on_demand"] for _, _, m in results]
    assert fetched[1] < fetched[0], fetched
