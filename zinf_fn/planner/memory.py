"""The memory model: what a config allocates, in which tier, what a step holds and moves; sums of
the parts.

A *layout build* (``zinf_fn.layout.build.layout``) lays the states out over
``offload.tiers.MetaTier``s: the store allocates every array into them exactly as ``zf.init`` would,
but only shapes are recorded. ``estimate`` turns that layout into bytes per (tier, state kind) and,
for what a step holds and moves, sums the ``demand`` each streaming part declares beside its class
(``demands``: the fetcher, the gradient backlog, the optimizer read-ahead and write-behind, the kept
rows; the boundary carries where a batch sizes them). The runtime's buffer pool is bounded by the
same demands (``pool_limit``): nothing here counts a buffer of its own. (A checkpoint save's
buffers, ``checkpoints.save_async``, belong to a save, not to a step: outside the estimate.)

A config is fitted to its budgets by ``planner.fit`` (``resolve``, ``check_fit``), over these
estimates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..config import Config
from ..layout.demand import Demand, Key, Sizing, pool_bytes_by_part, pool_counts
from ..layout.units import reused, stage_of, units
from ..offload import activations
from ..offload.spill import SpillTier
from ..optim import backlog, stream_demand
from ..optim.pieces import piece_numel
from ..overlap import fetch_demand, stream
from ..overlap.plan import refetched, reuse_blocks, row_is_layer
from ..partition.sharding import OwnedRowsTier
from ..store import Store
from ..tiling import plan as tile_plan
from ..tiling.leaf_tiles import reuses_fetched

if TYPE_CHECKING:  # type names only: the layout step is imported by whoever builds one
    from ..layout.build import Layout
    from .experts import Experts

# the rows of the table: Adam's m and v summed as "opt"
KINDS = ("param", "master", "remainder", "opt", "grad")


class Estimate(NamedTuple):
    """Bytes per tier and kind (this rank), peak working memory and per-step traffic of one
    config."""

    config: Config
    states: dict[tuple[str, str], int]  # (placement, kind) -> bytes of states
    working: dict[str, int]  # named host working-memory parts (bytes)
    device_working: int  # compute-device working memory (0 on CPU compute)
    moved: dict[str, int]  # placement -> bytes read + written per step
    host_peak: int  # states in host memory + host working memory
    device_peak: int  # states on the CUDA device + device working memory
    disk: int  # bytes of states under nvme_path
    experts: Experts | None = None  # streamed experts (``planner.experts.with_experts``)

    def tier_bytes(self, placement: str) -> int:
        return sum(v for (p, _), v in self.states.items() if p == placement)

    def table(self) -> str:
        """Tiers x state kinds in MiB, the working memory and the peaks, as a printable table."""
        tiers = [p for p in ("none", "cpu", "nvme") if self.tier_bytes(p)]
        lines = [
            f"{'kind':8s}"
            + "".join(f"{t:>12s}" for t in tiers)
            + "   (MiB; 'none' is the compute device)"
        ]
        for kind in KINDS:
            if any(self.states.get((t, kind)) for t in tiers):
                lines.append(
                    f"{kind:8s}"
                    + "".join(f"{self.states.get((t, kind), 0) / MIB:12.1f}" for t in tiers)
                )
        lines.append(
            f"{'moved':8s}"
            + "".join(f"{self.moved.get(t, 0) / MIB:12.1f}" for t in tiers)
            + "   per step"
        )
        parts = ", ".join(f"{k} {v / MIB:.1f}" for k, v in self.working.items() if v)
        lines.append(
            f"host working memory {sum(self.working.values()) / MIB:.1f} MiB ({parts or 'none'})"
        )
        lines.append(
            f"peak host {self.host_peak / MIB:.1f} MiB (budget "
            f"{_mib(self.config.host_memory_budget)}), "
            f"peak device {self.device_peak / MIB:.1f} MiB (budget "
            f"{_mib(self.config.device_memory_budget)})"
            f", disk {self.disk / MIB:.1f} MiB"
        )
        if self.experts is not None:
            lines.append(self.experts.row())
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


def sizing(layout: Layout, config: Config) -> Sizing:
    """What the streaming parts' demands read of ``config`` and ``layout`` besides the store
    (``zinf_fn.layout.demand.Sizing``)."""
    n_layers = layout.n_layers
    return Sizing(
        n_layers=n_layers,
        world_size=layout.sharding.comm.world_size,
        device=config.resolved_device(),
        compute=config.resolved_compute_dtype(),
        depth=config.prefetch_depth,
        workers=config.update_workers,
        piece_numel=piece_numel(config.optimizer_piece_bytes),
        clipping=config.clip_grad_norm is not None,
        grad_accum=config.grad_accum,
        reuse=reuse_blocks(config.reuse_blocks, n_layers, bool(layout.tiles)),
        embed_trains=layout.frozen.embed_trains(),
        keep_tiles=config.keep_tiles,
    )


def demands(layout: Layout, config: Config) -> list[Demand]:
    """The demand of every streaming part of a step of ``config`` over ``layout``
    (``zinf_fn.layout.demand``), each given the store and the step's ``sizing``; the boundary
    carries, which a batch sizes, are ``offload.activations.demand`` (``with_activations``)."""
    store, sized = layout.store, sizing(layout, config)
    device, compute = sized.device, sized.compute

    # a tile's gradient in its fetched buffer: a pool buffer, not the stored row
    def reuses(group: str) -> bool:
        in_memory = any(
            store.placement_of("param", u) != "nvme"
            for u in store.row_units(store.groups[group], layout.n_layers)
        )
        stored = row_is_layer(
            layout.sharding.comm.world_size,
            store.param_tier.device,
            store.row_kinds.param_dtype,
            device,
            compute,
        )
        return reuses_fetched(config.grad_accum, compute, device) and not (in_memory and stored)

    stages = units(layout.n_layers)
    return [
        fetch_demand.demand(store, sized),
        tile_plan.demand(layout.tiles, store, sized),
        backlog.demand(store, sized, reuses),
        stream_demand.demand(store, sized),
        stream.demand(store, sized),
        stream_demand.kept_demand(store, stages + layout.frozen.companions(stages)),
    ]


def pool_plan(layout: Layout, config: Config) -> dict[Key, int]:
    """The buffers of each (numel, dtype, where) the runtime's pool makes at init
    (``BufferPool.reserve``): what the parts' demands hold together at that size's peak
    (``demand.pool_counts``), at most ``Config.staging_buffers`` of one. A step takes no more while
    each part holds what it declares (``tests/engine/test_demand.py`` checks the pool after steps
    against this plan); the boundary carries' rows, which a batch sizes, are made at the first
    step."""
    counts = pool_counts(demands(layout, config), config.resolved_device().type == "cpu")
    return {k: min(c, config.staging_buffers or c) for k, c in counts.items()}


def pool_limit(layout: Layout, config: Config) -> int:
    """Buffers of one (numel, dtype, device) the runtime's pool may make:
    ``Config.staging_buffers``, or every pool buffer the parts' demands declare in any phase (the
    boundary carries' too), together: past the plan (``pool_plan``), room for a part that holds more
    than it declared, never an unbounded pool."""
    if config.staging_buffers:
        return config.staging_buffers
    placement = config.offload_activations
    carries = activations.demand(0, layout.n_layers, placement, config.prefetch_depth)
    parts = [*demands(layout, config), carries]
    return sum(b.count for d in parts for b in d.buffers)


def working(demands_: list[Demand], config: Config) -> tuple[dict[str, int], int]:
    """(host working memory by part, device working memory): the pool as planned (``pool_plan``:
    each size at its peak, counted to the parts that hold it then) and the bytes each part holds
    outside it, where they live (on CPU compute the device is the host)."""
    pool = pool_bytes_by_part(demands_, config.resolved_device().type == "cpu")
    host = {d.part: pool.get("host", {}).get(d.part, 0) + d.held for d in demands_}
    return host, sum(pool.get("device", {}).values())


def estimate(layout: Layout, config: Config) -> Estimate:
    """The estimate of ``config`` from its layout build (``MetaTier`` members)."""
    states = state_bytes(layout.store)
    parts = demands(layout, config)
    host_working, device_working = working(parts, config)
    cuda = config.resolved_device().type == "cuda"
    host_states = sum(v for (p, _), v in states.items() if p == "cpu" or (p == "none" and not cuda))
    device_states = sum(v for (p, _), v in states.items() if p == "none" and cuda)
    moved = _moved(layout, traffic(parts), config.reuse_blocks)
    disk = sum(v for (p, _), v in states.items() if p == "nvme")
    return Estimate(
        config,
        states,
        host_working,
        device_working,
        moved,
        host_states + sum(host_working.values()),
        device_states + device_working,
        disk,
    )


def _moved(layout: Layout, nvme: Traffic, config_reuse: int = 0) -> dict[str, int]:
    """placement -> bytes read and written per step through ``read_`` / ``write_`` (the engine's
    counters).

    NVMe: the parts' traffic (``nvme_traffic``). Params in host memory (CUDA compute): each unit is
    read in forward and again where the backward fetches it (``overlap.plan.refetched``, less the
    ``reused`` blocks of ``Config.reuse_blocks``), and its 16-bit copy written once, unless its
    group's policy says it is never ``written`` (frozen).
    """
    out: dict[str, int] = {}
    store, embed_trains, n = layout.store, layout.frozen.embed_trains(), layout.n_layers
    reuse = reuse_blocks(config_reuse, n, bool(layout.tiles))
    for tier in members(store.param_tier):
        for name, (rows, numel, dtype) in tier.arrays.items():
            if tier.name not in ("none", "nvme"):
                group = name.split("/")[0]
                # a spill member's rows: counted as refetched
                units = store.row_units(store.groups[group], n)
                again = (
                    0
                    if not refetched(stage_of(group), embed_trains)
                    else rows
                    - (sum(reused(u, n, reuse) for u in units) if rows == len(units) else 0)
                )
                times = rows * (1 + store.row_kinds.policy(group).written) + again
                out[tier.name] = out.get(tier.name, 0) + numel * dtype.itemsize * times
    if sum(nvme):
        out["nvme"] = sum(nvme)
    return out


class Traffic(NamedTuple):
    """NVMe bytes of one step (this rank): read in forward, read in backward (and a clipped update),
    written."""

    read_forward: int = 0
    read_backward: int = 0
    written: int = 0


def traffic(demands_: list[Demand]) -> Traffic:
    """The NVMe bytes the parts move, summed per phase."""
    return Traffic(*(sum(getattr(d, f) for d in demands_) for f in Traffic._fields))


def nvme_traffic(layout: Layout, config: Config) -> Traffic:
    """The NVMe bytes one step reads and writes, per phase, as the parts declare them (row by row of
    every group, a tiled weight's tile rows included); the engine's counters (``bytes_read.nvme`` /
    ``bytes_written.nvme``) are their sum.

        forward    each unit's 16-bit param row on NVMe is read (``overlap.fetch_demand.demand``); a
                   tile's as often as the tile plan fetches it (``tiling.plan.demand``: a block's
                   once in forward, and in backward once for its recompute, once for its op's
                   backward; a frozen head's once; an embedding's used tiles once a unit fetch)
        backward   read again, unless the head's or its master is lent
                   (``optim.passes.lends_master``); optimizer rows on NVMe (master, moments; with
                   clipping the stashed gradient) are read (``optim.stream_demand.demand``) and
                   written (``overlap.stream.demand``), with the 16-bit copy of each NVMe param row
                   (none where the fp32 param row is the master)
    """
    return traffic(demands(layout, config))


def with_activations(est: Estimate, carry_bytes: int, layer_bytes: int, n_layers: int) -> Estimate:
    """``est`` with the activations of a step added: the boundary carries kept from forward to
    backward (``offload.activations.demand`` of ``carry_bytes``, all micro-batches together) and one
    block's recomputed activations (``layer_bytes``, one micro-batch's) during its vjp, and up to
    ``Config.keep_activations`` of the blocks' activations kept from forward to backward
    (``scan.tape.Kept``, tiled blocks' too: at most every block's of every micro-batch)."""
    config = est.config
    placement = config.offload_activations
    carries = activations.demand(carry_bytes, n_layers, placement, config.prefetch_depth)
    tapes = n_layers * config.grad_accum  # one per block and micro-batch
    parts = {
        carries.part: carries.held + sum(b.nbytes for b in carries.buffers),
        "layer activations": layer_bytes,
        "kept activations": min(config.keep_activations, layer_bytes * tapes),
    }
    if config.resolved_device().type == "cuda":
        return est._replace(
            device_working=est.device_working + sum(parts.values()),
            device_peak=est.device_peak + sum(parts.values()),
        )
    return est._replace(
        working={**est.working, **parts}, host_peak=est.host_peak + sum(parts.values())
    )
