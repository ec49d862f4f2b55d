"""The public state interface: what checkpoints/, tests and users reach of a ``TrainState``'s
engine.

Everything outside the engine goes through ``StateView`` (``zinf_fn.state.view(state)``), never
``state.runtime.<internals>``::

    v = view(state)
    v.groups                 {name: Group(name, rows, spec, part)}: "embed", "blocks", "head", one
                             group per tiled leaf ("blocks:mlp.fc.w", row = layer * n_tiles + t) and
                             one per stage whose frozen leaves are stored apart ("blocks:frozen",
                             row = the unit's)
    v.is_frozen(group)       whether a group holds frozen leaves only: a "param" row, never written
                             after init
    v.frozen                 the frozen leaves (zinf_fn.formats.frozen.FrozenLeaves):
    companion(unit),
                             assemble
    v.kinds()                the state kinds of every group: "param", "master" (or "remainder"),
                             "opt.0", ... (+ "grad")
    v.kinds(group=g)         the kinds of group g's rows (a compressed format may add rows: int8
                             "opt.<i>.absmax")
    v.stored_as(formats)     the rows' kinds, dtypes, sizes, ``Formats``, codec: the state's, or in
                             other formats
    v.dtype(kind, group)     param_dtype for "param", int16 for "remainder", the moments' dtype
                             where compressed (bf16; int8's uint8 codes, and fp32 for their
                             "opt.<i>.absmax" scale rows)
    v.row_numel(kind, group) elements of one of this rank's rows of that kind (the shard, or one per
                             block)
    v.span(kind, lo, hi)     the elements of a row of that kind holding elements [lo, hi) of the
                             shard
    v.tiles                  the tile layout (tiling.layout.TileLayout): which leaves are tiled, how
    v.ties                   the model's tied weights (``zf.Tie``): each is stored once, in the
                             "embed" group
    v.rows()                 the rows this rank holds, in the order a step updates them (``Row``)
    v.element_range(group)   [lo, hi) of the real elements of the group's flat buffer that this
                             rank's rows hold; element e of a row is ``buffer[e - lo]``
    v.view / read_ / write_  one row of one kind: a zero-copy view (memory tiers, else None), or a
                             read into / write from a buffer the caller owns (futures; ``.result()``
                             waits)
    v.load_row_(unit, flat)  a unit's full flat fp32 parameters in: master, fresh optimizer state,
                             param copy
    v.save_guard(guard)      while in the context, ``guard(unit)`` runs before a step changes any
                             row of ``unit`` (a save in flight copies out the rows it has not
                             written yet)
    v.flush()                the last step's write-behind is on disk; raises its first failed write
    v.close()                flush, then stop the state's workers and close its tiers
    v.comm                   the collectives of the state's ranks (rank, world_size,
                             all_gather_object, ...)
    v.gather_row(kind, unit) one row (a unit's or a tile's) gathered over ranks: flat fp32 on the
                             CPU, padding cut (a collective: one layer in memory, where
                             gather_params is all)
    v.gather_unit(kind, u)   a unit's weights by key path, gathered over its rows (tiles joined; a
                             collective)
    v.load_unit_(u, source)  every row of a unit from its weights by key path; v.leaf_shapes(u)
                             their shapes
    gather_params(state)     the full parameter trees on the CPU (``zf.gather_params``; a
                             collective)
    v.state_bytes()          bytes of this rank's model states over its tiers (a shared param/master
                             once)
    v.param_is_master        whether each group's param array is its master array (fp32 params in
                             memory)
    v.shares_master(group)   the same for one group: False for a frozen group (its param row is its
                             own)
    v.tier_name(kind)        the tier that holds ``kind``: "none", "cpu", "nvme", or a split
                             ("cpu+nvme")
    v.placement_of(kind, u)  where unit (or tile) ``u``'s row of ``kind`` lives: "none", "cpu" or
                             "nvme"
    v.nvme_engine(kind)      the NVMe engine of that tier ("direct", "tensorstore"), None off NVMe
    v.counters()             ``Counters``: what the engine moved and holds now, read between steps
                             (the tiers' byte counters, the buffer pool, the write-behind, the
                             fetcher, and whether the last step kept unit gradients as leaves)
    v.idle_buffers()         the staging buffers the pool holds idle (where staging memory lives:
                             pinned on CUDA)
    v.wrap_tier_(kind, wrap) the seam for tests and benchmarks: the tier of ``kind`` becomes
                             ``wrap(tier)`` (a throttle, a fault injector, a counter keeping the
                             Tier protocol); between steps

A *row* is one unit's flat buffer in its group's arrays. Who holds which part of it is the partition
mode: "allgather" (every rank a shard of every row: elements ``[r * S, (r + 1) * S)`` of the padded
buffer) or "broadcast" (the owner of a unit holds its rows whole). The padding past ``numel`` is
zeros. """

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, NamedTuple

