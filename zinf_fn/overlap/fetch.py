"""The fetcher that materialises one unit of the fetch plan (``overlap.plan``), and what it holds
and moves (``demand``); ``overlap.prefetch`` runs it ahead of compute.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ..formats.codebook import decode_row_
from ..formats.frozen import assemble_frozen
from ..layout.demand import SCANS, Buffers, Demand, Sizing
from ..layout.policy import TILE, GroupPolicy
from ..layout.units import BLOCKS, EMBED, Unit, key, reused, stage_of
from ..model import tied_leaf
from ..offload.transfers import Transfer
from ..store import Group, Store
from ..tree import unflatten
from .gather import Layer, RowGather
from .plan import refetched, row_is_layer, staged_is_layer
from .tile_runs import computing, store_window, window_buffers


class Reads(NamedTuple):
    """The tier reads ``Fetcher.start`` issued ahead for one fetch: the unit's row, and its frozen
    row where its stage keeps its frozen leaves apart (``zinf_fn.formats.frozen``); None where there
    is nothing to read."""

    own: Transfer | None
    frozen: Transfer | None = None


class Kept(NamedTuple):
    """A layer the fetcher holds from its first fetch on (its policy's ``held``): the tree every
    later fetch hands out (views into its buffers), its ``flat`` buffer, and the pool buffers it
    keeps out, given back by ``Fetcher.forget``: its ``flat``, and where some of its leaves' codes
    are lent to the op (``GroupPolicy.lent_leaves``) the gathered row they view (``Layer.codes``)
    where that is a pool buffer."""

    tree: Any
    flat: torch.Tensor
    buffers: tuple[torch.Tensor, ...]


class Fetcher:
    """Materialises one unit from its rows (``overlap.gather.RowGather``: read, stage, gather, cast)
    as its group's read policy says (``RowKinds.policy``, ``zinf_fn.layout.policy``): its frozen row
    fetched with it and put back into its tree (``companion``), the embedding's tied leaves brought
    along (``tied``), its bytes decoded (``decode``), its layer kept once fetched (``held``,
    ``Kept``), its row read early for the next step (``reads_early``).

    It is given its ``RowGather`` (built by the composition root) and reads where rows are, the
    buffers, the device and dtype of the layers made and the tracer from it. Twenty methods:
    five are read-only views (``live``, ``peak_live``, ``held``, ``held_buffers`` and
    ``cancellable``), the rest what the prefetcher, the tile runs and the runtime call."""

    def __init__(self, rows: RowGather):
        """``rows`` reads, stages, gathers and casts one row (with the masters a step lends, for
        ``start(derive=True)``)."""
        self.store, self.sharding, self.pool = rows.store, rows.sharding, rows.pool
        self.device, self.compute_dtype, self.tracer = rows.device, rows.compute_dtype, rows.tracer
        self.rows = rows
        self.counts = rows.counts
        # (group, row) -> the kept layer (its policy's ``held``)
        self._held: dict[tuple[str, int], Kept] = {}

    def start(self, unit: Unit, derive: bool = False) -> Reads | None:
        """Issue the tier reads of unit's shard (and of its frozen row's) now (NVMe: into pooled
        host buffers).

        Returns the reads in flight (pooled host buffers and their futures; None: nothing to read),
        which ``fetch`` completes; called ahead of time by the prefetcher so that the reads of
        several units are in flight at once. ``derive`` (a backward fetch): where the unit's master
        is read ahead for its update, the shard is cast from that master instead of read (the stored
        16-bit copy is that cast, so the bits are the same): each parameter crosses the disk once
        per step for the backward pass and the update together.
        """
        companion = self.store.row_kinds.policy(unit.group).companion_of(unit)
        frozen = None if companion is None else self._read(companion)
        reads = Reads(self._read(unit, derive), frozen)
        return None if reads == (None, None) else reads  # memory tiers: nothing to read ahead

    @property
    def cancellable(self) -> bool:
        """Whether a fetch issued ahead may be cancelled on this rank alone (``Prefetcher``): with
        one rank; with several, each fetch is a collective every rank runs in the same order."""
        return self.sharding.comm.world_size == 1

    def abandon(self, started: Reads | None) -> None:
        """sync: the reads ``start`` issued for a fetch that will not run (``Prefetcher``: a
        cancelled fetch) completed, their pooled buffers back; raises the first read's error once
        every buffer is back."""
        error = None
        for read in () if started is None else started:
            if read is None:
                continue
            try:
                if read.future is not None:
                    read.future.result()  # sync: the read landed; its buffer may be reused
            except Exception as e:  # give every buffer back, then raise the first
                error = error or e
            if read.pooled:
                self.pool.give(read.buf)
        if error is not None:
            raise error

    def _read(self, unit, derive: bool = False) -> Transfer | None:
        """The read of one row's shard, issued now (``RowGather.read``); None: its layer is held."""
        return None if (unit.group, unit.row) in self._held else self.rows.read(unit, derive)

    def fetch(self, unit: Unit, started: Reads | None = None) -> Layer:
        """The unit materialised; a tied head brings the embedding along (one more fetch, in order:
        in broadcast mode every rank runs the same collectives)."""
        layer = self._with_frozen(unit, started)
        tied = self.store.row_kinds.policy(unit.group).tied
        if not tied:
            return layer
        embed = self._with_frozen(Unit(0, EMBED, 0))
        return layer._replace(
            tied=tuple(tied_leaf(embed.tree, path) for path in tied), along=(*layer.along, embed)
        )

    def _with_frozen(self, unit: Unit, started: Reads | None = None) -> Layer:
        """The unit's own row materialised and, where its frozen leaves are stored apart, its frozen
        row too (fetched after it, in order), its leaves put back into the unit's tree; released
        with it."""
        layer = self._row_layer(unit, None if started is None else started.own)
        policy = self.store.row_kinds.policy(unit.group)
        companion = policy.companion_of(unit)
        if companion is None:
            return layer
        try:
            frozen = self._row_layer(companion, None if started is None else started.frozen)
        except BaseException:
            self.release(layer)
            raise
        tree = assemble_frozen(layer.tree, frozen.tree, policy.companion.anchors)
        return layer._replace(tree=tree, along=(frozen,))

    def _row_layer(self, unit: Unit, started=None) -> Layer:
        """One row's layer: the one the fetcher holds (its policy's ``held``; the tier is not
        touched), or fetched (decoded where its policy says). ``started``: its read was issued
        before the layer was held."""
        kept = self._held.get((unit.group, unit.row)) if started is None else None
        if kept is None:
            return self._decoded(self.rows.layer(unit, started))
        self.counts.add(0)
        return Layer(unit, kept.tree, kept.flat, owned=False)

    def counters(self) -> dict[str, int]:
        """What it fetched so far: rows (``fetches``), the calls that cast them (``fetch_casts``),
        bytes taken."""
        counts = self.counts
        return {
            "fetches": counts.fetches,
            "fetch_casts": counts.casts,
            "bytes_fetched": counts.bytes_fetched,
        }

    @property
    def live(self) -> int:
        """Layers out now (``FetchCounts.live``)."""
        return self.counts.live

    @property
    def peak_live(self) -> int:
        """The most layers out at once so far (``FetchCounts.peak_live``)."""
        return self.counts.peak_live

    def fetch_run(
        self, units: tuple[Unit, ...], started: tuple[Reads | None, ...] | None = None
    ) -> tuple[Layer, ...]:
        """Adjacent tiles of one leaf materialised (``tiling.runs``), each its own pool buffer, in
        order; ``started``: each tile's reads issued ahead (``start``). With one rank and every row
        a memory row on the compute device in another dtype (``_run_rows``), the run's rows are
        cast with one call (``torch._foreach_copy_``) instead of one ``copy_`` each; else ``fetch``
        of each (the plain loop this equals: ``tuple(fetch(unit) for unit in units)``)."""
        rows = self._run_rows(units)
        if rows is None:
            layers: list[Layer] = []
            try:
                for k, unit in enumerate(units):
                    layers.append(self.fetch(unit, None if started is None else started[k]))
            except BaseException:
                for layer in layers:
                    self.release(layer)
                raise
            return tuple(layers)
        group = self.store.group_of(units[0])
        fulls = [
            self.pool.take(group.part.padded_numel, self.compute_dtype, self.device) for _ in units
        ]
        with self.tracer.span("gather", f"gather {units[0].name} and {len(units) - 1} more"):
            # the run's one cast: param_dtype -> compute_dtype, row by row
            torch._foreach_copy_(fulls, rows)
        nbytes = len(units) * self.store.row_kinds.row_nbytes("param", group.name)
        self.counts.add(nbytes, fetches=len(units), casts=1)
        return tuple(
            Layer(u, unflatten(f[: group.spec.numel], group.spec), f, owned=True)
            for u, f in zip(units, fulls, strict=True)
        )

    def _run_rows(self, units: tuple[Unit, ...]) -> list[torch.Tensor] | None:
        """The param rows of a run of tiles to cast in one call (``fetch_run``): one rank, two tiles
        or more, none held, decoded or with a frozen companion, every row a memory row on the
        compute device in another dtype than the compute's (the path ``RowGather.layer`` casts with
        one ``copy_``); None otherwise."""
        if (
            len(units) < 2
            or self.sharding.comm.world_size != 1
            or any(
                self.store.row_kinds.policy(u.group).companion is not None
                or (u.group, u.row) in self._held
                or self.store.row_kinds.policy(u.group).gathered_as(self.compute_dtype)
                != self.compute_dtype
                for u in units
            )
        ):
            return None
        rows = [self.store.param_tier.view(key(u.group, "param"), u.row) for u in units]
        if any(r is None or r.device != self.device or r.dtype == self.compute_dtype for r in rows):
            return None
        return rows

    def _decoded(self, layer: Layer) -> Layer:
        """A layer whose row is stored as codes (its policy's ``decode``: ``Config.frozen_storage``)
        decoded into a pool buffer of the compute dtype, here on the fetch thread; its bytes go
        back, unless some of its leaves' codes are lent to the op (``lent_leaves``): those leaves
        are views of its bytes, which stay out with the layer (``Layer.codes``). Any other layer as
        it is (a row whose one leaf's codes are lent, ``LENT``, too: its bytes are the layer)."""
        policy = self.store.row_kinds.policy(layer.unit.group)
        decode = policy.decoded
        if decode is None:
            return layer
        flat = self.pool.take(decode.values.numel, self.compute_dtype, self.device)
        decode_row_(decode, layer.flat, flat)
        if policy.lent_leaves:  # the lent leaves view the gathered row: it stays out with them
            leaves = policy.lent_tree(layer.flat, flat)
            tree = optree.tree_unflatten(policy.decode.values.treedef, leaves)
            codes = layer.flat if layer.owned else None
            return layer._replace(tree=tree, flat=flat, owned=True, codes=codes)
        if layer.owned:
            self.rows.give_device(layer.flat)
        return layer._replace(tree=unflatten(flat, decode.values), flat=flat, owned=True)

    @property
    def held(self) -> int:
        """Layers kept (their policy's ``held``)."""
        return len(self._held)

    @property
    def held_buffers(self) -> int:
        """The pool buffers the kept layers hold out for good (``Kept.buffers``: a layer's one, a
        row's two where it lends some leaves' codes and decodes the others)."""
        return sum(len(kept.buffers) for kept in self._held.values())

    def forget(self, group: str, row: int) -> None:
        """A row was written (``zf.init``'s rows, a restore, ``StateView.write_``): its held layer's
        buffers go back."""
        kept = self._held.pop((group, row), None)
        for buf in () if kept is None else kept.buffers:
            self.rows.give_device(buf)
        self.drop_early((group, row))

    def read_early(self, units: list[Unit], most: int) -> None:
        """Issue now at most ``most`` reads of the rows of ``units`` (and their frozen rows) their
        policy lets be read early (``reads_early``: never written after init, no layer held), the
        next step's first, as the backward reaches its last unit: the next ``start`` takes them."""
        rows = [
            r
            for u in units
            for r in (u, self.store.row_kinds.policy(u.group).companion_of(u))
            if r and self.store.row_kinds.policy(r.group).reads_early(r)
        ]
        self.rows.read_early(rows, most)

    def drop_early(self, name: tuple[str, int] | None = None) -> None:
        """sync: the early reads (``read_early``; of row ``name`` only, if given) completed, their
        buffers back."""
        self.rows.drop_early(name)

    def release(self, layer: Layer) -> None:
        """``layer`` given back (and those fetched along with it): its pool buffers back to the
        pool, or, the first time a layer its policy ``holds`` comes back, kept (``Kept``) as this
        row's layer from then on; a kept layer handed out (not ``owned``) gives nothing back."""
        for other in layer.along:
            self.release(other)
        name = (layer.unit.group, layer.unit.row)
        holds = self.store.row_kinds.policy(layer.unit.group).holds(layer.unit)
        buffers = ((layer.flat,) if layer.owned else ()) + (
            () if layer.codes is None else (layer.codes,)
        )
        if layer.owned and name not in self._held and holds:
            # from now on this unit's layer: its buffers never given back (until ``forget``)
            self._held[name] = Kept(layer.tree, layer.flat, buffers)
        else:
            for buf in buffers:
                self.rows.give_device(buf)
        self.counts.released()


