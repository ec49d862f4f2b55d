"""The engine behind a TrainState: tiers, comm, buffers, fetcher and updater, built once at init."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .buffers import BufferPool
from .config import Config
from .optim import Optimizer, clip_coefficient, learning_rate
from .prefetch import Fetcher, Prefetcher, eval_plan, train_plan
from .scan import ScanIO, backward_scan, forward_scan, head_step
from .sharding import Sharding
from .store import Store, Unit, units
from .tile_runtime import TileEngine
from .update import Updater


class Runtime:
    def __init__(self, model, optimizer: Optimizer, config: Config, store: Store, sharding: Sharding):
        self.model, self.optimizer, self.config = model, optimizer, config
        self.store, self.sharding, self.comm = store, sharding, sharding.comm
        self.device = config.resolved_device()
        self.compute_dtype = config.resolved_compute_dtype()
        self.units: list[Unit] = units(model.n_layers)
        # Buffers out at once: prefetch_depth + 1 layers, their casts, staging and grads in flight.
        self.pool = BufferPool(limit_per_key=4 * (config.prefetch_depth + 2) + 2 * config.update_workers + 8)
        self.fetcher = Fetcher(store, sharding, self.pool, self.device, self.compute_dtype)
        self._fetch_thread = ThreadPoolExecutor(1, thread_name_prefix="zinf-fetch") if config.prefetch_depth else None
        opt_device = store.opt_tier.device if store.opt_tier.device.type != "meta" else torch.device("cpu")
        self.updater = Updater(store, sharding, self.pool, optimizer, self.device, opt_device,
                               config.update_workers)
        # Tiled leaves (zinf_fn.tiles): filled in by init; at most 2 tile updates queued behind the worker.
        self.tiles = TileEngine(self.fetcher, config.prefetch_depth, self._fetch_thread, self._tile_grad_buffer,
                                lambda: self.updater.wait_backlog(2))
        self.batch_signature = None

    # -- one step --------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list, step: int) -> dict:
        t0 = time.perf_counter()
        before = self._counters()
        self.updater.sq_norm.zero_()
        clipping = self.config.clip_grad_norm is not None
        plan = train_plan(self.units)
        prefetcher = Prefetcher(plan, self.fetcher, self.config.prefetch_depth, self._fetch_thread)

        def emit(unit, flat):
            grad = self.updater.scatter(unit, flat)
            if grad is None:   # broadcast mode: another rank owns this unit and updates it
                return
            if clipping:
                self.updater.stash_(unit, grad)
            else:
                self.updater.submit(unit, grad, step)

        tiles = self.tiles.begin(plan, emit, len(micro_batches), train=True)
        io, model = self._io(prefetcher, emit, tiles), self.tiles.model(self.model)
        try:
            carries, bounds = forward_scan(model, io, micro_batches, keep_boundaries=True, check=True)
            losses, d_carries = head_step(model, io, carries, micro_batches)
            del carries
            backward_scan(model, io, bounds, d_carries, micro_batches)
            grad_norm = self._global_grad_norm()
            if clipping:
                scale = clip_coefficient(grad_norm, self.config.clip_grad_norm)
                self.updater.stream_clipped(self.units + self.tiles.layout.units(self.units), step, scale)
            self.updater.wait()
        finally:
            prefetcher.close()
            if tiles is not None:
                tiles.close()
        loss = self._mean_loss(losses)
        counts = {k: v - before[k] for k, v in self._counters().items()}
        return self._metrics(loss, grad_norm, step, time.perf_counter() - t0, prefetcher.wait_s, counts)

    def eval_step(self, micro_batches: list) -> torch.Tensor:
        plan = eval_plan(self.units)
        prefetcher = Prefetcher(plan, self.fetcher, self.config.prefetch_depth, self._fetch_thread)
        tiles = self.tiles.begin(plan, None, len(micro_batches), train=False)
        io, model = self._io(prefetcher, None, tiles), self.tiles.model(self.model)
        try:
            carries, _ = forward_scan(model, io, micro_batches, keep_boundaries=False, check=True)
            layer = io.get(self.model.n_layers + 1)
            with torch.no_grad():
                pairs = zip(carries, micro_batches, strict=True)
                losses = [model.head.apply(layer.tree, c, mb) for c, mb in pairs]
            io.release(layer)
        finally:
            prefetcher.close()
            if tiles is not None:
                tiles.close()
        return torch.tensor(self._mean_loss([_scalar(x) for x in losses]))

    # -- helpers -----------------------------------------------------------------------------------------
    def _io(self, prefetcher: Prefetcher, emit, tiles=None) -> ScanIO:
        def grad_buffer(unit):
            group = self.store.group_of(unit)
            buf = self.pool.take(group.part.padded_numel, torch.float32, self.device)
            buf[group.spec.numel :].zero_()
            return buf

        io = ScanIO(prefetcher.get, self.fetcher.release, grad_buffer, emit,
                    lambda unit: self.store.group_of(unit).spec)
        return io if tiles is None else tiles.wrap(io)

    def _tile_grad_buffer(self, unit) -> torch.Tensor:
        """A flat fp32 gradient buffer for a tile unit (the caller fills all of it, padding included)."""
        return self.pool.take(self.store.group_of(unit).part.padded_numel, torch.float32, self.device)

    def _global_grad_norm(self) -> float:
        total = self.updater.sq_norm.clone()
        self.comm.all_reduce_sum_(total, "grad norm")   # sync: every rank's squared shard norms
        return float(total.sqrt())

    def _mean_loss(self, losses: list) -> float:
        mean = torch.stack([x.detach().double().cpu() for x in losses]).mean()
        self.comm.all_reduce_sum_(mean, "loss")   # sync: the global loss is the mean over ranks
        return float(mean) / self.comm.world_size

    def _counters(self) -> dict:
        """Cumulative traffic counters; a step reports their difference."""
        out = {"fetches": self.fetcher.fetches, "bytes_fetched": self.fetcher.bytes_fetched}
        for tier in (self.store.param_tier, self.store.opt_tier):
            out[f"bytes_read.{tier.name}"] = out.get(f"bytes_read.{tier.name}", 0) + tier.bytes_read
            out[f"bytes_written.{tier.name}"] = out.get(f"bytes_written.{tier.name}", 0) + tier.bytes_written
        return out

    def _metrics(self, loss: float, grad_norm: float, step: int, seconds: float, wait_s: float, counts: dict) -> dict:
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": None if self.optimizer.lr is None else learning_rate(self.optimizer.lr, step),
            "step_time_s": seconds,
            "fetch_wait_s": wait_s,
            "peak_live_layers": self.fetcher.peak_live,
            "buffers": self.pool.count,
            **(self.tiles.last if self.tiles.layout else {}),
            **counts,
        }

    def close(self) -> None:
        self.updater.close()
        if self._fetch_thread is not None:
            self._fetch_thread.shutdown(wait=True)


def _scalar(loss) -> torch.Tensor:
    from .scan import check_loss

    return check_loss(loss)