import torch

from .formats.frozen import FrozenLeaves, FrozenUnit, frozen_group, is_frozen_group
from .layout import rows as unit_tensors
from .layout.build import init_unit, layout
from .layout.units import BLOCKS, EMBED, HEAD, Unit, key, stage_rows, unit_name, units
from .model import with_ties
from .observe import counters
from .observe.counters import Counters
from .optim.stored import (
    Formats,
    RowFormat,
    StoredRows,
    Where,
    check_values,
    parse_formats,
    row_format,
)
from .partition.comm import Comm
from .store import Group
from .tiling.layout import TileLayout, TileUnit
from .train import TrainState, empty_state

__all__ = [
    "BLOCKS",
    "EMBED",
    "HEAD",
    "Counters",
    "Formats",
    "FrozenUnit",
    "Row",
    "RowFormat",
    "StateView",
    "StoredRows",
    "TileLayout",
    "TileUnit",
    "TrainState",
    "Unit",
    "Where",
    "check_values",
    "empty_state",
    "frozen_group",
    "gather_params",
    "gather_row",
    "init_unit",
    "is_frozen_group",
    "key",
    "parse_formats",
    "row_format",
    "stage_rows",
    "unit_name",
    "units",
    "view",
]


class Row(NamedTuple):
    group: str
    row: int
    unit: Unit | TileUnit | FrozenUnit  # the unit (or tile, or frozen row) the row belongs to


