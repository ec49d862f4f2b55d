"""Frozen streamed tiles kept from their forward fetch into their backward (``Config.keep_tiles``,
``tiling.keep``): a LoRA base's experts on NVMe read once a step instead of twice.

A kept tile is the layer its forward fetch made, and its rows are never written, so the backward
computes on the same bits it would read again: every run here is compared bitwise with the same run
keeping nothing (losses and every weight), and the reads it spares are counted exactly where nothing
is fetched ahead (``prefetch_depth=0``: each fetch on demand, after the forward's release).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import optree
import pytest
import torch
from dist_utils import rank_part, run_world
from engine_internals import log_tile_fetches, most_held_rows
from reference import make_batches

import zinf_fn as zf
from layers import llama, lora, moe
from zinf_fn import tiling
from zinf_fn.layout.build import layout
from zinf_fn.overlap import tile_runs
from zinf_fn.planner import auto
from zinf_fn.planner.machine import Machine
from zinf_fn.planner.memory import demands, pool_plan
from zinf_fn.planner.sizes import plan_config
from zinf_fn.planner.timing import predict
from zinf_fn.state import view

# experts of whole NF4 blocks (d 64): their codes lent to the op, each tile its fetched bytes
LENT = moe.Config(n_experts=8, top_k=2, d_model=64, d_ff=64, stream_experts=True)
CFG = llama.Config(
    vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, d_ff=64, n_layers=3, seq_len=8, moe=LENT
)
EXPERTS = ("blocks:mlp.experts.gate_up.w", "blocks:mlp.experts.down.w")
STEPS = 3
ALL = 1 << 30  # room for every tile


def _model(cfg: llama.Config = CFG) -> zf.Model:
    """LoRA on attention: every expert frozen."""
    return lora.apply(llama.model(cfg), rank=2, alpha=4, targets=("attn.q", "attn.v"))


def _config(tmp_path, keep: int, **kw) -> zf.Config:
    kw = {"frozen_storage": "nf4", **kw}
    tmp_path.mkdir(parents=True, exist_ok=True)
    return zf.Config(offload_params="nvme", nvme_path=str(tmp_path), keep_tiles=keep, **kw)


def _train(config: zf.Config, cfg: llama.Config = CFG, watch=None, log=None) -> dict:
    """``STEPS`` steps: their losses, NVMe bytes read, the layers the fetcher holds after each and
    the final weights (tiles untiled); ``watch(state)`` is called once the state is made; ``log``:
    each step's tile fetches (``engine_internals.log_tile_fetches``), a list a step."""
    state = zf.init(_model(cfg), zf.adamw(lr=3e-3, weight_decay=0.1), config, seed=0)
    if watch is not None:
        watch(state)
    fetches: list = []
    if log is not None:
        log_tile_fetches(state, fetches)
    out: dict = {"losses": [], "reads": [], "held": []}
    for batch in make_batches(cfg, STEPS, 4, seed=1):
        state, metrics = zf.train_step(state, batch)
        if log is not None:
            log.append(list(fetches))
            fetches.clear()
        out["losses"].append(metrics["loss"])
        out["reads"].append(metrics["bytes_read.nvme"])
        out["held"].append(view(state).counters().held_layers)
    final = optree.tree_map(tiling.untile, zf.gather_params(state), is_leaf=tiling.is_tiled)
    out["final"] = optree.tree_flatten(final)[0]
    zf.close(state)
    return out


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"], strict=True))


