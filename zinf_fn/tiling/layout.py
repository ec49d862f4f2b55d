"""Tiled weights as fetch units of the engine: their layout (groups, rows, the order the tiled ops
use the leaves in) and the tile fetches it makes (``TileOp``); the plan of a step's tile fetches is
``tiling/plan.py``.

At ``zf.init`` each stage's tree is split into the *rest* (stored as the stage's group, as for any
model) and one extra group per tiled leaf path::

    stage "blocks", leaf "mlp.fc.w" as 4 RowTiles  ->  group "blocks:mlp.fc.w", rows n_layers * 4,
                                                        row = layer * 4 + t, one tile per row

In the rest tree the tiled node is replaced by an *anchor*: a zero-size fp32 leaf at the same key
path, so the rest keeps its structure, and a vjp over the rest's leaves differentiates the anchor,
which the tiled op takes as an input (see ``zinf_fn.tiling.TileSource``). A tile group's flat spec
is one leaf at the tiled key path with the shape of its largest tile; smaller tiles (a non-divisible
split) fill the front of their row and leave zeros behind, which get zero gradients and stay zero
under the optimizers.

Each tile is then stored, sharded, gathered, reduce-scattered and updated exactly like a unit: its
``TileUnit`` has the ``group``/``row`` the fetcher and updater use, and a ``name`` ("blocks.3") so
that weight-decay masks see the key path of the untiled weight ("blocks.3.mlp.fc.w").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from typing import Any, NamedTuple

import optree
import torch

from ..layout.units import Unit, stage_rows, unit_name
from ..tree import FlatSpec, LeafSpec, path_str
from .deferred import Deferred, is_deferred, made
from .ops import is_tiled


class TiledLeaf(NamedTuple):
    """One tiled weight of a stage: where it sits in the stage's tree and how it is cut."""

    stage: str  # "embed" | "blocks" | "head"
    # key path of the weight in the stage's tree, e.g. "mlp.fc.w"
    path: str
    kind: type  # tiling.RowTiles or tiling.ColTiles
    shapes: tuple[tuple[int, ...], ...]  # shape of each tile
    anchor_index: int  # index of its anchor among the rest tree's leaves

    @property
    def group(self) -> str:
        return f"{self.stage}:{self.path}"

    @property
    def n_tiles(self) -> int:
        return len(self.shapes)

    @property
    def axis(self) -> int:
        return self.kind.axis

    @property
    def experts(self) -> bool:
        """Whether it is a stack of experts cut one expert per tile: row tiles of shape
        ``(1, out, in)`` (``layers.moe`` with ``stream_experts``, ``tiling.experts``). The one rule:
        the layout step marks their groups ``streamed`` (``zinf_fn.layout.policy``) and the planner
        counts them (``planner.experts``)."""
        return self.axis == 0 and all(len(s) == 3 and s[0] == 1 for s in self.shapes)

    def numel(self, t: int) -> int:
        return int(torch.Size(self.shapes[t]).numel())

    def spec(self) -> FlatSpec:
        """One leaf at the weight's key path, shaped like the largest tile."""
        big = max(range(self.n_tiles), key=self.numel)
        leaf = LeafSpec(self.path, self.shapes[big], 0, self.numel(big))
        return FlatSpec(optree.tree_structure(torch.zeros(0)), (leaf,), leaf.numel)

    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.shapes[0])
        shape[self.axis] = sum(s[self.axis] for s in self.shapes)
        return tuple(shape)

    def describe(self) -> str:
        sizes = sorted({s[self.axis] for s in self.shapes}, reverse=True)
        over = "output features/rows" if self.axis == 0 else "input features/columns"
        if self.axis == 0 and len(self.shapes[0]) == 3 and sizes == [1]:
            # stacked experts (tiling.experts): fetched only where the routing chose them
            return (
                f"{self.group}: {self.kind.__name__} of {self.full_shape()}, {self.n_tiles} "
                "experts, each a tile fetched only where its tokens chose it"
            )
        return (
            f"{self.group}: {self.kind.__name__} of {self.full_shape()}, {self.n_tiles} tiles over "
            "dim "
            f"{self.axis} ({over}) of {'/'.join(map(str, sizes))}"
        )


