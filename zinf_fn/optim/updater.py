"""Gradients out: reduce-scatter a unit's flat gradient to this rank's shard, then update it where it lives.

One-pass path (no clipping): the update of unit l runs in a background worker as soon as its gradient
shard exists, overlapping the backward compute of unit l-1. Two-pass path (global-norm clipping): the
shards are written to the optimizer tier during backward; once the global norm is known, a second
streamed pass reads each back, scales it and updates.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from ..demand import Buffers, Demand
from ..io.buffers import BufferPool
from ..overlap import copies
from ..overlap.copies import SideCopies
from ..overlap.stream import InFlight, WriteBehind
from ..partition.sharding import Sharding
from ..scan.grads import LeafGrads
from ..store import Store
from ..trace import NULL_TRACER, WaitClock
from ..tree import FlatSpec
from ..units import Unit, key
from .optimizers import DecaySpans, Optimizer
from .pieces import grad_spans, piece_numel, pieces, update_piece_
from .readahead import LEND_PIECES, ReadAhead

if TYPE_CHECKING:   # type names only: the layout step and the config sit above the optimizer
    from ..config import Config
    from ..layout import Layout


def backlog_bytes(workers: int, depth: int, piece_numel: int) -> int:
    """The weight of the gradients that may wait for their update: ``workers + depth + 1`` slots of
    ``LEND_PIECES`` pieces, each gradient weighing its bytes or a slot, whichever is more (so as many small
    gradients wait as workers + depth + 1, and a layer-sized one alone where layers are large)."""
    return (workers + depth + 1) * LEND_PIECES * piece_numel * 4


def grad_weight(shard_numel: int, piece_numel: int) -> int:
    """A waiting gradient's weight in ``backlog_bytes``: its fp32 bytes, or a slot of ``LEND_PIECES`` pieces."""
    return max(shard_numel, LEND_PIECES * piece_numel) * 4


