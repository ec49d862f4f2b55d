"""The step-time prediction: an estimate's traffic and a step's work over this machine's speeds.

    forward   = max(compute_fwd + casts_fwd + e * disk_fwd, disk_fwd)
                + (units + tiles_f) * per_unit
    backward  = max(compute_bwd + casts_bwd + optimizer + e * disk_bwd, disk_bwd)
                + (units - 1 + tiles_b) * per_unit
    step      = forward + backward

The prefetcher and the write-behind overlap disk and compute; e (``Machine.disk_exposed``) is the
share of the disk time that still shows in a step (I/O threads and copies take CPU time from the
compute), and per_unit (``Machine.unit_overhead_s``) the engine's cost per fetched unit (a tile
fetch counts as one: tiles_f in the forward scan, tiles_b in the head and the reverse scan,
``tiling.plan``); both are measured by calibrate's probe runs.

compute: the seconds of the model's own layers timed at the real shapes (``plan.compute``: one unit
of each stage, forward as the training scan records it, backward as its tape pulls back); an untimed
``Work`` falls back to matmul FLOPs over the calibrated FLOP/s (backward a recompute and the vjp: 3x
the forward of a block, 2x of the head). casts: each fetch copies a unit's shard into its
compute-dtype buffer. optimizer: Adam-like updates of the trainable elements (a frozen leaf has
none) read master, moments and gradient and write master, moments and the 16-bit copy, at the host
copy bandwidth; the cost is per element whatever the states' format (the compressed kernels update
an element in about the fused fp32 kernel's time, ``benchmarks/optimizer.py``: their saving is disk
bytes, which ``nvme_traffic`` counts row by row). disk: the NVMe bytes of each phase
(``memory.nvme_traffic``: params read in forward; in backward the param rows no master is lent for,
the optimizer rows read and written, the 16-bit copies written) at the measured read/write
bandwidth. On CPU compute the optimizer and the casts share the cores with the matmuls, so they add
up.
"""

from __future__ import annotations

from typing import NamedTuple

from .machine import Machine
from .memory import Estimate
from .sizes import Work


class StepTime(NamedTuple):
    """Predicted seconds per phase of one step."""

    forward: float
    backward: float
    compute: float
    optimizer: float
    disk: float

    @property
    def step(self) -> float:
        return self.forward + self.backward

    def row(self) -> str:
        return (
            f"fwd {self.forward:7.3f}  bwd {self.backward:7.3f}  (compute {self.compute:.3f}, "
            "optimizer "
            f"{self.optimizer:.3f}, disk {self.disk:.3f})  step {self.step:7.3f} s"
        )


def predict(est: Estimate, work: Work, machine: Machine) -> StepTime:
    """Seconds per phase of one step of ``est``'s config doing ``work`` on ``machine`` (see the
    module)."""
    fwd, bwd = _compute(work, machine)
    copy = max(machine.copy_bps, 1.0)
    param_bytes = sum(v for (_, kind), v in est.states.items() if kind == "param")
    itemsize = est.config.param_dtype.itemsize
    casts = param_bytes * (1 + est.config.resolved_compute_dtype().itemsize / itemsize) / copy
    opt = work.params * (7 * 4 + itemsize) / copy
    read_fwd, read_bwd, write_bwd = work.disk
    disk_fwd = read_fwd / max(machine.disk_read_bps, 1.0) if read_fwd else 0.0
    disk_bwd = (read_bwd / max(machine.disk_read_bps, 1.0) if read_bwd else 0.0) + (
        write_bwd / max(machine.disk_write_bps, 1.0) if write_bwd else 0.0
    )
    # the engine's own cost per fetched unit (calibrated by a probe run)
    per_unit = machine.unit_overhead_s
    # the share of the disk time a step does not hide (the probe's)
    shown = machine.disk_exposed
    tiles_fwd, tiles_bwd = work.tile_fetches  # a tile fetch costs what a unit's does
    forward = max(fwd + casts / 2 + shown * disk_fwd, disk_fwd) + per_unit * (
        work.units + tiles_fwd
    )
    backward = max(bwd + casts / 2 + opt + shown * disk_bwd, disk_bwd) + per_unit * (
        max(0, work.units - 1) + tiles_bwd
    )
    return StepTime(forward, backward, fwd + bwd, opt, disk_fwd + disk_bwd)


def _compute(work: Work, machine: Machine) -> tuple[float, float]:
    """Seconds of the forward and the backward's compute: measured on the model's own layers when
    ``work`` was timed, else its FLOPs over the machine's FLOP/s."""
    if work.forward_s is not None and work.backward_s is not None:
        return work.forward_s, work.backward_s
    flops = max(machine.matmul_flops, 1.0)
    return (
        work.forward_flops / flops,
        (3 * (work.forward_flops - work.head_flops) + 2 * work.head_flops) / flops,
    )


def peak_rss(est: Estimate, machine: Machine) -> int:
    """The resident bytes a run adds at its peak: the estimate's peak host memory and the runtime's
    own (threads, allocator caches, code pages first touched by a step:
    ``Machine.runtime_rss_bytes``)."""
    return int(est.host_peak + machine.runtime_rss_bytes)
