"""The engine behind a TrainState: tiers, comm, buffers, fetcher and updater, built once at init.

``Runtime`` is the composition root: it builds every engine object with its collaborators, writes a
state's initial rows (``load_row_``) and closes it. A step runs in ``zinf_fn.step`` (``StepDriver``,
over the ``StepParts`` built here).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch

from .config import Config
from .io.buffers import BufferPool
from .layout.build import Layout
from .layout.units import Unit, key, units
from .observe.trace import Observers
from .offload.activations import OffloadedCheckpoints
from .offload.tiers import make_tier
from .optim.backlog import backlog_bytes
from .optim.compressed import encode_moments
from .optim.decay import DecayCache
from .optim.gradients import GradientsIn
from .optim.masters import cast16_, cast16_widened_, split_master_
from .optim.optimizers import Optimizer
from .optim.paramcast import ParamCast
from .optim.pieces import piece_numel, pieces
from .optim.queue import UpdateQueue
from .optim.readahead import ReadAhead
from .optim.strategies import InPlaceUpdate, Strategies, StreamedUpdate, UpdateTools
from .optim.updater import Updater, UpdaterParts
from .overlap.fetch import Fetcher
from .overlap.gather import RowGather
from .overlap.plan import reuse_blocks
from .overlap.stream import WriteBehind
from .overlap.window import Window
from .partition.sharding import Sharding
from .planner.memory import pool_limit, pool_plan
from .scan.grads import keeps_leaf_grads
from .step import FirstBatch, StepDriver, tiers_of
from .step_io import StepParts
from .store import Store
from .tiling.runtime import TileEngine


class Runtime:
    """The composition root: every engine object of a state, built once here with its collaborators.

    ``observers`` (one tracer, one I/O busy clock, one exposed-wait clock) are the ones the tiers in
    ``store`` were built with; every worker made here gets them in its constructor.
    """

    def __init__(
        self, model, optimizer: Optimizer, config: Config, layout: Layout, observers: Observers
    ):
        """``layout``: the layout step's store, tiles and sharding
        (``zinf_fn.layout.build.lay_out``)."""
        self.model, self.optimizer, self.config = model, optimizer, config
        store, sharding = layout.store, layout.sharding
        self.store, self.sharding, self.comm = store, sharding, sharding.comm
        self.tracer, self.io_clock, self.waits = observers
        self.device = config.resolved_device()
        self.compute_dtype = config.resolved_compute_dtype()
        self.units: list[Unit] = units(model.n_layers)
        # units.reused
        self.reuse = reuse_blocks(config.reuse_blocks, model.n_layers, bool(layout.tiles))
        depth = config.prefetch_depth
        # the parts' demands, summed
        self.pool = BufferPool(limit_per_key=pool_limit(layout, config))
        # a fixed pool, as the parts declare it: reserve_pool
        self._planned = planned_buffers(layout, config)
        opt_device = (
            store.opt_tier.device if store.opt_tier.device.type != "meta" else torch.device("cpu")
        )
        # zinf_fn.formats.frozen: frozen leaves stored apart, no gradient, never written
        self.frozen = layout.frozen
        self.updater = compose_updater(
            store,
            sharding,
            self.pool,
            optimizer,
            config,
            self.device,
            opt_device,
            (self.tracer, self.io_clock, self.waits),
        )
        rows = RowGather(
            store,
            sharding,
            self.pool,
            self.device,
            self.compute_dtype,
            self.tracer,
            masters=self.updater.master_of,
            widen=cast16_widened_,
        )
        self.fetcher = Fetcher(rows)  # how each unit is made of its rows: RowKinds.policy
        self._fetch_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="zinf-fetch") if depth else None
        )
        # the prefetchers' tier reads, the layers' and the tiles', are issued here, not on the
        # compute thread (``overlap.prefetch.Prefetcher``'s ``issuer``), where a param row is on
        # NVMe: elsewhere there is nothing to issue, and no thread hop to pay
        on_disk = any(store.placement_of("param", unit) == "nvme" for unit in self.units)
        self._issue_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="zinf-issue") if depth and on_disk else None
        )
        # Tiled leaves (zinf_fn.tiling): filled in by init.
        self.tiles = TileEngine(
            self.fetcher,
            depth,
            self._fetch_thread,
            layout.tiles,
            clipping=config.clip_grad_norm is not None,
            issuer=self._issue_thread,
            keep_tiles=config.keep_tiles,
        )
        self.checkpoints = self._offloaded_checkpoints(depth)
        self.first_batch = FirstBatch()  # train.split_batch checks every batch against the first
        self.driver = StepDriver(self._step_parts())

    def _offloaded_checkpoints(self, depth: int) -> OffloadedCheckpoints | None:
        """Where the carries are kept (``Config.offload_activations``); None: as they are."""
        config = self.config
        if config.offload_activations == "none":
            return None
        role = f"rank{self.comm.rank}/activations"
        tier = make_tier(
            config.offload_activations,
            self.device,
            config.nvme_path,
            role,
            tracer=self.tracer,
            clock=self.io_clock,
            nvme_engine=config.nvme_engine,
        )
        return OffloadedCheckpoints(
            tier,
            self.model.n_layers,
            self.pool,
            self.device,
            depth,
            WriteBehind(self.pool, depth, self.waits),
            Window,
            self.waits,
        )

    def _step_parts(self) -> StepParts:
        """What the step driver uses, with the gradient path of every step of this run: a unit's
        leaves (``scan.grads.keeps_leaf_grads``) or a flat buffer."""
        config = self.config
        clipping = config.clip_grad_norm is not None
        leaf_grads = keeps_leaf_grads(
            self.comm.world_size,
            config.grad_accum,
            clipping,
            self.compute_dtype,
            self.device,
            self.updater.opt_device,
        )
        observers = Observers(self.tracer, self.io_clock, self.waits)
        return StepParts(
            self.model,
            self.optimizer,
            config,
            self.units,
            self.reuse,
            self.frozen,
            self.store,
            self.sharding,
            self.pool,
            self.fetcher,
            self.updater,
            self.tiles,
            self.checkpoints,
            observers,
            self._fetch_thread,
            self._issue_thread,
            self.device,
            leaf_grads,
        )

    def reserve_pool(self) -> None:
        """Make the planned pool (``planner.memory.pool_plan``) once, before the first step or
        evaluation: not at init, whose own temporaries would then add to it in the run's peak."""
        if self._planned:
            self.pool.reserve(self._planned)
            self._planned.clear()  # made once

    def train_step(self, micro_batches: list, step: int) -> dict:
        """One training step (``step.StepDriver.train_step``): its metrics."""
        self.reserve_pool()
        return self.driver.train_step(micro_batches, step)

    def eval_step(self, micro_batches: list) -> torch.Tensor:
        """The mean loss (``step.StepDriver.eval_step``), after the last step's writes are done."""
        self.flush()  # sync: a failed write of the last step raises here, not after an evaluation
        self.reserve_pool()
        return self.driver.eval_step(micro_batches)

    def keep_first_rows(self) -> None:
        """Keep the 16-bit rows of the embedding and the first block in memory where they are on
        NVMe (written through, ``offload.resident``): a step's forward needs them before any compute
        could hide a read, and the updates that write them end the step before (their policy's
        ``resident``, ``zinf_fn.layout.policy``)."""
        # a frozen row: written once, at init
        for unit in self.units + self.frozen.companions(self.units):
            if self.sharding.holds(unit) and self.store.row_kinds.policy(unit.group).keeps(unit):
                self.store.param_tier.keep(key(unit.group, "param"), unit.row)

    def load_row_(self, unit, flat: torch.Tensor) -> None:
        """This rank's part of ``flat`` (a unit's or a tile's padded flat fp32 row) as its master, a
        fresh optimizer state and the 16-bit copy, as ``zf.init`` writes them (a quantized frozen
        row: its leaves' values, ``FrozenCodes.stored_row``); nothing where another rank owns it.

        Lean: besides ``flat``, one piece (``Config.optimizer_piece_bytes``) of each optimizer leaf
        and of the 16-bit copy is in memory at a time: ``optimizer.init`` is elementwise (a
        shard-shaped state per leaf, as the optimizers' contract has it), so it runs piece by piece.
        """
        store, sharding = self.store, self.sharding
        self.fetcher.forget(unit.group, unit.row)
        if not sharding.holds(unit):
            return
        start, end = sharding.local_range(store.groups[unit.group].part)
        param_key = key(unit.group, "param")
        # a param row only (zinf_fn.formats.frozen): its 16-bit copy (as a master's) or codes
        if unit.group in store.row_kinds.frozen:
            row = self.frozen.codes.stored_row(
                unit.group,
                flat,
                (start, end),
                store.groups[unit.group].part.padded_numel,
                functools.partial(cast16_, ties_away=store.row_kinds.ties_away),
            )
            store.param_tier.write_(param_key, unit.row, row).result()  # sync: written
            return
        master = flat[start:end].to(self.updater.opt_device)
        # else each piece's remainder is written with its param copy, below
        if not store.row_kinds.remainder:
            # sync: written
            store.opt_tier.write_(key(unit.group, "master"), unit.row, master).result()
        # the optimizer leaves' rows (int8: codes, scales)
        leaf_rows = store.row_kinds.opt_kinds(False, unit.group)[1:]
        for lo, hi in pieces(master.numel(), self.updater.piece_numel):
            stored = encode_moments(
                store.row_kinds.moments_of(unit.group), self.optimizer.init(master[lo:hi])
            )
            for kind, row in zip(leaf_rows, stored, strict=True):
                start = store.row_kinds.span(kind, lo, hi)[0]
                # sync: written
                store.opt_tier.write_(key(unit.group, kind), unit.row, row, start).result()
            if (
                not store.row_kinds.param_is_master
            ):  # else the param row is the master row just written
                param = torch.empty(
                    hi - lo, dtype=store.row_kinds.param_dtype, device=master.device
                )
                if store.row_kinds.remainder:  # the master's two halves (optim.masters)
                    remainder = torch.empty(hi - lo, dtype=torch.int16, device=master.device)
                    split_master_(master[lo:hi], param, remainder)
                    store.opt_tier.write_(
                        key(unit.group, "remainder"), unit.row, remainder, lo
                    ).result()  # sync
                else:
                    cast16_(param, master[lo:hi], store.row_kinds.ties_away)
                store.param_tier.write_(param_key, unit.row, param, lo).result()  # sync: written

    def flush(self) -> None:
        """sync: the last step's write-behind is on disk (raises its first failed write: layer and
        state) and the next step's early reads (``Fetcher.read_early``) given back. ``train_step``
        returns with the writes of the last updated units in flight: whatever reads the tier files
        but through the tier calls this first."""
        self.fetcher.drop_early()
        self.updater.flush()

    def close(self) -> None:
        """Flush the write-behind (raising its error, if any), then stop every worker and close the
        tiers."""
        try:
            self.flush()
        finally:
            self.updater.close()
            for thread in (self._fetch_thread, self._issue_thread):
                if thread is not None:
                    thread.shutdown(wait=True)
            for tier in tiers_of(self.store, self.checkpoints):
                tier.close()
            self.tracer.close()


