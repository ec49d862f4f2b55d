"""A run of small tiles is one cast and one optimizer call, bitwise the tiles fetched and updated
one by one.

The tile prefetcher fetches a run of adjacent small tiles of one leaf as one item (``tiling.runs``);
with its rows in memory on the compute device the run's rows are cast to the compute dtype with one
call (``Fetcher.fetch_run``), and with one rank and no clipping the run's gradients go to the
updater as one update (``overlap.tile_runs.update_run``): one fused optimizer call over the run's
rows (``Optimizer.update_many``) and one cast of their 16-bit copies. The twin is
``prefetch_depth=0``, where every tile is fetched, cast and updated on its own. The fused kernels
treat each tensor of a list on its own and a cast is elementwise, so the two train bit for bit
(compared with ``torch.equal``, no tolerance); the calls are counted, not timed.
"""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
from engine_helpers import CFG
from reference import make_batches

import zinf_fn as zf
from layers import gpt, linear
from zinf_fn import tiling
from zinf_fn.layout.build import layout
from zinf_fn.model import Model, Stage
from zinf_fn.overlap import tile_runs
from zinf_fn.planner.memory import pool_plan
from zinf_fn.state import view

D, T, RUN = 64, 8, 3  # one tiled d x d linear of 8 tiles, runs of 3: 3 + 3 + 2 tiles a direction
GROUP = "blocks:w.w"


def _model() -> Model:
    def block_init(gen, i):
        return {"w": linear.init(gen, D, D, bias=False, tiles=T)}

    return Model(
        embed=Stage(lambda gen: {"s": torch.ones(D)}, lambda p, b: b["x"] * p["s"]),
        block=Stage(block_init, lambda p, x: x + tiling.linear(x, p["w"]["w"])),
        head=Stage(lambda gen: {"s": torch.ones(D)}, lambda p, x, b: ((x * p["s"]) ** 2).mean()),
        n_layers=1,
    )


def _batches(n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(2, 4, D, generator=gen)} for _ in range(n)]


def _runs_of(monkeypatch, model, opt, config) -> None:
    """Make runs of ``RUN`` tiles: ``TILE_RUN_BYTES`` holds that many of this model's tiles in the
    compute dtype."""
    padded = layout(model, opt, config).store.groups[GROUP].part.padded_numel
    monkeypatch.setattr(
        tile_runs, "TILE_RUN_BYTES", RUN * padded * config.resolved_compute_dtype().itemsize
    )


def _counting(opt: zf.Optimizer, calls: list) -> zf.Optimizer:
    """``opt`` that records each call: ("update", 1) per shard updated alone, ("many", shards) per
    fused call."""

    def update(grad, state, param, step, decay=None):
        calls.append(("update", 1))
        return opt.update(grad, state, param, step, decay)

    def update_many(grads, states, params, step, decays):
        calls.append(("many", len(params)))
        return opt.update_many(grads, states, params, step, decays)

    return opt._replace(update=update, update_many=update_many)


@pytest.mark.parametrize("placement", ["none", "cpu"])
def test_a_run_of_small_tiles_is_one_cast_and_one_update_call(placement, monkeypatch):
    model, config = _model(), {}
    for depth in (0, 1):
        calls: list = []
        opt = _counting(zf.adamw(lr=1e-2, weight_decay=0.1), calls)
        config[depth] = zf.Config(
            offload_params=placement,
            offload_optimizer=placement,
            param_dtype=torch.bfloat16,
            prefetch_depth=depth,
        )
        _runs_of(monkeypatch, model, opt, config[depth])
        state = zf.init(model, opt, config[depth], seed=0)
        for batch in _batches(
            3
        ):  # the last step's counts: the plan has followed the applies since the first
            calls.clear()
            state, metrics = zf.train_step(state, batch)
        zf.close(state)
        config[depth] = (metrics, sorted(calls))
    (alone, calls_alone), (batched, calls_batched) = config[0], config[1]
    assert (
        batched["tile_fetches_prefetched"] == 6 and batched["tile_fetches_on_demand"] == 0
    )  # 2 x (3, 3, 2)
    assert (
        batched["fetches"] == alone["fetches"]
    )  # the same 16 tile fetches a step (and the units')
    assert (
        alone["fetch_casts"] - batched["fetch_casts"] == 2 * T - 6
    )  # one cast a run, not one a tile
    tiles_alone = [c for c in calls_alone if c[0] == "update"][:T]  # the units' own updates besides
    assert [c for c in calls_alone if c[0] == "many"] == [] and len(tiles_alone) == T
    assert [c for c in calls_batched if c[0] == "many"] == [("many", 2), ("many", 3), ("many", 3)]
    assert len(calls_alone) - len(calls_batched) == T - 3  # 8 tile updates became 3 calls


def _leaves(state) -> list[torch.Tensor]:
    return optree.tree_leaves(
        optree.tree_map(tiling.untile, zf.gather_params(state), is_leaf=tiling.is_tiled)
    )


