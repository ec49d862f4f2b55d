"""The executor of the fetch plan (``overlap.plan``): the fetcher that materialises one unit, and the
prefetcher that runs the plan ahead of compute.

The prefetcher materialises unit ``plan[i + 1 .. i + depth]`` in a background thread while the caller
computes with ``plan[i]``; with depth 0 every fetch happens on demand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..demand import SCANS, Buffers, Demand
from ..frozen import is_frozen_group
from ..io.buffers import BufferPool
from ..io.futures import done
from ..model import Tie, tied_leaf
from ..offload.transfers import Transfer
from ..partition.sharding import Sharding
from ..store import Store
from ..trace import NULL_TRACER
from ..tree import unflatten
from ..units import BLOCKS, EMBED, HEAD, STAGES, Unit, key, reused
from . import copies
from .copies import CastRead, SideCopies
from .plan import FetchOp, refetched, reuse_blocks
from .stream import Window
from .tile_runs import tile_run, window_buffers

if TYPE_CHECKING:   # type names only: the layout step and the config sit above the overlap
    from ..config import Config
    from ..layout import Layout


class Layer(NamedTuple):
    """A materialised unit: its full parameter tree (views into ``flat``) in the compute dtype.

    A tied head (``zf.Model.ties``) also holds the embedding it was fetched along with (``along``,
    released with it) and the tied leaves of that embedding (``tied``, in ``ties`` order)."""

    unit: Unit
    tree: Any
    flat: torch.Tensor
    owned: bool        # flat came from the pool and goes back on release
    tied: tuple = ()
    along: tuple = ()


class Reads(NamedTuple):
    """The tier reads ``Fetcher.start`` issued ahead for one fetch: the unit's row, and its frozen row where
    its stage keeps its frozen leaves apart (``zinf_fn.frozen``); None where there is nothing to read."""

    own: Transfer | None
    frozen: Transfer | None = None


class Fetcher:
    """Materialises one unit: read this rank's shard from its tier, allgather (or broadcast), cast, unflatten;
    where the unit's frozen leaves are stored apart, its frozen row too, put back into its tree."""

    def __init__(self, store: Store, sharding: Sharding, pool: BufferPool, device: torch.device,
                 compute_dtype: torch.dtype, tracer=NULL_TRACER, ties: tuple[Tie, ...] = (), masters=None,
                 frozen=None):
        """``tracer`` records each gather's span; ``ties``: the model's, fetched with the head;
        ``masters(unit)`` (the updater's ``master_of``) lends the fp32 master row read ahead for a unit's
        update (an ``offload.transfers.Transfer``) or None, for ``start(derive=True)``; ``frozen``: the
        layout's ``zinf_fn.frozen.FrozenLeaves`` (``companion(unit)``, ``assemble``), None: nothing frozen."""
        self.ties, self.frozen = ties, frozen
        self.store, self.sharding, self.pool = store, sharding, pool
        self.device, self.compute_dtype = device, compute_dtype
        self.live = 0
        self.peak_live = 0
        self.fetches = 0
        self.casts = 0             # calls that cast fetched rows to the compute dtype (a run of tiles: one)
        self.bytes_fetched = 0     # this rank's shard bytes taken from the param tier (copied or viewed)
        self._lock = threading.Lock()
        self._copies = SideCopies(device)   # H2D on a side stream (CUDA), beside compute
        self._freed: dict[int, Any] = {}    # device buffer -> the event after which compute is done with it
        self.tracer = tracer
        self._masters = masters

    def start(self, unit: Unit, derive: bool = False) -> Reads | None:
        """Issue the tier reads of unit's shard (and of its frozen row's) now (NVMe: into pooled host buffers).

        Returns the reads in flight (pooled host buffers and their futures; None: nothing to read), which
        ``fetch`` completes; called ahead of time by the prefetcher so that the reads of several units are in
        flight at once. ``derive`` (a backward fetch): where the unit's master is read ahead for its update,
        the shard is cast from that master instead of read (the stored 16-bit copy is that cast, so the bits
        are the same): each parameter crosses the disk once per step for the backward pass and the update
        together.
        """
        companion = self.companion(unit)
        reads = Reads(self._start_row(unit, derive), None if companion is None else self._start_row(companion))
        return None if reads == (None, None) else reads   # memory tiers: nothing to read ahead

    def companion(self, unit):
        """The row stored apart with ``unit`` (its frozen leaves: ``zinf_fn.frozen``), or None."""
        return None if self.frozen is None else self.frozen.companion(unit)

    def _start_row(self, unit, derive: bool = False) -> Transfer | None:
        """The read of one row's shard, issued now (``start``); None where it is a view (or another rank's)."""
        tier = self.store.param_tier
        if not self.sharding.holds(unit) or tier.view(key(unit.group, "param"), unit.row) is not None:
            return None
        n = self.store.group_of(unit).part.shard_numel
        master = self._masters(unit) if derive and self._masters is not None else None
        host = self.pool.take(n, self.store.param_dtype, tier.device)
        if master is not None:
            return Transfer(host, CastRead(host, master.buf, master.future), pooled=True)
        return Transfer(host, tier.read_(key(unit.group, "param"), unit.row, host), pooled=True)

    def fetch(self, unit: Unit, started: Reads | None = None) -> Layer:
        """The unit materialised; a tied head brings the embedding along (one more fetch, in order: in
        broadcast mode every rank runs the same collectives)."""
        layer = self._with_frozen(unit, started)
        if unit.group != HEAD or not self.ties:
            return layer
        embed = self._with_frozen(Unit(0, EMBED, 0))
        return layer._replace(tied=tuple(tied_leaf(embed.tree, t.embed) for t in self.ties),
                              along=(*layer.along, embed))

    def _with_frozen(self, unit: Unit, started: Reads | None = None) -> Layer:
        """The unit's own row materialised and, where its frozen leaves are stored apart, its frozen row too
        (fetched after it, in order), its leaves put back into the unit's tree; released with it."""
        layer = self._fetch_unit(unit, None if started is None else started.own)
        companion = self.companion(unit)
        if companion is None:
            return layer
        try:
            frozen = self._fetch_unit(companion, None if started is None else started.frozen)
        except BaseException:
            self.release(layer)
            raise
        return layer._replace(tree=self.frozen.assemble(unit, layer.tree, frozen.tree), along=(frozen,))

    def counters(self) -> dict[str, int]:
        """What it fetched so far: rows (``fetches``), the calls that cast them (``fetch_casts``), bytes taken."""
        return {"fetches": self.fetches, "fetch_casts": self.casts, "bytes_fetched": self.bytes_fetched}

    def count(self, group, held: bool, fetches: int = 1, casts: int = 0) -> None:
        """Count ``fetches`` of ``group``'s rows (live from now until ``release``) and ``casts`` cast calls."""
        with self._lock:
            self.live += fetches
            self.peak_live = max(self.peak_live, self.live)
            self.fetches += fetches
            self.casts += casts
            self.bytes_fetched += fetches * group.part.shard_numel * self.store.param_dtype.itemsize if held else 0

    def _fetch_unit(self, unit: Unit, started=None) -> Layer:
        group = self.store.group_of(unit)
        held = self.sharding.holds(unit)   # broadcast mode: only the owner stores a row
        shard = self.store.param_tier.view(key(unit.group, "param"), unit.row) if held else None
        direct = shard is not None and row_is_layer(self.sharding.comm.world_size, shard.device, shard.dtype,
                                                    self.device, self.compute_dtype)
        self.count(group, held)
        if direct:   # placement "none", one rank, no cast: the stored row *is* the layer
            return Layer(unit, unflatten(shard[: group.spec.numel], group.spec), shard, owned=False)
        on_device = self._shard_on_device(unit, shard, started) if held else None
        with self.tracer.span("gather", f"gather {unit.name}"):
            full = self._whole_unit(unit, on_device)
        return Layer(unit, unflatten(full[: group.spec.numel], group.spec), full, owned=True)

    def _whole_unit(self, unit: Unit, on_device: Transfer | None) -> torch.Tensor:
        """The unit's padded flat buffer in the compute dtype, a pool buffer: gathered over ranks, then cast.

        ``on_device`` (this rank's row on the device; None when it holds none) goes back to the pool if
        it is pooled, unless it becomes the result. One rank has nothing to gather: its row is cast
        straight into the layer buffer, or *is* the layer buffer when it is already a pool buffer of the
        compute dtype (a row read from NVMe, or staged to the GPU), with no copy at all.
        """
        n = self.store.group_of(unit).part.padded_numel
        shard, pooled = (None, False) if on_device is None else (on_device.buf, on_device.pooled)
        if self.sharding.comm.world_size == 1:
            if pooled and staged_is_layer(1, shard.dtype, self.compute_dtype):
                return shard
            full = self.pool.take(n, self.compute_dtype, self.device)
            full.copy_(shard)   # the one copy: casts param_dtype -> compute_dtype
            self.count(None, False, fetches=0, casts=1)
        else:
            full = self.pool.take(n, self.store.param_dtype, self.device)
            self.sharding.gather_(full, shard, unit)   # sync: the gathered layer is needed whole before compute
            if full.dtype != self.compute_dtype:
                cast = self.pool.take(n, self.compute_dtype, self.device)
                cast.copy_(full)
                self.count(None, False, fetches=0, casts=1)
                self._give_device(full)
                full = cast
        if pooled:
            self._give_device(shard)
        return full

    def _shard_on_device(self, unit: Unit, view: torch.Tensor | None, started: Transfer | None) -> Transfer:
        """This rank's shard on the compute device (in memory: no future), pooled where it is a pool buffer
        to give back."""
        if view is not None and view.device == self.device:
            return Transfer(view, None, pooled=False)
        n = self.store.group_of(unit).part.shard_numel
        if view is not None:   # a memory tier on another device (CPU rows, CUDA compute)
            staging = self._staging(n)
            copies.wait(self._copies.copy_(staging, view, self._freed.pop(staging.data_ptr(), None)))  # sync: copied
            self.store.param_tier.count_view_io(read=staging.numel() * staging.element_size())
            return Transfer(staging, None, pooled=True)
        read = started or self._start_row(unit)
        host = read.buf
        try:
            read.future.result()   # sync: the shard is read from its tier
        except BaseException:
            self.pool.give(host)
            raise
        if host.device == self.device:
            return Transfer(host, None, pooled=True)
        staging = self._staging(n)
        # sync: H2D copy done (on the side stream, after compute released the buffer); the host buffer may be reused
        copies.wait(self._copies.copy_(staging, host, self._freed.pop(staging.data_ptr(), None)))
        self.pool.give(host)
        return Transfer(staging, None, pooled=True)

    def _staging(self, n: int) -> torch.Tensor:
        return self.pool.take(n, self.store.param_dtype, self.device)

    def _give_device(self, buf: torch.Tensor) -> None:
        """Give a device buffer back; a side-stream copy into it waits for the compute queued so far to end
        (kernels that still read it), not for the whole stream."""
        event = self._copies.after_compute()
        if event is not None:
            self._freed[buf.data_ptr()] = event
        self.pool.give(buf)

    def release(self, layer: Layer) -> None:
        for other in layer.along:
            self.release(other)
        if layer.owned:
            self._give_device(layer.flat)
        with self._lock:
            self.live -= 1


