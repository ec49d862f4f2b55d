"""Gradients out: reduce-scatter a unit's flat gradient to this rank's shard, then update it where it lives.

One-pass path (no clipping): the update of unit l runs in a background worker as soon as its gradient
shard exists, overlapping the backward compute of unit l-1. Two-pass path (global-norm clipping): the
shards are written to the optimizer tier during backward; once the global norm is known, a second
streamed pass reads each back, scales it and updates.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .buffers import BufferPool
from .comm import Comm
from .optim import Optimizer
from .store import Store, Unit, key
from .tree import FlatSpec


def decay_mask(spec: FlatSpec, prefix: str, part_range: tuple[int, int], shard_numel: int,
               predicate, device: torch.device) -> torch.Tensor | None:
    """Bool mask over this rank's shard: True where ``predicate(key path)`` asks for weight decay."""
    if predicate is None:
        return None
    start, end = part_range
    mask = torch.zeros(shard_numel, dtype=torch.bool, device=device)
    for leaf in spec.leaves:
        lo, hi = max(leaf.offset, start), min(leaf.offset + leaf.numel, end)
        if lo < hi and predicate(f"{prefix}{leaf.path}"):
            mask[lo - start : hi - start] = True
    return mask


class Updater:
    """Owns the optimizer side of a step: grad shards, their squared norms, and the updates."""

    def __init__(self, store: Store, comm: Comm, pool: BufferPool, opt: Optimizer, device: torch.device,
                 opt_device: torch.device, workers: int = 1):
        self.store, self.comm, self.pool, self.opt = store, comm, pool, opt
        self.device, self.opt_device = device, opt_device
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="zinf-update") if workers else None
        self._pending: list[Future] = []
        self._masks: dict[tuple, torch.Tensor | None] = {}
        self.sq_norm = torch.zeros((), dtype=torch.float64)

    # -- gradient in -------------------------------------------------------------------------------
    def scatter(self, unit: Unit, flat_grad: torch.Tensor) -> torch.Tensor:
        """Reduce-scatter (mean over ranks) a padded flat gradient; returns this rank's fp32 shard."""
        part = self.store.group_of(unit).part
        if self.comm.world_size == 1:
            shard = flat_grad      # one rank: the padded buffer *is* the shard, no copy
        else:
            shard = self.pool.take(part.shard_numel, torch.float32, self.device)
            self.comm.reduce_scatter_mean_(shard, flat_grad)   # sync: the shard is complete after this
            self.pool.give(flat_grad)
        self.sq_norm += torch.dot(shard, shard).double().cpu()
        if shard.device != self.opt_device:
            host = self.pool.take(part.shard_numel, torch.float32, self.opt_device)
            host.copy_(shard)
            self.pool.give(shard)
            shard = host
        return shard

    def stash_(self, unit: Unit, grad: torch.Tensor) -> None:
        """Two-pass path: write the grad shard to the optimizer tier (consumes ``grad``)."""
        self.store.opt_tier.write_(key(unit.group, "grad"), unit.row, grad).result()  # sync: written
        self.pool.give(grad)

    # -- update --------------------------------------------------------------------------------------
    def submit(self, unit: Unit, grad: torch.Tensor, step: int, scale: float = 1.0) -> None:
        """Update unit's shard with ``grad`` (consumed), in the background worker when there is one."""
        if self._executor is None:
            self.update_(unit, grad, step, scale)
        else:
            self._pending.append(self._executor.submit(self.update_, unit, grad, step, scale))

    def update_(self, unit: Unit, grad: torch.Tensor, step: int, scale: float) -> None:
        """Read master and moments of one unit, apply the optimizer, write them and the 16-bit copy back."""
        self.store.before_update(unit)   # sync: an in-flight checkpoint save may still need these rows
        tier = self.store.opt_tier
        kinds = ["master", *(f"opt.{i}" for i in range(self.store.n_opt_leaves))]
        bufs = [self._row(tier, key(unit.group, k), unit.row) for k in kinds]
        if scale != 1.0:
            grad.mul_(scale)
        master, state = self.opt.update(grad, tuple(b for b, _ in bufs[1:]), bufs[0][0], step, self._mask(unit))
        for (buf, pooled), new, k in zip(bufs, (master, *state), kinds, strict=True):
            tier.write_(key(unit.group, k), unit.row, new).result()   # sync: state written back
            if pooled:
                self.pool.give(buf)
        self._write_param(unit, master)
        self.pool.give(grad)

    def stream_clipped(self, all_units: list[Unit], step: int, scale: float) -> None:
        """Two-pass path, second pass: read each stashed grad shard, scale it, update."""
        for unit in all_units:
            buf, pooled = self._row(self.store.opt_tier, key(unit.group, "grad"), unit.row)
            grad = self.pool.take(buf.numel(), torch.float32, self.opt_device)
            grad.copy_(buf)
            if pooled:
                self.pool.give(buf)
            self.submit(unit, grad, step, scale)

    def wait(self) -> None:
        """sync: every submitted update has been written back."""
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # -- helpers -------------------------------------------------------------------------------------
    def _row(self, tier, name: str, row: int) -> tuple[torch.Tensor, bool]:
        """A row of an optimizer array to update in place: a view when the tier is memory, else a read."""
        view = tier.view(name, row)
        if view is not None:
            return view, False
        group = self.store.groups[name.split("/")[0]]
        buf = self.pool.take(group.part.shard_numel, torch.float32, self.opt_device)
        tier.read_(name, row, buf).result()   # sync: state read before it is updated
        return buf, True

    def _write_param(self, unit: Unit, master: torch.Tensor) -> None:
        tier = self.store.param_tier
        name = key(unit.group, "param")
        view = tier.view(name, unit.row)
        if view is not None and view.device == master.device:
            view.copy_(master)     # casts to param_dtype in place
            tier.bytes_written += view.numel() * view.element_size()
            return
        staged = self.pool.take(master.numel(), self.store.param_dtype, master.device)
        staged.copy_(master)
        tier.write_(name, unit.row, staged).result()   # sync: 16-bit copy written
        self.pool.give(staged)

    def _mask(self, unit: Unit) -> torch.Tensor | None:
        predicate = self.opt.weight_decay_mask
        if predicate is None:
            return None
        group = self.store.group_of(unit)
        prefix = f"{unit.name}."
        start, end = group.part.shard_range(self.comm.rank)
        signature = tuple(predicate(prefix + leaf.path) for leaf in group.spec.leaves)
        cache_key = (unit.group, signature)
        if cache_key not in self._masks:
            self._masks[cache_key] = decay_mask(group.spec, prefix, (start, end), group.part.shard_numel,
                                                predicate, self.opt_device)
        return self._masks[cache_key]