class StateView:
    """The engine of one ``TrainState`` as checkpoints and tests see it; see the module
    docstring."""

    def __init__(self, state: TrainState):
        self.state = state
        self._runtime = state.runtime
        self._store = state.runtime.store

    # -- layout
    # --------------------------------------------------------------------------------------
    @property
    def groups(self) -> dict[str, Group]:
        return self._store.groups

    @property
    def param_dtype(self) -> torch.dtype:
        return self._store.param_dtype

    @property
    def n_opt_leaves(self) -> int:
        return self._store.n_opt_leaves

    @property
    def n_layers(self) -> int:
        return self.state.model.n_layers

    @property
    def tiles(self) -> TileLayout:
        return self._runtime.tiles.layout

    @property
    def frozen(self) -> FrozenLeaves:
        """The frozen leaves (``zinf_fn.formats.frozen``): ``companion(unit)``, the unit's row in
        its stage's frozen group ("blocks:frozen") or None; ``split_tree`` / ``assemble`` between a
        whole tree and its rows."""
        return self._runtime.frozen

    def is_frozen(self, group: str) -> bool:
        """Whether ``group`` holds only frozen leaves: a "param" row only (``kinds(group=)``),
        written once at init and never after; its "master" (``gather_row``) is that row upcast."""
        return group in self._store.frozen

    @property
    def ties(self) -> tuple:
        """The model's ``zf.Tie`` s: the head reads these embed leaves; they have rows in "embed"
        only."""
        return self.state.model.ties

    @property
    def comm(self) -> Comm:
        return self._runtime.comm

    @property
    def identity(self) -> object:
        """One object per engine (the same for every state of a run): a key for caches kept across
        steps."""
        return self._store

    def kinds(self, grads: bool = False, group: str | None = None) -> list[str]:
        """"param", "master" (or "remainder"), "opt.<i>" (and "grad" with ``grads``, when the state
        has grad arrays). With ``group``: the kinds of that group's rows (``Store.kinds_of``: a
        compressed format may store a kind in more rows, e.g. int8 codes "opt.<i>" and scales
        "opt.<i>.absmax")."""
        if group is not None:
            return self._store.kinds_of(group, None if grads else False)
        return ["param", *self._store.opt_kinds(None if grads else False)]

    def row_numel(self, kind: str, group: str) -> int:
        """Elements of one of this rank's rows of ``kind`` in ``group`` (``shard_numel`` for every
        kind but a per-block one, such as int8 moments' "opt.<i>.absmax")."""
        return self._store.row_numel(kind, group)

    def span(self, kind: str, lo: int, hi: int) -> tuple[int, int]:
        """The elements of a row of ``kind`` that hold elements ``[lo, hi)`` of this rank's shard
        (``Store.span``: ``(lo, hi)``, or the blocks ``(lo // 256, hi // 256)`` of a per-block scale
        row)."""
        return self._store.span(kind, lo, hi)

    def dtype(self, kind: str, group: str | None = None) -> torch.dtype:
        """The dtype of ``kind``'s rows of ``group``: ``param_dtype`` for "param", int16 for
        "remainder", bf16 or uint8 (int8 codes) for the optimizer leaves of a group with compressed
        moments (``adamw(moments="bf16" | "int8")``), else fp32 (the int8 scale rows
        "opt.<i>.absmax" too)."""
        return self._store.dtype_of(kind, group)

    def stored_as(
        self, formats: Formats | None = None, param_dtype: torch.dtype | None = None
    ) -> StoredRows:
        """This state's rows, or a layout build's in ``formats`` (one layer per group initialised;
        ValueError)."""
        own = StoredRows(
            self._store, self.state.optimizer.moments, self.state.config.resolved_param_rounding()
        )
        if formats is None or (formats == own.formats and param_dtype == self.param_dtype):
            return own
        master, moments = parse_formats(formats.master, formats.moments)
        state, rounding = self.state, formats.param_rounding
        opt = state.optimizer._replace(
            moments=moments, compress=lambda name, numel: name in formats.compressed
        )
        config = dataclasses.replace(
            state.config, master=master.kind, param_dtype=param_dtype, param_rounding=rounding
        )
        return StoredRows(layout(state.model, opt, config).store, moments, rounding)

    def device(self, kind: str) -> torch.device:
        """Where the tier of ``kind`` keeps its rows (a read or write buffer may live anywhere)."""
        return self._store.tier_of(kind).device

    # -- rows this rank holds
    # ------------------------------------------------------------------------
    def all_rows(self) -> list[Row]:
        """Every row, in the order a step updates them (reverse scan: head, blocks L-1..0, embed;
        each unit's tiles, then its frozen row, before it)."""
        out = []
        for unit in reversed(units(self.n_layers)):
            out += [Row(t.group, t.row, t) for t in reversed(self.tiles.units([unit]))]
            out += [Row(f.group, f.row, f) for f in self.frozen.companions([unit])]
            out.append(Row(unit.group, unit.row, unit))
        return out

    def rows(self) -> list[Row]:
        """The rows this rank holds (all of them in allgather mode, its units' in broadcast
        mode)."""
        return [r for r in self.all_rows() if self._runtime.sharding.holds(r.unit)]

    def holds(self, unit: Unit | TileUnit) -> bool:
        return self._runtime.sharding.holds(unit)

    def element_range(self, group: str) -> tuple[int, int]:
        """[lo, hi) of the real elements of ``group``'s rows that this rank's tier rows hold."""
        part = self._store.groups[group].part
        lo, hi = self._runtime.sharding.local_range(part)
        hi = min(hi, part.numel)
        return min(lo, hi), hi

    def shard_numel(self, group: str) -> int:
        """Elements of one of this rank's rows of ``group`` (padding included)."""
        return self._store.groups[group].part.shard_numel

    # -- read and write
    # ------------------------------------------------------------------------------
    def view(self, kind: str, group: str, row: int) -> torch.Tensor | None:
        """Row ``row`` of ``group``'s ``kind`` array itself (memory tiers), or None (NVMe: nothing
        resident)."""
        return self._store.tier_of(kind).view(key(group, kind), row)

    def read_(self, kind: str, group: str, row: int, out: torch.Tensor) -> Future:
        """Copy the row into ``out`` (``row_numel(kind, group)`` elements of ``dtype(kind,
        group)``); keep ``out`` until done."""
        return self._store.tier_of(kind).read_(key(group, kind), row, out)

    def write_(self, kind: str, group: str, row: int, src: torch.Tensor) -> Future:
        """Copy ``src`` into the row; keep ``src`` untouched until the future is done."""
        self._runtime.fetcher.forget(group, row)  # a layer the fetcher holds is of the row before
        return self._store.tier_of(kind).write_(key(group, kind), row, src)

    def load_row_(self, unit: Unit | TileUnit, flat: torch.Tensor) -> None:
        """Set a unit's parameters from its padded flat fp32 buffer (every rank passes the whole
        buffer): this rank's part becomes the master, the optimizer state starts afresh, the param
        copy is cast."""
        self._runtime.load_row_(unit, flat)

    # -- what the engine holds and moved
    # --------------------------------------------------------------
    @property
    def param_is_master(self) -> bool:
        """Whether each group's param array *is* its master array (no second fp32 copy is
        stored)."""
        return self._store.param_is_master

    def shares_master(self, group: str) -> bool:
        """Whether ``group``'s param array is its master array (``param_is_master`` and the group
        trains)."""
        return self._store.shares_master(group)

    def state_bytes(self) -> int:
        """Bytes of this rank's model states over all tiers (a param array that is the master counts
        once)."""
        return self._store.state_bytes()

    def tier_name(self, kind: str) -> str:
        """The placement of the tier holding ``kind``: "none", "cpu", "nvme", or a split such as
        "cpu+nvme"."""
        return self._store.tier_of(kind).name

    def placement_of(self, kind: str, unit: Unit | TileUnit) -> str:
        """Where ``unit``'s row of ``kind`` lives: "none", "cpu" or "nvme" (a spilled kind names the
        member tier of that row; ``Store.placement_of``, the engine's and the planner's one
        answer)."""
        return self._store.placement_of(kind, unit)

    def nvme_engine(self, kind: str) -> str | None:
        """The engine of the NVMe tier holding ``kind`` ("direct", "tensorstore"); None where it is
        not on NVMe."""
        return counters.nvme_engine(self._store.tier_of(kind))

    def counters(self) -> Counters:
        """The tiers' byte counters, the buffer pool, the write-behind and the fetcher, as they are
        now."""
        return counters.read(self._runtime)

    def idle_buffers(self) -> list[torch.Tensor]:
        """The staging buffers the pool holds idle now (a snapshot): where staging memory lives."""
        return counters.idle_buffers(self._runtime)

    def wrap_tier_(self, kind: str, wrap: Callable[[Any], Any]) -> Any:
        """Replace the tier that holds ``kind`` (and every kind it shares) with ``wrap(tier)``;
        returns the wrapper. For tests and benchmarks (a throttled link, an injected fault), between
        steps: the engine reaches its tiers through the store, so the next step reads and writes
        through the wrapper."""
        wrapped = wrap(self._store.tier_of(kind))
        if kind == "param":
            self._store.param_tier = wrapped
        else:
            self._store.opt_tier = wrapped
        return wrapped

    # -- guards and flushes
    # --------------------------------------------------------------------------
    @contextlib.contextmanager
    def save_guard(self, guard: Callable[[Any], None]) -> Iterator[None]:
        """While inside, every step runs ``guard(unit)`` before it changes a row of ``unit``."""
        self.add_save_guard(guard)
        try:
            yield
        finally:
            self.remove_save_guard(guard)

    def add_save_guard(self, guard: Callable[[Any], None]) -> None:
        self._store.write_guards.append(guard)

    def remove_save_guard(self, guard: Callable[[Any], None]) -> None:
        """Remove ``guard`` if it is installed (a no-op otherwise)."""
        if guard in self._store.write_guards:
            self._store.write_guards.remove(guard)

    def flush(self) -> None:
        """sync: the last step's write-behind is on disk; raises its first failed write (layer and
        state)."""
        self._runtime.flush()

    def close(self) -> None:
        """Flush (raising a failed write), then stop the state's workers and close its tiers (files
        stay)."""
        self._runtime.close()

    def gather_row(self, kind: str, unit: Unit | TileUnit) -> torch.Tensor:
        """``unit``'s row of ``kind`` gathered over ranks: flat fp32 on the CPU, padding cut.
        Collective. "master" of a remainder master is joined from the param and remainder rows
        (``optim.remainder``); "remainder" comes back as its int16 bits. The "master" of a frozen
        group (``is_frozen``) is its param row upcast: a frozen leaf keeps its 16-bit copy only; a
        quantized frozen row (``Config.frozen_storage``) comes back as its uint8 bytes
        (``gather_unit`` / ``gather_params`` dequantize them)."""
        return unit_tensors.gather_row(self._store, self._runtime.sharding, kind, unit)

    # -- a unit's weights by key path, over its rows (``zinf_fn.layout.rows``)
    # ------------------------------
    def leaf_shapes(self, unit: Unit) -> dict[str, tuple[int, ...]]:
        """Key path in ``unit``'s tree -> shape of each of its weights (a tiled weight whole)."""
        return unit_tensors.leaf_shapes(self, unit)

    def gather_unit(self, kind: str, unit: Unit) -> dict[str, torch.Tensor]:
        """Key path -> ``unit``'s weight of ``kind`` ("master", "param") gathered over ranks, fp32
        on the CPU: tiled weights whole, frozen leaves from their frozen row. Collective (one unit
        in memory)."""
        return unit_tensors.gather_unit(self, kind, unit)

    def load_unit_(self, unit: Unit, source: Callable[[str], torch.Tensor]) -> None:
        """Set every row of ``unit`` (its group's, its frozen row, its tiles) from ``source(path)``,
        each weight whole, as ``zf.init`` writes rows (``load_row_``); every rank calls it with the
        same weights."""
        unit_tensors.load_unit_(self, unit, source)