def demand(store: Store, sizing: Sizing) -> Demand:
    """What the prefetcher and its fetcher hold and move (see ``zinf_fn.layout.demand``), in the
    scans.

    Per group: ``prefetch_depth`` + 1 gathered units in the compute dtype (the one computing and the
    ones fetched ahead; none where the stored row is the layer: one rank, in memory on the device,
    of the compute dtype), where its 16-bit rows are on NVMe ``depth`` (at least one) staging rows
    read into (the fetch thread reads one unit at a time per depth; the ``depth`` + 1 layers
    themselves where a staged row is the layer, as on one CPU rank of the compute dtype), and with
    several ranks a 16-bit gather buffer where the compute dtype is another (one unit at a time:
    cast, then given back); a stage's frozen row (``zinf_fn.formats.frozen``) is fetched with its
    unit, as a unit. The tiles of every tiled leaf share one prefetcher (``tiling.runtime``): of
    each size, ``depth`` + 1 runs of ``tile_run`` tiles at once (a streamed expert group's:
    ``window_runs`` + 1), their staging rows too (a run's reads start as it enters the window; a
    tile whose buffer becomes its gradient is the gradients' from then on). NVMe bytes: each unit's
    16-bit row on NVMe (its frozen row's too; a tile's reads are the tile plan's,
    ``tiling.plan.demand``) is read in forward and again in backward where the backward fetches it
    (``overlap.plan.refetched``: not the head's, not a frozen embedding's), unless its policy
    ``lends`` its master (``zinf_fn.layout.policy``: read ahead for its update, the fetch casts it),
    and but once where it ``holds`` its layer (its buffers held from then on: one, or two where
    it lends some leaves' codes and decodes the others, ``_kept``). A row the
    policy ``decode``s (``Config.frozen_storage``) is gathered as its bytes
    (``GroupPolicy.gathered_as``), then decoded into a buffer of the compute dtype, unless its
    policy lends those bytes to the op as they are (``GroupPolicy.codes``: no decoded buffer; where
    it lends some leaves' only, ``lent_leaves``, a buffer of the others' values, the gathered row
    out as long as its layer)."""
    n_layers, reuse = sizing.n_layers, sizing.reuse
    stages: list[Buffers] = []
    tiles: list[Buffers] = []
    most: dict[int, int] = {}  # tile buffers of a numel out at once (``window_buffers``)
    streamed = store_window(store, sizing.compute, sizing.depth)
    forward = backward = 0
    for group in store.groups.values():
        rows = store.row_units(group, n_layers)
        on_disk = [u for u in rows if store.placement_of("param", u) == "nvme"]
        policy = store.row_kinds.policy(group.name)
        if policy.unit != TILE:
            blocks = stage_of(group.name) == BLOCKS
            stages += _held(
                store,
                sizing,
                group,
                len(on_disk),
                reuse=reuse if blocks else 0,
                kept=tuple(u for u in rows if policy.holds(u)),
            )
        else:  # tiles: one window, of runs of at most a leaf's tiles
            run = policy.fetch_run
            ahead = sizing._replace(depth=streamed if policy.streamed else sizing.depth)
            decoded = () if policy.decoded is None else (policy.decoded.values.numel,)
            held = computing(policy)  # runs out computing, beside those fetched ahead
            for numel in (group.part.padded_numel, group.part.shard_numel, *decoded):
                most[numel] = max(most.get(numel, 0), (ahead.depth + held) * run)
            tiles += _held(store, ahead, group, len(on_disk), run, computing=held)
        if policy.unit == TILE:  # as often as the tile plan fetches it (``tiling.plan.demand``)
            continue
        row = store.row_kinds.row_nbytes("param", group.name)
        on_disk = [u for u in on_disk if not policy.holds(u)]
        forward += row * len(on_disk)
        again = refetched(stage_of(group.name), sizing.embed_trains)
        refetches = [u for u in on_disk if not policy.lends(u) and not reused(u, n_layers, reuse)]
        backward += row * len(refetches) if again else 0
    windows = window_buffers(tiles, most)
    buffers = [b for b in [*stages, *windows] if b.count]
    return Demand("fetched layers", tuple(buffers), read_forward=forward, read_backward=backward)


