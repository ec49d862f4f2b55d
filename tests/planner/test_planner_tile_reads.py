"""The planner's NVMe reads of tiled weights are the tile fetches the engine makes: the tile plan's
(``tiling.plan.step_reads``), against the engine's own ``bytes_read.nvme`` counters and its logged
fetches. A block's tiles are read three times a step where its backward recomputes (forward, the
recompute, the backward), twice where the block kept its activations; a trained head twice, a
frozen one once; an embedding's used tiles once per unit fetch (its backward reads none).
"""

from __future__ import annotations

import dataclasses

import pytest
from engine_internals import log_fetches
from reference import make_batches

import zinf_fn as zf
from layers import llama, lora
from zinf_fn.planner.sizes import plan_config
from zinf_fn.tiling.layout import TileUnit

# every id in every tile (the batches' ids cover the vocabulary), so the planned reads (every
# tile) are the used ones
CFG = llama.Config(
    vocab_size=32,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    d_ff=48,
    seq_len=32,
    n_layers=2,
    mlp_tiles=2,
    head_tiles=4,
    embed_tiles=2,
)
KEEP_ALL = 1 << 40  # Config.keep_activations: room for every block's tape


def model(frozen: bool) -> zf.Model:
    m = llama.model(CFG)
    return lora.apply(m, rank=2, alpha=4, targets=("attn.q", "attn.v")) if frozen else m


def config(tmp_path, keep: int, optimizer: str = "cpu") -> zf.Config:
    return zf.Config(
        offload_params="nvme",
        offload_optimizer=optimizer,
        nvme_path=str(tmp_path),
        keep_activations=keep,
    )


def engine_step(m: zf.Model, cfg: zf.Config, batches: list) -> tuple[dict, list]:
    """The last step's metrics and its logged tile fetches (the second step: the first has no
    previous writes to wait for, else the same)."""
    state = zf.init(m, zf.adamw(), cfg)
    log: list = []
    log_fetches(state, log)
    for b in batches:
        log.clear()
        state, metrics = zf.train_step(state, b)
    zf.close(state)
    return metrics, [u for _, u in log if isinstance(u, TileUnit)]


def nvme_read(metrics: dict) -> int:
    return sum(
        v
        for k, v in metrics.items()
        if k.startswith("bytes_read.") and "nvme" in k and "inflight" not in k
    )


CASES = {
    "trained": (False, 0),
    "trained-kept": (False, KEEP_ALL),
    "lora": (True, 0),
    "lora-kept": (True, KEEP_ALL),
}


@pytest.mark.parametrize("case", CASES)
def test_planned_reads_are_the_engines_counted_reads(case, tmp_path):
    frozen, keep = CASES[case]
    batches = make_batches(CFG, 2, 4, seed=1)
    m, cfg = model(frozen), config(tmp_path, keep)
    work = plan_config(m, zf.adamw(), cfg, batches[0], timed=False).work
    metrics, tiles = engine_step(m, cfg, batches)
    assert work.disk.read_forward + work.disk.read_backward == nvme_read(metrics)
    # the logged fetches, per leaf: what the tile plan counts
    per_leaf = {path: sum(u.path == path for u in tiles) for path in {u.path for u in tiles}}
    layers, blocks = CFG.n_layers, 3 if not keep else 2  # block tiles: fwd, recompute, bwd
    assert per_leaf["lm_head.w"] == CFG.head_tiles * (1 if frozen else 2)
    assert per_leaf["tok.w"] == CFG.embed_tiles * (1 if frozen else 2)
    assert per_leaf["mlp.up.w"] == CFG.mlp_tiles * layers * blocks
    assert sum(work.tile_fetches) == len(tiles)


def test_a_frozen_head_is_read_once_and_a_trained_one_twice(tmp_path):
    """The head's tile reads alone: the trained model's step reads its head tiles twice, the LoRA
    model's once; both planned so."""
    reads = {}
    for frozen in (False, True):
        path = tmp_path / str(frozen)
        path.mkdir()
        m, cfg = model(frozen), config(path, KEEP_ALL)
        metrics, tiles = engine_step(m, cfg, make_batches(CFG, 2, 4, seed=1))
        reads[frozen] = [u.tile for u in tiles if u.path == "lm_head.w"]
    assert reads[True] == list(range(CFG.head_tiles))
    assert reads[False] == [*range(CFG.head_tiles), *reversed(range(CFG.head_tiles))]


def test_nvme_optimizer_tile_reads_are_counted_too(tmp_path):
    """Masters on NVMe (lent to a unit's backward fetch): a tile's fetch still reads its row, as
    the tile plan counts it."""
    m = llama.model(dataclasses.replace(CFG, embed_tiles=1))
    cfg = config(tmp_path, 0, optimizer="nvme")
    batches = make_batches(CFG, 2, 4, seed=1)
    disk = plan_config(m, zf.adamw(), cfg, batches[0], timed=False).work.disk
    metrics, _ = engine_step(m, cfg, batches)
    assert disk.read_forward + disk.read_backward == nvme_read(metrics)
