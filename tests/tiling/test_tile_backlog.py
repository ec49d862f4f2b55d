"""A tile's gradient buffer when the update worker lags: the tile throttle lets ``TILE_BACKLOG``
updates run behind the backward, and the buffers those queued updates hold come back as each ends.

An update worker slowed by a sleep (as a loaded machine slows it) made the backward ask the pool
for a tile's gradient buffer while every one was still held by queued updates: "buffer pool
exhausted" (before the fix: every run with the sleep; 4 of 20 runs of tests/models/test_llama.py's
tiled test, four at once). The step waits for them instead; training is bitwise the unslowed
run's."""

from __future__ import annotations

import time

import optree
import torch

import zinf_fn as zf
from layers import llama
from zinf_fn.optim.updater import Updater

CFG = llama.Config(
    vocab_size=96, d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16, mlp_tiles=2, head_tiles=3
)


def _train(steps: int = 3) -> tuple[list[float], dict]:
    config = zf.Config(offload_params="cpu", offload_optimizer="cpu", param_dtype=torch.float32)
    state = zf.init(llama.model(CFG), zf.adamw(lr=1e-3), config, seed=0)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=gen)
        state, metrics = zf.train_step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
        losses.append(metrics["loss"])
    params = zf.gather_params(state)
    zf.close(state)
    return losses, params


def _slowed(monkeypatch, seconds: float) -> None:
    for name in ("update_", "update_run_"):
        real = getattr(Updater, name)

        def slow(self, *args, _real=real, **kwargs):
            time.sleep(seconds)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Updater, name, slow)


def test_a_lagging_update_worker_costs_waits_not_a_failed_step(monkeypatch):
    want_losses, want = _train()
    _slowed(monkeypatch, 0.02)
    losses, got = _train()
    assert losses == want_losses
    pairs = zip(optree.tree_leaves(want), optree.tree_leaves(got), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
