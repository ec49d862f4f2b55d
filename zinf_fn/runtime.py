"""The engine behind a TrainState: tiers, comm, buffers, fetcher and updater, built once at init."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .config import Config
from .io.buffers import BufferPool
from .layout import Layout
from .model import packed_head
from .offload.activations import OffloadedCheckpoints
from .offload.tiers import make_tier
from .optim.compressed import encode_moments
from .optim.decay import DecayCache
from .optim.gradients import GradientsIn
from .optim.masters import cast16_, split_
from .optim.optimizers import Optimizer, clip_coefficient, learning_rate
from .optim.paramcast import ParamCast
from .optim.pieces import piece_numel, pieces
from .optim.queue import UpdateQueue
from .optim.readahead import ReadAhead
from .optim.strategies import InPlaceUpdate, Strategies, StreamedUpdate
from .optim.updater import TILE_BACKLOG, Updater, backlog_bytes
from .overlap.fetch import Fetcher
from .overlap.plan import eval_plan, keep_budget, reuse_blocks, train_plan
from .overlap.prefetch import Prefetcher, plan_prefetcher
from .overlap.stream import Window, WriteBehind
from .partition.sharding import Sharding
from .planner.memory import pool_limit, pool_plan
from .scan.grads import LeafGrads, keeps_leaf_grads
from .scan.loops import ScanIO, backward_scan, forward_scan, head_params, head_step
from .store import Store
from .tiling.runtime import TileEmit, TileEngine
from .trace import Observers
from .units import Unit, head_index, key, units


class Runtime:
    """The composition root: every engine object of a state, built once here with its collaborators.

    ``observers`` (one tracer, one I/O busy clock, one exposed-wait clock) are the ones the tiers in
    ``store`` were built with; every worker made here gets them in its constructor.
    """

    def __init__(self, model, optimizer: Optimizer, config: Config, layout: Layout, observers: Observers):
        """``layout``: the layout step's store, tiles and sharding (``zinf_fn.layout.lay_out``)."""
        self.model, self.optimizer, self.config = model, optimizer, config
        store, sharding = layout.store, layout.sharding
        self.store, self.sharding, self.comm = store, sharding, sharding.comm
        self.tracer, self.io_clock, self.waits = observers
        self.device = config.resolved_device()
        self.compute_dtype = config.resolved_compute_dtype()
        self.units: list[Unit] = units(model.n_layers)
        self.reuse = reuse_blocks(config.reuse_blocks, model.n_layers, bool(layout.tiles))   # units.reused
        depth = config.prefetch_depth
        self.pool = BufferPool(limit_per_key=pool_limit(layout, config))   # the parts' demands, summed
        self._planned = planned_buffers(layout, config)   # a fixed pool, as the parts declare it: reserve_pool
        self._fetch_thread = ThreadPoolExecutor(1, thread_name_prefix="zinf-fetch") if depth else None
        opt_device = store.opt_tier.device if store.opt_tier.device.type != "meta" else torch.device("cpu")
        self.frozen = layout.frozen   # zinf_fn.frozen: frozen leaves stored apart, no gradient, never written
        self.updater = compose_updater(store, sharding, self.pool, optimizer, config, self.device, opt_device,
                                       (self.tracer, self.io_clock, self.waits))
        self.fetcher = Fetcher(store, sharding, self.pool, self.device, self.compute_dtype, self.tracer,
                               masters=self.updater.master_of)   # the rest: Store.policy
        # Tiled leaves (zinf_fn.tiling): filled in by init; at most TILE_BACKLOG tile updates queued behind the worker.
        self.tiles = TileEngine(self.fetcher, depth, self._fetch_thread, self._tile_grad_buffer,
                                lambda: self.updater.wait_backlog(TILE_BACKLOG), layout.tiles,
                                lambda g: g in store.frozen, clipping=config.clip_grad_norm is not None)
        self.checkpoints = None
        if config.offload_activations != "none":
            tier = make_tier(config.offload_activations, self.device, config.nvme_path,
                             f"rank{self.comm.rank}/activations", tracer=self.tracer, clock=self.io_clock,
                             nvme_engine=config.nvme_engine)
            self.checkpoints = OffloadedCheckpoints(tier, model.n_layers, self.pool, self.device, depth,
                                                    WriteBehind(self.pool, depth, self.waits), Window, self.waits)
        self.batch_signature, self._leaf_grads = None, False

    # -- one step --------------------------------------------------------------------------------------
    def reserve_pool(self) -> None:
        """Make the planned pool (``planner.memory.pool_plan``) once, before the first step or evaluation: not
        at init, whose own temporaries would then add to it in the run's peak."""
        if self._planned is not None:
            self.pool.reserve(self._planned)
            self._planned = None

    def train_step(self, micro_batches: list, step: int) -> dict:
        self.reserve_pool()
        t0 = time.perf_counter()
        n_targets = self._target_tokens(micro_batches)   # a TokenLoss head: the mean over the global batch's targets
        before = self._counters()
        self.waits.thread = threading.get_ident()   # the thread that calls train_step computes
        self.updater.reset_norm()
        clipping = self.config.clip_grad_norm is not None
        self._leaf_grads = keeps_leaf_grads(self.comm.world_size, len(micro_batches), clipping, self.compute_dtype,
                                            self.device, self.updater.opt_device)
        plan = train_plan(self.units, self.frozen.embed_trains(), self.reuse)
        prefetcher = plan_prefetcher(plan, self.fetcher, self.config.prefetch_depth, self._fetch_thread)
        # The optimizer rows are read ahead from `depth` units before the head on, not at the step's start,
        # where they would queue in front of the first layers' parameter reads.
        begin_at = max(0, head_index(self.model.n_layers) - self.config.prefetch_depth)
        hooks = {begin_at: lambda: self.updater.begin_step(self.frozen.trained(self.units), clipping)}
        if not clipping:   # the next step's first frozen reads, from the backward's last unit on (read_early)
            hooks[len(plan) - 1] = lambda: self.fetcher.read_early(self.units, self.config.prefetch_depth)
        emit, tile_emit = self._emitter(step, clipping)
        tiles = self.tiles.begin(plan, emit, len(micro_batches), train=True, tile_emit=tile_emit)
        scale = None if n_targets is None else self.comm.world_size / n_targets
        io = self._io(plan, prefetcher, emit, tiles, hooks, scale)
        try:
            losses, grad_norm = self._scan_and_update(io, micro_batches, step, clipping)
        except BaseException:
            self._abandon()
            raise
        finally:
            _close_step(prefetcher, tiles)
        loss = self._mean_loss(losses, n_targets)
        counts = self._step_counts(before)
        metrics = self._metrics(loss, grad_norm, step, time.perf_counter() - t0, prefetcher.wait_s, counts)
        self.tracer.flush()
        return metrics

    def _emitter(self, step: int, clipping: bool) -> tuple:
        """Where the scans hand a unit's flat gradient (reduce-scattered, then stashed with clipping, else queued for
        its update), and where a run of small tiles hands its shards (``TileEmit``: queued as one update)."""
        def emit(unit, flat):
            if self.frozen.whole(unit):   # nothing of it trains: no reduce-scatter, no update, no row written
                if isinstance(flat, torch.Tensor):   # (grad_buffer made none: flat is None)
                    self.pool.give(flat)
                return
            grad = self.updater.scatter(unit, flat, not clipping)   # not clipping: its update takes its norm
            if grad is None:   # broadcast mode: another rank owns this unit and updates it
                return
            if clipping:
                self.updater.stash_(unit, grad)
            else:
                self.updater.submit(unit, grad, step)
        return emit, TileEmit(lambda unit, flat: self.updater.scatter(unit, flat, True),
                              lambda units, shards: self.updater.submit_run(units, shards, step))

    def _scan_and_update(self, io: ScanIO, micro_batches: list, step: int, clipping: bool) -> tuple[list, float]:
        """Forward, head, backward and every update of one step: (the micro-batches' losses, the global
        gradient norm)."""
        model = self.tiles.model(packed_head(self.model))
        carries, bounds = forward_scan(model, io, micro_batches, keep_boundaries=True, check=True)
        losses, d_carries, d_tied = head_step(model, io, carries, micro_batches)
        del carries
        backward_scan(model, io, bounds, d_carries, micro_batches, d_tied)
        if clipping:
            grad_norm = self._global_grad_norm()
            scale = clip_coefficient(grad_norm, self.config.clip_grad_norm)
            updated = self.frozen.trained(self.units + self.tiles.layout.units(self.units))
            self.updater.stream_clipped(updated, step, scale)
        self.updater.wait()   # sync: every update ran; the last units' writes stay in flight (Updater.wait)
        if not clipping:   # the one-pass updates took the norms of the units they updated
            grad_norm = self._global_grad_norm()
        return losses, grad_norm

    def _step_counts(self, before: dict) -> dict:
        """The counters' change since ``before`` (``_counters``), with the I/O time hidden behind compute."""
        counts = {k: v - before[k] for k, v in self._counters().items()}
        wait, busy = counts.pop("io_wait_s"), counts.pop("io_busy_s")
        counts.update(io_wait_s=wait, io_busy_s=busy, io_hidden_s=max(0.0, busy - wait))
        return counts

    def eval_step(self, micro_batches: list) -> torch.Tensor:
        self.flush()   # sync: a failed write of the last step raises here, not after an evaluation
        self.reserve_pool()
        plan = eval_plan(self.units)
        prefetcher = plan_prefetcher(plan, self.fetcher, self.config.prefetch_depth, self._fetch_thread)
        tiles = self.tiles.begin(plan, None, len(micro_batches), train=False)
        io, model = self._io(plan, prefetcher, None, tiles), self.tiles.model(packed_head(self.model))
        try:
            carries, _ = forward_scan(model, io, micro_batches, keep_boundaries=False, check=True)
            layer = io.get(head_index(self.model.n_layers))
            with torch.no_grad():
                pairs = zip(carries, micro_batches, strict=True)
                losses = [model.head.apply(head_params(model, layer), c, mb) for c, mb in pairs]
            io.release(layer)
        finally:
            _close_step(prefetcher, tiles)
        n_targets = self._target_tokens(micro_batches)
        return torch.tensor(self._mean_loss([_scalar(x, n_targets is not None) for x in losses], n_targets))

    # -- helpers -----------------------------------------------------------------------------------------
    def _io(self, plan: list, prefetcher: Prefetcher, emit, tiles=None, hooks: dict | None = None,
            loss_scale: float | None = None) -> ScanIO:
        """The scan's view of this step; ``hooks[i]()`` runs once plan entry i is in hand; ``loss_scale``: a
        ``TokenLoss`` head's cotangent (``ScanIO.loss_scale``)."""
        def grad_buffer(unit):
            if self.frozen.whole(unit):   # nothing of it takes a gradient: none is made (zinf_fn.frozen)
                return None
            group = self.store.group_of(unit)
            if self._leaf_grads:
                return LeafGrads(group.spec)
            buf = self.pool.take(group.part.padded_numel, torch.float32, self.device)
            buf[group.spec.numel :].zero_()
            return buf

        computing: dict[tuple, tuple] = {}

        def get(i):
            op = plan[i]
            with self.waits.waiting(op.unit.name):
                layer = prefetcher.get(i)
            if hooks and i in hooks:
                hooks.pop(i)()
            computing[(op.unit.group, op.unit.row)] = (time.perf_counter_ns(), f"{op.phase} {op.unit.name}")
            return layer

        def release(layer):
            start, name = computing.pop((layer.unit.group, layer.unit.row))
            if self.tracer.enabled:
                self.tracer.record("compute", name, start, time.perf_counter_ns())
            self.fetcher.release(layer)

        io = ScanIO(get, release, grad_buffer, emit, lambda unit: self.store.group_of(unit).spec, self.checkpoints,
                    loss_scale=loss_scale, frozen_of=self.frozen.of, embed_trains=self.frozen.embed_trains(),
                    keep_activations=keep_budget(self.config.keep_activations, tiles is not None), reuse=self.reuse)
        return io if tiles is None else tiles.wrap(io)

    def _tile_grad_buffer(self, unit) -> torch.Tensor:
        """A flat fp32 gradient buffer for a tile unit (the caller fills all of it, padding included)."""
        return self.pool.take(self.store.group_of(unit).part.padded_numel, torch.float32, self.device)

    def _global_grad_norm(self) -> float:
        total = self.updater.sq_norm()
        self.comm.all_reduce_sum_(total, "grad norm")   # sync: every rank's squared shard norms
        return float(total.sqrt())

    def _target_tokens(self, micro_batches: list) -> int | None:
        """The target tokens of the global batch (``Model.count_targets`` summed over micro-batches and ranks);
        None for a model whose head returns a scalar loss."""
        if self.model.count_targets is None:
            return None
        local = torch.stack([torch.as_tensor(self.model.count_targets(mb)).reshape(()) for mb in micro_batches])
        total = local.sum().to("cpu", torch.float64)   # sync: one device-to-host copy for all micro-batches
        self.comm.all_reduce_sum_(total, "target tokens")   # sync: every rank's count, once per step
        if total <= 0:
            raise ValueError("the global batch has no target tokens (every target is -100): its loss is undefined; "
                             "skip such batches or train on the prompt (train_on_prompt)")
        return int(total)

    def _mean_loss(self, losses: list, n_targets: int | None = None) -> float:
        """The mean over micro-batches and ranks; for ``TokenLoss`` es the sum over them / ``n_targets``."""
        if n_targets is not None:
            total = torch.stack([x.sum.detach().double().cpu() for x in losses]).sum()
            self.comm.all_reduce_sum_(total, "loss")   # sync: the global loss sum
            return float(total) / n_targets
        mean = torch.stack([x.detach().double().cpu() for x in losses]).mean()
        self.comm.all_reduce_sum_(mean, "loss")   # sync: the global loss is the mean over ranks
        return float(mean) / self.comm.world_size

    def _counters(self) -> dict:
        """Cumulative traffic counters and clocks; a step reports their difference."""
        out = {**self.fetcher.counters(), "io_wait_s": self.waits.seconds, "io_busy_s": self.io_clock.read(),
               "state_bytes_moved": sum(sum(t.counters()[c] for c in ("bytes_read", "bytes_written"))
                                        for t in (self.store.param_tier, self.store.opt_tier))}
        for tier in self._tiers():
            for counter, value in tier.counters().items():   # NVMe adds bytes_read_inflight
                name = f"{counter}.{tier.name}"
                out[name] = out.get(name, 0) + value
        return out

    def _tiers(self) -> list:
        tiers = [self.store.param_tier, self.store.opt_tier]
        return tiers + ([self.checkpoints.tier] if self.checkpoints is not None else [])

    def _abandon(self) -> None:
        """A step failed: give every buffer of the optimizer stream and the checkpoints back."""
        self.updater.abandon()
        if self.checkpoints is not None:
            self.checkpoints.abandon()

    def _metrics(self, loss: float, grad_norm: float, step: int, seconds: float, wait_s: float, counts: dict) -> dict:
        return {
            "loss": loss, "grad_norm": grad_norm,
            "lr": None if self.optimizer.lr is None else learning_rate(self.optimizer.lr, step),
            "step_time_s": seconds, "fetch_wait_s": wait_s,
            "peak_live_layers": self.fetcher.peak_live, "buffers": self.pool.count,
            "bytes_per_param": counts["state_bytes_moved"] / max(1, self._held_elements()),
            **(self.tiles.last if self.tiles.layout else {}), **counts,
        }

    def _held_elements(self) -> int:
        """Elements of one row of every unit and tile this rank holds (padding included): the parameters
        whose states this rank's tiers store and move."""
        rows = self.units + self.tiles.layout.units(self.units) + self.frozen.companions(self.units)
        return sum(self.frozen.shard_elements(u.group, self.store.group_of(u).part) for u in rows
                   if self.sharding.holds(u))

    def keep_first_rows(self) -> None:
        """Keep the 16-bit rows of the embedding and the first block in memory where they are on
        NVMe (written through, ``offload.resident``): a step's forward needs them before any compute
        could hide a read, and the updates that write them end the step before (their policy's
        ``resident``, ``zinf_fn.policy``)."""
        for unit in self.units + self.frozen.companions(self.units):   # a frozen row: written once, at init
            if self.sharding.holds(unit) and self.store.policy(unit.group).keeps(unit):
                self.store.param_tier.keep(key(unit.group, "param"), unit.row)

    def load_row_(self, unit, flat: torch.Tensor) -> None:
        """This rank's part of ``flat`` (a unit's or a tile's padded flat fp32 row) as its master, a fresh
        optimizer state and the 16-bit copy, as ``zf.init`` writes them (a quantized frozen row: its leaves' values,
        ``FrozenLeaves.stored_row``); nothing where another rank owns it.

        Lean: besides ``flat``, one piece (``Config.optimizer_piece_bytes``) of each optimizer leaf and of
        the 16-bit copy is in memory at a time: ``optimizer.init`` is elementwise (a shard-shaped state
        per leaf, as the optimizers' contract has it), so it runs piece by piece.
        """
        store, sharding = self.store, self.sharding
        self.fetcher.forget(unit.group, unit.row)
        if not sharding.holds(unit):
            return
        start, end = sharding.local_range(store.groups[unit.group].part)
        param_key = key(unit.group, "param")
        if unit.group in store.frozen:   # a param row only (zinf_fn.frozen): its 16-bit copy (as a master's) or codes
            row = self.frozen.stored_row(unit.group, flat, (start, end), store.groups[unit.group].part.padded_numel,
                                         lambda out, x: cast16_(out, x, store.ties_away))
            store.param_tier.write_(param_key, unit.row, row).result()   # sync: written
            return
        master = flat[start:end].to(self.updater.opt_device)
        if not store.remainder:   # else each piece's remainder is written with its param copy, below
            store.opt_tier.write_(key(unit.group, "master"), unit.row, master).result()   # sync: written
        leaf_rows = store.opt_kinds(False, unit.group)[1:]   # the optimizer leaves' rows (int8: codes, scales)
        for lo, hi in pieces(master.numel(), self.updater.piece_numel):
            stored = encode_moments(store.moments_of(unit.group), self.optimizer.init(master[lo:hi]))
            for kind, row in zip(leaf_rows, stored, strict=True):
                start = store.span(kind, lo, hi)[0]
                store.opt_tier.write_(key(unit.group, kind), unit.row, row, start).result()   # sync: written
            if not store.param_is_master:   # else the param row is the master row just written
                param = torch.empty(hi - lo, dtype=store.param_dtype, device=master.device)
                if store.remainder:   # the master's two halves (optim.masters)
                    remainder = torch.empty(hi - lo, dtype=torch.int16, device=master.device)
                    split_(master[lo:hi], param, remainder)
                    store.opt_tier.write_(key(unit.group, "remainder"), unit.row, remainder, lo).result()   # sync
                else:
                    cast16_(param, master[lo:hi], store.ties_away)
                store.param_tier.write_(param_key, unit.row, param, lo).result()   # sync: written

    def flush(self) -> None:
        """sync: the last step's write-behind is on disk (raises its first failed write: layer and state) and the
        next step's early reads (``Fetcher.read_early``) given back. ``train_step`` returns with the writes of the
        last updated units in flight: whatever reads the tier files but through the tier calls this first."""
        self.fetcher.drop_early()
        self.updater.flush()

    def close(self) -> None:
        """Flush the write-behind (raising its error, if any), then stop every worker and close the tiers."""
        try:
            self.flush()
        finally:
            self.updater.close()
            if self._fetch_thread is not None:
                self._fetch_thread.shutdown(wait=True)
            for tier in self._tiers():
                tier.close()
            self.tracer.close()


