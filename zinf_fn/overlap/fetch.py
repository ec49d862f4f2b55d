"""The fetcher that materialises one unit of the fetch plan (``overlap.plan``); what it holds and
moves is ``overlap.fetch_demand``; ``overlap.prefetch`` runs it ahead of compute.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ..formats.codebook import decode_row_
from ..formats.frozen import assemble_frozen
from ..layout.units import EMBED, Unit, key
from ..model import tied_leaf
from ..offload.transfers import Transfer
from ..tree import unflatten
from .gather import Layer, RowGather


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
        """A row was written (``zf.init``'s rows, a restore, ``StateView.write_``), or a kept tile's
        backward is done (``tiling.keep``): its held layer's buffers go back."""
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

    def release(self, layer: Layer, keep: bool = False) -> None:
        """``layer`` given back (and those fetched along with it): its pool buffers back to the
        pool, or, the first time a layer its policy ``holds`` comes back, kept (``Kept``) as this
        row's layer from then on; a kept layer handed out (not ``owned``) gives nothing back.
        ``keep``: kept so too where it was fetched here and brought nothing along (a tile a
        training step keeps from its forward into its backward, ``tiling.keep``), until
        ``forget``."""
        for other in layer.along:
            self.release(other)
        name = (layer.unit.group, layer.unit.row)
        holds = self.store.row_kinds.policy(layer.unit.group).holds(layer.unit)
        buffers = ((layer.flat,) if layer.owned else ()) + (
            () if layer.codes is None else (layer.codes,)
        )
        if layer.owned and name not in self._held and (holds or keep and not layer.along):
            # from now on this unit's layer: its buffers never given back (until ``forget``)
            self._held[name] = Kept(layer.tree, layer.flat, buffers)
        else:
            for buf in buffers:
                self.rows.give_device(buf)
        self.counts.released()
