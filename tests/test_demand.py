"""A part declares what it costs: the estimate and the runtime's pool are sums of the parts' demands.

``zinf_fn.planner.memory.demands`` lists the ``demand`` of every streaming part (fetcher, gradient backlog,
optimizer read-ahead and write-behind, kept rows). The estimate's working memory and NVMe traffic are
their sums, the runtime's pool limit is derived from them, and a real step never holds more pool
buffers of one (numel, dtype) than the parts declared for it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from engine_helpers import CFG, batches

import zinf_fn as zf
from layers import gpt
from zinf_fn.demand import pool_counts
from zinf_fn.io.buffers import BufferPool
from zinf_fn.layout import layout
from zinf_fn.planner.memory import demands, pool_limit, traffic

CONFIGS = [
    dict(offload_params="nvme", offload_optimizer="nvme"),
    dict(offload_params="nvme", offload_optimizer="nvme", clip_grad_norm=1.0),
    dict(offload_params="cpu", offload_optimizer="nvme", spill_params="2:nvme"),
    dict(offload_params="nvme", offload_optimizer="cpu", param_dtype=torch.float32),
    dict(offload_optimizer="cpu", spill_optimizer="2:nvme", optimizer_piece_bytes=16 << 10),
]
IDS = [",".join(f"{k}={v}" for k, v in kw.items()) for kw in CONFIGS]


@pytest.mark.parametrize("kw", CONFIGS, ids=IDS)
def test_the_estimate_is_the_sum_of_the_parts_demands(kw, tmp_path):
    config = zf.Config(nvme_path=str(tmp_path), **kw)
    model, opt = gpt.model(CFG), zf.adamw()
    est = zf.estimate(model, opt, config)
    parts = demands(layout(model, opt, config), config)
    assert est.working == {d.part: d.bytes("host") + d.bytes("device") for d in parts}   # CPU compute
    assert est.host_peak - sum(est.working.values()) == est.tier_bytes("cpu") + est.tier_bytes("none")
    assert est.moved.get("nvme", 0) == sum(traffic(parts))


class _PeakPerKey:
    """Counts the pool buffers out at once per (numel, dtype), at their peak, and the pools' limits."""

    def __init__(self):
        self.out: dict[tuple, int] = {}
        self.peak: dict[tuple, int] = {}
        self.limits: list[int] = []
        self._lock = threading.Lock()

    def install(self, monkeypatch) -> None:
        take, give, init = BufferPool.take, BufferPool.give, BufferPool.__init__

        def counted_take(pool, numel, dtype, device):
            buf = take(pool, numel, dtype, device)
            with self._lock:
                k = (numel, dtype)
                self.out[k] = self.out.get(k, 0) + 1
                self.peak[k] = max(self.peak.get(k, 0), self.out[k])
            return buf

        def counted_give(pool, buf):
            with self._lock:
                self.out[(buf.numel(), buf.dtype)] -= 1
            give(pool, buf)

        def recorded_init(pool, limit_per_key=8):
            self.limits.append(limit_per_key)
            init(pool, limit_per_key)

        monkeypatch.setattr(BufferPool, "take", counted_take)
        monkeypatch.setattr(BufferPool, "give", counted_give)
        monkeypatch.setattr(BufferPool, "__init__", recorded_init)


@pytest.mark.parametrize("kw", CONFIGS, ids=IDS)
def test_a_step_holds_no_more_pool_buffers_than_the_parts_declare(kw, tmp_path, monkeypatch):
    config = zf.Config(nvme_path=str(tmp_path), **kw)
    model, opt = gpt.model(CFG), zf.adamw()
    built = layout(model, opt, config)
    declared = {(n, dtype): c for (n, dtype, _), c in pool_counts(demands(built, config), True).items()}
    counter = _PeakPerKey()
    counter.install(monkeypatch)
    state = zf.init(model, opt, config)
    assert counter.limits == [pool_limit(built, config)]   # the runtime's pool is bounded by the same demands
    for batch in batches(3):
        state, _ = zf.train_step(state, batch)
    zf.close(state)
    over = {k: (peak, declared.get(k, 0)) for k, peak in counter.peak.items() if peak > declared.get(k, 0)}
    assert not over, f"(numel, dtype): (held at once, declared) {over}"
