"""The scan's I/O of one step over the runtime's parts, and where its gradients go.

``StepParts`` are the engine objects a step uses, built once by the composition root
(``runtime.Runtime``). ``StepIO`` is the runtime's ``scan.ScanIO``: it hands the scans the
prefetched layers of the step's plan (``overlap.plan``), runs the events the plan's entries name
(``BEGIN_UPDATES``, ``READ_EARLY``), makes the live unit's tiles fetchable
(``tiling.step_tiles.StepTiles``) and records compute spans. ``GradientsOut`` is where a unit's or a
tile's gradient goes: the reduce-scatter, then the update queue (or, with clipping, the stash the
second pass reads). ``step.StepDriver`` runs a step with them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from .formats.frozen import FrozenLeaves
from .io.buffers import BufferPool, PoolExhausted
from .layout.units import Unit
from .observe.trace import Observers
from .offload.activations import OffloadedCheckpoints
from .optim.backlog import TILE_BACKLOG
from .optim.optimizers import Optimizer
from .optim.updater import Updater
from .overlap.fetch import Fetcher
from .overlap.plan import BEGIN_UPDATES, READ_EARLY, FetchOp
from .overlap.prefetch import Prefetcher
from .partition.sharding import Sharding
from .scan.grads import LeafGrads
from .scan.loops import ScanOptions
from .store import Store
from .tiling.runtime import TileEngine
from .tiling.step_tiles import StepTiles


class StepParts(NamedTuple):
    """The engine objects a step uses, built once by the composition root (``runtime.Runtime``)."""

    model: Any  # the zf.Model
    optimizer: Optimizer
    config: Any  # the zf.Config
    units: list[Unit]  # the scan's units, embed .. head
    reuse: int  # blocks held from forward into backward (``overlap.plan.reuse_blocks``)
    frozen: FrozenLeaves
    store: Store
    sharding: Sharding
    pool: BufferPool
    fetcher: Fetcher
    updater: Updater
    tiles: TileEngine
    checkpoints: OffloadedCheckpoints | None
    observers: Observers
    executor: ThreadPoolExecutor | None  # the fetch thread (none where prefetch_depth is 0)
    issuer: ThreadPoolExecutor | None  # the thread the reads are issued on (none: not on NVMe)
    device: torch.device  # the compute device
    leaf_grads: bool  # gradients go to the update as leaves (``scan.grads.keeps_leaf_grads``)


class GradientsOut:
    """Where a step's gradients go: a unit's flat gradient is reduce-scattered, then stashed
    (clipping: the second pass updates it) or queued for its update; a run of small tiles' shards as
    one update.

    It is the ``tiling.leaf_tiles.TileGrads`` of the step's tiles too.
    """

    def __init__(self, parts: StepParts, step: int, clipping: bool):
        self.parts = parts
        self.step = step
        self.clipping = clipping

    def emit_grad(self, unit: Unit, flat) -> None:
        """Take ``unit``'s flat gradient (``StepIO.grad_buffer``'s, or a tile's) and own it."""
        updater = self.parts.updater
        # nothing of it trains: no reduce-scatter, no update, no row written
        if self.parts.frozen.whole(unit):
            if isinstance(flat, torch.Tensor):  # (grad_buffer made none: flat is None)
                self.parts.pool.give(flat)
            return
        # not clipping: its update takes its norm
        grad = updater.scatter(unit, flat, not self.clipping)
        if grad is None:  # broadcast mode: another rank owns this unit and updates it
            return
        if self.clipping:
            updater.stash_(unit, grad)
        else:
            updater.submit(unit, grad, self.step)

    def tile_buffer(self, unit) -> torch.Tensor:
        """A flat fp32 gradient buffer for a tile unit (the caller fills all of it, padding too).

        Where every buffer of its size is out, the queued tile updates hold them (each gives its
        gradient back as it ends; the tile throttle lets ``TILE_BACKLOG`` run behind): wait for
        them, then take again, which raises only where nothing of the pool came back."""
        numel = self.parts.store.group_of(unit).part.padded_numel
        try:
            return self.parts.pool.take(numel, torch.float32, self.parts.device)
        except PoolExhausted:
            self.parts.updater.wait_backlog(0)  # sync: the queued updates give their buffers back
            return self.parts.pool.take(numel, torch.float32, self.parts.device)

    def scatter(self, unit, flat: torch.Tensor) -> torch.Tensor:
        """A tile of a run's shard, made as its gradient is done (its norm's slot in that order)."""
        return self.parts.updater.scatter(unit, flat, True)

    def submit(self, units: list, shards: list) -> None:
        """A run of small tiles' shards, queued as one update (``overlap.tile_runs.update_run``)."""
        self.parts.updater.submit_run(units, shards, self.step)

    def throttle(self) -> None:
        """sync: at most ``TILE_BACKLOG`` tile updates stay queued behind the update worker."""
        self.parts.updater.wait_backlog(TILE_BACKLOG)