class TileUnit(NamedTuple):
    """One tile as a unit of the store: ``group``/``row`` address it like any ``store.Unit``."""

    index: int  # scan position of the unit the tile belongs to
    group: str  # "blocks:mlp.fc.w"
    row: int  # layer * n_tiles + tile
    stage: str
    layer: int
    tile: int
    path: str

    @property
    def name(self) -> str:
        """The owning unit's name: the key-path prefix of the weight (decay masks, messages)."""
        return unit_name(self.stage, self.layer)

    @property
    def label(self) -> str:
        return f"{self.name} {self.path}[{self.tile}]"


class TileOp(NamedTuple):
    """One tile fetch of a step's plan; ``direction`` is the op's pass that asks for it."""

    unit: TileUnit
    direction: str  # "forward" | "backward"


# -- splitting trees
# ---------------------------------------------------------------------------------


def split_tiled(tree: Any) -> tuple[Any, list[tuple[str, int, Any]]]:
    """(rest tree with an anchor in place of every tiled node, [(key path, anchor index, node),
    ...])."""
    paths, leaves, treedef = optree.tree_flatten_with_path(tree, is_leaf=is_tiled)
    found = []
    for i, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
        if is_tiled(leaf):
            found.append((path_str(path), i, leaf))
            leaves[i] = torch.zeros(0)
    return optree.tree_unflatten(treedef, leaves), found


def _describe_node(node) -> tuple[type, tuple[tuple[int, ...], ...]]:
    return type(node), tuple(
        tuple(t.shape) if isinstance(t, (torch.Tensor, Deferred)) else type(t) for t in node.tiles
    )


def _check_node(node, where: str) -> None:
    axis = node.axis
    for t, tile in enumerate(node.tiles):
        shaped = isinstance(tile, (torch.Tensor, Deferred))
        if not shaped or not tile.is_floating_point() or tile.ndim <= axis:
            got = type(tile).__name__ if not shaped else f"{tile.dtype} {tuple(tile.shape)}"
            raise TypeError(
                f"{where}: tile {t} must be a floating tensor (or a tiling.Deferred) with a dim "
                f"{axis}, got {got}"
            )
        other = [s for d, s in enumerate(tile.shape) if d != axis]
        first = [s for d, s in enumerate(node.tiles[0].shape) if d != axis]
        if other != first:
            raise ValueError(
                f"{where}: tiles of a {type(node).__name__} must agree outside dim {axis}; tile 0 "
                "is "
                f"{tuple(node.tiles[0].shape)}, tile {t} is {tuple(tile.shape)}"
            )
    if not node.tiles:
        raise ValueError(f"{where}: a {type(node).__name__} needs at least one tile")