def row_is_layer(world_size: int, row_device: torch.device, row_dtype: torch.dtype, device: torch.device,
                 compute_dtype: torch.dtype) -> bool:
    """Whether a stored row in memory *is* the layer (``Fetcher``: no pool buffer, no copy): one rank, the row on
    the compute device, in the compute dtype."""
    return world_size == 1 and row_device == device and row_dtype == compute_dtype


def staged_is_layer(world_size: int, param_dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
    """Whether a row staged on the compute device (read from NVMe, or copied to the GPU) becomes the layer buffer
    itself (``Fetcher._whole_unit``): one rank, nothing to cast."""
    return world_size == 1 and param_dtype == compute_dtype


class Prefetcher:
    """Runs ``fetcher.fetch`` over a plan's units up to ``depth`` ahead of the consumer (a ``stream.Window``):
    the one prefetcher of layers (``plan_prefetcher``) and of tiles (``tiling.runtime``).

    ``get(j)`` returns ``units[j]`` materialised, issued ahead or now, and moves the window on to ``j + 1``;
    ``fetch_unplanned(unit)`` serves a unit the plan does not hold (queued behind the fetches issued).
    ``start(j)``, when given, issues item j's tier read at once, so that the reads of several units are in
    flight together (``Fetcher.start``); the fetch thread completes it. With depth 0 (or no fetch thread)
    every fetch runs on demand, on the caller's thread. ``wait_s``: how long ``get`` waited (exposed I/O).
    """

    def __init__(self, units: list, fetcher: Fetcher, depth: int, executor: ThreadPoolExecutor | None,
                 start: Callable[[int], Any] | None = None):
        self.units, self.fetcher = units, fetcher
        self._executor = executor if depth > 0 else None
        self._start = start
        self._window: Window[Future] = Window(len(units), self._issue, self._drop, depth if self._executor else 0)
        self.unplanned = 0
        self.wait_s = 0.0

    prefetched = property(lambda self: self._window.prefetched)
    on_demand = property(lambda self: self._window.on_demand + self.unplanned)
    wasted = property(lambda self: self._window.wasted)
    cursor = property(lambda self: self._window.cursor)

    def get(self, j: int) -> Layer:
        t0 = time.perf_counter()
        layer = self._window.take(j).result()   # sync: wait for the prefetched unit
        self._window.advance(j + 1)
        self.wait_s += time.perf_counter() - t0
        return layer

    def fetch_unplanned(self, unit: Unit) -> Layer:
        self.unplanned += 1
        return self._submit(unit).result()   # sync: the unit is gathered and cast

    def replan(self, units: list, moved: int = 0) -> None:
        """Follow a new plan in which the cursor's position is ``moved`` fewer (items behind it left out):
        fetches issued ahead for a position that now plans another unit are given back, the window refilled."""
        old, self.units = self.units, units

        def same(j: int) -> bool:
            was = j + moved
            return 0 <= was < len(old) and (units[j].group, units[j].row) == (old[was].group, old[was].row)

        self._window.replan(len(units), same, moved)

    def refill(self) -> None:
        """Keep exactly the plan window [cursor, cursor + depth) in flight; drop what fell out of it."""
        self._window.advance(self._window.cursor)

    def close(self) -> None:
        """Wait for and release whatever was fetched ahead but not consumed (the end of a pass, or an aborted one)."""
        self._window.close()

    def _issue(self, j: int) -> Future:
        started = self._start(j) if self._start is not None and self._executor is not None else None
        return self._submit(self.units[j], started)

    def _submit(self, unit: Unit, started=None) -> Future:
        if self._executor is None:
            return done(self.fetcher.fetch(unit))
        args = (unit,) if started is None else (unit, started)
        return self._executor.submit(self.fetcher.fetch, *args)

    def _drop(self, fetched: Future) -> None:
        self.fetcher.release(fetched.result())   # sync: the fetch completed before its buffers go back


def plan_prefetcher(plan: list[FetchOp], fetcher: Fetcher, depth: int,
                    executor: ThreadPoolExecutor | None) -> Prefetcher:
    """The layers' prefetcher of a step's plan: the tier reads of the next ``depth`` units run concurrently,
    and a backward fetch may cast the master its update reads ahead (``Fetcher.start(derive=True)``)."""
    def start(j: int):
        return fetcher.start(plan[j].unit, derive=plan[j].phase == "backward")

    return Prefetcher([op.unit for op in plan], fetcher, depth, executor, start)


def demand(layout: Layout, config: Config, lent: Callable[[Unit], bool]) -> Demand:
    """What the prefetcher and its fetcher hold and move (see ``zinf_fn.demand``), in the scans.

    Per group: ``prefetch_depth`` + 1 gathered units in the compute dtype (the one computing and the ones
    fetched ahead; none where the stored row is the layer: one rank, in memory on the device, of the compute
    dtype), where its 16-bit rows are on NVMe ``depth`` (at least one) staging rows read into (the fetch
    thread reads one unit at a time per depth; the ``depth`` + 1 layers themselves where a staged row is the
    layer, as on one CPU rank of the compute dtype), and with several ranks a 16-bit gather buffer where the
    compute dtype is another (one unit at a time: cast, then given back); a stage's frozen row
    (``zinf_fn.frozen``) is fetched with its unit, as a unit. The tiles of every tiled leaf share one
    prefetcher (``tiling.runtime``): of each size, ``depth`` + 1 runs of ``tile_run`` tiles at once (a tile
    whose buffer becomes its gradient is the gradients' from then on). NVMe bytes: each unit's 16-bit row on
    NVMe (its frozen row's too) is read in forward and again in backward where the backward fetches it
    (``overlap.plan.refetched``: not the head's, not a frozen embedding's), unless its master is ``lent(unit)``
    (``optim.passes.lends_master``: read ahead for its update, the fetch casts it).
    """
    store, embed_trains = layout.store, layout.frozen.embed_trains()
    reuse = reuse_blocks(config.reuse_blocks, layout.n_layers, bool(layout.tiles))
    stages, tiles, runs, forward, backward = [], [], {}, 0, 0
    compute, n_tiles = config.resolved_compute_dtype(), layout.tiles.n_tiles()
    for group in store.groups.values():
        on_disk = [u for u in store.row_units(group, layout.n_layers) if store.placement_of("param", u) == "nvme"]
        if group.name in STAGES or is_frozen_group(group.name):
            stages += _held(layout, config, group, len(on_disk), reuse=reuse if group.name.split(":")[0] == BLOCKS
                            else 0)
        else:   # tiles: one window, of runs of at most a leaf's tiles
            run = min(tile_run(group.part.padded_numel, compute, config.prefetch_depth), n_tiles[group.name])
            for numel in (group.part.padded_numel, group.part.shard_numel):
                runs[numel] = max(runs.get(numel, 1), run)
            tiles += _held(layout, config, group, len(on_disk), run)
        row = store.row_nbytes("param", group.name)
        forward += row * len(on_disk)
        again = refetched(group.name.split(":")[0], embed_trains)
        backward += row * sum(1 for u in on_disk if again and not lent(u) and not reused(u, layout.n_layers, reuse))
    windows = window_buffers(tiles, runs, compute, config.prefetch_depth)
    buffers = [b for b in [*stages, *windows] if b.count]
    return Demand("fetched layers", tuple(buffers), read_forward=forward, read_backward=backward)


def _held(layout: Layout, config: Config, group, on_disk: int, run: int | None = None, reuse: int = 0) -> list[Buffers]:
    """The fetch buffers of one group (``demand``), ``on_disk`` of its rows on NVMe; a tile group's (``run``: its
    tiles fetched as one item, ``overlap.tile_runs``) as many as its window's runs whatever its rows; ``reuse``
    of a unit group's units held from their forward into their backward (``units.reused``) besides."""
    store, depth, world = layout.store, config.prefetch_depth, layout.sharding.comm.world_size
    device, compute = config.resolved_device(), config.resolved_compute_dtype()
    where = "host" if device.type == "cpu" else "device"
    direct = row_is_layer(world, store.param_tier.device, store.param_dtype, device, compute)
    staged_layer = where == "host" and staged_is_layer(world, store.param_dtype, compute)
    full = (0 if direct else group.rows - on_disk) + (0 if staged_layer else on_disk)
    def window(rows: int) -> int:   # a unit's: at most its rows; a tile group's: the window's runs of it
        return min(rows, depth + 1 + reuse) if run is None else (depth + 1) * run * (rows > 0)

    out = [Buffers(group.part.padded_numel, compute, window(full), where, SCANS)]
    if on_disk:
        out.append(Buffers(group.part.shard_numel, store.param_dtype,
                           window(on_disk) if staged_layer else min(on_disk, max(1, depth)), phases=SCANS))
    if world > 1 and store.param_dtype != compute:
        out.append(Buffers(group.part.padded_numel, store.param_dtype, 1, where, SCANS))
    return out