def _held(
    store: Store,
    sizing: Sizing,
    group,
    on_disk: int,
    run: int | None = None,
    reuse: int = 0,
    kept: tuple[Unit, ...] = (),
    computing: int = 1,
) -> list[Buffers]:
    """The fetch buffers of one group (``demand``), ``on_disk`` of its rows on NVMe; a tile group's
    (``run``: its tiles fetched as one item, ``overlap.tile_runs``) as many as its window's runs
    whatever its rows; ``reuse`` of a unit group's units held from their forward into their backward
    (``units.reused``) besides, and the ``kept`` units whose layers the fetcher holds
    (``Fetcher.release``) from their first fetch on."""
    depth, world = sizing.depth, sizing.world_size
    device, compute = sizing.device, sizing.compute
    where = "host" if device.type == "cpu" else "device"
    row, flat = (
        store.row_kinds.dtype_of("param", group.name),
        store.row_kinds.policy(group.name).gathered_as(compute),
    )
    direct = row_is_layer(world, store.param_tier.device, row, device, flat)
    staged_layer = where == "host" and staged_is_layer(world, row, flat)
    full = (0 if direct else group.rows - on_disk) + (0 if staged_layer else on_disk)

    # a unit's: at most its rows; a tile group's: the window's runs of it
    def window(rows: int) -> int:
        if run is None:
            return min(rows, depth + 1 + reuse)
        return (depth + computing) * run * (rows > 0)

    out = [Buffers(group.part.padded_numel, flat, window(full), where, SCANS)]
    if on_disk:
        out.append(
            Buffers(
                group.part.shard_numel,
                row,
                window(on_disk) if staged_layer or run else min(on_disk, max(1, depth)),
                phases=SCANS,
            )
        )
    if world > 1 and row != flat:
        out.append(Buffers(group.part.padded_numel, row, 1, where, SCANS))
    policy = store.row_kinds.policy(group.name)
    values = None if policy.decoded is None else policy.decoded.values
    if values is not None:  # a row decoded, for each unit held (``Fetcher._decoded``)
        out.append(Buffers(values.numel, compute, window(group.rows), where, SCANS))
    # a kept layer's gathered row is a pool buffer, unless its stored row (in memory) is the layer
    pooled = [u for u in kept if not direct or store.placement_of("param", u) == "nvme"]
    return out + _kept(group, policy, flat, compute, where, len(kept), len(pooled))


def _kept(
    group: Group,
    policy: GroupPolicy,
    gathered: torch.dtype,
    compute: torch.dtype,
    where: str,
    kept: int,
    pooled: int,
) -> list[Buffers]:
    """The buffers of the ``kept`` layers the fetcher holds (``Fetcher.release``, ``Kept``), for
    the whole step: each as fetched, decoded (its policy's ``decoded``: a buffer of the compute
    dtype, wherever its row is) or as gathered (in ``gathered``, ``GroupPolicy.gathered_as``), and
    where it lends some leaves' codes and decodes the others (``lent_leaves``) the gathered row
    those view besides. ``pooled``: those of the kept layers whose gathered row is a pool buffer,
    not the stored row itself (``row_is_layer``)."""
    decode = policy.decoded
    decoded = [] if decode is None else [Buffers(decode.values.numel, compute, kept, where)]
    if decode is not None and not policy.lent_leaves:
        return decoded
    return [*decoded, Buffers(group.part.padded_numel, gathered, pooled, where)]
