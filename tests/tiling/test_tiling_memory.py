"""The memory contract of tiling, measured: a large layer's working memory falls about T-fold with
T.

``benchmarks/tiling.py`` measures, in a fresh subprocess, one training step of a one-layer model (a
GPT block of hidden size 2048: 50M parameters, 192 MiB in fp32) with bf16 parameters in CPU memory:
working memory = peak RSS of the step minus the RSS after ``zf.init`` (the resident model states),
after a warm-up model has paid the lazy imports. 64 tokens keep the activations (~1 MiB per (64, 4d)
tensor) small beside the weights, so what changes with T is the weight-related part.

Untiled, the step holds the whole layer at once (fp32 cast of the stored row, fp32 gradient from the
vjp and the flat gradient: ~12 bytes per parameter, ~580 MiB; ~680 MiB while a bf16 gather copy came
first). Tiled, it holds a few tiles: the one in use and the one prefetched (fp32) and a tile
gradient or two in flight, per distinct tile size, which is up to ~2x the untiled bytes per
parameter of a tile, but a tile is 1/T of one matrix, while the untiled unit is all four. Observed:
583 / 132 / 46 MiB for T = 1 / 4 / 16 (4.4x and 12.7x). The test asserts a strict fall and at least
T/2-fold: working(T) <= 2 * working(1) / T.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import zinf_fn as zf
from layers import gpt
from zinf_fn.io.buffers import BufferPool
from zinf_fn.state import view

_SPEC = importlib.util.spec_from_file_location(
    "bench_tiling", Path(__file__).parents[2] / "benchmarks" / "tiling.py"
)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_working_memory_of_a_large_layer_falls_with_tiles():
    rows = bench.run_probe("block", 2048, [1, 4, 16], tokens=64)
    work = {r["tiles"]: r["working_bytes"] for r in rows}
    fp32_layer = rows[0]["layer_params"] * 4
    assert work[1] > fp32_layer  # untiled: more than the whole layer in fp32 is live at once
    assert work[1] > work[4] > work[16]
    for t in (4, 16):
        assert work[t] <= 2 * work[1] / t, (
            f"T={t}: {work[t] / 2**20:.1f} MiB vs untiled {work[1] / 2**20:.1f} MiB"
        )
    # A few tiles of one matrix, not the layer. Peak RSS near this size varies by a few MiB between
    # runs (45.6, 46.5 and 49.5 MiB measured for T=16 against a 48 MiB = fp32_layer / 4 line), so
    # the line is drawn at a third of the fp32 layer: still far below the ~680 MiB untiled step.
    assert work[16] < fp32_layer / 3


# -- the staging pool stays bounded with tiles
# ----------------------------------------------------------


def test_pool_reuses_buffers_when_the_device_is_spelled_without_its_index():
    """``torch.device("cuda")`` and ``"cpu:0"`` name the device tensors report as ``cuda:0`` /
    ``cpu``: a buffer given back must land where the next ``take`` looks, or every take makes a new
    one."""
    pool = BufferPool(limit_per_key=2)
    for _ in range(5):
        pool.give(pool.take(64, torch.bfloat16, torch.device("cpu", 0)))
    assert pool.count == 1 and pool.out == 0
    with pytest.raises(AssertionError, match="did not make"):
        pool.give(torch.empty(3))


def test_tiled_gpt_pool_is_flat_when_tiles_keep_their_gathered_buffer(tmp_path):
    """The path of ``benchmarks/tiling.py --check --device cuda``: the device is named without its
    index, the stored rows are not views on the compute device (NVMe here, host memory under CUDA),
    so every tile is staged and gathered into a pool buffer, and param_dtype == compute_dtype, so no
    cast copy is made and the gathered buffer is the tile the op uses until it is released. 3 steps
    x 2 layers x 2 tiled linears x 7 tiles, each fetched 3 times, are far more takes of one key than
    the pool's limit (44 at depth 1): the pool must reuse its buffers, not grow."""
    cfg = gpt.Config(
        vocab_size=256,
        d_model=64,
        n_heads=2,
        n_layers=2,
        seq_len=16,
        attn_tiles=4,
        mlp_tiles=7,
        head_tiles=16,
    )
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="cpu",
        nvme_path=str(tmp_path),
        device="cpu:0",
        param_dtype=torch.float32,
        compute_dtype=torch.float32,
    )
    state = zf.init(gpt.model(cfg), zf.adamw(lr=1e-3), config)
    gen = torch.Generator().manual_seed(0)
    counts = []
    for _ in range(3):
        tokens = torch.randint(0, 256, (2, 17), generator=gen)
        state, metrics = zf.train_step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
        counts.append(metrics["buffers"])
        # out after a step: only the buffers of the last units' writes still in flight
        # (write-behind)
        counters = view(state).counters()
        assert counters.live_layers == 0
        assert counters.pool_out == counters.write_behind_buffers
    zf.flush(state)
    assert view(state).counters().pool_out == 0
    assert metrics["tile_fetches_prefetched"] > 0
    # Out at once: per size the fetch window's depth + 1 runs (tiles this small are fetched a whole
    # leaf an item, ``overlap.tile_runs.tile_run``: 2 x 16 of the head's at most), the unit, their
    # staging, tile gradients in flight, a run's waiting for its last tile to go to the updater as
    # one update (``update_run``: 16 of the head's at most); nothing that scales with the steps or
    # the fetches. A pool that never reused a buffer would make one per take: 44 of one size within
    # the first step. Measured: 39-48 out at once (23-32 when each tile went to its update alone;
    # the 16 more are the head's run); the pool is made as planned before the first step and no step
    # holds more of a size than planned.
    assert view(state).counters().pool_peak_out <= 56
    assert counts == [counts[0]] * 3, counts
