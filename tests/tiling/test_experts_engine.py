"""Experts streamed as fetch units of the engine: a MoE decoder with ``stream_experts`` trains
bitwise like the same decoder with each block fetched whole (every placement, grad_accum 2, world
2), and an expert no token chose is not fetched in the backward, yet moves as torch's AdamW moves a
weight whose gradient is zero.

No tolerance: the two runs store the same values and make the same fp32 products in the same order
(``tests/tiling/test_experts.py``); a tile's update is the same elementwise AdamW as its slice of
the block's row, so losses and weights agree bitwise.
"""

from __future__ import annotations

import dataclasses
import threading

import optree
import pytest
import torch
from dist_utils import rank_part, run_world
from engine_internals import log_fetches
from llama_reference import placement_config
from reference import make_batches

import zinf_fn as zf
from layers import llama, lora, moe
from zinf_fn import tiling
from zinf_fn.formats import codebook
from zinf_fn.overlap import fetch, tile_runs
from zinf_fn.overlap.plan import train_plan
from zinf_fn.state import units, view
from zinf_fn.tiling.layout import TileUnit
from zinf_fn.tiling.plan import step_tile_plan, unit_passes, unit_tile_ops
from zinf_fn.tiling.routed import Routes, rerouted, routed_pass
from zinf_fn.tiling.runs import cut_runs

MOE = moe.Config(n_experts=8, top_k=2, d_model=32, d_ff=16)
CFG = llama.Config(
    vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2, seq_len=8, moe=MOE
)
STEPS = 3
LR, WD = 3e-3, 0.1


def model(stream: bool, cfg: llama.Config = CFG) -> zf.Model:
    return llama.model(
        dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, stream_experts=stream))
    )


def untiled(tree):
    return optree.tree_map(tiling.untile, tree, is_leaf=tiling.is_tiled)


def train(stream: bool, config: zf.Config, rank: int = 0, world: int = 1, batch: int = 4):
    """(losses, final weights untiled, last step's metrics) of STEPS steps."""
    state = zf.init(model(stream), zf.adamw(lr=LR, weight_decay=WD), config, seed=0)
    losses = []
    for b in make_batches(CFG, STEPS, batch, seed=1):
        state, metrics = zf.train_step(state, rank_part(b, rank, world))
        losses.append(metrics["loss"])
    final = untiled(zf.gather_params(state))
    zf.close(state)
    return losses, final, metrics


def assert_same(a, b) -> None:
    assert a[0] == b[0]
    assert all(
        torch.equal(x, y)
        for x, y in zip(optree.tree_leaves(a[1]), optree.tree_leaves(b[1]), strict=True)
    )


CASES = {"none": ("none", 1), "cpu-accum-2": ("cpu", 2), "nvme": ("nvme", 1)}


def record_tile_issue(monkeypatch) -> set[str]:
    """The names of the threads ``Fetcher.start`` issues tile units' reads on, filled as it runs."""
    threads: set[str] = set()
    start = fetch.Fetcher.start

    def recorded(self, unit, derive=False):
        if isinstance(unit, TileUnit):
            threads.add(threading.current_thread().name)
        return start(self, unit, derive)

    monkeypatch.setattr(fetch.Fetcher, "start", recorded)
    return threads


@pytest.mark.parametrize("case", CASES)
def test_streamed_experts_train_bitwise_like_the_whole_block(case, tmp_path, monkeypatch):
    placement, k = CASES[case]
    tile_threads = record_tile_issue(monkeypatch)
    results = []
    for stream in (False, True):
        path = tmp_path / str(stream)
        path.mkdir()
        config = placement_config(placement, path, grad_accum=k)
        results.append(train(stream, config))
    assert_same(*results)
    assert results[1][2]["tile_fetches_prefetched"] > 0
    if placement == "nvme":  # the experts' reads issued on the issue thread, not the compute one
        assert tile_threads == {"zinf-issue_0"}


WORLD_CONFIG = dict(
    offload_params="cpu", offload_optimizer="cpu", param_dtype=torch.float32, prefetch_depth=2
)


def _world_train(rank: int, world_size: int, stream: bool) -> tuple[list, list]:
    losses, final, _ = train(stream, zf.Config(**WORLD_CONFIG), rank, world_size)
    return losses, [x.numpy() for x in optree.tree_leaves(final)]