def _train(model, opt, config, data) -> tuple[list, list, list, list]:
    """(losses, grad norms, final parameters, initial parameters) of training on ``data``."""
    state = zf.init(model, opt, config, seed=0)
    losses, norms, initial = [], [], _leaves(state)
    for batch in data:
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    leaves = _leaves(state)
    zf.close(state)
    return losses, norms, leaves, initial


TILED = dataclasses.replace(
    CFG, attn_tiles=2, mlp_tiles=3, head_tiles=5
)  # tiny tiles: a run is a whole leaf
# (model, placement, engine config besides): every path a run of tiles takes, and two it does not
TWINS = {
    "linear-none": ("linear", "none", {}),
    "linear-cpu": ("linear", "cpu", {}),
    "linear-cpu-accum": ("linear", "cpu", dict(grad_accum=2)),
    "linear-nvme": (
        "linear",
        "nvme",
        {},
    ),  # no views: fetched and updated tile by tile, submitted as a run
    "linear-cpu-clip": ("linear", "cpu", dict(clip_grad_norm=0.5)),  # stashed tile by tile: no runs
    "gpt-cpu": ("gpt", "cpu", {}),
    "gpt-cpu-remainder": (
        "gpt",
        "cpu",
        dict(master="remainder"),
    ),  # joined per tile: updated one by one
}


@pytest.mark.parametrize("case", TWINS)
def test_runs_of_tiles_train_bitwise_like_tiles_one_by_one(case, monkeypatch, tmp_path):
    name, placement, extra = TWINS[case]
    model = _model() if name == "linear" else gpt.model(TILED)
    data = _batches(3) if name == "linear" else make_batches(TILED, 3, 8, seed=1)
    runs = []
    for depth in (0, 1):
        opt = zf.adamw(lr=1e-2, weight_decay=0.1, mask=lambda path: not path.endswith(".s"))
        config = zf.Config(
            offload_params=placement,
            offload_optimizer=placement,
            param_dtype=torch.bfloat16,
            prefetch_depth=depth,
            nvme_path=str(tmp_path),
            **extra,
        )
        if name == "linear":
            _runs_of(monkeypatch, model, opt, config)
        runs.append(_train(model, opt, config, data))
    (losses0, norms0, leaves0, initial), (losses1, norms1, leaves1, _) = runs
    assert losses0 == losses1 and norms0 == norms1
    assert all(torch.equal(a, b) for a, b in zip(leaves0, leaves1, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(leaves0, initial, strict=True))  # it did train


def test_sgd_runs_of_tiles_bitwise_like_tiles_one_by_one(monkeypatch):
    """SGD with momentum and decoupled decay: one ``_foreach_mul_`` and one ``_fused_sgd_`` over the
    run."""
    model, data, runs = _model(), _batches(3), []
    for depth in (0, 1):
        opt = zf.sgd(lr=0.1, momentum=0.9, weight_decay=0.1)
        config = zf.Config(
            offload_params="cpu",
            offload_optimizer="cpu",
            param_dtype=torch.bfloat16,
            prefetch_depth=depth,
        )
        _runs_of(monkeypatch, model, opt, config)
        runs.append(_train(model, opt, config, data))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2], strict=True))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_runs_shorter_than_a_leaf_hold_no_buffer_beyond_the_plan(grad_accum, monkeypatch):
    """A GPT whose runs are shorter than its leaves (runs of 3 of the largest tiles: qkv's 4 tiles
    in runs of 3 and 1, the MLP's 8 in runs of 4): a run's gradients wait for its last tile (in its
    fetched buffers, or, with two micro-batches, in copies), and the pool after three steps is still
    the planned one (the gradients' demand counts ``update_run`` tiles an update), as
    ``tests/engine/test_demand.py`` checks for whole-leaf runs."""
    cfg = dataclasses.replace(CFG, attn_tiles=4, mlp_tiles=8, head_tiles=8)
    model, opt = gpt.model(cfg), zf.adamw(lr=1e-2)
    config = zf.Config(offload_params="cpu", offload_optimizer="cpu", grad_accum=grad_accum)
    groups = [
        g for g in layout(model, opt, config).store.groups.values() if ":" in g.name
    ]  # the tile groups
    monkeypatch.setattr(
        tile_runs, "TILE_RUN_BYTES", RUN * max(g.part.padded_numel for g in groups) * 4
    )
    built = layout(model, opt, config)
    plan, tiles = pool_plan(built, config), built.tiles.n_tiles()
    assert any(
        tile_runs.tile_run(g.part.padded_numel, torch.float32, 1) < tiles[g.name] for g in groups
    )
    state = zf.init(model, opt, config, seed=0)
    for batch in make_batches(cfg, 3, 8, seed=1):
        state, _ = zf.train_step(state, batch)
    zf.flush(state)
    counters = view(state).counters()
    assert counters.pool_made == sum(plan.values()) and counters.pool_out == 0
    zf.close(state)
