"""Gradients in: a unit's flat gradient reduce-scattered to this rank's fp32 shard, its squared
norm, and the shard landed on the optimizer's device.

A gradient leaves the reverse scan as a padded flat buffer (or, one rank, as its leaves:
``LeafGrads``). ``scatter`` turns it into this rank's shard (mean over ranks), records the shard's
squared norm for the global norm, and, where the optimizer is on the host and compute is on CUDA,
starts the device-to-host copy on a side stream: the update worker waits for it (``landed``), not
the compute thread. Where the shard's update runs next (no clipping) and the shard is already on the
optimizer's device, its norm is taken by the update worker (``landed``, before the update may use
the shard as scratch) in the slot ``scatter`` kept in emission order: the same dot product, off the
compute thread (a tiled leaf emits one gradient per tile).

    plain loop this equals (per unit):
        shard = reduce_mean(flat)[rank]; norms.append(shard @ shard); shard.cpu()
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..io.buffers import BufferPool
from ..layout.units import Unit
from ..overlap import copies
from ..overlap.copies import SideCopies
from ..partition.sharding import Sharding
from ..scan.grads import LeafGrads
from ..store import Store


class Landing(NamedTuple):
    """A gradient shard on its way to the host: the event of its copy (None: done) and the device
    shard it came from, given back once the copy completed."""

    copied: object  # a ``torch.cuda.Event`` or None
    shard: torch.Tensor


class GradientsIn:
    """Scatters gradients to this rank's shards on ``opt_device``, keeps their squared norms
    (``sq_norm``)."""

    def __init__(
        self,
        store: Store,
        sharding: Sharding,
        pool: BufferPool,
        device: torch.device,
        opt_device: torch.device,
    ):
        self.store, self.sharding, self.pool = store, sharding, pool
        self.device, self.opt_device = device, opt_device
        self._sq_parts: list[torch.Tensor | None] = []  # per emitted unit, in emission order
        self._d2h = SideCopies(device)
        self._landing: dict[int, Landing] = {}  # id of a host grad buffer -> its copy in flight
        # id of a grad shard -> its slot in _sq_parts, taken by ``landed``
        self._unnormed: dict[int, int] = {}
        self._leaf_slots: dict[int, int] = {}  # id of a LeafGrads -> its slot (norm_of_leaves)

    def reset_norm(self) -> None:
        """A new step's norm: no unit's squared norm counted yet."""
        self._sq_parts.clear()
        self._unnormed.clear()
        self._leaf_slots.clear()

    def sq_norm(self) -> torch.Tensor:
        """This rank's squared gradient norm so far (float64): the units' parts summed in emission
        order.

        A ``LeafGrads`` unit's part is taken by its update (``norm_of_leaves``): call after the
        updates ran."""
        total = torch.zeros((), dtype=torch.float64)
        for part in self._sq_parts:
            if part is None:
                raise RuntimeError("sq_norm: an update has not run yet (call wait first)")
            total += part.to(total.device)  # sync (CUDA): the parts were left on the device
        return total

    def norm_of_leaves(self, grad: LeafGrads) -> None:
        """The squared norm of a gradient that came as its leaves, in its emission slot (before the
        update may use the leaves as scratch)."""
        self._sq_parts[self._leaf_slots.pop(id(grad))] = grad.sq_norm()

    def scatter(
        self, unit: Unit, flat_grad: torch.Tensor | LeafGrads, norm_in_update: bool = False
    ) -> torch.Tensor | LeafGrads | None:
        """Reduce-scatter (mean over ranks) a padded flat gradient (consumed); returns this rank's
        fp32 shard, or None when this rank holds no part of the unit (broadcast mode, not its
        owner).

        A ``LeafGrads`` (one rank: nothing to scatter) passes through; its norm is taken in its
        update, and so is a shard's on the optimizer's device where ``norm_in_update`` (the shard
        goes to its update next, which calls ``landed`` first: not a stash)."""
        if isinstance(flat_grad, LeafGrads):
            self._leaf_slots[id(flat_grad)] = len(self._sq_parts)
            self._sq_parts.append(None)
            return flat_grad
        part = self.store.group_of(unit).part
        if self.sharding.comm.world_size == 1:
            shard = flat_grad  # one rank: the padded buffer *is* the shard, no copy
        else:
            shard = self.pool.take(part.shard_numel, torch.float32, self.device)
            # sync: the shard is complete after this
            held = self.sharding.reduce_mean_(shard, flat_grad, unit)
            self.pool.give(flat_grad)
            if not held:  # broadcast mode: the owner updates this unit
                self.pool.give(shard)
                return None
        if norm_in_update and shard.device == self.opt_device:
            self._unnormed[id(shard)] = len(self._sq_parts)
            self._sq_parts.append(None)
            return shard
        # on its device: summed after the updates
        self._sq_parts.append(torch.dot(shard, shard).double())
        return shard if shard.device == self.opt_device else self._to_host(shard, part.shard_numel)

    def _to_host(self, shard: torch.Tensor, numel: int) -> torch.Tensor:
        """D2H on a side stream after the backward that made the shard: compute goes on meanwhile,
        and the update worker waits for the copy (``landed``), not the compute thread."""
        host = self.pool.take(numel, torch.float32, self.opt_device)
        copied = self._d2h.copy_(host, shard, self._d2h.after_compute())
        if copied is None:
            self.pool.give(shard)
        else:
            self._landing[id(host)] = Landing(copied, shard)
        return host

    def landed(self, grad) -> None:
        """Wait for ``grad``'s copy to the host, if it is in flight, and give its device shard back;
        take its squared norm where ``scatter`` left it to the update (before the update may use it
        as scratch)."""
        slot = self._unnormed.pop(id(grad), None)
        if slot is not None:
            self._sq_parts[slot] = torch.dot(grad, grad).double()
        self._land(id(grad))

    def abandon(self) -> None:
        """After a failed step: wait for every copy in flight and give the device shards back."""
        for ident in list(self._landing):
            self._land(ident)

    def _land(self, ident: int) -> None:
        landing = self._landing.pop(ident, None)
        if landing is not None:
            copies.wait(landing.copied)  # sync: the gradient is on the host
            self.pool.give(landing.shard)