def _world_run(rank: int, world_size: int) -> list:
    """This rank's runs in one world: the whole block's, then the streamed experts' with the
    default runs and with runs of one tile (every expert its own prefetch item)."""
    runs = [_world_train(rank, world_size, False)]
    for run_bytes in (tile_runs.TILE_RUN_BYTES, 1):
        tile_runs.TILE_RUN_BYTES = run_bytes  # a spawned process of its own: nothing to restore
        runs.append(_world_train(rank, world_size, True))
    return runs


def test_streamed_experts_world_2_match_the_whole_block_world_2():
    """Each expert's tile is sharded and gathered like a layer; every rank routes its own half of
    the batch, and computes the union of both ranks' experts (some on no rows), so both fetch and
    reduce-scatter the same tiles in the same order, and the gradients sum as the whole block's
    do. With runs of one tile every expert is its own prefetch item, planned from the routing."""
    for (want_losses, want), *streamed in run_world(2, _world_run):
        for losses, leaves in streamed:
            assert losses == want_losses
            assert all((a == b).all() for a, b in zip(leaves, want, strict=True))


# -- an expert without tokens ----------------------------------------------------------------------

ONE = dataclasses.replace(CFG, n_layers=1, moe=dataclasses.replace(MOE, top_k=1))


def test_an_expert_without_tokens_is_not_fetched_in_backward_and_moves_as_adamw():
    """One step of 4 tokens, top-1 of 8 experts: at least 4 experts take no token. The backward
    fetches only the experts the forward did; an untouched expert's weights move as
    ``torch.optim.AdamW(fused=True)`` moves them on a zero gradient (its moments stay zero, the
    weight decays), bitwise."""
    config = zf.Config(param_dtype=torch.float32, prefetch_depth=0)
    state = zf.init(model(True, ONE), zf.adamw(lr=LR, weight_decay=WD), config, seed=0)
    before = zf.gather_params(state)["blocks"][0]["mlp"]["experts"]
    log = []
    log_fetches(state, log)
    state, _ = zf.train_step(state, _tokens(4))
    tiles = [(u.path, u.tile) for _, u in log if isinstance(u, TileUnit)]
    half = len(tiles) // 2  # one block: its forward unit's fetches, then its backward unit's
    forward, backward = tiles[:half], tiles[half:]
    used = sorted({t for _, t in forward})
    assert set(backward) <= set(forward) and len(used) <= 4
    assert sorted({t for _, t in backward}) == used  # only what the tokens touched
    after = zf.gather_params(state)["blocks"][0]["mlp"]["experts"]
    unused = [e for e in range(MOE.n_experts) if e not in used]
    for name in ("gate_up", "down"):
        for e in unused:
            w = before[name]["w"].tiles[e].clone().requires_grad_(True)
            opt = torch.optim.AdamW(
                [w], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD, fused=True
            )
            w.grad = torch.zeros_like(w)
            opt.step()
            assert torch.equal(after[name]["w"].tiles[e], w.detach()), (name, e)
        assert not torch.equal(after[name]["w"].tiles[used[0]], before[name]["w"].tiles[used[0]])
    zf.close(state)


def _tokens(n: int) -> dict:
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, ONE.vocab_size, (1, n + 1), generator=gen)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


# -- LoRA over a frozen quantized base -------------------------------------------------------------

LORA_TARGETS = ("attn.q", "attn.v", "mlp.experts.gate_up", "mlp.experts.down")


@pytest.mark.parametrize("storage", ["nf4", "int8"])
def test_lora_on_a_quantized_base_with_streamed_experts_equals_the_whole_block(storage):
    """A frozen expert tile is stored as codes as the whole block's frozen row is (its elements a
    multiple of the 64-element block, so every block of codes is one expert's either way): the LoRA
    steps are bitwise the whole block's, and each expert tile's row is its codes, not 16-bit values.
    The whole block's LoRA equals PEFT's (tests/models/test_moe_lora.py,
    tests/models/test_peft.py)."""
    results, states = [], []
    for stream in (False, True):
        m = lora.apply(model(stream), rank=2, alpha=4, targets=LORA_TARGETS)
        state = zf.init(
            m, zf.adamw(lr=LR, weight_decay=WD), zf.Config(frozen_storage=storage), seed=0
        )
        losses = []
        for b in make_batches(CFG, STEPS, 4, seed=1):
            state, metrics = zf.train_step(state, b)
            losses.append(metrics["loss"])
        results.append((losses, untiled(zf.gather_params(state))))
        states.append(state)
    assert_same(*results)
    v = view(states[1])
    group = "blocks:mlp.experts.gate_up.w"
    values = 2 * MOE.d_ff * MOE.d_model  # one expert's gate_up
    assert v.dtype("param", group) == torch.uint8
    assert v.shard_numel(group) == -(-codebook.leaf_nbytes(storage, values) // 4) * 4
    for state in states:
        zf.close(state)


# -- the tile plan follows the routing -------------------------------------------------------------

WIDE = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, n_experts=16, top_k=1))


