"""The memory model: what a config allocates, in which tier, and what a step moves; the one place it lives.

``offload.tiers.MetaTier`` stands in for a tier in a *layout build* (``zinf_fn.train.layout``): the store allocates
every array into it exactly as ``zf.init`` would, but only shapes are recorded. ``estimate`` turns that
store into bytes per (tier, state kind), the peak host and device working memory and the bytes moved
per step per tier, using the engine's own sizes: the staging of ``prefetch_depth`` + 1 gathered units,
the gradient buffers waiting for the updater, the optimizer pieces read ahead and written behind
(``depth`` pieces each way, NVMe rows only) and the masters lent whole. When the engine's buffers
change, change ``_working`` here.

``resolve`` turns "auto" placements into explicit splits (``Config.spill_*``) by filling the faster
tier unit by unit up to its budget; ``check_fit`` raises before init when an estimate exceeds a budget
or the free space under ``nvme_path``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import NamedTuple

from .config import Config, spill_of
from .offload.spill import SpillTier
from .optim.pieces import piece_numel
from .optim.readahead import keeps_resident, lends_whole, pieces_ahead
from .optim.updater import backlog_bytes, grad_weight
from .partition.sharding import OwnedRowsTier
from .store import Store
from .units import HEAD, unit_of_row, units

KINDS = ("param", "master", "opt", "grad")   # the rows of the table: Adam's m and v are summed as "opt"


class Estimate(NamedTuple):
    """Bytes per tier and kind (this rank), peak working memory and per-step traffic of one config."""

    config: Config
    states: dict[tuple[str, str], int]   # (placement, kind) -> bytes of states
    working: dict[str, int]              # named host working-memory parts (bytes)
    device_working: int                  # compute-device working memory (0 on CPU compute)
    moved: dict[str, int]                # placement -> bytes read + written per step
    host_peak: int                       # states in host memory + host working memory
    device_peak: int                     # states on the CUDA device + device working memory
    disk: int                            # bytes of states under nvme_path

    def tier_bytes(self, placement: str) -> int:
        return sum(v for (p, _), v in self.states.items() if p == placement)

    def table(self) -> str:
        """Tiers x state kinds in MiB, the working memory and the peaks, as a printable table."""
        tiers = [p for p in ("none", "cpu", "nvme") if self.tier_bytes(p)]
        lines = [f"{'kind':8s}" + "".join(f"{t:>12s}" for t in tiers) + "   (MiB; 'none' is the compute device)"]
        for kind in KINDS:
            if any(self.states.get((t, kind)) for t in tiers):
                lines.append(f"{kind:8s}" + "".join(f"{self.states.get((t, kind), 0) / MIB:12.1f}" for t in tiers))
        lines.append(f"{'moved':8s}" + "".join(f"{self.moved.get(t, 0) / MIB:12.1f}" for t in tiers) + "   per step")
        parts = ", ".join(f"{k} {v / MIB:.1f}" for k, v in self.working.items() if v)
        lines.append(f"host working memory {sum(self.working.values()) / MIB:.1f} MiB ({parts or 'none'})")
        lines.append(f"peak host {self.host_peak / MIB:.1f} MiB (budget {_mib(self.config.host_memory_budget)}), "
                     f"peak device {self.device_peak / MIB:.1f} MiB (budget {_mib(self.config.device_memory_budget)})"
                     f", disk {self.disk / MIB:.1f} MiB")
        return "\n".join(lines)


MIB = float(1 << 20)


def _mib(value: int | None) -> str:
    return "none" if value is None else f"{value / MIB:.1f} MiB"


def members(tier) -> list:
    """The tiers that hold rows: a spill tier's two members, a broadcast-mode tier's inner tier."""
    if isinstance(tier, OwnedRowsTier):
        return members(tier.inner)
    if isinstance(tier, SpillTier):
        return [*members(tier.fast), *members(tier.slow)]
    return [tier]


def state_bytes(store: Store) -> dict[tuple[str, str], int]:
    """(placement, kind) -> bytes of every array the layout build's store allocated."""
    out: dict[tuple[str, str], int] = {}
    for tier in {id(t): t for t in members(store.param_tier) + members(store.opt_tier)}.values():
        for name, (rows, numel, dtype) in tier.arrays.items():
            kind = name.split("/")[1].split(".")[0]
            out[(tier.name, kind)] = out.get((tier.name, kind), 0) + rows * numel * dtype.itemsize
    return out