def compose_updater(
    store: Store,
    sharding: Sharding,
    pool: BufferPool,
    optimizer: Optimizer,
    config: Config,
    device: torch.device,
    opt_device: torch.device,
    observers: Observers,
) -> Updater:
    """The updater and its parts, each given its collaborators: gradients in, the update queue, the
    read-ahead and write-behind of the optimizer's rows, the 16-bit cast, the decay spans and the
    two strategies."""
    tracer, _, waits = observers
    depth, n = config.prefetch_depth, piece_numel(config.optimizer_piece_bytes)
    reads = ReadAhead(store, pool, opt_device, depth, waits, n)
    writes = WriteBehind(pool, depth, waits)
    cast, decay = (
        ParamCast(store, pool, device),
        DecayCache(store, sharding, optimizer.weight_decay_mask),
    )
    # grads waiting for an update: workers + depth + 1 of them, or fewer where larger than a slot of
    # LEND_PIECES pieces (bounded by that many slots' bytes; a gradient larger than the bound waits
    # for the update before it)
    queue = UpdateQueue(
        config.update_workers, backlog_bytes(config.update_workers, depth, n), waits
    )
    tools = UpdateTools(store, optimizer, decay, cast, writes, pool)
    strategies = Strategies(InPlaceUpdate(tools, n), StreamedUpdate(tools, reads))
    parts = UpdaterParts(
        gradients=GradientsIn(store, sharding, pool, device, opt_device),
        queue=queue,
        strategies=strategies,
        reads=reads,
        writes=writes,
        cast=cast,
    )
    return Updater(store, sharding, pool, parts, tracer)


def planned_buffers(
    layout: Layout, config: Config
) -> list[tuple[int, torch.dtype, torch.device, int]]:
    """The pool's plan (``planner.memory.pool_plan``) on this run's devices: "host" buffers in host
    memory, "device" ones on the compute device (``BufferPool.reserve``'s specs)."""
    devices = {"host": torch.device("cpu"), "device": config.resolved_device()}
    return [
        (numel, dtype, devices[where], count)
        for (numel, dtype, where), count in pool_plan(layout, config).items()
        if numel
    ]
