"""Observability: per-step bytes per tier, the exposed wait and hidden I/O, and the Chrome trace."""

from __future__ import annotations

import json

import torch
from engine_helpers import CFG, batches

import zinf_fn as zf
from layers import gpt
from zinf_fn.observe.trace import BusyClock, Tracer
from zinf_fn.state import view


def _train(config, steps=3):
    state = zf.init(gpt.model(CFG), zf.adamw(), config)
    out = []
    for batch in batches(steps):
        state, metrics = zf.train_step(state, batch)
        out.append(metrics)
    return state, out


def test_bytes_per_step_match_the_data_movement_of_a_step(tmp_path):
    """Per step (not cumulative): params read once (forward; the backward fetch casts the master
    read ahead for the update), optimizer rows read and written once."""
    state, metrics = _train(
        zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path))
    )
    groups = view(state).groups
    n = {g: groups[g].part.shard_numel * groups[g].rows for g in groups}
    param, opt = 2, 4 * 3  # bf16 param; fp32 master, m, v
    everything = sum(n.values())
    expected_read = param * everything + opt * everything
    expected_written = param * everything + opt * everything
    for m in metrics:
        assert m["bytes_read.nvme"] == expected_read
        assert (
            0 <= m["bytes_read_inflight.nvme"] <= expected_read
        )  # the part served by a write in flight
        assert m["bytes_written.nvme"] == expected_written
        assert m["io_busy_s"] > 0 and m["io_wait_s"] >= 0
        assert m["io_hidden_s"] == max(0.0, m["io_busy_s"] - m["io_wait_s"])


def test_in_ram_steps_report_no_nvme_bytes():
    """CPU rows are used as views (nothing is read); the updated rows count as written, once per
    step."""
    _, metrics = _train(zf.Config(offload_params="cpu", offload_optimizer="cpu"), steps=2)
    assert metrics[0]["bytes_written.cpu"] == metrics[1]["bytes_written.cpu"] > 0
    assert "bytes_read.nvme" not in metrics[0] and metrics[1]["io_busy_s"] == 0.0


def test_trace_is_a_chrome_trace_of_compute_read_write_gather(tmp_path):
    path = tmp_path / "trace.json"
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
        trace=str(path),
        param_dtype=torch.bfloat16,
    )
    _train(config, steps=2)
    events = json.loads(path.read_text())  # valid JSON after every step
    spans = [e for e in events if e["ph"] == "X"]
    cats = {e["cat"] for e in spans}
    assert {"compute", "read", "write", "gather", "update"} <= cats
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and "tid" in e for e in spans)
    names = {e["name"] for e in spans if e["cat"] == "compute"}
    assert {"forward embed", "forward blocks.0", "backward blocks.0", "forward head"} <= names
    threads = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert any(t.startswith("zinf-nvme") for t in threads) and any(
        t.startswith("zinf-update") for t in threads
    )
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
        assert (
            len([e for e in json.loads((tmp_path / "t.json").read_text()) if e["ph"] == "X"])
            == i + 1
        )


def test_busy_clock_counts_overlapping_requests_once():
    """The clock runs from the first request's start to the last one's end: overlaps count once,
    idle time not at all. Its time source is a counter the test moves, so no sleep or wall time
    decides."""
    now = [0.0]
    clock = BusyClock(now=lambda: now[0])
    now[0] = 1.0
    clock.enter()  # a starts
    now[0] = 2.0
    clock.enter()  # b starts while a runs
    now[0] = 3.0
    clock.exit()  # a ends; b still runs
    assert clock.read() == 2.0  # running since 1.0
    now[0] = 5.0
    clock.exit()  # b ends: busy from 1.0 to 5.0
    assert clock.busy_s == 4.0  # not (3 - 1) + (5 - 2) = 5
    now[0] = 9.0
    clock.enter()  # idle from 5.0 to 9.0 does not count
    now[0] = 10.0
    clock.exit()
    assert clock.busy_s == clock.read() == 5.0


def test_busy_clock_counts_requests_of_many_threads_once():
    """Three threads' requests, all started before any ends (an order the test enforces with
    barriers): busy for the span the test moved the clock by, not three times it."""
    import threading

    now = [1.0]
    clock, started, finish = BusyClock(now=lambda: now[0]), threading.Barrier(4), threading.Event()

    def request():
        clock.enter()
        started.wait()
        finish.wait()
        clock.exit()

    threads = [threading.Thread(target=request) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait()  # sync: every request has entered
    now[0] = 1.5
    finish.set()
    for t in threads:
        t.join()
    assert clock.busy_s == 0.5