@pytest.mark.parametrize("storage", ["nf4", "int8"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_kept_tiles_train_bitwise_as_tiles_read_again(storage, grad_accum, tmp_path):
    """Lent NF4 codes and decoded int8 values, one micro-batch and two (the second's forward takes
    the first's kept tile too): the same bits as keeping nothing, fewer bytes read every step, and
    every kept tile given back by the step's end (the fetcher holds what it held before)."""
    kw = {"frozen_storage": storage, "grad_accum": grad_accum}
    none = _train(_config(tmp_path / "none", 0, **kw))
    kept = _train(_config(tmp_path / "kept", ALL, **kw))
    _same(kept, none)
    assert all(k < n for k, n in zip(kept["reads"], none["reads"], strict=True))
    assert kept["held"] == none["held"]


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_with_nothing_fetched_ahead_each_kept_tile_is_read_once_a_step(grad_accum, tmp_path):
    """On demand (depth 0) with room for every tile: the reads spared are exactly every tile fetch
    but the first of its row in a step (its backward's, a later micro-batch's), each its row's
    stored bytes, and the tiles fetched are the same, in the same order."""
    logs: dict[int, list] = {0: [], ALL: []}
    runs = {}
    for keep, log in logs.items():
        config = _config(tmp_path / str(keep), keep, prefetch_depth=0, grad_accum=grad_accum)
        runs[keep] = _train(config, log=log)
    _same(runs[ALL], runs[0])
    store = layout(_model(), zf.adamw(), _config(tmp_path / "x", 0)).store
    for step in range(STEPS):
        kept, none = logs[ALL][step], logs[0][step]
        assert [u for u, _ in kept] == [u for u, _ in none]
        read = [u for u, owned in kept if owned]
        assert len({(u.group, u.row) for u in read}) == len(read)  # each row read once
        again = [u for u, owned in kept if not owned]
        spared = sum(store.row_kinds.row_nbytes("param", u.group) for u in again)
        assert again and runs[0]["reads"][step] - runs[ALL]["reads"][step] == spared


def test_the_budget_bounds_the_tiles_kept_at_once(tmp_path, monkeypatch):
    """Room for two experts and a half: at most two tiles of each expert group kept at any time
    (counted at each release), and two kept; the reads between keeping nothing and keeping
    everything (on demand: with fetches ahead, how many predicted experts a step reads in vain
    varies with timing), the bits the same."""
    config = _config(tmp_path / "two", 0, prefetch_depth=0)  # reads that timing cannot move
    store = layout(_model(), zf.adamw(), config).store
    policies = {g: store.row_kinds.policy(g) for g in EXPERTS}
    expert = sum(
        tile_runs.kept_tile_nbytes(store.groups[g], policies[g], torch.float32) for g in EXPERTS
    )
    most: list[dict] = []  # the rows of each expert group held at once, at most (per release)
    budget = 2 * expert + expert // 2
    two = _train(
        dataclasses.replace(config, keep_tiles=budget),
        watch=lambda state: most.append(most_held_rows(state, EXPERTS)),
    )
    none = _train(_config(tmp_path / "none", 0, prefetch_depth=0))
    every = _train(_config(tmp_path / "all", ALL, prefetch_depth=0))
    _same(two, none)
    assert most == [dict.fromkeys(EXPERTS, 2)]
    assert all(
        e < t < n for e, t, n in zip(every["reads"], two["reads"], none["reads"], strict=True)
    )


def test_an_evaluation_keeps_nothing(tmp_path):
    """``zf.eval_step`` has no backward: it keeps no tile, reads what a run keeping nothing reads,
    and computes the same loss."""
    read, losses, held = {}, {}, {}
    for keep in (0, ALL):
        config = _config(tmp_path / str(keep), keep, prefetch_depth=0)  # no reads in vain
        state = zf.init(_model(), zf.adamw(), config, seed=0)
        before = view(state).counters().tiers["param"]["bytes_read"]
        losses[keep] = zf.eval_step(state, make_batches(CFG, 1, 4, seed=1)[0])
        counters = view(state).counters()
        read[keep] = counters.tiers["param"]["bytes_read"] - before
        held[keep] = counters.held_layers  # the layers its read policy holds for good
        zf.close(state)
    assert read[ALL] == read[0] > 0 and torch.equal(losses[ALL], losses[0])
    assert held[ALL] == held[0]


def test_the_fetchers_demand_holds_the_kept_tiles(tmp_path):
    """The pool plan grows by the kept tiles' buffers, each the buffer its layer is (one rank on
    the CPU: the NVMe staging row of the codes), as many as the budget holds of one tile of each
    expert group; several ranks keep none (``kept_tiles``)."""
    model = _model()
    config = _config(tmp_path, 0)
    built = layout(model, zf.adamw(), config)
    store = built.store
    each = {
        g: tile_runs.kept_tile_nbytes(store.groups[g], store.row_kinds.policy(g), torch.float32)
        for g in EXPERTS
    }
    budget = 3 * sum(each.values()) + 1
    assert tile_runs.kept_tiles(store, torch.float32, 1, budget) == dict.fromkeys(EXPERTS, 3)
    assert tile_runs.kept_tiles(store, torch.float32, 2, budget) == {}
    assert tile_runs.kept_tiles(store, torch.float32, 1, sum(each.values()) - 1) == {}

    def fetched(keep: int) -> dict:
        kept = dataclasses.replace(config, keep_tiles=keep)
        part = next(d for d in demands(built, kept) if d.part == "fetched layers")
        counts: dict = {}
        for b in part.buffers:
            counts[b.numel, b.dtype] = counts.get((b.numel, b.dtype), 0) + b.count
        return counts

    without, with_ = fetched(0), fetched(budget)
    grown = {k: with_[k] - without.get(k, 0) for k in with_ if with_[k] != without.get(k, 0)}
    want: dict = {}
    for g in EXPERTS:
        key = (store.groups[g].part.shard_numel, torch.uint8)
        want[key] = want.get(key, 0) + 3
    assert grown == want


def test_keep_tiles_must_be_bytes():
    with pytest.raises(ValueError, match="keep_tiles must be an int >= 0"):
        zf.Config(keep_tiles=-1)


def test_the_planner_subtracts_the_reads_kept_tiles_spare(tmp_path):
    """Planned with the step's batch (every expert read: no ``top_k``), on demand: the NVMe reads
    of a step keeping every tile are the engine's counted ones, and so are those of a step keeping
    none (the tile plan's, tests/planner/test_planner_tile_reads.py); the estimate's moved bytes
    fall by as much."""
    batches = make_batches(CFG, 2, 4, seed=1)
    planned, moved, counted = {}, {}, {}
    for keep in (0, ALL):
        config = _config(tmp_path / str(keep), keep, prefetch_depth=0)
        work = plan_config(_model(), zf.adamw(), config, batches[0], timed=False)
        planned[keep] = work.work.disk.read_forward + work.work.disk.read_backward
        moved[keep] = work.estimate.moved["nvme"]
        state = zf.init(_model(), zf.adamw(), config, seed=0)
        for batch in batches:  # the second step's (the first has no earlier writes to read)
            state, metrics = zf.train_step(state, batch)
        counted[keep] = metrics["bytes_read.nvme"]
        zf.close(state)
    assert planned == counted
    assert moved[0] - moved[ALL] == planned[0] - planned[ALL] > 0


def test_auto_config_fills_the_host_budgets_room_with_kept_tiles(tmp_path):
    """``zf.auto_config``'s chosen placement keeps frozen tiles in the room its host budget leaves,
    at most the bytes a step's forward reads (``planner.auto.with_kept_tiles``): its estimate is the
    one planned keeping that many bytes, grown by the kept buffers and within the budget, with
    fewer NVMe bytes and less disk time; a config that sets ``keep_tiles``, no budget or no room is
    left as it was."""
    batch = make_batches(CFG, 1, 4, seed=1)[0]
    machine = Machine(1e9, 1e9, 1e10, 1e10)
    opt = zf.adamw()

    def picked(budget, keep=0) -> tuple[auto.Candidate, int]:
        config = _config(tmp_path, keep, host_memory_budget=budget)
        planned = plan_config(_model(), opt, config, batch)
        time = predict(planned.estimate, planned.work, machine)
        candidate = auto.Candidate(planned.estimate.config, planned.estimate, time, [])
        return candidate, planned.work.disk.read_forward

    floor, forward = picked(None)
    peak = floor.estimate.host_peak
    for room, keep in ((forward // 2, forward // 2), (1 << 30, forward)):
        first, _ = picked(peak + room)
        chosen = auto.with_kept_tiles(first, _model(), opt, batch, machine)
        assert chosen.config.keep_tiles == keep and not chosen.problems
        assert chosen.estimate == picked(peak + room, keep=keep)[0].estimate
        assert peak < chosen.estimate.host_peak <= chosen.config.host_memory_budget
        assert chosen.estimate.moved["nvme"] < floor.estimate.moved["nvme"]
        assert chosen.time.disk < first.time.disk  # bytes over the machine's bandwidth
    for unchanged in (floor, picked(peak)[0], picked(1 << 30, keep=4096)[0]):
        assert auto.with_kept_tiles(unchanged, _model(), opt, batch, machine) is unchanged
    no_batch = auto.with_kept_tiles(picked(1 << 30)[0], _model(), opt, None, machine)
    assert no_batch.config.keep_tiles == 0


def _world_step(rank: int, world: int, path: str) -> tuple[int, int, float]:
    """(the bytes of this rank's pool keeping ``ALL``, of the pool planned keeping nothing, its
    loss) of one step of this rank's part of a batch, each rank's rows on NVMe under ``path``."""
    config = _config(Path(path) / str(rank), ALL)
    none = dataclasses.replace(config, keep_tiles=0)
    plan = pool_plan(layout(_model(), zf.adamw(), none), none)
    state = zf.init(_model(), zf.adamw(), config, seed=0)
    batch = rank_part(make_batches(CFG, 1, 4, seed=1)[0], rank, world)
    state, metrics = zf.train_step(state, batch)
    made = view(state).counters().pool_bytes
    zf.close(state)
    return made, sum(n * dtype.itemsize * c for (n, dtype, _), c in plan.items()), metrics["loss"]


def test_several_ranks_keep_nothing(tmp_path):
    """With two ranks each fetch is a collective, and a backward fetch issued ahead of the keep on
    one rank and not on the other would part them: the engine keeps no tile there, its pool the
    one planned keeping nothing (one rank's holds the kept tiles besides), and the ranks' steps
    agree."""
    made, none, _ = _world_step(0, 1, str(tmp_path / "one"))
    assert made > none
    ranks = run_world(2, _world_step, str(tmp_path / "two"))
    assert [made == none for made, none, _ in ranks] == [True, True]
    assert ranks[0][2] == ranks[1][2]
