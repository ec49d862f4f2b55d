"""The engine behind a TrainState: tiers, comm, buffers, fetcher and updater, built once at init."""

from __future__ import annotations

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
from .update import Updater


class Runtime:
    def __init__(self, model, optimizer: Optimizer, config: Config, store: Store, comm: Comm):
        self.model, self.optimizer, self.config = model, optimizer, config
        self.store, self.comm = store, comm
        self.device = config.resolved_device()
        self.compute_dtype = config.resolved_compute_dtype()
        self.units: list[Unit] = units(model.n_layers)
        # Buffers out at once: prefetch_depth + 1 layers, their casts, staging and grads in flight.
        self.pool = BufferPool(limit_per_key=4 * (config.prefetch_depth + 2) + 2 * config.update_workers + 8)
        self.fetcher = Fetcher(store, comm, self.pool, self.device, self.compute_dtype)
        self._fetch_thread = ThreadPoolExecutor(1, thread_name_prefix="zinf-fetch") if config.prefetch_depth else None
        opt_device = store.opt_tier.device if store.opt_tier.device.type != "meta" else torch.device("cpu")
        self.updater = Updater(store, comm, self.pool, optimizer, self.device, opt_device, config.update_workers)
        self.batch_signature = None

    # -- one step --------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list, step: int) -> dict:
        t0 = time.perf_counter()
        before = self._counters()
        self.updater.sq_norm.zero_()
        clipping = self.config.clip_grad_norm is not None
        prefetcher = Prefetcher(train_plan(self.units), self.fetcher, self.config.prefetch_depth, self._fetch_thread)

        def emit(unit, flat):
            grad = self.updater.scatter(unit, flat)
            if clipping:
                self.updater.stash_(unit, grad)
            else:
                self.updater.submit(unit, grad, step)

        io = self._io(prefetcher, emit)
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
        finally:
            prefetcher.close()
        loss = self._mean_loss(losses)
        counts = {k: v - before[k] for k, v in self._counters().items()}
        return self._metrics(loss, grad_norm, step, time.perf_counter() - t0, prefetcher.wait_s, counts)

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
    def _io(self, prefetcher: Prefetcher, emit) -> ScanIO:
        def grad_buffer(unit):
            group = self.store.group_of(unit)
            buf = self.pool.take(group.part.padded_numel, torch.float32, self.device)
            buf[group.spec.numel :].zero_()
            return buf

        return ScanIO(prefetcher.get, self.fetcher.release, grad_buffer, emit,
                      lambda unit: self.store.group_of(unit).spec)

    def _global_grad_norm(self) -> float:
        total = self.updater.sq_norm.clone()
        self.comm.all_reduce_sum_(total)   # sync: every rank's squared shard norms
        return float(total.sqrt())

    def _mean_loss(self, losses: list) -> float:
        mean = torch.stack([x.detach().double().cpu() for x in losses]).mean()
        self.comm.all_reduce_sum_(mean)   # sync: the global loss is the mean over ranks
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
            **counts,
        }

    def close(self) -> None:
        self.updater.close()
        if self._fetch_thread is not None:
            self._fetch_thread.shutdown(wait=True)


def _scalar(loss) -> torch.Tensor:
    from .scan import check_loss

    return check_loss(loss)