class TileLayout:
    """The tiled leaves of every stage of a model of ``n_layers`` layers, found in the first unit of
    each group at init."""

    def __init__(self, n_layers: int):
        self.leaves: dict[str, tuple[TiledLeaf, ...]] = {}  # tree order (optree sorts dict keys)
        # indices into leaves[stage], in apply's order
        self.use_order: dict[str, tuple[int, ...]] = {}
        # the leaves a backward's recompute runs
        self.recomputed: dict[str, frozenset[int]] = {}
        # the tile groups never written (``zinf_fn.formats.frozen``): their ops make no weight
        # gradient; marked by the layout step as it adds their groups
        self.frozen: set[str] = set()
        self.n_layers = n_layers

    def __bool__(self) -> bool:
        return any(self.leaves.values())

    def n_tiles(self) -> dict[str, int]:
        """Each tiled leaf's tile group -> its number of tiles."""
        return {leaf.group: leaf.n_tiles for leaves in self.leaves.values() for leaf in leaves}

    def register(self, stage: str, found: list, where: str) -> tuple[TiledLeaf, ...]:
        leaves = []
        for path, index, node in found:
            _check_node(node, f"{where}: tiled leaf {path!r}")
            kind, shapes = _describe_node(node)
            leaves.append(TiledLeaf(stage, path, kind, shapes, index))
        self.leaves[stage] = tuple(leaves)
        self.use_order[stage] = tuple(range(len(leaves)))  # until an apply shows its own order
        # until a backward shows what it recomputes
        self.recomputed[stage] = frozenset(range(len(leaves)))
        return self.leaves[stage]

    def in_use_order(self, stage: str) -> tuple[TiledLeaf, ...]:
        """The stage's tiled leaves in the order its ``apply`` asks for them (tree order until
        observed)."""
        return tuple(self.leaves[stage][i] for i in self.use_order.get(stage, ()))

    def observe_use(self, stage: str, used: list[int]) -> bool:
        """Record the order in which one ``apply`` of ``stage`` first fetched its leaves (indices
        into ``leaves[stage]``); leaves it did not use keep their place after those. True if the
        order changed."""
        order = tuple(dict.fromkeys([*used, *self.use_order[stage]]))
        changed, self.use_order[stage] = order != self.use_order[stage], order
        return changed

    def in_recompute(self, stage: str) -> tuple[TiledLeaf, ...]:
        """The leaves whose forward a backward unit of ``stage`` runs again before its backward, in
        use order: all of them until a backward was observed (a recorded graph recomputes only what
        its backward needs)."""
        ran = self.recomputed.get(stage, frozenset())
        return tuple(self.leaves[stage][i] for i in self.use_order.get(stage, ()) if i in ran)

    def observe_recompute(self, stage: str, ran: list[int]) -> bool:
        """Record which leaves (indices into ``leaves[stage]``) one backward unit's recompute ran;
        True if that changed."""
        before, self.recomputed[stage] = self.recomputed[stage], frozenset(ran)
        return before != self.recomputed[stage]

    def check(self, stage: str, found: list, where: str) -> None:
        """Every unit of a stage must tile the same leaves the same way as its first unit."""
        want = {leaf.path: (leaf.kind, leaf.shapes) for leaf in self.leaves.get(stage, ())}
        got = {path: _describe_node(node) for path, _, node in found}
        for path in sorted(set(want) | set(got)):
            if want.get(path) != got.get(path):

                def show(v):
                    return (
                        "untiled" if v is None else f"{v[0].__name__} with tile shapes {list(v[1])}"
                    )

                raise ValueError(
                    f"{where}: tiled leaf {path!r} differs from layer 0: expected "
                    f"{show(want.get(path))},"
                    f" got {show(got.get(path))}. Every unit of a stage must tile the "
                    "same way."
                )

    def rows(self, leaf: TiledLeaf) -> int:
        return leaf.n_tiles * stage_rows(leaf.stage, self.n_layers)

    def tile_unit(self, leaf: TiledLeaf, unit: Unit, t: int) -> TileUnit:
        layer = unit.row  # the layer of a block; 0 for the embedding and the head
        return TileUnit(
            unit.index, leaf.group, layer * leaf.n_tiles + t, leaf.stage, layer, t, leaf.path
        )

    def units(self, all_units: list[Unit]) -> list[TileUnit]:
        """Every tile unit of the model, in scan order of their owners."""
        return [
            self.tile_unit(leaf, u, t)
            for u in all_units
            for leaf in self.leaves.get(u.group, ())
            for t in range(leaf.n_tiles)
        ]


def tile_groups(
    leaves: tuple[TiledLeaf, ...], layout: TileLayout, sharding, all_units: list[Unit]
) -> list[tuple[str, int, FlatSpec]]:
    """The store group of each tiled leaf, (name, rows, spec), for the layout step to add.

    A tile is sharded like the unit it belongs to: in broadcast mode the owner of a layer owns every
    tile of it (``Sharding.add_rows``, called here); the layout step partitions each row
    (``zinf_fn.layout.build``).
    """
    out = []
    for leaf in leaves:
        tiles = [
            layout.tile_unit(leaf, u, t)
            for u in all_units
            if u.group == leaf.stage
            for t in range(leaf.n_tiles)
        ]
        sharding.add_rows(leaf.group, tiles)
        out.append((leaf.group, layout.rows(leaf), leaf.spec()))
    return out


