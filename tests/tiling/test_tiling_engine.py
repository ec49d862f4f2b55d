"""Tiles as fetch units of the engine: a tiled GPT trains like the untiled one (and so like torch).

Tolerances. The tiled and untiled runs store the same values and run the same fp32 products; only
the order of sums inside the tiled linears and the head's log-sum-exp differs (bounded per op in
tests/tiling/test_tiling.py, ~1e-7 relative), so losses agree to ~1e-7 relative (asserted: 1e-5;
1e-4 with bf16 storage, where a master difference can flip the rounding of a stored parameter).
AdamW's first steps are lr * g / (|g| + eps): insensitive to relative noise, except where the true
gradient is ~0 and the computed one is rounding noise (the attention key bias: softmax is invariant
to it, so its gradient is exactly 0 in exact arithmetic and ~1e-10 computed). There the update is lr
* noise / (|noise| + eps), different in every summation order, ~1e-2 * lr per step. Observed over 4
  steps: max parameter
difference 6e-6 (fp32) and 2.2e-5 (bf16); 65 of 43k elements differ by more than 1e-6, 64 of them
key biases. The tests allow 1e-4, 3% of one lr=3e-3 step (the budget tests/engine/test_engine.py
uses for clipping).
"""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
from dist_utils import rank_part, run_world
from engine_helpers import CFG, decay_predicate, max_abs_diff, run_reference
from engine_internals import log_fetches
from reference import make_batches

import zinf_fn as zf
from layers import gpt
from zinf_fn import tiling
from zinf_fn.model import Model, Stage
from zinf_fn.overlap.plan import train_plan
from zinf_fn.state import units, view
from zinf_fn.tiling.layout import TileUnit
from zinf_fn.tiling.plan import step_tile_plan
from zinf_fn.tiling.runs import cut_runs

TILED = dataclasses.replace(
    CFG, attn_tiles=2, mlp_tiles=3, head_tiles=5
)  # 32/2, 128/3 and 64/5: uneven
STEPS = 4


def untile_tree(tree):
    return optree.tree_map(tiling.untile, tree, is_leaf=tiling.is_tiled)


def train(cfg, config, steps=STEPS, data=None, rank=0, world=1):
    opt = zf.adamw(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay_predicate)
    state = zf.init(gpt.model(cfg), opt, config, seed=0)
    initial = zf.gather_params(state)
    losses = []
    for batch in data or make_batches(cfg, steps, 8, seed=1):
        state, metrics = zf.train_step(state, rank_part(batch, rank, world))
        losses.append(metrics["loss"])
    return losses, zf.gather_params(state), initial, state, metrics


CASES = {  # (placement, param_dtype, grad_accum, clip)
    "none-fp32": ("none", torch.float32, 1, None),
    "cpu-fp32": ("cpu", torch.float32, 1, None),
    "cpu-bf16-accum-clip": ("cpu", torch.bfloat16, 2, 0.5),
    "none-fp32-accum-clip": ("none", torch.float32, 2, 0.5),
}


@pytest.mark.parametrize("case", CASES)
def test_tiled_gpt_trains_like_untiled(case):
    placement, dtype, k, clip = CASES[case]
    config = zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        param_dtype=dtype,
        grad_accum=k,
        clip_grad_norm=clip,
    )
    losses, final, initial, state, metrics = train(TILED, config)
    base_losses, base_final, base_initial, _, _ = train(CFG, config)
    assert max_abs_diff(untile_tree(initial), base_initial) == 0.0  # same seed, same values
    assert isinstance(final["blocks"][0]["mlp"]["fc"]["w"], tiling.RowTiles)
    rel = 1e-5 if dtype == torch.float32 else 1e-4
    assert losses == pytest.approx(base_losses, rel=rel)
    assert max_abs_diff(untile_tree(final), base_final) < 1e-4
    assert max_abs_diff(untile_tree(final), untile_tree(initial)) > 1e-3  # it did train
    assert metrics["tile_fetches_prefetched"] > 0 and view(state).counters().live_layers == 0
    if (
        dtype == torch.float32 and k == 1
    ):  # and the torch reference (the untiled engine equals it bitwise)
        ref_losses, ref_final = run_reference(
            untile_tree(initial), steps=STEPS, mask=True, data=make_batches(CFG, STEPS, 8, seed=1)
        )
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert max_abs_diff(untile_tree(final), ref_final) < 1e-4