def demand(layout: Layout, config: Config) -> Demand:
    """What the update backlog holds (see ``zinf_fn.demand``): per group, the fp32 gradients waiting for
    their update (``backlog_bytes`` over ``grad_weight``: at least two, the one being applied and the one
    the vjp is making, at most one per row), in padded buffers as the backward makes them."""
    piece = piece_numel(config.optimizer_piece_bytes)
    backlog = backlog_bytes(config.update_workers, config.prefetch_depth, piece)
    where = "host" if config.resolved_device().type == "cpu" else "device"
    buffers = tuple(Buffers(g.part.padded_numel, torch.float32,
                            min(g.rows, max(2, backlog // grad_weight(g.part.shard_numel, piece))), where)
                    for g in layout.store.groups.values())
    return Demand("gradients", buffers)


def decay_spans(spec: FlatSpec, prefix: str, part_range: tuple[int, int], predicate) -> DecaySpans | None:
    """The ranges of this rank's shard (``part_range`` of the padded flat buffer) that take weight decay:
    the leaves whose key path ``predicate`` accepts, merged where they touch. None: decay everything."""
    if predicate is None:
        return None
    start, end = part_range
    spans: list[tuple[int, int]] = []
    for leaf in spec.leaves:
        lo, hi = max(leaf.offset, start), min(leaf.offset + leaf.numel, end)
        if lo < hi and predicate(f"{prefix}{leaf.path}"):
            if spans and spans[-1][1] == lo - start:
                spans[-1] = (spans[-1][0], hi - start)
            else:
                spans.append((lo - start, hi - start))
    return DecaySpans(tuple(spans), end - start)


class Updater:
    """Owns the optimizer side of a step: grad shards, their squared norms, and the updates.

    Every update runs over the pieces of its rows (``optim.pieces``). When the optimizer tier keeps
    nothing resident (NVMe), the pieces of a unit's master and moments are read ``depth`` pieces ahead
    (``ReadAhead``) and written behind (``WriteBehind``); otherwise they are updated in place as views
    of the tier's rows.
    """

    def __init__(self, store: Store, sharding: Sharding, pool: BufferPool, opt: Optimizer, device: torch.device,
                 opt_device: torch.device, workers: int = 1, depth: int = 0, tracer=NULL_TRACER,
                 waits: WaitClock | None = None, piece_bytes: int = 16 << 20):
        """``tracer`` records each update's span; ``waits`` (the runtime's) counts the compute thread's waits
        on updates, reads and writes; each unit's update runs in pieces of ``piece_bytes`` of fp32
        (``optim.pieces``), streamed from and to a tier without views."""
        self.store, self.sharding, self.pool, self.opt = store, sharding, pool, opt
        self.device, self.opt_device = device, opt_device
        self.tracer, self.waits = tracer, waits or WaitClock()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="zinf-update") if workers else None
        self.piece_numel = piece_numel(piece_bytes)
        # grads waiting for an update: workers + depth + 1 of them, or fewer where they are larger than a slot
        # of LEND_PIECES pieces (bounded by that many slots' bytes, and at least the newest one: a gradient
        # larger than the bound waits for the update before it)
        self._pending: InFlight[tuple[Future, int]] = InFlight(
            self._wait_update, backlog_bytes(workers, depth, self.piece_numel), weight=lambda ticket: ticket[1])
        self._decay: dict[tuple, DecaySpans | None] = {}
        self._sq_parts: list[torch.Tensor | None] = []   # per emitted unit, in emission order
        self.reads = ReadAhead(store, pool, opt_device, depth, self.waits, self.piece_numel)
        self.writes = WriteBehind(pool, depth, self.waits)
        self._previous_drained = True   # begin_step: the previous step's writes not waited for yet
        self._shares_masters = False    # the one-pass read-ahead of this step lends its masters (master_of)
        # CUDA: gradients go to the host, and 16-bit copies to the device, on side streams (overlap.copies)
        self._d2h, self._h2d = SideCopies(device), SideCopies(device)
        self._landing: dict[int, tuple] = {}   # host grad buffer -> (its copy's event, the device shard)

    def streamed(self, unit: Unit) -> bool:
        """Whether unit's optimizer rows are read and written (NVMe) rather than updated in place (views);
        per unit, since a spilled placement (``offload.spill``) keeps some units' rows in memory."""
        return self.store.placement_of("master", unit) == "nvme"

    def opt_kinds(self) -> list[str]:
        return self.store.opt_kinds(grad_arrays=False)

    def begin_step(self, all_units: list[Unit], clipping: bool) -> None:
        """One-pass path: start reading ahead the state of the units in gradient order (reverse scan).

        The previous step's last writes may still run; the tier orders reads and writes of their rows
        after them. They are waited for before this step changes its first row (``_previous_writes``,
        on the update worker, not the compute thread).
        """
        self._previous_drained = False
        # sync: the previous step's last writes, left in flight in the room its read-ahead no longer held, are
        # back to ``depth`` pieces before this pass's reads take that room again (they have long completed
        # where the disk keeps up: this waits only where it does not)
        self.writes.press()
        order = [] if clipping else [u for u in reversed(all_units) if self.sharding.holds(u) and self.streamed(u)]
        self._shares_masters = bool(order)
        if order:   # the backward fetch casts the masters lent (readahead.lends_master) instead of reading
            self.reads.begin(order, self.opt_kinds(), clipping=False)

    def master_of(self, unit: Unit) -> tuple[torch.Tensor, Future] | None:
        """The fp32 master row of ``unit`` read ahead for this step's update (``ReadAhead.master_of``), as
        it was before the update, for the backward fetch to cast instead of reading the 16-bit copy (which
        is that cast, bitwise); None where this step reads no master ahead for ``unit``."""
        return self.reads.master_of(unit) if self._shares_masters else None

    # -- gradient in -------------------------------------------------------------------------------
    def reset_norm(self) -> None:
        self._sq_parts = []

    def sq_norm(self) -> torch.Tensor:
        """This rank's squared gradient norm so far (float64): the units' parts summed in emission order.

        A ``LeafGrads`` unit's part is computed by its update: call after ``wait``."""
        total = torch.zeros((), dtype=torch.float64)
        for part in self._sq_parts:
            if part is None:
                raise RuntimeError("sq_norm: an update has not run yet (call wait first)")
            total += part.to(total.device)   # sync (CUDA): the parts were left on the device
        return total

    def scatter(self, unit: Unit, flat_grad: torch.Tensor | LeafGrads) -> torch.Tensor | LeafGrads | None:
        """Reduce-scatter (mean over ranks) a padded flat gradient (consumed); returns this rank's fp32
        shard, or None when this rank holds no part of the unit (broadcast mode, not its owner).

        A ``LeafGrads`` (one rank: nothing to scatter) passes through; its norm is taken in its update."""
        if isinstance(flat_grad, LeafGrads):
            flat_grad.slot = len(self._sq_parts)
            self._sq_parts.append(None)
            return flat_grad
        part = self.store.group_of(unit).part
        if self.sharding.comm.world_size == 1:
            shard = flat_grad      # one rank: the padded buffer *is* the shard, no copy
        else:
            shard = self.pool.take(part.shard_numel, torch.float32, self.device)
            held = self.sharding.reduce_mean_(shard, flat_grad, unit)   # sync: the shard is complete after this
            self.pool.give(flat_grad)
            if not held:       # broadcast mode: the owner updates this unit
                self.pool.give(shard)
                return None
        self._sq_parts.append(torch.dot(shard, shard).double())   # on its device: summed after the updates
        if shard.device != self.opt_device:
            host = self.pool.take(part.shard_numel, torch.float32, self.opt_device)
            # D2H on a side stream after the backward that made the shard: compute goes on meanwhile, and
            # the update worker waits for the copy (``_landed``), not the compute thread.
            copied = self._d2h.copy_(host, shard, self._d2h.after_compute())
            if copied is None:
                self.pool.give(shard)
            else:
                self._landing[id(host)] = (copied, shard)
            shard = host
        return shard

    def _landed(self, grad, ident: int | None = None) -> None:
        """Wait for ``grad``'s copy to the host (by ``id``), if it is in flight, and give its device shard back."""
        entry = self._landing.pop(id(grad) if ident is None else ident, None)
        if entry is not None:
            copies.wait(entry[0])   # sync: the gradient is on the host
            self.pool.give(entry[1])

    def stash_(self, unit: Unit, grad: torch.Tensor) -> None:
        """Two-pass path: write the grad shard to the optimizer tier (consumes ``grad``, written behind)."""
        self._landed(grad)
        self._previous_writes()
        self.writes.put([(self.store.opt_tier, key(unit.group, "grad"), unit.row, grad, True)])

    # -- update --------------------------------------------------------------------------------------
    def submit(self, unit: Unit, grad: torch.Tensor | None, step: int, scale: float = 1.0) -> None:
        """Update unit's shard with ``grad`` (consumed; None: its stashed grad), in the background worker."""
        ready = self._h2d.after_compute()   # CUDA: the compute that may still read the unit's device rows
        if self._executor is None:
            self.update_(unit, grad, step, scale, ready)
            return
        # sync: backpressure when the updates fell behind the backward pass
        weight = grad_weight(self.store.group_of(unit).part.shard_numel, self.piece_numel)
        self._pending.put((self._executor.submit(self.update_, unit, grad, step, scale, ready), weight))

    def update_(self, unit: Unit, grad: torch.Tensor | LeafGrads | None, step: int, scale: float,
                ready=None) -> None:
        """Apply the optimizer to one unit's master and moments, piece by piece (``optim.pieces``); write them
        and the 16-bit copy back. ``grad`` is consumed; None: the unit's stashed gradient. ``ready`` (CUDA):
        the event after which compute is done with the unit's device rows (``submit`` records it)."""
        self._landed(grad)
        self.store.before_update(unit)   # sync: an in-flight checkpoint save may still need these rows
        self._previous_writes()          # sync: before the first row of this step changes
        with self.tracer.span("update", f"update {unit.name}"):
            if isinstance(grad, LeafGrads):
                self._sq_parts[grad.slot] = grad.sq_norm()   # before the update may use the leaves as scratch
            elif grad is not None and scale != 1.0:
                grad.mul_(scale)
            if self.streamed(unit):
                self._update_streamed(unit, grad, step, scale, ready)
            else:
                self._update_in_place(unit, grad, step, ready)
            if isinstance(grad, torch.Tensor):
                self.pool.give(grad)   # spent: the update used it as scratch at most

    def _update_in_place(self, unit: Unit, grad: torch.Tensor | LeafGrads, step: int, ready) -> None:
        """Memory tiers: every piece of the rows' views updated in place, then the rows written back."""
        rows = self._views(unit)
        kinds = self.opt_kinds()
        for lo, hi in pieces(rows["master"].numel(), self.piece_numel):
            state = tuple(rows[k][lo:hi] for k in kinds[1:])
            update_piece_(self.opt, grad_spans(grad, lo, hi), rows["master"][lo:hi], state, step,
                          self._decay_of(unit), lo)
            _release_through(grad, hi)
        self._write_back(unit, rows, ready)

    def _update_streamed(self, unit: Unit, grad: torch.Tensor | LeafGrads | None, step: int, scale: float,
                         ready) -> None:
        """NVMe: each piece read ahead (``ReadAhead``), updated, and written behind with its 16-bit copy; a
        master row lent whole to the backward fetch is written whole after the last piece."""
        master_row = self.reads.take_master(unit)
        tier, kinds = self.store.opt_tier, self.opt_kinds()
        for lo, hi in self.reads.pieces_of(unit):
            rows = self.reads.take_piece(unit, lo, hi)
            stashed = rows.pop("grad", None)
            if stashed is not None and scale != 1.0:
                stashed.mul_(scale)
            master = rows["master"] if master_row is None else master_row[lo:hi]
            update_piece_(self.opt, grad_spans(grad if stashed is None else stashed, lo, hi), master,
                          tuple(rows[k] for k in kinds[1:]), step, self._decay_of(unit), lo)
            _release_through(grad, hi)
            param = self._param_copy(unit, master, lo, ready)   # before any buffer goes to the write-behind
            writes = [(tier, key(unit.group, k), unit.row, buf, True, lo) for k, buf in rows.items()]
            if param is not None:
                writes.append((self.store.param_tier, key(unit.group, "param"), unit.row, param, True, lo))
            if stashed is not None:
                self.pool.give(stashed)
            # the end of a pass leaves its last pieces' writes in flight (the step returns without waiting for
            # them) in the bytes the read-ahead no longer holds, so the last updates wait on no write
            self.writes.put(writes, self.reads.room_bytes())
        if master_row is not None:
            self.writes.put([(tier, key(unit.group, "master"), unit.row, master_row, True)], self.reads.room_bytes())

    def stream_clipped(self, all_units: list[Unit], step: int, scale: float) -> None:
        """Two-pass path, second pass: read each stashed grad shard back, scale it, update."""
        self.writes.drain()   # sync: every stashed grad is on its tier before it is read back
        held = [u for u in all_units if self.sharding.holds(u)]
        streamed = [u for u in held if self.streamed(u)]
        if streamed:
            self.reads.begin(streamed, ["grad", *self.opt_kinds()])
        for unit in held:
            grad = None
            if not self.streamed(unit):
                view = self.store.opt_tier.view(key(unit.group, "grad"), unit.row)
                grad = self.pool.take(view.numel(), torch.float32, self.opt_device)
                grad.copy_(view)
            self.submit(unit, grad, step, scale)

    def wait_backlog(self, limit: int) -> None:
        """sync: block until at most ``limit`` submitted updates are unfinished (bounds grad shards in flight)."""
        running = [fut for fut, _ in self._pending.tickets() if not fut.done()]
        with self.waits.waiting("update backlog"):
            for fut in running[: max(0, len(running) - limit)]:
                fut.result()

    def wait(self) -> None:
        """sync: every submitted update ran; the writes of the last units' rows may still be in flight.

        They complete behind the next step's forward pass, whose first reads of those rows the tier
        serves from the buffers being written (``NvmeTier``); ``flush`` waits for them.
        """
        self._shares_masters = False   # every update took its rows: no master is as it was
        with self.waits.waiting("updates"):
            self._pending.drain()

    def flush(self) -> None:
        """sync: every row written so far is on its tier (raises the first failed write, naming its row)."""
        with self.waits.waiting("write-behind"):
            self.writes.drain()

    def abandon(self) -> None:
        """After a failed step: let running updates finish, give every buffer back, swallow their errors."""
        self._shares_masters = False
        for ident in list(self._landing):
            self._landed(None, ident)
        self._pending.abandon()
        self.reads.abort()
        self.writes.abandon()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # -- helpers -------------------------------------------------------------------------------------
    def _previous_writes(self) -> None:
        """sync: before this step's first write, the previous step's write-behind completed; a failed write
        raises here, so a step that follows a failed write changes no row."""
        if not self._previous_drained:
            self.writes.drain()
            self._previous_drained = True

    def _wait_update(self, update: tuple[Future, int]) -> None:
        with self.waits.waiting("update"):
            update[0].result()   # sync: the update ran (raises its error)

    def _views(self, unit: Unit) -> dict[str, torch.Tensor]:
        tier = self.store.opt_tier
        return {k: tier.view(key(unit.group, k), unit.row) for k in self.opt_kinds()}

    def _write_back(self, unit: Unit, rows: dict[str, torch.Tensor], ready=None) -> None:
        """Memory tiers: the updated rows (views) to the optimizer tier, their 16-bit copy to the param tier."""
        param = self._param_copy(unit, rows["master"], 0, ready)
        tier = self.store.opt_tier
        writes = [(tier, key(unit.group, k), unit.row, buf, False) for k, buf in rows.items()]
        if param is not None:
            writes.append((self.store.param_tier, key(unit.group, "param"), unit.row, param, True))
        self.writes.put(writes)

    def _param_copy(self, unit: Unit, master: torch.Tensor, lo: int = 0, ready=None) -> torch.Tensor | None:
        """Cast ``master`` (elements ``[lo, lo + len)`` of the row) into the param tier's row in place (memory
        tiers), or into a staging buffer to write; None where nothing is left to write.

        A memory row on another device (CUDA params, host master) is filled straight from the master on
        the updater's side stream once ``ready`` (the compute that may still read the row) completed, and
        waited for here: not through a staging buffer, and not queued behind the next layer's compute.
        The staging buffer is made before the master's buffer is handed to the write-behind (which gives
        it back to the pool once written), so nothing reads a buffer after it was given back.
        """
        tier = self.store.param_tier
        view = tier.view(key(unit.group, "param"), unit.row)
        if view is not None:
            view = view[lo : lo + master.numel()]
            if view.device != master.device:
                copies.wait(self._h2d.copy_(view, master, ready))   # sync: the 16-bit copy is on the device
            elif view.data_ptr() != master.data_ptr():   # an fp32 param row may be the master row itself
                view.copy_(master)     # casts to param_dtype in place
            tier.count_view_io(written=view.numel() * view.element_size())
            return None
        if self.store.param_is_master:   # NVMe: the param row is the master row written beside it
            return None
        staged = self.pool.take(master.numel(), self.store.param_dtype, master.device)
        staged.copy_(master)
        return staged

    def _decay_of(self, unit: Unit) -> DecaySpans | None:
        """The decayed spans of this rank's shard of ``unit`` (cached per group and decay pattern)."""
        predicate = self.opt.weight_decay_mask
        if predicate is None:
            return None
        group = self.store.group_of(unit)
        prefix = f"{unit.name}."
        signature = tuple(predicate(prefix + leaf.path) for leaf in group.spec.leaves)
        cache_key = (unit.group, signature)
        if cache_key not in self._decay:
            self._decay[cache_key] = decay_spans(group.spec, prefix, self.sharding.local_range(group.part), predicate)
        return self._decay[cache_key]


def _release_through(grad, end: int) -> None:
    """A ``LeafGrads`` gives up the leaves an update is past (flat offset ``end``: one rank, shard = layout)."""
    if isinstance(grad, LeafGrads):
        grad.release_through(end)