def compose_updater(store: Store, sharding: Sharding, pool: BufferPool, optimizer: Optimizer, config: Config,
                    device: torch.device, opt_device: torch.device, observers: Observers) -> Updater:
    """The updater and its parts, each given its collaborators: gradients in, the update queue, the read-ahead
    and write-behind of the optimizer's rows, the 16-bit cast, the decay spans and the two strategies."""
    tracer, _, waits = observers
    depth, n = config.prefetch_depth, piece_numel(config.optimizer_piece_bytes)
    reads = ReadAhead(store, pool, opt_device, depth, waits, n)
    writes = WriteBehind(pool, depth, waits)
    cast, decay = ParamCast(store, pool, device), DecayCache(store, sharding, optimizer.weight_decay_mask)
    # grads waiting for an update: workers + depth + 1 of them, or fewer where larger than a slot of LEND_PIECES
    # pieces (bounded by that many slots' bytes; a gradient larger than the bound waits for the update before it)
    queue = UpdateQueue(config.update_workers, backlog_bytes(config.update_workers, depth, n), waits)
    strategies = Strategies(InPlaceUpdate(store, optimizer, n, decay, cast, writes, pool),
                            StreamedUpdate(store, optimizer, reads, writes, decay, cast, pool))
    return Updater(store, sharding, pool, gradients=GradientsIn(store, sharding, pool, device, opt_device),
                   queue=queue, strategies=strategies, reads=reads, writes=writes, cast=cast, tracer=tracer)


def planned_buffers(layout: Layout, config: Config) -> list[tuple[int, torch.dtype, torch.device, int]]:
    """The pool's plan (``planner.memory.pool_plan``) on this run's devices: "host" buffers in host memory,
    "device" ones on the compute device (``BufferPool.reserve``'s specs)."""
    devices = {"host": torch.device("cpu"), "device": config.resolved_device()}
    return [(numel, dtype, devices[where], count) for (numel, dtype, where), count in pool_plan(layout, config).items()
            if numel]


def _close_step(prefetcher: Prefetcher, tiles) -> None:
    """A step's prefetcher and tile stream released, whether the step finished or failed."""
    prefetcher.close()
    if tiles is not None:
        tiles.close()


def _scalar(loss, token: bool = False):
    from .scan.blocks import check_loss

    return check_loss(loss, token)