def test_tile_gradient_norms_taken_by_their_updates():
    """Without clipping a tile gradient's squared norm is taken by its update worker
    (``GradientsIn.scatter``'s ``norm_in_update``); with clipping (far above the norm: coefficient
    1) by the compute thread before the stash. The step's reported norm is the same up to the order
    of sums: the untiled units' norms are summed per leaf without clipping
    (``scan.grads.LeafGrads``), over the flat shard with it (~1e-7 relative)."""
    norms = []
    for clip in (None, 1e9):
        config = zf.Config(offload_params="cpu", offload_optimizer="cpu", clip_grad_norm=clip)
        norms.append([m["grad_norm"] for m in _step_metrics(TILED, config, 2)])
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)
    assert all(n > 0 for n in norms[0])


def _step_metrics(cfg, config, steps):
    opt = zf.adamw(lr=3e-3, weight_decay=0.1, mask=decay_predicate)
    state, out = zf.init(gpt.model(cfg), opt, config, seed=0), []
    for batch in make_batches(cfg, steps, 8, seed=1):
        state, metrics = zf.train_step(state, batch)
        out.append(metrics)
    view(state).close()
    return out


def _world_run(rank, world_size):
    """Both partition modes with the fetch thread on: tiles gathered/broadcast like the layers they
    tile."""
    out = {}
    for mode in ("allgather", "broadcast"):
        config = zf.Config(
            offload_params="cpu", offload_optimizer="cpu", param_dtype=torch.float32, partition=mode
        )
        losses, final, _, _, metrics = train(TILED, config, rank=rank, world=world_size)
        assert metrics["tile_fetches_prefetched"] > 0
        out[mode] = (losses, [t.numpy() for t in optree.tree_leaves(untile_tree(final))])
    return out


def test_tiled_gpt_world_2_matches_untiled_world_1():
    """Each rank trains on its half of every batch; gradients are averaged over ranks
    (reduce-scatter in allgather mode, reduce to the layer's owner in broadcast mode, whose tiles it
    owns too)."""
    config = zf.Config(offload_params="cpu", offload_optimizer="cpu", param_dtype=torch.float32)
    base_losses, base_final, _, _, _ = train(CFG, config)
    for per_rank in run_world(2, _world_run):
        for losses, leaves in per_rank.values():
            assert losses == pytest.approx(base_losses, rel=1e-5)
            assert (
                max(
                    float((torch.from_numpy(a) - b).abs().max())
                    for a, b in zip(leaves, optree.tree_leaves(base_final), strict=True)
                )
                < 1e-4
            )


def test_plan_shows_tiles():
    state = zf.init(gpt.model(TILED), zf.adamw(lr=1e-3), zf.Config(prefetch_depth=1, grad_accum=2))
    text = zf.plan(state)
    assert "blocks:mlp.fc.w: RowTiles of (128, 32), 3 tiles over dim 0" in text
    assert "blocks:attn.proj.w: ColTiles of (32, 32), 2 tiles over dim 1" in text
    assert "head:lm_head.w: RowTiles of (64, 32), 5 tiles over dim 0" in text
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "fetch backward blocks.1" in line)
    block = lines[start + 1 : start + 9]
    assert all(line.strip().startswith("tile") for line in block)
    assert "forward  mlp.fc.w       tiles 0..2 (3 fetches)  x 2 micro-batches" in block[2]
    assert "backward mlp.fc.w       tiles 2..0 (3 fetches)" in block[5]
    assert "tile" not in zf.plan(zf.init(gpt.model(CFG), zf.adamw(lr=1e-3)))


def test_gather_params_and_eval_step_with_tiles():
    config = zf.Config(param_dtype=torch.float32)
    tiled = zf.init(gpt.model(TILED), zf.adamw(lr=1e-3), config)
    plain = zf.init(gpt.model(CFG), zf.adamw(lr=1e-3), config)
    full = zf.gather_params(tiled)
    assert (
        isinstance(full["head"]["lm_head"]["w"], tiling.RowTiles)
        and len(full["head"]["lm_head"]["w"].tiles) == 5
    )
    assert [t.shape for t in full["blocks"][2]["attn"]["proj"]["w"].tiles] == [(32, 16), (32, 16)]
    assert max_abs_diff(untile_tree(full), zf.gather_params(plain)) == 0.0
    batch = make_batches(CFG, 1, 4, seed=3)[0]
    assert float(zf.eval_step(tiled, batch)) == pytest.approx(
        float(zf.eval_step(plain, batch)), rel=1e-6
    )


# -- tiles requested in another order than planned
# -----------------------------------------------------

D = 24


