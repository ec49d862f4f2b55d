"""Observability: per-step bytes per tier, the exposed wait and hidden I/O, and the Chrome trace."""

from __future__ import annotations

import json

import torch
from engine_helpers import CFG, batches

import zinf_fn as zf
from layers import gpt
from zinf_fn.state import view
from zinf_fn.trace import BusyClock, Tracer


def _train(config, steps=3):
    state = zf.init(gpt.model(CFG), zf.adamw(), config)
    out = []
    for batch in batches(steps):
        state, metrics = zf.train_step(state, batch)
        out.append(metrics)
    return state, out


def test_bytes_per_step_match_the_data_movement_of_a_step(tmp_path):
    """Per step (not cumulative): params read once (forward; the backward fetch casts the master read ahead
    for the update), optimizer rows read and written once."""
    state, metrics = _train(zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path)))
    groups = view(state).groups
    n = {g: groups[g].part.shard_numel * groups[g].rows for g in groups}
    param, opt = 2, 4 * 3                            # bf16 param; fp32 master, m, v
    everything = sum(n.values())
    expected_read = param * everything + opt * everything
    expected_written = param * everything + opt * everything
    for m in metrics:
        assert m["bytes_read.nvme"] == expected_read
        assert 0 <= m["bytes_read_inflight.nvme"] <= expected_read   # the part served by a write in flight
        assert m["bytes_written.nvme"] == expected_written
        assert m["io_busy_s"] > 0 and m["io_wait_s"] >= 0
        assert m["io_hidden_s"] == max(0.0, m["io_busy_s"] - m["io_wait_s"])


def test_in_ram_steps_report_no_nvme_bytes():
    """CPU rows are used as views (nothing is read); the updated rows count as written, once per step."""
    _, metrics = _train(zf.Config(offload_params="cpu", offload_optimizer="cpu"), steps=2)
    assert metrics[0]["bytes_written.cpu"] == metrics[1]["bytes_written.cpu"] > 0
    assert "bytes_read.nvme" not in metrics[0] and metrics[1]["io_busy_s"] == 0.0


def test_trace_is_a_chrome_trace_of_compute_read_write_gather(tmp_path):
    path = tmp_path / "trace.json"
    config = zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path), trace=str(path),
                       param_dtype=torch.bfloat16)
    _train(config, steps=2)
    events = json.loads(path.read_text())            # valid JSON after every step
    spans = [e for e in events if e["ph"] == "X"]
    cats = {e["cat"] for e in spans}
    assert {"compute", "read", "write", "gather", "update"} <= cats
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and "tid" in e for e in spans)
    names = {e["name"] for e in spans if e["cat"] == "compute"}
    assert {"forward embed", "forward blocks.0", "backward blocks.0", "forward head"} <= names
    threads = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert any(t.startswith("zinf-nvme") for t in threads) and any(t.startswith("zinf-update") for t in threads)
    per_step = sum(1 for e in spans if e["name"] == "forward blocks.0")
    assert per_step == 2


def test_tracer_appends_and_stays_valid(tmp_path):
    tracer = Tracer(tmp_path / "t.json")
    tracer.flush()
    assert json.loads((tmp_path / "t.json").read_text()) == []
    for i in range(3):
        with tracer.span("compute", f"s{i}"):
            pass
        tracer.flush()
        assert len([e for e in json.loads((tmp_path / "t.json").read_text()) if e["ph"] == "X"]) == i + 1


def test_busy_clock_counts_overlapping_requests_once():
    import threading
    import time

    clock, barrier = BusyClock(), threading.Barrier(3)

    def request():
        barrier.wait()
        clock.enter()
        time.sleep(0.05)
        clock.exit()

    threads = [threading.Thread(target=request) for _ in range(3)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert 0.05 <= clock.busy_s <= wall   # three overlapping 50 ms requests: ~50 ms busy, not 150
