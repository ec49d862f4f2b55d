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

import torch

from ..layout import rows as unit_tensors
from ..layout.units import BLOCKS, EMBED, HEAD, Unit, units
from ..model import with_ties
from ..tiling.layout import TileUnit
from ..train import TrainState
from .engine import EngineHandle
from .held import HeldRows
from .shapes import RowShapes
from .storage import RowStorage


class StateView(RowShapes, HeldRows, RowStorage, EngineHandle):
    """The engine of one ``TrainState`` as checkpoints and tests see it; see the module docstring.

    Its interface is the union of four parts, each a class of one responsibility over the state's
    store and runtime: what rows there are (``RowShapes``), which this rank holds and gathers
    (``HeldRows``), the rows in their tiers (``RowStorage``) and the engine as a whole
    (``EngineHandle``). One object, for a reason: checkpoints/ and tests reach every one of these
    names on the one view ``zinf_fn.state.view(state)`` returns."""

    def __init__(self, state: TrainState):
        self.state = state
        self._runtime = state.runtime
        self._store = state.runtime.store


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