def _odd_model(tiles: int) -> Model:
    """Blocks whose tree order (a, b) is not their use order (b, then a): the plan predicts
    wrong."""

    def block_init(gen, i):
        a, b = (torch.randn(D, D, generator=gen) * 0.2 for _ in range(2))
        if tiles > 1:
            a, b = tiling.tile(a, tiles, axis=0), tiling.tile(b, tiles, axis=1)
        return {"a": a, "b": b}

    def block_apply(p, x):  # tiling.linear runs F.linear for a plain tensor: the untiled twin
        return x + torch.tanh(tiling.linear(torch.tanh(tiling.linear(x, p["b"])), p["a"]))

    def head_apply(p, x, batch):
        return ((x * p["s"] - batch["y"]) ** 2).mean()

    return Model(
        embed=Stage(lambda gen: {"s": torch.ones(D)}, lambda p, batch: batch["x"] * p["s"]),
        block=Stage(block_init, block_apply),
        head=Stage(lambda gen: {"s": torch.ones(D)}, head_apply),
        n_layers=2,
    )


def test_out_of_plan_order_tiles_still_train_correctly():
    gen = torch.Generator().manual_seed(5)
    data = [
        {"x": torch.randn(6, D, generator=gen), "y": torch.randn(6, D, generator=gen)}
        for _ in range(3)
    ]
    results = []
    for tiles, depth in ((1, 1), (4, 2), (4, 0)):
        state = zf.init(
            _odd_model(tiles),
            zf.sgd(lr=0.1),
            zf.Config(param_dtype=torch.float32, prefetch_depth=depth),
        )
        losses, metrics = [], []
        for batch in data:
            state, m = zf.train_step(state, batch)
            losses.append(m["loss"])
            metrics.append(m)
        results.append((losses, untile_tree(zf.gather_params(state)), metrics))
        assert view(state).counters().live_layers == 0  # every tile fetched ahead was given back
    (base, base_p, _), (got, got_p, m), (got0, got0_p, m0) = results
    assert (
        m[0]["tile_fetches_on_demand"] > 0 and m[0]["tile_fetches_wasted"] > 0
    )  # the first plan was wrong,
    assert (
        m[-1]["tile_fetches_on_demand"] == m[-1]["tile_fetches_wasted"] == 0
    )  # later ones use b, then a ...
    assert m0[-1]["tile_fetches_prefetched"] == 0
    for losses, params in ((got, got_p), (got0, got0_p)):  # ... and the training is the same
        assert losses == pytest.approx(base, rel=1e-6)
        assert (
            max_abs_diff(params, base_p) < 1e-6
        )  # SGD: differences stay at the fp32 sum-order level


def test_tile_plan_follows_use_order_and_the_prefetcher_hits():
    """optree sorts a block's keys (attn.proj before attn.qkv) but apply uses qkv first: the first
    apply of a stage records its order, so the tiles are fetched in exactly the planned order from
    then on."""
    for depth, k in ((1, 1), (2, 2)):
        state = zf.init(
            gpt.model(TILED),
            zf.adamw(lr=1e-3),
            zf.Config(param_dtype=torch.float32, prefetch_depth=depth, grad_accum=k),
        )
        assert "attn.proj.w" in zf.plan(state).split("attn.qkv.w")[1]  # before any step: tree order
        ops_per_unit = (2 + 3) * k  # block 0's forward: qkv and proj tiles, per micro-batch
        for step, batch in enumerate(make_batches(CFG, 3, 4, seed=2)):
            state, m = zf.train_step(state, batch)
            if step == 0:  # only block 0's forward, which shows the order, can miss
                assert 0 < m["tile_fetches_on_demand"] <= ops_per_unit
            else:
                assert m["tile_fetches_on_demand"] == m["tile_fetches_wasted"] == 0, m
        block = [
            line.split()[2]
            for line in zf.plan(state).splitlines()
            if line.strip().startswith("tile  forward")
        ]
        assert block[:4] == ["attn.qkv.w", "attn.proj.w", "mlp.fc.w", "mlp.proj.w"]
        lines = zf.plan(
            state
        ).splitlines()  # a backward unit's recompute: every tiled leaf but the last linear
        start = next(i for i, line in enumerate(lines) if "fetch backward blocks.1" in line)
        assert [line.split()[1:3] for line in lines[start + 1 : start + 8]] == [
            ["forward", "attn.qkv.w"],
            ["forward", "attn.proj.w"],
            ["forward", "mlp.fc.w"],
            ["backward", "mlp.proj.w"],
            ["backward", "mlp.fc.w"],
            ["backward", "attn.proj.w"],
            ["backward", "attn.qkv.w"],
        ]
    # The fetches a step makes, in order, are the plan's tile ops (depth 0: each one asked for on
    # demand).
    state = zf.init(
        gpt.model(TILED), zf.adamw(lr=1e-3), zf.Config(param_dtype=torch.float32, prefetch_depth=0)
    )
    batches = make_batches(CFG, 2, 4, seed=2)
    state, _ = zf.train_step(state, batches[0])
    v, fetched = view(state), []
    log_fetches(state, fetched)
    zf.train_step(state, batches[1])
    ops, _ = step_tile_plan(v.tiles, train_plan(units(v.n_layers)), 1, train=True)
    assert [u for _, u in fetched if isinstance(u, TileUnit)] == [op.unit for op in ops]