def unit_bytes(store: Store, n_layers: int, kinds: list[str]) -> list[int]:
    """Bytes of ``kinds`` rows per unit (scan order, its tile rows included), for filling a budget."""
    out = [0] * (n_layers + 2)
    for group in store.groups.values():
        per_row = group.part.shard_numel * sum(store.param_dtype.itemsize if k == "param" else 4 for k in kinds)
        for row in range(group.rows):
            out[unit_of_row(group.name, row, group.rows, n_layers)] += per_row
    return out


def _nvme_rows(tier, array: str) -> int:
    """Rows of ``array`` that ``tier`` (a layout build's) keeps on NVMe: those a step streams."""
    return sum(t.arrays[array][0] for t in members(tier) if t.name == "nvme" and array in t.arrays)


def _working(store: Store, config: Config, n_layers: int) -> dict[str, int]:
    """Host working memory of a step by part (bytes): the buffers the pool keeps at their peak count.

    Per group: ``prefetch_depth`` + 1 gathered units in the compute dtype (CPU compute) and ``depth`` 16-bit
    staging rows where its params are on NVMe (the fetch thread reads one unit at a time per depth); the
    gradients waiting for the updater (``optim.updater.backlog_bytes``: ``update_workers + depth + 1`` of
    them, fewer where they are larger than ``LEND_PIECES`` pieces, and at least two: the one being
    applied and the one the vjp is making); where its optimizer rows are on NVMe, the pieces of master,
    moments and 16-bit copy in flight (``depth`` read ahead, or ``depth * LEND_PIECES`` where every
    streamed unit lends, one updating, ``depth`` written behind) and, where a unit lends its master to
    the backward fetch (params on NVMe too, a row of at most ``LEND_PIECES`` pieces), ``depth + 2`` whole
    master rows; the copies of the embedding's and the first block's 16-bit rows on NVMe that the tier keeps
    (``optim.readahead.keeps_resident``).
    """
    depth, workers = config.prefetch_depth, config.update_workers
    compute = config.resolved_compute_dtype().itemsize
    on_cpu = config.resolved_device().type == "cpu"
    piece = piece_numel(config.optimizer_piece_bytes)
    backlog = backlog_bytes(workers, depth, piece)
    out = {"gathered layers": 0, "param staging": 0, "gradients": 0, "optimizer read/write": 0,
           "kept 16-bit rows": _kept_rows(store, config, piece, n_layers)}
    streamed = [g for g in store.groups.values() if _nvme_rows(store.opt_tier, f"{g.name}/master")]
    all_lent = all(_lent(store, config, g) for g in streamed)
    in_flight = pieces_ahead(depth, all_lent) + 1 + depth   # read ahead, updating, written behind
    for group in store.groups.values():
        shard, padded = group.part.shard_numel, group.part.padded_numel
        if on_cpu:
            out["gathered layers"] += min(group.rows, depth + 1) * padded * compute
            waiting = backlog // grad_weight(shard, piece)   # at least 2: being applied, being made
            out["gradients"] += min(group.rows, max(2, waiting)) * padded * 4
        param_rows = _nvme_rows(store.param_tier, f"{group.name}/param")
        out["param staging"] += min(param_rows, max(1, depth)) * shard * store.param_dtype.itemsize
        opt_rows = _nvme_rows(store.opt_tier, f"{group.name}/master")
        lent = _lent(store, config, group)
        piece_kinds = store.n_opt_leaves + (0 if lent else 1)
        per_piece = min(shard, piece) * (4 * piece_kinds + store.param_dtype.itemsize)
        n_pieces = opt_rows * -(-shard // piece)   # of the group's rows a step streams
        out["optimizer read/write"] += min(n_pieces, in_flight) * per_piece
        out["optimizer read/write"] += min(opt_rows, depth + 2) * shard * 4 if lent else 0
    return out


def _kept_rows(store: Store, config: Config, piece: int, n_layers: int) -> int:
    """Bytes of the 16-bit rows an NVMe param tier keeps in memory (``Runtime.keep_first_rows``)."""
    total = 0
    for unit in units(n_layers):
        shard = store.groups[unit.group].part.shard_numel
        if keeps_resident(unit.index, shard, piece) and _on_nvme(config, "params", unit.index):
            total += shard * store.param_dtype.itemsize   # an fp32 param row is its master row
    return total


def estimate(store: Store, config: Config, n_layers: int) -> Estimate:
    """The estimate of ``config`` from its layout build's ``store`` (``MetaTier`` members)."""
    states = state_bytes(store)
    working = _working(store, config, n_layers)
    cuda = config.resolved_device().type == "cuda"
    device_working = 0
    if cuda:   # the gathered layers and their gradients live on the device
        depth = config.prefetch_depth
        device_working = sum(min(g.rows, depth + 1) * g.part.padded_numel * (2 + 4) for g in store.groups.values())
    host_states = sum(v for (p, _), v in states.items() if p == "cpu" or (p == "none" and not cuda))
    device_states = sum(v for (p, _), v in states.items() if p == "none" and cuda)
    moved = _moved(store, config, n_layers)
    disk = sum(v for (p, _), v in states.items() if p == "nvme")
    return Estimate(config, states, working, device_working, moved, host_states + sum(working.values()),
                    device_states + device_working, disk)


def _moved(store: Store, config: Config, n_layers: int) -> dict[str, int]:
    """placement -> bytes read and written per step through ``read_`` / ``write_`` (the engine's counters).

    NVMe: ``nvme_traffic``. Params in host memory (CUDA compute): each unit is read twice (forward,
    backward; the head once) and its 16-bit copy written once.
    """
    out: dict[str, int] = {}
    for tier in members(store.param_tier):
        for name, (rows, numel, dtype) in tier.arrays.items():
            if tier.name not in ("none", "nvme"):
                once = name.startswith(HEAD)
                out[tier.name] = out.get(tier.name, 0) + rows * numel * dtype.itemsize * ((1 if once else 2) + 1)
    traffic = nvme_traffic(store, config, n_layers)
    if sum(traffic):
        out["nvme"] = sum(traffic)
    return out


class Traffic(NamedTuple):
    """NVMe bytes of one step (this rank): read in forward, read in backward (and a clipped update), written."""

    read_forward: int = 0
    read_backward: int = 0
    written: int = 0


def nvme_traffic(store: Store, config: Config, n_layers: int) -> Traffic:
    """The NVMe bytes one step reads and writes, per phase, row by row of every group as the engine moves
    them (a tiled weight's tile rows are groups of their own); the engine's counters
    (``bytes_read.nvme`` / ``bytes_written.nvme``) are their sum.

        forward    each unit's 16-bit param row on NVMe is read (prefetched)
        backward   each block's and the embedding's param row on NVMe is read again, unless its master is
                   lent (``lends_master``: read ahead from NVMe for its update, the fetch casts it); the
                   head is not refetched; optimizer rows on NVMe (master, moments; with clipping the
                   stashed gradient, written in backward and read by the second pass) are read and
                   written once; the 16-bit copy of each NVMe param row is written after its update (an
                   fp32 param row is the master: no copy)

    Only the units whose rows are on NVMe count: a spilled placement moves its spilled units' bytes alone.
    """
    opt_kinds = store.opt_kinds()
    fwd = bwd = out = 0
    for group in store.groups.values():
        n = group.part.shard_numel
        param, opt = n * store.param_dtype.itemsize, n * 4 * len(opt_kinds)
        lent = lends_master(config, n)
        for row in range(group.rows):
            unit = unit_of_row(group.name, row, group.rows, n_layers)
            param_on_disk, opt_on_disk = _on_nvme(config, "params", unit), _on_nvme(config, "optimizer", unit)
            if param_on_disk:
                fwd += param
                out += 0 if store.param_is_master else param
                if not group.name.startswith(HEAD) and not (lent and opt_on_disk):
                    bwd += param
            if opt_on_disk:
                bwd += opt
                out += opt
    return Traffic(fwd, bwd, out)


def _lent(store: Store, config: Config, group) -> bool:
    """Whether ``group``'s units lend their masters: params and optimizer rows on NVMe, and small enough."""
    on_nvme = _nvme_rows(store.param_tier, f"{group.name}/param") and _nvme_rows(store.opt_tier, f"{group.name}/master")
    return bool(on_nvme) and lends_master(config, group.part.shard_numel)


def lends_master(config: Config, shard_numel: int) -> bool:
    """Whether a unit of ``shard_numel`` elements whose params and optimizer are both on NVMe lends its
    master to its backward fetch (``optim.readahead``): the one-pass update (no clipping) reads it ahead
    (depth > 0), and its row is at most ``LEND_PIECES`` pieces."""
    piece = piece_numel(config.optimizer_piece_bytes)
    return config.clip_grad_norm is None and config.prefetch_depth > 0 and lends_whole(shard_numel, piece)


def _on_nvme(config: Config, kind: str, unit: int) -> bool:
    """Whether unit ``unit``'s rows of ``kind`` ("params" or "optimizer") live on NVMe under ``config``."""
    spill = spill_of(config, kind)
    if spill is not None and unit >= spill[0]:
        return spill[1] == "nvme"
    return getattr(config, f"offload_{kind}") == "nvme"


def resolve(config: Config, layout, n_layers: int) -> Config:
    """``config`` with "auto" placements made explicit: the faster tier filled unit by unit up to its budget.

    ``layout(config)`` is the layout build's store of a config. Params first (the compute device, or
    host memory on CPU compute, up to its budget), then the optimizer (host memory up to what is left).
    """
    if config.offload_params == "auto":
        cuda = config.resolved_device().type == "cuda"
        fast, slow = ("none", "cpu") if cuda else ("none", "nvme")
        budget = config.device_memory_budget if cuda and config.device_memory_budget is not None \
            else config.host_memory_budget
        config = _fill(config, "params", fast, slow, budget, layout, n_layers, host=not cuda)
    if config.offload_optimizer == "auto":
        config = _fill(config, "optimizer", "cpu", "nvme", config.host_memory_budget, layout, n_layers, host=True)
    return config


def _fill(config: Config, kind: str, fast: str, slow: str, budget: int, layout, n_layers: int,
          host: bool) -> Config:
    """The explicit split of ``kind`` with the most units in ``fast`` whose estimate fits ``budget``."""
    n_units = n_layers + 2
    for first in range(n_units, -1, -1):
        spill = None if first == n_units else f"{first}:{slow}"
        if spill and slow == "nvme" and not config.nvme_path:
            raise ValueError(f"Config(offload_{kind}='auto'): the {kind} rows do not all fit the budget in "
                             f"{fast!r} and would spill to NVMe, but nvme_path is not set; pass nvme_path=...")
        trial = dataclasses.replace(config, **{f"offload_{kind}": fast if first else slow,
                                                f"spill_{kind}": spill if first else None})
        other = "optimizer" if kind == "params" else "params"
        probe = trial if getattr(trial, f"offload_{other}") != "auto" else \
            dataclasses.replace(trial, **{f"offload_{other}": "nvme" if trial.nvme_path else "cpu"})
        est = estimate(layout(probe), probe, n_layers)
        if (est.host_peak if host else est.device_peak) <= budget:
            return trial
    return trial


def problems(est: Estimate) -> list[str]:
    """What of ``est`` exceeds its config's budgets or the free space under ``nvme_path`` (empty: it fits)."""
    config, out = est.config, []
    if config.host_memory_budget is not None and est.host_peak > config.host_memory_budget:
        out.append(f"peak host memory {est.host_peak / MIB:.1f} MiB > host_memory_budget "
                   f"{config.host_memory_budget / MIB:.1f} MiB")
    if config.device_memory_budget is not None and est.device_peak > config.device_memory_budget:
        out.append(f"peak device memory {est.device_peak / MIB:.1f} MiB > device_memory_budget "
                   f"{config.device_memory_budget / MIB:.1f} MiB")
    if est.disk and config.nvme_path:
        free = shutil.disk_usage(_existing(config.nvme_path)).free
        if est.disk > free:
            out.append(f"NVMe states {est.disk / MIB:.1f} MiB > free space {free / MIB:.1f} MiB under "
                       f"nvme_path={config.nvme_path!r}")
    return out


def check_fit(est: Estimate) -> None:
    """Raise ValueError (with the estimate's table) when ``est`` exceeds a budget or the disk's free space."""
    found = problems(est)
    if found:
        raise ValueError("zf.init: this config does not fit: " + "; ".join(found) + ". Estimate "
                         "(zf.estimate):\n" + est.table() + "\nOffload more (e.g. offload_optimizer='auto' or "
                         "'nvme'), free disk space, or raise the budgets.")


def with_activations(est: Estimate, carry_bytes: int, layer_bytes: int, n_layers: int) -> Estimate:
    """``est`` with the activations of a step added: the boundary carries kept from forward to backward
    (``n_layers`` + 1 of ``carry_bytes``, all micro-batches together; none in host memory when they are
    offloaded to NVMe) and one block's recomputed activations (``layer_bytes``) during its vjp."""
    config = est.config
    boundaries = (n_layers + 1) * carry_bytes if config.offload_activations != "nvme" else 2 * carry_bytes
    parts = {"boundary carries": boundaries, "layer activations": layer_bytes}
    if config.resolved_device().type == "cuda":
        return est._replace(device_working=est.device_working + sum(parts.values()),
                            device_peak=est.device_peak + sum(parts.values()))
    return est._replace(working={**est.working, **parts}, host_peak=est.host_peak + sum(parts.values()))


def _existing(path: str) -> str:
    """``path`` or its nearest existing parent (the NVMe tier creates the directory at init)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path
