"""One row of the param tier made a layer buffer on the compute device: read from its tier (or cast
from a lent master), staged, gathered across ranks and cast (``RowGather``); the fetcher
(``overlap.fetch``) makes units of such rows as their read policy says (``zinf_fn.layout.policy``).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

from ..io.buffers import BufferPool
from ..layout.units import Unit, key
from ..observe.trace import NULL_TRACER
from ..offload.transfers import CastRead, Transfer
from ..partition.sharding import Sharding
from ..store import Store
from ..tree import unflatten
from . import copies
from .copies import SideCopies
from .plan import row_is_layer, staged_is_layer


class Layer(NamedTuple):
    """A materialised unit: its full parameter tree (views into ``flat``) in the compute dtype.

    A tied head (``zf.Model.ties``) also holds the embedding it was fetched along with (``along``,
    released with it) and the tied leaves of that embedding (``tied``, in ``ties`` order). A row
    some of whose leaves' codes are lent to the op (``GroupPolicy.lent_leaves``) holds the gathered
    row they view as ``codes`` where it is a pool buffer, given back with ``flat`` (or kept with it,
    where the fetcher holds the row's layer: ``overlap.fetch.Kept``)."""

    unit: Unit
    tree: Any
    flat: torch.Tensor
    owned: bool  # flat came from the pool and goes back on release
    tied: tuple = ()
    along: tuple = ()
    codes: torch.Tensor | None = None


class FetchCounts:
    """What the fetcher made so far: layers out now (``live``) and at most (``peak_live``), rows
    materialised (``fetches``), the calls that cast them (``casts``; a run of tiles: one), this
    rank's shard bytes taken from the param tier (``bytes_fetched``, copied or viewed). Thread-safe:
    the fetch thread adds, compute releases."""

    def __init__(self):
        self.live = 0
        self.peak_live = 0
        self.fetches = 0
        self.casts = 0
        self.bytes_fetched = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int, fetches: int = 1, casts: int = 0) -> None:
        """``fetches`` more layers out, ``nbytes`` of them from the param tier, ``casts`` casts."""
        with self._lock:
            self.live += fetches
            self.peak_live = max(self.peak_live, self.live)
            self.fetches += fetches
            self.casts += casts
            self.bytes_fetched += nbytes

    def released(self) -> None:
        """One layer given back."""
        with self._lock:
            self.live -= 1


