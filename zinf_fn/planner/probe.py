"""``python -m zinf_fn.planner.probe PLACEMENT NVME_PATH MACHINE_JSON STEPS_JSON``: a probe run
of ``zf.calibrate``.

Runs in a fresh process (the RSS it measures starts where a user's run would).

Initialises ``machine.probe_model`` (placement ``machine.probe_config``: "memory" or "nvme"), runs
``STEPS_JSON``'s ``machine.ProbeSteps``: ``warm`` steps (a warm-up first), then ``timed`` ones with
the planner (``plan_config``, which times the probe's own layers) before each, and prints JSON:
``runtime_rss_bytes`` (peak RSS added over ``zf.init`` and the first steps, minus the estimate's
peak host) and, in memory, ``unit_overhead_s`` (median step time minus the median prediction, per
fetched unit) or, on NVMe, ``disk_exposed`` (the step time beyond the prediction with the disk
hidden, over the predicted disk time; the disk's bandwidth is measured again between the steps too,
as the layers are timed: the disk's speed of the moment).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
import time

from ..optim.optimizers import adamw
from ..train import init, train_step
from .machine import (
    PROBE_LAYERS,
    Machine,
    ProbeSteps,
    disk_bandwidth,
    probe_batch,
    probe_config,
    probe_model,
)
from .sizes import plan_config
from .timing import predict

PROBE_DISK_BYTES = 64 << 20  # the disk measured between the probe's steps: ~0.1 s


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def main(placement: str, nvme_path: str, machine: Machine, steps: ProbeSteps) -> dict:
    batch = probe_batch()
    with tempfile.TemporaryDirectory(dir=nvme_path or None) as run:
        config = probe_config(placement, run)
        baseline = _status("VmRSS")
        _reset_peak()
        state = init(probe_model(), adamw(), config)
        for _ in range(steps.warm):  # the first is the warm-up; the peak is the run's own
            state, _ = train_step(state, batch)
        peak, times, now = _status("VmHWM"), [], []
        # the planner between steps: both see the machine's load of the moment
        for _ in range(steps.timed):
            now.append(_predict_now(config, batch, machine, run if placement == "nvme" else None))
            t0 = time.perf_counter()
            state, _ = train_step(state, batch)
            times.append(time.perf_counter() - t0)
        state.runtime.close()
    step = statistics.median(times)
    out = {"runtime_rss_bytes": max(0, peak - baseline - now[0][0].estimate.host_peak)}
    if placement == "memory":
        predicted = statistics.median(
            predict(p.estimate, p.work, m._replace(unit_overhead_s=0.0)).step for p, m in now
        )
        out["unit_overhead_s"] = max(0.0, step - predicted) / (2 * PROBE_LAYERS + 3)
    # the share of the disk time the step shows (``machine.unit_overhead_s`` from the memory run)
    else:
        hidden = [predict(p.estimate, p.work, m._replace(disk_exposed=0.0)) for p, m in now]
        shown = statistics.median(
            (t - h.step) / max(h.disk, 1e-9) for t, h in zip(times, hidden, strict=True)
        )
        # per step and the prediction just before it
        out["disk_exposed"] = min(1.0, max(0.0, shown))
    return out


def _predict_now(config, batch, machine: Machine, disk: str | None) -> tuple:
    """(the probe's plan, its layers timed now; ``machine`` with the disk under ``disk`` measured
    now)."""
    if disk is not None:
        machine = machine._replace(
            **dict(
                zip(
                    ("disk_read_bps", "disk_write_bps"),
                    disk_bandwidth(disk, PROBE_DISK_BYTES),
                    strict=True,
                )
            )
        )
    return plan_config(probe_model(), adamw(), config, batch), machine


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


if __name__ == "__main__":
    machine = Machine(*json.loads(sys.argv[3]))
    print(json.dumps(main(sys.argv[1], sys.argv[2], machine, ProbeSteps(*json.loads(sys.argv[4])))))
