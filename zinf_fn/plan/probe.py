"""``python -m zinf_fn.plan.probe PLACEMENT NVME_PATH MACHINE_JSON``: a probe run of ``zf.calibrate``.

Runs in a fresh process (the RSS it measures starts where a user's run would).

Initialises ``machine.probe_model`` (placement ``machine.probe_config``: "memory" or "nvme"), runs a few
steps and prints JSON: ``runtime_rss_bytes`` (peak RSS added over ``zf.init`` and the steps, minus the
estimate's peak host) and, in memory, ``unit_overhead_s`` (median step time minus the prediction, per
fetched unit) or, on NVMe, ``disk_exposed`` (the step time beyond the prediction with the disk hidden,
over the predicted disk time).
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
from .machine import PROBE_LAYERS, PROBE_STEPS, Machine, probe_batch, probe_config, probe_model
from .sizes import plan_config
from .timing import predict


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def main(placement: str, nvme_path: str, machine: Machine) -> dict:
    batch = probe_batch()
    with tempfile.TemporaryDirectory(dir=nvme_path or None) as run:
        config = probe_config(placement, run)
        baseline = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # VmHWM := VmRSS
        state, times = init(probe_model(), adamw(), config), []
        for _ in range(PROBE_STEPS):
            t0 = time.perf_counter()
            state, _ = train_step(state, batch)
            times.append(time.perf_counter() - t0)
        state.runtime.close()
        peak = _status("VmHWM")
        planned = plan_config(probe_model(), adamw(), config, batch)   # after: its allocations would pre-warm the run
    step = statistics.median(times[1:])
    out = {"runtime_rss_bytes": max(0, peak - baseline - planned.estimate.host_peak)}
    if placement == "memory":
        predicted = predict(planned.estimate, planned.work, machine._replace(unit_overhead_s=0.0)).step
        out["unit_overhead_s"] = max(0.0, step - predicted) / (2 * PROBE_LAYERS + 3)
    else:   # the share of the disk time the step shows (``machine.unit_overhead_s`` from the memory run)
        hidden = predict(planned.estimate, planned.work, machine._replace(disk_exposed=0.0))
        out["disk_exposed"] = min(1.0, max(0.0, (step - hidden.step) / max(hidden.disk, 1e-9)))
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], Machine(*json.loads(sys.argv[3])))))
