"""The last step's routing of a layer is the prior of the next step's first expert fetches
(``tiling.routed.Learnt``): before the router runs, the tile plan brings the experts the layer used
last step instead of every expert in order.

Counted, not timed: with a learning rate of 0 and the same batch every step the routing repeats, so
from step 2 on the prior is exact and no prefetched expert is wasted, where step 1 (no prior: every
expert planned until the router tells) wastes the window's fetches issued before each router ran.
"""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
from reference import make_batches

import zinf_fn as zf
from layers import llama, moe
from zinf_fn.overlap import tile_runs
from zinf_fn.overlap.plan import KEPT, LEARNT, ROUTED
from zinf_fn.tiling import runtime as tiling_runtime
from zinf_fn.tiling import step_tiles

WIDE = llama.Config(
    vocab_size=64,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    d_ff=48,
    n_layers=2,
    seq_len=8,
    moe=moe.Config(n_experts=16, top_k=1, d_model=32, d_ff=16, stream_experts=True),
)
DEPTH = 2


@pytest.mark.parametrize("k", [1, 2])
def test_the_last_steps_routing_wastes_no_prefetched_expert(k, monkeypatch):
    """Runs of one tile (every expert its own prefetch item), 16 experts top-1: step 1 wastes some
    fetches (the plan's first experts before each router ran; the first step also learns the
    order of use); steps 2 and 3, planned from the last step's routing, waste none and fetch as many
    tiles as step 1 asked for."""
    monkeypatch.setattr(tile_runs, "TILE_RUN_BYTES", 1)
    config = zf.Config(param_dtype=torch.float32, prefetch_depth=DEPTH, grad_accum=k)
    state = zf.init(llama.model(WIDE), zf.adamw(lr=0.0), config, seed=0)
    batch = make_batches(WIDE, 1, 2, seed=1)[0]
    wasted, used = [], []
    for _ in range(3):
        state, metrics = zf.train_step(state, batch)
        wasted.append(metrics["tile_fetches_wasted"])
        used.append(metrics["tile_fetches_prefetched"] + metrics["tile_fetches_on_demand"])
    zf.close(state)
    assert wasted[0] > 0, wasted
    assert wasted[1:] == [0, 0], wasted
    assert used[1:] == [used[0]] * 2, used


def test_an_evaluation_does_not_replace_the_learnt_routing():
    """An evaluation step between two training steps leaves the training prior as it was (its
    routing has no backward and may have other micro-batches): the next training step still
    wastes nothing."""
    config = zf.Config(param_dtype=torch.float32, prefetch_depth=DEPTH)
    model = llama.model(dataclasses.replace(WIDE, n_layers=1))
    state = zf.init(model, zf.adamw(lr=0.0), config, seed=0)
    batch, other = make_batches(WIDE, 2, 2, seed=1)
    state, _ = zf.train_step(state, batch)
    zf.eval_step(state, other)
    state, metrics = zf.train_step(state, batch)
    zf.close(state)
    assert metrics["tile_fetches_wasted"] == 0, metrics


def test_routing_revises_the_tile_plan_by_appending_values(monkeypatch):
    """The step's tile plan (``StepTiles.runs``, an ``overlap.plan.PassPlan``) keeps the plan cut
    before the step, untouched, and appends a revision per routing told (and per kept tape or
    learnt order): step 1 plans every expert, the router's top-1 of 16 leaves fewer to fetch."""
    steps = []
    finish = tiling_runtime.TileEngine.finish

    def logged_finish(self, step):
        steps.append(step)
        return finish(self, step)

    monkeypatch.setattr(tiling_runtime.TileEngine, "finish", logged_finish)
    config = zf.Config(param_dtype=torch.float32, prefetch_depth=DEPTH)
    state = zf.init(llama.model(WIDE), zf.adamw(lr=0.0), config, seed=0)
    state, _ = zf.train_step(state, make_batches(WIDE, 1, 2, seed=1)[0])
    zf.close(state)
    plan = steps[0].runs
    assert plan.causes[ROUTED] > 0 and set(plan.causes) <= {ROUTED, KEPT, LEARNT}
    # the plan cut before the step, untouched, still plans every expert; the routed one only those
    # with tokens (16 tokens top-1: some of the 16 experts get none)
    planned = {op.unit.tile for op in plan.planned.ops}
    routed = {op.unit.tile for op in plan.now.ops}
    assert planned == set(range(WIDE.moe.n_experts)) and routed < planned
    assert len(plan.now.ops) < len(plan.planned.ops)
    assert str(plan).startswith(f"planned {len(plan.planned)} items")


def test_the_predicted_experts_are_computed_first_and_train_as_in_increasing_order(monkeypatch):
    """With a routing that changes between steps (new batches, a learning rate), a layer's
    experts the last step's routing predicted (the plan's first fetches, issued before the router
    ran) are computed first, in their planned order, the others after in increasing order
    (``tiling.routed.predicted_first``): step 2's first layer puts them first as step 1 told them,
    and the run is bitwise the one computing every layer's experts in increasing order, losses
    and weights (each expert computes the same rows, and a token's k outputs are summed in pair
    order whatever the experts' order)."""
    told: list[tuple[int, ...]] = []
    will_use = step_tiles.StepTiles.will_use

    def recorded(self, leaf, tiles, others):
        out = will_use(self, leaf, tiles, others)
        told.append(out)
        return out

    def run(order):
        monkeypatch.setattr(step_tiles, "predicted_first", order)
        monkeypatch.setattr(step_tiles.StepTiles, "will_use", recorded)
        told.clear()
        config = zf.Config(param_dtype=torch.float32, prefetch_depth=DEPTH)
        state = zf.init(llama.model(WIDE), zf.adamw(lr=1e-2), config, seed=0)
        losses, orders = [], []
        for batch in make_batches(WIDE, 3, 2, seed=1):
            state, metrics = zf.train_step(state, batch)
            losses.append(metrics["loss"])
            orders.append(list(told))
            told.clear()
        params = optree.tree_leaves(zf.gather_params(state))
        zf.close(state)
        monkeypatch.undo()
        return losses, params, orders

    def increasing(tiles, planned):
        return tuple(sorted(tiles))

    losses, params, orders = run(step_tiles.predicted_first)
    want_losses, want_params, _ = run(increasing)
    assert losses == want_losses
    assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))
    # step 1 planned every expert in order; step 2's first layer follows step 1's first routing
    assert all(list(o) == sorted(o) for o in orders[0])
    first, before = orders[1][0], orders[0][0]
    assert first == step_tiles.predicted_first(first, before)
    assert any(list(o) != sorted(o) for step in orders[1:] for o in step)  # some order changed