def tile_shards(
    layout: TileLayout, unit: Unit, found: list, maker: Executor | None = None
) -> Iterator[tuple[TileUnit, torch.Tensor, FlatSpec]]:
    """(tile unit, tile padded to its group's leaf shape, spec) for every tile of one unit's tree,
    made as it is asked for: a ``Deferred`` tile is made just before it is yielded, and no tile is
    held by it once the next is asked for (a tile the caller still holds in ``found`` stays).
    ``maker``: the next ``MADE_AHEAD`` tiles of a leaf are made on its threads meanwhile (a random
    expert's ``torch.randn``, ~10 ns an element, beside the caller's encoding and writing of the
    tile before), at most that many held besides."""
    tiles = {path: list(node.tiles) for path, _, node in found}
    del found  # lean: the tiles below are the generator's only references to them
    for leaf in layout.leaves.get(unit.group, ()):
        spec = leaf.spec()
        where = f"{unit.name} init: tiled leaf {leaf.path!r}"
        pending = _Making(tiles.pop(leaf.path), spec, where)
        for t in range(leaf.n_tiles):
            # lean: no local holds the tile, so the caller's row is its only reference
            yield layout.tile_unit(leaf, unit, t), pending.take(t, maker), spec


MADE_AHEAD = 2  # tiles ``tile_shards`` makes ahead on its maker's threads


class _Making:
    """The tiles of one leaf, each made (where deferred) and padded to ``spec``'s leaf shape when
    taken, or ahead on a maker's threads; a tile is dropped once taken."""

    def __init__(self, pending: list, spec: FlatSpec, where: str):
        self.pending, self.spec, self.where = pending, spec, where
        self.ahead: dict[int, Future] = {}

    def take(self, t: int, maker: Executor | None) -> torch.Tensor:
        """Tile ``t``, padded; with ``maker``, tiles t + 1 .. t + ``MADE_AHEAD`` set making."""
        for k in range(t + 1, min(t + 1 + MADE_AHEAD, len(self.pending))):
            if maker is not None and k not in self.ahead and is_deferred(self.pending[k]):
                self.ahead[k] = maker.submit(_padded_, self.pending, k, self.spec, self.where)
        future = self.ahead.pop(t, None)
        if future is None:
            return _padded_(self.pending, t, self.spec, self.where)
        return future.result()


def _padded_(pending: list, t: int, spec: FlatSpec, where: str) -> torch.Tensor:
    """Tile ``t`` of ``pending`` (made where deferred) padded to ``spec``'s leaf shape; consumes
    ``pending[t]`` (set to None)."""
    tile = made(pending[t], f"{where} tile {t}")
    pending[t] = None
    padded = tile.reshape(-1)
    # a smaller tile of a non-divisible split: zeros behind it
    if tile.numel() < spec.numel:
        padded = torch.zeros(spec.numel, dtype=torch.float32)
        padded[: tile.numel()] = tile.reshape(-1)
    return padded.view(spec.leaves[0].shape)


def assemble(
    layout: TileLayout, unit: Unit, rest: Any, read_tile: Callable[[TileUnit], torch.Tensor]
) -> Any:
    """The full tree of a unit: the rest tree with each anchor replaced by its tiled node again.

    ``read_tile(tile_unit)`` returns the tile's row (a flat tensor); the tile is its front
    ``numel``.
    """
    leaves_of = layout.leaves.get(unit.group, ())
    if not leaves_of:
        return rest
    leaves, treedef = optree.tree_flatten(rest)
    for leaf in leaves_of:
        tiles = []
        for t in range(leaf.n_tiles):
            flat = read_tile(layout.tile_unit(leaf, unit, t))
            tiles.append(flat[: leaf.numel(t)].view(leaf.shapes[t]))
        leaves[leaf.anchor_index] = leaf.kind(tuple(tiles))
    return optree.tree_unflatten(treedef, leaves)
