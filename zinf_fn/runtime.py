"""The engine behind a TrainState: tiers, comm, buffers, fetcher and updater, built once at init."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .buffers import BufferPool
from .comm import Comm
from .config import Config
from .optim import Optimizer, clip_coefficient, learning_rate
from .prefetch import Fetcher, Prefetcher, eval_plan, train_plan
from .scan import ScanIO, backward_scan, forward_scan, head_step
from .store import Store, Unit, units
from .trace import BusyClock, WaitClock, make_tracer
from .update import Updater


class Runtime:
    def __init__(self, model, optimizer: Optimizer, config: Config, store: Store, comm: Comm):
        self.model, self.optimizer, self.config = model, optimizer, config
        self.store, self.comm = store, comm
        self.device = config.resolved_device()
        self.compute_dtype = config.resolved_compute_dtype()
        self.units: list[Unit] = units(model.n_layers)
        self.pool = BufferPool(limit_per_key=staging_limit(config))
        self.fetcher = Fetcher(store, comm, self.pool, self.device, self.compute_dtype)
        self._fetch_thread = ThreadPoolExecutor(1, thread_name_prefix="zinf-fetch") if config.prefetch_depth else None
        opt_device = store.opt_tier.device if store.opt_tier.device.type != "meta" else torch.device("cpu")
        self.updater = Updater(store, comm, self.pool, optimizer, self.device, opt_device, config.update_workers,
                               config.prefetch_depth)
        self.checkpoints = None
        if config.offload_activations != "none":
            from .activations import OffloadedCheckpoints

            self.checkpoints = OffloadedCheckpoints(config.offload_activations, model.n_layers, self.pool,
                                                    self.device, config.prefetch_depth, config.nvme_path,
                                                    f"rank{comm.rank}/activations")
        self.tracer, self.io_clock, self.waits = make_tracer(config.trace), BusyClock(), WaitClock()
        self._attach_observers()
        self.batch_signature = None

    # -- one step --------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list, step: int) -> dict:
        t0 = time.perf_counter()
        wait0, busy0 = self._start_clocks()
        self.updater.sq_norm.zero_()
        clipping = self.config.clip_grad_norm is not None
        prefetcher = Prefetcher(train_plan(self.units), self.fetcher, self.config.prefetch_depth, self._fetch_thread)
        # The optimizer rows are read ahead from `depth` units before the head on, not at the step's start,
        # where they would queue in front of the first layers' parameter reads.
        begin_at = max(0, self.model.n_layers + 1 - self.config.prefetch_depth)
        hooks = {begin_at: lambda: self.updater.begin_step(self.units, clipping)}

        def emit(unit, flat):
            grad = self.updater.scatter(unit, flat)
            if clipping:
                self.updater.stash_(unit, grad)
            else:
                self.updater.submit(unit, grad, step)

        io = self._io(prefetcher, emit, hooks)
        try:
            carries, bounds = forward_scan(self.model, io, micro_batches, keep_boundaries=True, check=True)
            losses, d_carries = head_step(self.model, io, carries, micro_batches)
            del carries
            backward_scan(self.model, io, bounds, d_carries, micro_batches)
            grad_norm = self._global_grad_norm()
            if clipping:
                scale = clip_coefficient(grad_norm, self.config.clip_grad_norm)
                self.updater.stream_clipped(self.units, step, scale)
            self.updater.wait()
        except BaseException:
            self._abandon()
            raise
        finally:
            prefetcher.close()
        loss = self._mean_loss(losses)
        metrics = self._metrics(loss, grad_norm, step, time.perf_counter() - t0, prefetcher.wait_s)
        metrics.update(self._io_metrics(wait0, busy0))
        self.tracer.flush()
        return metrics

    def eval_step(self, micro_batches: list) -> torch.Tensor:
        prefetcher = Prefetcher(eval_plan(self.units), self.fetcher, self.config.prefetch_depth, self._fetch_thread)
        io = self._io(prefetcher, None)
        try:
            carries, _ = forward_scan(self.model, io, micro_batches, keep_boundaries=False, check=True)
            layer = io.get(self.model.n_layers + 1)
            with torch.no_grad():
                pairs = zip(carries, micro_batches, strict=True)
                losses = [self.model.head.apply(layer.tree, c, mb) for c, mb in pairs]
            io.release(layer)
        finally:
            prefetcher.close()
        return torch.tensor(self._mean_loss([_scalar(x) for x in losses]))

    # -- helpers -----------------------------------------------------------------------------------------
    def _io(self, prefetcher: Prefetcher, emit, hooks: dict | None = None) -> ScanIO:
        """The scan's view of this step; ``hooks[i]()`` runs once plan entry i is in hand."""
        def grad_buffer(unit):
            group = self.store.group_of(unit)
            buf = self.pool.take(group.part.padded_numel, torch.float32, self.device)
            buf[group.spec.numel :].zero_()
            return buf

        computing: dict[int, tuple] = {}

        def get(i):
            op = prefetcher.plan[i]
            with self.waits.waiting(str(op).split()[-1]):
                layer = prefetcher.get(i)
            if hooks and i in hooks:
                hooks.pop(i)()
            computing[op.unit.index] = (time.perf_counter_ns(), f"{op.phase} {op.unit.name}")
            return layer

        def release(layer):
            start, name = computing.pop(layer.unit.index)
            if self.tracer.enabled:
                self.tracer.record("compute", name, start, time.perf_counter_ns())
            self.fetcher.release(layer)

        return ScanIO(get, release, grad_buffer, emit, lambda unit: self.store.group_of(unit).spec,
                      self.checkpoints)

    def _tiers(self) -> list:
        tiers = [self.store.param_tier, self.store.opt_tier]
        return tiers + ([self.checkpoints.tier] if self.checkpoints is not None else [])

    def _attach_observers(self) -> None:
        """One tracer, one I/O busy clock and one exposed-wait clock for every tier and worker."""
        for tier in self._tiers():
            if hasattr(tier, "clock"):
                tier.clock, tier.tracer = self.io_clock, self.tracer
        self.fetcher.tracer = self.updater.tracer = self.waits.tracer = self.tracer
        self.updater.waits = self.updater.reads.waits = self.updater.writes.waits = self.waits
        if self.checkpoints is not None:
            self.checkpoints.waits = self.checkpoints.writes.waits = self.waits

    def _start_clocks(self) -> tuple[float, float]:
        self.waits.thread = threading.get_ident()   # the thread that calls train_step computes
        self._bytes_before = self._tier_bytes()
        return self.waits.seconds, self.io_clock.read()

    def _tier_bytes(self) -> dict[str, list[int]]:
        totals: dict[str, list[int]] = {}
        for tier in self._tiers():
            entry = totals.setdefault(tier.name, [0, 0])
            entry[0] += getattr(tier, "bytes_read", 0)
            entry[1] += getattr(tier, "bytes_written", 0)
        return totals

    def _io_metrics(self, wait0: float, busy0: float) -> dict:
        """Per-step bytes per tier, the exposed wait, and the I/O time hidden behind compute."""
        now = self._tier_bytes()
        out = {}
        for name, (read, written) in now.items():
            before = self._bytes_before.get(name, [0, 0])
            out[f"bytes_read.{name}"], out[f"bytes_written.{name}"] = read - before[0], written - before[1]
        wait, busy = self.waits.seconds - wait0, self.io_clock.read() - busy0
        return {**out, "io_wait_s": wait, "io_busy_s": busy, "io_hidden_s": max(0.0, busy - wait)}

    def _abandon(self) -> None:
        self.updater.abandon()
        if self.checkpoints is not None:
            self.checkpoints.abandon()

    def _global_grad_norm(self) -> float:
        total = self.updater.sq_norm.clone()
        self.comm.all_reduce_sum_(total)   # sync: every rank's squared shard norms
        return float(total.sqrt())

    def _mean_loss(self, losses: list) -> float:
        mean = torch.stack([x.detach().double().cpu() for x in losses]).mean()
        self.comm.all_reduce_sum_(mean)   # sync: the global loss is the mean over ranks
        return float(mean) / self.comm.world_size

    def _metrics(self, loss: float, grad_norm: float, step: int, seconds: float, wait_s: float) -> dict:
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": None if self.optimizer.lr is None else learning_rate(self.optimizer.lr, step),
            "step_time_s": seconds,
            "fetch_wait_s": wait_s,
            "peak_live_layers": self.fetcher.peak_live,
            "fetches": self.fetcher.fetches,
            "buffers": self.pool.count,
        }

    def close(self) -> None:
        self.updater.close()
        if self._fetch_thread is not None:
            self._fetch_thread.shutdown(wait=True)
        for tier in self._tiers():
            if hasattr(tier, "close"):
                tier.close()
        self.tracer.close()


def staging_limit(config: Config) -> int:
    """Buffers of one (size, dtype) the pool may make: ``Config.staging_buffers``, or enough for the depth.

    Out at once per size: ``prefetch_depth`` + 1 layers with their staging and casts, the optimizer
    rows read ahead and written behind (``depth`` + 1 units of master and moments each), the
    checkpoints in flight and the gradients waiting for an update.
    """
    if config.staging_buffers:
        return config.staging_buffers
    depth = config.prefetch_depth
    return 8 * (depth + 2) + 4 * config.update_workers + 16


def _scalar(loss) -> torch.Tensor:
    from .scan import check_loss

    return check_loss(loss)