@pytest.mark.parametrize("k", [1, 2])
def test_the_prefetcher_fetches_the_routed_experts_ahead(k, monkeypatch):
    """Runs of one tile (``TILE_RUN_BYTES`` 1 byte: every expert its own prefetch item), 16 experts,
    top-1 over 16 tokens a step: the plan told the routing fetches every expert the op asks for
    ahead (none on demand), and wastes at most the fetches its window issued for a forward pass
    before the router ran (the streamed experts' window, ``tile_runs.window_runs``, per layer and
    micro-batch: the last step's routing, its prior, differs). Without the routing the plan's
    every-expert order misses almost every fetch (measured: 0 of 90 prefetched, 178 wasted, in the
    first step at k=1)."""
    monkeypatch.setattr(tile_runs, "TILE_RUN_BYTES", 1)
    depth = 2
    window = tile_runs.window_runs([4 * 2 * WIDE.moe.d_ff * WIDE.d_model], depth)  # fp32 gate_up
    config = zf.Config(param_dtype=torch.float32, prefetch_depth=depth, grad_accum=k)
    state = zf.init(model(True, WIDE), zf.adamw(lr=LR), config, seed=0)
    for step, b in enumerate(make_batches(WIDE, 3, 2, seed=1)):
        state, metrics = zf.train_step(state, b)
        assert metrics["tile_fetches_on_demand"] == 0, (step, metrics)
        assert metrics["tile_fetches_prefetched"] > 0
        if step:  # the first step's plan also learns the order of use (tree order until then)
            assert metrics["tile_fetches_wasted"] <= window * WIDE.n_layers * k, metrics
    zf.close(state)


def test_a_routed_pass_fetches_the_experts_in_the_order_the_op_computes_them():
    """``tiling.routed.routed_pass``: the planned pass (every expert, leaf by leaf) becomes the
    routed experts, each expert's two linears in turn, in forward, and the reverse in backward."""
    state = zf.init(model(True), zf.adamw(lr=LR), zf.Config(param_dtype=torch.float32))
    v = view(state)
    plan = train_plan(units(v.n_layers))
    i = next(j for j, op in enumerate(plan) if op.phase == "backward" and op.unit.row == 1)
    planned = unit_passes(v.tiles, plan[i], 1, train=True)[0]
    leaves = {leaf.path.split(".")[2]: leaf for leaf in v.tiles.leaves["blocks"]}
    assert len(planned.forward) == 2 * MOE.n_experts  # every expert, leaf by leaf (tree order)
    order = tuple(
        v.tiles.tile_unit(leaves[name], plan[i].unit, e)
        for e in (1, 3)
        for name in ("gate_up", "down")
    )
    routed = routed_pass(planned, order, recomputes=True)
    names = [
        (op.unit.path.split(".")[2], op.unit.tile, op.direction)
        for op in (*routed.forward, *routed.backward)
    ]
    assert names == [
        ("gate_up", 1, "forward"),
        ("down", 1, "forward"),
        ("gate_up", 3, "forward"),
        ("down", 3, "forward"),
        ("down", 3, "backward"),
        ("gate_up", 3, "backward"),
        ("down", 1, "backward"),
        ("gate_up", 1, "backward"),
    ]
    zf.close(state)