class RowGather:
    """Reads this rank's shard of one param row and makes the row's padded flat buffer on the
    compute device (``layer``): staged (H2D on a side stream), allgathered (or broadcast), cast to
    the compute dtype or kept as its stored bytes (``GroupPolicy.gathered_as``). Reads may be issued
    ahead (``read``, the prefetcher's), or early for the next step (``read_early``).

    Eight parameters, for a reason: where rows are (``store``, ``sharding``), the buffers and the
    device and dtype of the layers made, the tracer, the one thing a step lends it (``masters``)
    and how a lent master becomes a layer in one pass (``widen``)."""

    def __init__(
        self,
        store: Store,
        sharding: Sharding,
        pool: BufferPool,
        device: torch.device,
        compute_dtype: torch.dtype,
        tracer=NULL_TRACER,
        masters=None,
        widen=None,
    ):
        """``tracer`` records each gather's span; ``masters(unit)`` (the updater's ``master_of``)
        lends the fp32 master row read ahead for a unit's update (an ``offload.transfers.Transfer``)
        or None (``read``); ``widen(out, master)`` (``optim.masters.cast16_widened_``) writes into
        the fp32 ``out`` the bf16 copy of the fp32 ``master`` widened back, in one pass, so a lent
        master becomes an fp32 layer with no 16-bit buffer between (None: cast twice)."""
        self.store, self.sharding, self.pool = store, sharding, pool
        self.device, self.compute_dtype = device, compute_dtype
        self.tracer = tracer
        self.counts = FetchCounts()
        self._masters = masters
        self._widen = widen
        self._copies = SideCopies(device)  # H2D on a side stream (CUDA), beside compute
        # device buffer -> the event after which compute is done with it
        self._freed: dict[int, Any] = {}
        # (group, row) -> a row's read issued early (``read_early``)
        self._early: dict[tuple[str, int], Transfer] = {}

    def read(self, unit, derive: bool = False) -> Transfer | None:
        """The read of one row's shard, issued now (or earlier: ``read_early``); None where it is a
        view (or another rank's). ``derive``: cast from the master lent for the unit's update where
        one is."""
        tier, early = self.store.param_tier, self._early.pop((unit.group, unit.row), None)
        if early is not None:
            return early
        if not self.sharding.holds(unit):  # broadcast mode: another rank's row
            return None
        if tier.view(key(unit.group, "param"), unit.row) is not None:  # a view: nothing to read
            return None
        n = self.store.group_of(unit).part.shard_numel
        master = self._masters(unit) if derive and self._masters is not None else None
        dtype = self.store.row_kinds.dtype_of("param", unit.group)
        if master is not None and master.buf.dtype == dtype:
            # the row lent is the param row itself (a remainder master's high half): the layer is
            # made from it where it lies, before the update takes it (the update follows this
            # fetch's backward), not from a copy of it
            return Transfer(master.buf, master.future, pooled=False)
        if master is not None:
            return self._cast_master(unit, master, dtype, n)
        host = self.pool.take(n, dtype, tier.device)
        return Transfer(host, tier.read_(key(unit.group, "param"), unit.row, host), pooled=True)

    def _cast_master(self, unit: Unit, master: Transfer, dtype: torch.dtype, n: int) -> Transfer:
        """The row cast from its lent fp32 ``master`` once it is read: straight into a buffer that
        becomes the layer (``widen``: one rank, compute in fp32 on the master's device, a bf16
        copy), else into a pool buffer of the 16-bit ``dtype``, cast again by ``layer``."""
        device = self.store.param_tier.device
        one_pass = (
            self._widen is not None
            and dtype == torch.bfloat16
            and device == self.device
            and staged_is_layer(
                self.sharding.comm.world_size,
                torch.float32,
                self.store.row_kinds.policy(unit.group).gathered_as(self.compute_dtype),
            )
        )
        out = self.pool.take(n, torch.float32 if one_pass else dtype, device)
        cast = CastRead(out, master.buf, master.future, self._widen if one_pass else None)
        return Transfer(out, cast, pooled=True)

    def read_early(self, rows: list, most: int) -> None:
        """Issue now the reads of ``rows`` (the next step's first), at most ``most`` in flight:
        ``read`` takes them."""
        for row in rows:
            if len(self._early) >= most or (row.group, row.row) in self._early:
                continue
            read = self.read(row)
            if read is not None:
                self._early[(row.group, row.row)] = read

    def drop_early(self, name: tuple[str, int] | None = None) -> None:
        """sync: the early reads (``read_early``; of row ``name`` only, if given) completed, their
        buffers back."""
        for read in [self._early.pop(n) for n in list(self._early) if name is None or n == name]:
            try:
                read.future.result()
            finally:
                self.pool.give(read.buf)

    def layer(self, unit: Unit, started: Transfer | None = None) -> Layer:
        """One row's layer: the stored row itself where it is one (one rank, in memory on the
        device, of the dtype gathered into), else a pool buffer gathered and cast; ``started``: its
        read issued ahead."""
        group = self.store.group_of(unit)
        held = self.sharding.holds(unit)  # broadcast mode: only the owner stores a row
        shard = self.store.param_tier.view(key(unit.group, "param"), unit.row) if held else None
        layer_dtype = self.store.row_kinds.policy(unit.group).gathered_as(self.compute_dtype)
        direct = shard is not None and row_is_layer(
            self.sharding.comm.world_size, shard.device, shard.dtype, self.device, layer_dtype
        )
        self.counts.add(self.store.row_kinds.row_nbytes("param", unit.group) if held else 0)
        if direct:  # placement "none", one rank, no cast: the stored row *is* the layer
            return Layer(unit, unflatten(shard[: group.spec.numel], group.spec), shard, owned=False)
        on_device = self._shard_on_device(unit, shard, started) if held else None
        with self.tracer.span("gather", f"gather {unit.name}"):
            full = self._whole_unit(unit, on_device, layer_dtype)
        return Layer(unit, unflatten(full[: group.spec.numel], group.spec), full, owned=True)

    def _whole_unit(
        self, unit: Unit, on_device: Transfer | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """The unit's padded flat buffer in ``dtype`` (``GroupPolicy.gathered_as``), a pool buffer:
        gathered, then cast.

        ``on_device`` (this rank's row on the device; None when it holds none) goes back to the pool
        if it is pooled, unless it becomes the result. One rank has nothing to gather: its row is
        cast straight into the layer buffer, or *is* the layer buffer when it is already a pool
        buffer of the compute dtype (a row read from NVMe, or staged to the GPU), with no copy at
        all.
        """
        n = self.store.group_of(unit).part.padded_numel
        shard, pooled = (None, False) if on_device is None else (on_device.buf, on_device.pooled)
        if self.sharding.comm.world_size == 1:
            if pooled and staged_is_layer(1, shard.dtype, dtype):
                return shard
            full = self.pool.take(n, dtype, self.device)
            full.copy_(shard)  # the one copy: casts param_dtype -> compute_dtype
            self.counts.add(0, fetches=0, casts=1)
        else:
            full = self.pool.take(
                n, self.store.row_kinds.dtype_of("param", unit.group), self.device
            )
            # sync: the gathered layer is needed whole before compute
            self.sharding.gather_(full, shard, unit)
            if full.dtype != dtype:
                cast = self.pool.take(n, dtype, self.device)
                cast.copy_(full)
                self.counts.add(0, fetches=0, casts=1)
                self.give_device(full)
                full = cast
        if pooled:
            self.give_device(shard)
        return full

    def _shard_on_device(
        self, unit: Unit, view: torch.Tensor | None, started: Transfer | None
    ) -> Transfer:
        """This rank's shard on the compute device (in memory: no future), pooled where it is a pool
        buffer to give back."""
        if view is not None and view.device == self.device:
            return Transfer(view, None, pooled=False)
        n = self.store.group_of(unit).part.shard_numel
        if view is not None:  # a memory tier on another device (CPU rows, CUDA compute)
            staging = self.pool.take(n, view.dtype, self.device)
            copies.wait(
                self._copies.copy_(staging, view, self._freed.pop(staging.data_ptr(), None))
            )  # sync: copied
            self.store.param_tier.count_view_io(read=staging.numel() * staging.element_size())
            return Transfer(staging, None, pooled=True)
        read = started or self.read(unit)
        host = read.buf
        try:
            read.future.result()  # sync: the shard is read from its tier
        except BaseException:
            if read.pooled:
                self.pool.give(host)
            raise
        if host.device == self.device:
            return Transfer(host, None, pooled=read.pooled)
        staging = self.pool.take(n, host.dtype, self.device)
        # sync: H2D copy done (on the side stream, after compute released the buffer); the host
        # buffer may be reused
        copies.wait(self._copies.copy_(staging, host, self._freed.pop(staging.data_ptr(), None)))
        if read.pooled:
            self.pool.give(host)
        return Transfer(staging, None, pooled=True)

    def give_device(self, buf: torch.Tensor) -> None:
        """Give a device buffer back; a side-stream copy into it waits for the compute queued so far
        to end (kernels that still read it), not for the whole stream."""
        event = self._copies.after_compute()
        if event is not None:
            self._freed[buf.data_ptr()] = event
        self.pool.give(buf)
