"""``python -m zinf_fn.plan.probe NVME_PATH MACHINE_JSON``: the probe run of ``zf.calibrate``, in a fresh process.

Initialises ``machine.probe_model`` (placement ``machine.probe_config``), runs a few steps and prints JSON:
``unit_overhead_s`` (measured median step time minus the prediction, per fetched unit) and
``runtime_rss_bytes`` (peak RSS added over ``zf.init`` and the steps, minus the estimate's peak host).
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


def main(nvme_path: str, machine: Machine) -> dict:
    batch = probe_batch()
    with tempfile.TemporaryDirectory(dir=nvme_path or None) as run:
        config = probe_config(run if nvme_path else None)
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
    predicted = predict(planned.estimate, planned.work, machine._replace(unit_overhead_s=0.0)).step
    return {"unit_overhead_s": max(0.0, step - predicted) / (2 * PROBE_LAYERS + 3),
            "runtime_rss_bytes": max(0, peak - baseline - planned.estimate.host_peak)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], Machine(*json.loads(sys.argv[2])))))
