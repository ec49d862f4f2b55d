"""``zf.auto_config``: every candidate placement estimated and timed; the fastest one that fits wins.

Candidates: params in "none", "cpu", "nvme" (and "auto" with a device budget on CUDA) times the
optimizer in "none", "cpu", "nvme" and "auto" (RAM up to the host budget, the rest spilled to NVMe);
NVMe only with an ``nvme_path``. Each is estimated (``plan.sizes``), checked against the budgets and
the disk (``memory.problems``) and timed (``plan.timing``) on this machine (``plan.machine``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from ..config import Config
from .machine import Machine, calibrate
from .memory import MIB, Estimate, problems
from .sizes import plan_config
from .timing import StepTime, predict


class Candidate(NamedTuple):
    config: Config
    estimate: Estimate
    time: StepTime | None      # None without a sample batch (no work to time)
    problems: list[str]


def candidates(model, optimizer, base: Config, batch: Any, machine: Machine) -> list[Candidate]:
    """Every placement of ``base``'s budgets and nvme_path, estimated, checked and timed."""
    slow = ["nvme"] if base.nvme_path else []
    params = ["none", "cpu", *slow] + (["auto"] if base.device_memory_budget is not None else [])
    optim = ["none", "cpu", *slow] + (["auto"] if slow and base.host_memory_budget is not None else [])
    out, seen, trees = [], set(), {}
    for p in params:
        for o in optim:
            config = dataclasses.replace(base, offload_params=p, offload_optimizer=o)
            planned = plan_config(model, optimizer, config, batch, trees)
            if planned.estimate.config in seen:   # an "auto" that resolved to a plain placement
                continue
            seen.add(planned.estimate.config)
            time = predict(planned.estimate, planned.work, machine) if planned.work else None
            out.append(Candidate(planned.estimate.config, planned.estimate, time, problems(planned.estimate)))
    return out


def best(found: list[Candidate]) -> Candidate:
    """The fitting candidate with the lowest predicted step time; on a tie (or without times) the one that
    moves the fewest bytes to and from its tiers."""
    fitting = [c for c in found if not c.problems]
    if not fitting:
        raise ValueError("zf.auto_config: no placement fits the budgets:\n" + format_candidates(found))
    return min(fitting, key=lambda c: (round(c.time.step, 3) if c.time else 0.0, sum(c.estimate.moved.values())))


def format_candidates(found: list[Candidate], chosen: Candidate | None = None) -> str:
    """One line per candidate: placements, peaks, disk, predicted seconds per phase, and why it does not fit."""
    lines = [f"  {'params':14s} {'optimizer':14s} {'host MiB':>9s} {'device MiB':>10s} {'disk MiB':>9s}  predicted"]
    for c in found:
        e, mark = c.estimate, "*" if c is chosen else " "
        time = c.time.row() if c.time else "(no batch: not timed)"
        why = f"  DOES NOT FIT: {'; '.join(c.problems)}" if c.problems else ""
        lines.append(f"{mark} {_placement(c.config, 'params'):14s} {_placement(c.config, 'optimizer'):14s} "
                     f"{e.host_peak / MIB:9.1f} {e.device_peak / MIB:10.1f} {e.disk / MIB:9.1f}  {time}{why}")
    return "\n".join(lines)


def _placement(config: Config, kind: str) -> str:
    spill = getattr(config, f"spill_{kind}")
    return getattr(config, f"offload_{kind}") + (f">{spill}" if spill else "")


def auto_config(model, optimizer, nvme_path: str | None = None, host_memory_budget: int | None = None,
                device_memory_budget: int | None = None, batch: Any = None, base: Config | None = None,
                machine: Machine | None = None, verbose: bool = True) -> Config:
    """The Config (placements and split; the rest from ``base``) that fits the budgets and has the lowest
    predicted step time on this machine (``calibrate(nvme_path)`` unless ``machine`` is given); prints
    its reasoning (every candidate, then the chosen one's tiers x kinds table) when ``verbose``.
    ``batch``: a sample batch, which the step time needs; without one the least offloaded fit wins."""
    base = dataclasses.replace(base or Config(), nvme_path=nvme_path, host_memory_budget=host_memory_budget,
                               device_memory_budget=device_memory_budget)
    machine = machine or calibrate(nvme_path)
    found = candidates(model, optimizer, base, batch, machine)
    chosen = best(found)
    if verbose:
        print(report(found, chosen))
    return chosen.config


def report(found: list[Candidate], chosen: Candidate) -> str:
    """The candidates' table and the chosen config's estimate table."""
    return (f"zf.auto_config: {len(found)} placements (* chosen)\n{format_candidates(found, chosen)}\n"
            f"chosen: params {_placement(chosen.config, 'params')}, optimizer "
            f"{_placement(chosen.config, 'optimizer')}\n{chosen.estimate.table()}")