def gather_row(state: TrainState, kind: str, unit: Unit | TileUnit) -> torch.Tensor:
    """One row of a group (a unit's or a tile's), gathered over ranks: a flat fp32 CPU tensor
    (padding cut). Collective: every rank calls it for the same row."""
    return view(state).gather_row(kind, unit)


def gather_params(state: TrainState, kind: str = "master") -> dict:
    """Full parameter trees ``{"embed": tree, "blocks": [tree, ...], "head": tree}`` on the CPU, in
    fp32.

    ``kind`` is "master" (the optimizer's fp32 copy) or "param" (the stored 16-bit copy, upcast); a
    frozen leaf (``zf.Model.trainable``) has no master: its "master" is its param copy upcast. A
    tiled weight comes back as the ``RowTiles``/``ColTiles`` node its ``init`` returned. A tied
    weight (``zf.Model.ties``) is stored once, in the embedding, and comes back in both places: the
    head's tree holds the embed tree's tensor itself at the tie's head path. Collective: every rank
    must call it. Materialises the whole model: for tests, export and sampling of models that fit in
    memory. """
    if kind not in ("master", "param"):
        raise ValueError(f"gather_params: kind must be 'master' or 'param', got {kind!r}")
    v = view(state)
    out: dict = {EMBED: None, BLOCKS: [], HEAD: None}
    for unit in units(v.n_layers):
        tree = unit_tensors.gather_tree(v, kind, unit)
        if unit.group == BLOCKS:
            out[BLOCKS].append(tree)
        else:
            out[unit.group] = tree
    out[HEAD] = with_ties(v.ties, out[HEAD], out[EMBED])
    return out


def view(state: TrainState) -> StateView:
    """The public interface of ``state``'s engine."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"zinf_fn.state.view expects a zf.TrainState (from zf.init or zf.train_step), got "
            f"{type(state).__name__}"
        )
    return StateView(state)