class StepIO:
    """The scan's I/O (``scan.ScanIO``) of one step over the runtime's parts.

    ``get(i)`` waits for plan entry i (``prefetcher``), runs the events the entry names, and makes
    its tiled leaves fetchable (``tiles``); ``release`` records its compute span and gives it back.
    ``out`` takes the gradients (None: an evaluation, which makes none).
    """

    def __init__(
        self,
        parts: StepParts,
        plan: list[FetchOp],
        prefetcher: Prefetcher,
        out: GradientsOut | None,
        tiles: StepTiles | None,
        options: ScanOptions,
    ):
        self.parts = parts
        self.plan = plan
        self.prefetcher = prefetcher
        self.out = out
        self.tiles = tiles
        self.options = options
        self.computing: dict[tuple, tuple] = {}  # (group, row) -> (compute start, its span's name)

    def get(self, i: int):
        """Plan entry i materialised; the events it names start once it is in hand."""
        op = self.plan[i]
        with self.parts.observers.waits.waiting(op.unit.name):
            layer = self.prefetcher.get(i)
        if op.events:  # the reads the events issue queue behind the layers' issued so far
            self.prefetcher.settle()
        for event in op.events:
            self._start(event)
        key = (op.unit.group, op.unit.row)
        self.computing[key] = (time.perf_counter_ns(), f"{op.phase} {op.unit.name}")
        return layer if self.tiles is None else self.tiles.enter(i, layer)

    def release(self, layer) -> None:
        """The unit is done: its tile gradients sent, its compute span kept, its buffers back."""
        if self.tiles is not None:
            self.tiles.leave(layer)
        start, name = self.computing.pop((layer.unit.group, layer.unit.row))
        tracer = self.parts.observers.tracer
        if tracer.enabled:
            tracer.record("compute", name, start, time.perf_counter_ns())
        self.parts.fetcher.release(layer)

    def recorded(self, layer, kept: list[bool]) -> None:
        """The forward recorded ``layer``'s block; the kept tapes' backward passes fetch no tile
        for a recompute (``tiling.step_tiles.StepTiles.recorded``)."""
        if self.tiles is not None:
            self.tiles.recorded(layer, kept)

    def grad_buffer(self, unit) -> torch.Tensor | LeafGrads | None:
        """A zeroed flat fp32 buffer for ``unit``'s gradient, its leaves (``LeafGrads``), or None
        where nothing of it takes a gradient (``zinf_fn.formats.frozen``)."""
        if self.parts.frozen.whole(unit):
            return None
        group = self.parts.store.group_of(unit)
        if self.parts.leaf_grads:
            return LeafGrads(group.spec)
        buf = self.parts.pool.take(group.part.padded_numel, torch.float32, self.parts.device)
        buf[group.spec.numel :].zero_()
        return buf

    def emit_grad(self, unit, flat) -> None:
        """``unit``'s gradient to ``out`` (``GradientsOut.emit_grad``)."""
        self.out.emit_grad(unit, flat)

    def spec_of(self, unit):
        return self.parts.store.group_of(unit).spec

    def frozen_of(self, unit) -> tuple[int, ...]:
        return self.parts.frozen.of(unit)

    def _start(self, event: str) -> None:
        """Start one of the plan's in-step events (``overlap.plan``)."""
        parts, depth = self.parts, self.parts.config.prefetch_depth
        if event == BEGIN_UPDATES:
            clipping = parts.config.clip_grad_norm is not None
            parts.updater.begin_step(parts.frozen.trained(parts.units), clipping)
        elif event == READ_EARLY:
            parts.fetcher.read_early(parts.units, depth)
        else:
            expected = f"{BEGIN_UPDATES!r} or {READ_EARLY!r}"
            raise ValueError(f"plan entry event {event!r}: expected {expected}")