def test_a_rerouted_plan_reads_as_the_routed_plan_cut_whole():
    """``tiling.routed.rerouted`` cuts anew only the sections a routing changed; its step-wide
    views (ops, runs, the run of each op, the first op of each run) are those of the whole routed
    plan cut at once (``cut_runs``), sections after the changed ones shifted."""
    state = zf.init(model(True), zf.adamw(lr=LR), zf.Config(param_dtype=torch.float32))
    assert "blocks:mlp.experts.gate_up.w: RowTiles of (8, 32, 32), 8 experts" in zf.plan(state)
    v = view(state)
    plan = train_plan(units(v.n_layers))
    routes = Routes(v.tiles, plan, 1, train=True)
    runs = cut_runs(*step_tile_plan(v.tiles, plan, 1, True), lambda unit: 3)
    i = next(j for j, op in enumerate(plan) if op.phase == "forward" and op.unit.group == "blocks")
    leaves = sorted(v.tiles.leaves["blocks"], key=lambda leaf: leaf.path, reverse=True)
    order = tuple(v.tiles.tile_unit(leaf, plan[i].unit, e) for e in (0, 5) for leaf in leaves)
    changed = routes.tell(i, order)
    assert len(changed) == 2  # the forward unit and its layer's backward unit
    got = rerouted(runs, routes, changed, runs.section(i)[0], lambda unit: 3)
    ops = [op for j in range(len(plan)) for op in routes.section_ops(j)]
    sections = [got.section(j) for j in range(len(plan))]
    want = cut_runs(ops, sections, lambda unit: 3)
    assert list(got.ops) == ops and len(ops) < len(runs.ops)
    assert list(got.runs) == list(want.runs)
    assert list(got.run_of) == list(want.run_of) and list(got.start) == list(want.start)
    assert [got.before(end) for _, end in sections] == [want.before(end) for _, end in sections]
    zf.close(state)


def test_the_planned_passes_kept_across_steps_follow_the_order_the_layout_learns():
    """``Routes(known=)``: the planned passes of a unit fetch, kept by the engine from step to step
    (``TileEngine.passes``), are those ``unit_passes`` makes for the layout's learnt order now: a
    second step's ``Routes`` reuses them, and once the layout learns another order of use
    (``TileLayout.observe_use``) the sections are that order's."""
    state = zf.init(model(True), zf.adamw(lr=LR), zf.Config(param_dtype=torch.float32))
    v = view(state)
    plan = train_plan(units(v.n_layers))
    known: dict = {}

    def sections(routes: Routes) -> list:
        return [routes.section_ops(j) for j in range(len(plan))]

    def fresh() -> list:
        return [unit_tile_ops(v.tiles, op, 1, True) for op in plan]

    first = Routes(v.tiles, plan, 1, train=True, known=known)
    assert sections(first) == fresh() and known
    made = dict(known)
    again = Routes(v.tiles, plan, 1, train=True, known=known)
    assert sections(again) == fresh() and known == made  # reused, none made anew
    used = list(reversed(v.tiles.use_order["blocks"]))
    assert v.tiles.observe_use("blocks", used)  # the applies used the leaves the other way round
    later = Routes(v.tiles, plan, 1, train=True, known=known)
    assert sections(later) == fresh() != sections(again)
    zf.close(state)


def test_the_step_counts_the_experts_its_routing_computed():
    """``experts_routed`` (a step's metric) counts (layer, micro-batch, expert) triples the routed
    ops computed in forward: with top_k = E every token chooses every expert, so it is exactly
    layers x micro-batches x E, whatever the weights (an embedding in tiles, whose lookup routes
    its tiles too, adds none); without streamed experts there are none."""
    every = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, top_k=MOE.n_experts))
    state = zf.init(model(True, dataclasses.replace(every, embed_tiles=2)), zf.adamw(), zf.Config())
    state, metrics = zf.train_step(state, make_batches(every, 1, 4, seed=1)[0])
    assert metrics["experts_routed"] == every.n_layers * MOE.n_experts
    zf.close(state)
    for k in (1, 2):
        state = zf.init(model(True, every), zf.adamw(), zf.Config(grad_accum=k), seed=0)
        for b in make_batches(every, 2, 4, seed=1):
            state, metrics = zf.train_step(state, b)
            assert metrics["experts_routed"] == every.n_layers * k * MOE.n_experts
        zf.close(state)
    state = zf.init(model(False, every), zf.adamw(), zf.Config(), seed=0)
    state, metrics = zf.train_step(state, make_batches(every, 1, 4, seed=1)[0])
    assert metrics.get("experts_routed", 0) == 0
    zf.close(state)