def test_tile_runs_cut_the_plan_into_adjacent_tiles_of_one_leaf():
    """``tiling.runs.cut_runs``: the plan's ops in order, each run adjacent tiles of one leaf and
    direction inside one unit's section, at most ``length`` long; ``Runs.before`` counts the runs
    before a section's end."""
    state = zf.init(gpt.model(TILED), zf.adamw(lr=1e-3), zf.Config(param_dtype=torch.float32))
    ops, sections = step_tile_plan(
        view(state).tiles, train_plan(units(view(state).n_layers)), 1, train=True
    )
    for length in (1, 2, 16):
        runs = cut_runs(ops, sections, lambda unit, n=length: n)
        assert [u for run in runs.runs for u in run.units] == [op.unit for op in ops]
        assert [runs.run_of[j] for j in runs.start] == list(range(len(runs.runs)))
        for r, run in enumerate(runs.runs):
            first = runs.start[r]
            mine = ops[first : first + len(run.units)]
            assert 1 <= len(run.units) <= length and run.row == tuple(u.row for u in run.units)
            assert len({(op.unit.group, op.direction) for op in mine}) == 1
            assert all(
                abs(a.unit.tile - b.unit.tile) == 1 for a, b in zip(mine, mine[1:], strict=False)
            )
            assert any(lo <= first and first + len(mine) <= hi for lo, hi in sections)
        assert [runs.before(hi) for _, hi in sections] == sorted(
            runs.before(hi) for _, hi in sections
        )
        if length == 1:
            assert len(runs.runs) == len(ops)
    zf.close(state)


def test_tiles_fetched_just_in_time_and_grads_leave_at_once():
    """Event log of one step: a tile's gradient is reduce-scattered before the next tile is
    fetched."""
    state = zf.init(
        gpt.model(TILED), zf.adamw(lr=1e-3), zf.Config(param_dtype=torch.float32, prefetch_depth=0)
    )
    log = []
    log_fetches(state, log, grads=True)
    state, _ = zf.train_step(state, make_batches(CFG, 1, 4, seed=2)[0])
    fc = [
        (kind, u.tile) for kind, u in log if getattr(u, "path", None) == "mlp.fc.w" and u.layer == 1
    ]
    forward, recompute, backward = fc[:3], fc[3:6], fc[6:]
    assert forward == recompute == [("fetch", 0), ("fetch", 1), ("fetch", 2)]
    assert backward == [
        ("fetch", 2),
        ("grad", 2),
        ("fetch", 1),
        ("grad", 1),
        ("fetch", 0),
        ("grad", 0),
    ]
    # The block's last linear: the recorded graph's recompute stops before it (nothing reads its
    # output).
    proj = [
        (kind, u.tile)
        for kind, u in log
        if getattr(u, "path", None) == "mlp.proj.w" and u.layer == 1
    ]
    assert proj == forward + backward
    # the block's rest + one tile (+ the head's rest during its loss)
    assert view(state).counters().peak_live_layers <= 3


def test_tiling_errors_name_the_leaf():
    def block_init(gen, i):
        w = torch.randn(8, 8, generator=gen)
        return {"w": tiling.tile(w, 2 if i == 0 else 4, axis=0)}

    bad = Model(
        embed=Stage(lambda gen: {"s": torch.ones(8)}, lambda p, b: b["x"] * p["s"]),
        block=Stage(block_init, lambda p, x: tiling.linear(x, p["w"])),
        head=Stage(lambda gen: {"s": torch.ones(8)}, lambda p, x, b: (x * p["s"]).pow(2).mean()),
        n_layers=2,
    )
    with pytest.raises(
        ValueError, match=r"block.init\(gen, 1\): tiled leaf 'w' differs from layer 0"
    ):
        zf.init(bad, zf.sgd(lr=0.1))
    twice = bad._replace(
        block=Stage(
            lambda gen, i: {"w": tiling.tile(torch.randn(8, 8, generator=gen), 2)},
            lambda p, x: tiling.linear(tiling.linear(x, p["w"]), p["w"]),
        )
    )
    state = zf.init(twice, zf.sgd(lr=0.1), zf.Config(prefetch_depth=0))
    with pytest.raises(ValueError, match=r"blocks.1 w\[1\]: tile 1 of 'w' got 2 gradients"):
        zf.train_step(state, {"x": torch.randn(3, 8)})
