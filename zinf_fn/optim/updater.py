"""Gradients out: reduce-scatter a unit's flat gradient to this rank's shard, then update it where
it lives.

One-pass path (no clipping): the update of unit l runs in a background worker as soon as its
gradient shard exists, overlapping the backward compute of unit l-1. Two-pass path (global-norm
clipping): the shards are written to the optimizer tier during backward; once the global norm is
known, a second streamed pass reads each back, scales it and updates.

``Updater`` is the front door the runtime and tiling call; the work is done by its parts, each built
by the runtime and handed in: ``GradientsIn`` (``optim.gradients``: scatter, norms, landing),
``UpdateQueue`` (``optim.queue``: the workers and the backlog), the two ``UpdateStrategy``
(``optim.strategies``: in place, streamed; they share the 16-bit cast ``ParamCast``,
``optim.paramcast``, and the decay spans ``DecayCache``, ``optim.decay``), ``ReadAhead``
(``optim.readahead``) and ``WriteBehind`` (``overlap.stream``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..io.buffers import BufferPool
from ..layout.units import Unit, key
from ..observe.trace import NULL_TRACER
from ..offload.transfers import Transfer, Write
from ..overlap.stream import WriteBehind
from ..partition.sharding import Sharding
from ..scan.grads import LeafGrads
from ..store import Store
from .backlog import grad_weight
from .gradients import GradientsIn
from .paramcast import ParamCast
from .passes import pass_order
from .queue import UpdateQueue
from .readahead import ReadAhead
from .strategies import Strategies, UpdateStrategy


class UpdaterParts(NamedTuple):
    """The parts an ``Updater`` is the front door over, each built by the runtime
    (``runtime.compose_updater``) with its collaborators."""

    gradients: GradientsIn  # gradients in: scatter, norms, landing (``optim.gradients``)
    queue: UpdateQueue  # the update workers and the backlog (``optim.queue``)
    strategies: Strategies  # in place and streamed (``optim.strategies``)
    reads: ReadAhead  # the optimizer rows read ahead (``optim.readahead``)
    writes: WriteBehind  # the rows written behind (``overlap.stream``)
    cast: ParamCast  # the 16-bit cast of an updated master (``optim.paramcast``)


class Updater:
    """Owns the optimizer side of a step: grad shards, their squared norms, and the updates.

    Every update runs over the pieces of its rows (``optim.pieces``), by one of two strategies
    chosen per unit (``streamed``): where the optimizer tier keeps nothing resident (NVMe), the
    pieces of a unit's master and moments are read ahead (``ReadAhead``) and written behind
    (``WriteBehind``); otherwise they are updated in place as views of the tier's rows.

    Twenty-three methods, for a reason: it is the front door over its parts (``UpdaterParts``, each
    built by the runtime and handed in), and each method is one call the runtime or the tiles make
    of the optimizer side.
    """

    def __init__(
        self,
        store: Store,
        sharding: Sharding,
        pool: BufferPool,
        parts: UpdaterParts,
        tracer=NULL_TRACER,
    ):
        """The ``parts``, built by the runtime (``runtime.compose_updater``), share ``pool`` and the
        runtime's wait clock; ``tracer`` records each update's span."""
        self.store = store
        self.sharding = sharding
        self.pool = pool
        self.tracer = tracer
        self.gradients = parts.gradients
        self.queue = parts.queue
        self.strategies = parts.strategies
        self.reads = parts.reads
        self.writes = parts.writes
        self.cast = parts.cast
        self._previous_drained = True  # begin_step: the previous step's writes not waited for yet
        # the one-pass read-ahead of this step lends its masters (master_of)
        self._shares_masters = False

    @property
    def opt_device(self) -> torch.device:
        return self.gradients.opt_device

    @property
    def piece_numel(self) -> int:
        return self.reads.piece_numel

    def streamed(self, unit: Unit) -> bool:
        """Whether unit's optimizer rows are read and written (NVMe) rather than updated in place
        (views); per unit, since a spilled placement (``offload.spill``) keeps some units' rows in
        memory."""
        return self.store.placement_of("master", unit) == "nvme"

    def strategy_of(self, unit: Unit) -> UpdateStrategy:
        """The strategy that updates ``unit``: streamed or in place (``streamed``)."""
        return self.strategies.streamed if self.streamed(unit) else self.strategies.in_place

    def begin_step(self, all_units: list[Unit], clipping: bool) -> None:
        """One-pass path: start reading ahead the state of the units in gradient order (reverse
        scan).

        The previous step's last writes may still run; the tier orders reads and writes of their
        rows after them. They are waited for before this step changes its first row
        (``_previous_writes``, on the update worker, not the compute thread).
        """
        self._previous_drained = False
        # sync: the previous step's last writes, left in flight in the room its read-ahead no longer
        # held, are back to ``depth`` pieces before this pass's reads take that room again (they
        # have long completed where the disk keeps up: this waits only where it does not)
        self.writes.press()
        order = (
            []
            if clipping
            else pass_order(all_units, False, lambda u: self.sharding.holds(u) and self.streamed(u))
        )
        self._shares_masters = bool(order)
        if order:  # the backward fetch casts the masters lent (the policy's ``lent``): no read
            self.reads.begin(order, self.store.row_kinds.update_kinds(), clipping=False)

    def master_of(self, unit: Unit) -> Transfer | None:
        """The fp32 master row of ``unit`` read ahead for this step's update
        (``ReadAhead.master_of``), as it was before the update, for the backward fetch to cast
        instead of reading the 16-bit copy (which is that cast, bitwise); None where this step reads
        no master ahead for ``unit``."""
        return self.reads.master_of(unit) if self._shares_masters else None

    # -- gradient in -------------------------------------------------------------------------------
    def reset_norm(self) -> None:
        self.gradients.reset_norm()

    def sq_norm(self) -> torch.Tensor:
        """This rank's squared gradient norm so far (``GradientsIn.sq_norm``): call after
        ``wait``."""
        return self.gradients.sq_norm()

    def scatter(
        self, unit: Unit, flat_grad: torch.Tensor | LeafGrads, norm_in_update: bool = False
    ) -> torch.Tensor | LeafGrads | None:
        """This rank's fp32 shard of a unit's gradient (``GradientsIn.scatter``: ``norm_in_update``
        where it is ``submit``-ted next); None: another rank's."""
        return self.gradients.scatter(unit, flat_grad, norm_in_update)

    def stash_(self, unit: Unit, grad: torch.Tensor) -> None:
        """Two-pass path: write the grad shard to the optimizer tier (consumes ``grad``, written
        behind)."""
        self.gradients.landed(grad)
        self._previous_writes()
        self.writes.put([Write(self.store.opt_tier, key(unit.group, "grad"), unit.row, grad, True)])

    # -- update
    # --------------------------------------------------------------------------------------
    def submit(self, unit: Unit, grad: torch.Tensor | None, step: int, scale: float = 1.0) -> None:
        """Update unit's shard with ``grad`` (consumed; None: its stashed grad), in the background
        worker."""
        ready = self.cast.ready()  # CUDA: the compute that may still read the unit's device rows
        weight = grad_weight(self.store.group_of(unit).part.shard_numel, self.piece_numel)
        self.queue.submit(self.update_, weight, unit, grad, step, scale, ready)

    def submit_run(self, units: list[Unit], grads: list[torch.Tensor], step: int) -> None:
        """``submit`` of several units' gradient shards (consumed) as one update (``update_run_``):
        a run of small tiles (``overlap.tile_runs.update_run``), weighing as one gradient of their
        total size."""
        ready = self.cast.ready()
        numel = sum(self.store.group_of(u).part.shard_numel for u in units)
        self.queue.submit(
            self.update_run_, grad_weight(numel, self.piece_numel), units, grads, step, ready
        )

    def update_run_(
        self, units: list[Unit], grads: list[torch.Tensor], step: int, ready=None
    ) -> None:
        """``update_`` of each unit with its gradient shard (consumed), as one: where every row is
        in memory, one fused optimizer call over them all (``InPlaceUpdate.update_run_``); else each
        by its strategy."""
        for unit, grad in zip(units, grads, strict=True):
            self._landed(unit, grad)
        self._previous_writes()  # sync: before the first row of this step changes
        with self.tracer.span("update", f"update {units[0].name} and {len(units) - 1} more"):
            if not any(self.streamed(u) for u in units):
                self.strategies.in_place.update_run_(units, grads, step, ready)
            else:
                for unit, grad in zip(units, grads, strict=True):
                    self.strategy_of(unit).update_(unit, grad, step, 1.0, ready)
            for grad in grads:
                self.pool.give(grad)  # spent: the update used it as scratch at most

    def _landed(self, unit: Unit, grad) -> None:
        """Before a unit's update: its gradient landed (device-to-host), the rows free of a
        checkpoint save."""
        self.gradients.landed(grad)
        # sync: an in-flight checkpoint save may still need these rows
        self.store.before_update(unit)

    def update_(
        self, unit: Unit, grad: torch.Tensor | LeafGrads | None, step: int, scale: float, ready=None
    ) -> None:
        """Apply the optimizer to one unit's master and moments, piece by piece (``optim.pieces``);
        write them and the 16-bit copy back. ``grad`` is consumed; None: the unit's stashed
        gradient. ``ready`` (CUDA): the event after which compute is done with the unit's device
        rows (``submit`` records it)."""
        self._landed(unit, grad)
        self._previous_writes()  # sync: before the first row of this step changes
        with self.tracer.span("update", f"update {unit.name}"):
            if isinstance(grad, LeafGrads):
                # before the update may use the leaves as scratch
                self.gradients.norm_of_leaves(grad)
            elif grad is not None and scale != 1.0:
                grad.mul_(scale)
            self.strategy_of(unit).update_(unit, grad, step, scale, ready)
            if isinstance(grad, torch.Tensor):
                self.pool.give(grad)  # spent: the update used it as scratch at most

    def stream_clipped(self, all_units: list[Unit], step: int, scale: float) -> None:
        """Two-pass path, second pass: read each stashed grad shard back, scale it, update."""
        self.writes.drain()  # sync: every stashed grad is on its tier before it is read back
        held = [u for u in all_units if self.sharding.holds(u)]
        streamed = pass_order(held, True, self.streamed)
        if streamed:
            self.reads.begin(streamed, ["grad", *self.store.row_kinds.update_kinds()])
        for unit in held:
            grad = None
            if not self.streamed(unit):
                view = self.store.opt_tier.view(key(unit.group, "grad"), unit.row)
                grad = self.pool.take(view.numel(), torch.float32, self.opt_device)
                grad.copy_(view)
            self.submit(unit, grad, step, scale)

    def wait_backlog(self, limit: int) -> None:
        """sync: block until at most ``limit`` submitted updates are unfinished (bounds grad shards
        in flight)."""
        self.queue.wait_backlog(limit)

    def wait(self) -> None:
        """sync: every submitted update ran; the writes of the last units' rows may still be in
        flight.

        They complete behind the next step's forward pass, whose first reads of those rows the tier
        serves from the buffers being written (``NvmeTier``); ``flush`` waits for them.
        """
        self._shares_masters = False  # every update took its rows: no master is as it was
        self.queue.wait()

    def flush(self) -> None:
        """sync: every row written so far is on its tier (raises the first failed write, naming its
        row)."""
        with self.writes.waits.waiting("write-behind"):
            self.writes.drain()

    def abandon(self) -> None:
        """After a failed step: let running updates finish, give every buffer back, swallow their
        errors."""
        self._shares_masters = False
        self.gradients.abandon()
        self.queue.abandon()
        self.reads.abort()
        self.writes.abandon()

    def close(self) -> None:
        self.queue.close()

    def _previous_writes(self) -> None:
        """sync: before this step's first write, the previous step's write-behind completed; a
        failed write raises here, so a step that follows a failed write changes no row."""
        if not self._previous_drained:
            self.writes.drain()
            self._previous_drained = True
