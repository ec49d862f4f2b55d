"""A config fitted to its budgets: ``resolve`` turns "auto" placements into explicit splits
(``Config.spill_*``) by filling the faster tier unit by unit up to its budget; ``check_fit`` raises
before init when an estimate (``planner.memory.estimate``) exceeds a budget or the free space under
``nvme_path`` (``problems``: what exceeds which).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from ..config import Config
from ..layout.units import head_index
from .memory import MIB, Estimate, estimate


def resolve(config: Config, layout, n_layers: int) -> Config:
    """``config`` with "auto" placements made explicit: the faster tier filled unit by unit up to
    its budget.

    ``layout(config)`` is the layout build of a config (``zinf_fn.layout.build.layout``). Params
    first (the compute device, or host memory on CPU compute, up to its budget), then the optimizer
    (host memory up to what is left).
    """
    if config.offload_params == "auto":
        cuda = config.resolved_device().type == "cuda"
        fast, slow = ("none", "cpu") if cuda else ("none", "nvme")
        budget = (
            config.device_memory_budget
            if cuda and config.device_memory_budget is not None
            else config.host_memory_budget
        )
        config = _fill(config, "params", fast, slow, budget, layout, n_layers, host=not cuda)
    if config.offload_optimizer == "auto":
        config = _fill(
            config,
            "optimizer",
            "cpu",
            "nvme",
            config.host_memory_budget,
            layout,
            n_layers,
            host=True,
        )
    return config


def _fill(
    config: Config, kind: str, fast: str, slow: str, budget: int, layout, n_layers: int, host: bool
) -> Config:
    """The explicit split of ``kind`` with the most units in ``fast`` whose estimate fits
    ``budget``."""
    n_units = head_index(n_layers) + 1  # the units of scan order
    for first in range(n_units, -1, -1):
        spill = None if first == n_units else f"{first}:{slow}"
        if spill and slow == "nvme" and not config.nvme_path:
            raise ValueError(
                f"Config(offload_{kind}='auto'): the {kind} rows do not all fit the budget in "
                f"{fast!r} and would spill to NVMe, but nvme_path is not set; pass "
                "nvme_path=..."
            )
        trial = dataclasses.replace(
            config,
            **{
                f"offload_{kind}": fast if first else slow,
                f"spill_{kind}": spill if first else None,
            },
        )
        other = "optimizer" if kind == "params" else "params"
        probe = (
            trial
            if trial.placement(other) != "auto"
            else dataclasses.replace(
                trial, **{f"offload_{other}": "nvme" if trial.nvme_path else "cpu"}
            )
        )
        est = estimate(layout(probe), probe)
        if (est.host_peak if host else est.device_peak) <= budget:
            return trial
    return trial


def problems(est: Estimate) -> list[str]:
    """What of ``est`` exceeds its config's budgets or the free space under ``nvme_path`` (empty: it
    fits)."""
    config, out = est.config, []
    if config.host_memory_budget is not None and est.host_peak > config.host_memory_budget:
        out.append(
            f"peak host memory {est.host_peak / MIB:.1f} MiB > host_memory_budget "
            f"{config.host_memory_budget / MIB:.1f} MiB"
        )
    if config.device_memory_budget is not None and est.device_peak > config.device_memory_budget:
        out.append(
            f"peak device memory {est.device_peak / MIB:.1f} MiB > device_memory_budget "
            f"{config.device_memory_budget / MIB:.1f} MiB"
        )
    if est.disk and config.nvme_path:
        free = shutil.disk_usage(_existing(config.nvme_path)).free
        if est.disk > free:
            out.append(
                f"NVMe states {est.disk / MIB:.1f} MiB > free space {free / MIB:.1f} MiB under "
                f"nvme_path={config.nvme_path!r}"
            )
    return out


def check_fit(est: Estimate) -> None:
    """Raise ValueError (with the estimate's table) when ``est`` exceeds a budget or the disk's free
    space."""
    found = problems(est)
    if found:
        raise ValueError(
            "zf.init: this config does not fit: " + "; ".join(found) + ". Estimate "
            "(zf.estimate):\n" + est.table() + "\nOffload more (e.g. offload_optimizer='auto' or "
            "'nvme'), free disk space, or raise the budgets."
        )


def _existing(path: str) -> str:
    """``path`` or its nearest existing parent (the NVMe tier creates the directory at init)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path
