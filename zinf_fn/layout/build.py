"""The layout step: model + optimizer + config -> the store, its groups and the tile layout; nothing
runs.

``lay_out`` is the pure part of ``zf.init``: it learns each group's flat layout from the first unit
of the group (one layer, never the model), partitions it and allocates every array of the model
states into the tiers it is given. ``zf.init`` gives it real tiers and wires a runtime around the
result (``zinf_fn.train``); a *layout build* (``layout``) gives it ``offload.tiers.MetaTier``s,
which record shapes only, so the planner's memory model (``zinf_fn.planner.memory``) sums exactly
what init would allocate. No Runtime, no threads, no collective here.

It decides, once per group, how the group's rows are read and written
(``zinf_fn.layout.policy.GroupPolicy``: ``_add_group``) and hands the record to the store with the
group; the engine's parts and the planner read it there (``RowKinds.policy``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from ..config import Config, spill_of
from ..formats import nf4_linear
from ..formats.codebook import Decode
from ..formats.frozen import FrozenLeaves, StageSplit
from ..model import Model, check_ties, check_trainable
from ..offload.spill import SpillTier, Split
from ..offload.tiers import MetaTier, can_share
from ..optim.formats import compressed_leaf
from ..optim.optimizers import Optimizer
from ..optim.passes import holds_layer, keeps_resident, lends_master
from ..optim.pieces import piece_numel
from ..overlap.tile_runs import tile_run, update_run
from ..partition.comm import current_comm
from ..partition.sharding import Sharding, make_sharding
from ..store import Group, Store
from ..tiling.layout import TileLayout, split_tiled, tile_groups
from ..tree import flat_spec
from .kinds import RowFormats
from .policy import FROZEN_ROWS, STAGE, TILE, Companion, GroupPolicy
from .units import BLOCKS, EMBED, HEAD, Unit, head_index, stage_rows, units


class Layout(NamedTuple):
    """What a layout step made: the store (groups, partitions, arrays in their tiers), the tile
    layout, the sharding, the model's layer count, the shapes of the first unit's tree of each group
    (by unit index; ``shapes_of``) and the frozen leaves (``zinf_fn.formats.frozen``)."""

    store: Store
    tiles: TileLayout
    sharding: Sharding
    n_layers: int
    trees: dict
    frozen: FrozenLeaves


def unit_generator(seed: int, unit: Unit) -> torch.Generator:
    """The generator a unit is initialised from: depends on the seed and unit only (not rank, not
    placement)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + unit.index)


def shapes_of(tree: Any) -> Any:
    """``tree`` with every tensor leaf a ``meta`` tensor of its shape and dtype (no memory), and
    deferred tiles (``tiling.Deferred``) as they are: all the layout step learns a group from."""
    return optree.tree_map(_on_meta, tree)


def _on_meta(leaf: Any) -> Any:
    return leaf.to("meta") if isinstance(leaf, torch.Tensor) else leaf


def init_unit(model: Model, unit: Unit, seed: int) -> Any:
    """The tree ``zf.init(model, seed=seed)`` initialises ``unit`` with (its stage's init, its
    generator)."""
    gen = unit_generator(seed, unit)
    if unit.group == EMBED:
        return model.embed.init(gen)
    if unit.group == HEAD:
        return model.head.init(gen)
    return model.block.init(gen, unit.row)


def check_model(model: Model, optimizer: Optimizer, config: Config) -> None:
    if not isinstance(model, Model):
        raise TypeError(f"zf.init expects a zf.Model, got {type(model).__name__}")
    if not isinstance(model.n_layers, int) or model.n_layers < 1:
        raise ValueError(f"zf.Model.n_layers must be an int >= 1, got {model.n_layers!r}")
    # honoured by zinf_fn.formats.frozen (frozen leaves stored as a param row only)
    check_trainable(model)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"zf.init expects an optimizer from zf.adamw / zf.sgd, got {type(optimizer).__name__}"
        )
    if not isinstance(config, Config):
        raise TypeError(f"zf.init expects a zf.Config, got {type(config).__name__}")


def compress_rule(optimizer: Optimizer) -> Callable[[str, int], bool] | None:
    """Which groups keep compressed moments: those whose whole flat row ``compressed_leaf(compress,
    group name, row numel)`` accepts (the predicate is asked once per group, its name as the key
    path: "embed", "blocks", "head", a tile group's name); None with fp32 moments."""
    if optimizer.moments.kind == "fp32":
        return None
    return lambda name, numel: compressed_leaf(optimizer.compress, name, numel)


def row_formats(optimizer: Optimizer, config: Config) -> RowFormats:
    """The formats of the store's rows: ``config``'s 16-bit dtype, master and rounding of the 16-bit
    copy, ``optimizer``'s moments (their kind, which groups keep them, their block) and leaves, and
    whether the clipped path stashes gradients."""
    ties_away = config.resolved_param_rounding() == "ties_away"
    moments = optimizer.moments
    compress = compress_rule(optimizer)
    # the leaf count (init is elementwise): no layer of zeros
    n_opt = len(optimizer.init(torch.zeros(1)))
    clipping = config.clip_grad_norm is not None
    return RowFormats(
        config.param_dtype,
        config.master,
        ties_away,
        moments.kind,
        compress,
        moments.block,
        n_opt_leaves=n_opt,
        grad_arrays=clipping,
    )


def placement_split(config: Config, kind: str) -> Split:
    """``config``'s ``Split`` of ``kind`` ("params" or "optimizer"): ``offload_<kind>`` and
    ``spill_<kind>``."""
    spill = spill_of(config, kind)  # (first spilled unit, its placement) or None
    placement = config.placement(kind)
    return Split(placement) if spill is None else Split(placement, spill[1], spill[0])


def lay_out(
    model: Model,
    optimizer: Optimizer,
    config: Config,
    sharding: Sharding,
    made: Callable[[str, str], Any],
    first_tree: Callable[[Unit], Any],
) -> Layout:
    """The store of ``config`` over the tiers ``made(placement, role)`` returns, each group's layout
    learnt from ``first_tree(unit)`` (the first unit of the group). Only the shapes of each tree are
    kept (``Layout.trees``): one unit's tree is in memory at a time, however large the units."""
    check_model(model, optimizer, config)
    splits = {kind: placement_split(config, kind) for kind in ("params", "optimizer")}

    def tier(kind: str, role: str):
        # its placement, and where its units from first_spilled on go: zinf_fn.offload.spill
        s = splits[kind]
        fast = made(s.fast, role)
        return sharding.wrap_tier(
            fast if s.slow is None else SpillTier(fast, made(s.slow, role), s, model.n_layers)
        )

    param_tier, opt_tier = tier("params", "params"), tier("optimizer", "optimizer")
    # an fp32 param copy beside its master
    shared = can_share(param_tier, opt_tier, config.param_dtype)
    frozen = FrozenLeaves(model, config.frozen_storage, config.param_dtype)
    store = Store(
        param_tier,
        opt_tier,
        splits,
        row_formats(optimizer, config),
        (lambda param, master: param_tier.share(param, opt_tier, master)) if shared else None,
    )
    layout_ = Layout(store, TileLayout(model.n_layers), sharding, model.n_layers, {}, frozen)
    firsts = {u.group: u for u in reversed(units(model.n_layers))}  # the first unit of each group
    rows = _Rows(
        config.clip_grad_norm is not None,
        config.prefetch_depth,
        piece_numel(config.optimizer_piece_bytes),
        tuple(t.embed for t in model.ties),
        config.resolved_compute_dtype(),
        config.resolved_device(),
        model.takes_lent,
    )
    for _, unit in sorted(firsts.items(), key=lambda kv: kv[1].index):
        # lean: the tree goes as soon as its shapes are taken (a vocabulary's embedding, 1 GB)
        layout_.trees[unit.index] = shapes_of(first_tree(unit))
        _add_stage(layout_, unit, rows)
    check_ties(model, layout_.trees[0], layout_.trees[head_index(model.n_layers)])
    return layout_


class _Rows(NamedTuple):
    """What the layout step's ``_add_group`` needs of the model and the config besides a group:
    whether the clipped path stashes gradients, the prefetch depth, the piece size (the per-row
    rules of ``optim.passes``), the embedding's tied leaves (the head's fetch brings them), the
    compute dtype (the tile runs of ``overlap.tile_runs``) and device (where a frozen expert's NF4
    codes are lent to its op: ``formats.nf4_linear.computes``), and the frozen leaves of the blocks
    whose codes the block's apply takes (``Model.takes_lent``)."""

    clipping: bool
    depth: int
    piece_numel: int
    tied: tuple[str, ...]
    compute: torch.dtype
    device: torch.device
    takes_lent: Callable[[str], bool] | None = None


def _add_stage(layout_: Layout, unit: Unit, rows: _Rows) -> None:
    """The groups of ``unit``'s stage (``unit`` its first): the stage's own, its frozen group where
    it keeps one (``zinf_fn.formats.frozen``) and one per tiled leaf (``zinf_fn.tiling.layout``),
    each with its arrays allocated."""
    sharding, n_layers, stage = layout_.sharding, layout_.n_layers, unit.group
    rest, tiled = split_tiled(layout_.trees[unit.index])  # tiled leaves become groups of their own
    leaves = layout_.tiles.register(stage, tiled, where=f"{unit.name} init")
    # marks the groups of frozen leaves only
    rest, frozen = layout_.frozen.split_stage_(unit, rest, leaves)
    # frozen tiles of matrices: codes, as the frozen group's
    layout_.frozen.codes.code_tiles_(leaves, layout_.frozen.param_only)
    spec = flat_spec(rest, where=f"{unit.name} init")
    stage_rows_ = stage_rows(stage, n_layers)
    policy = _stage_policy(layout_, stage, frozen, rows)
    _add_group(layout_, Group(stage, stage_rows_, spec, None), policy, rows)
    if frozen is not None:  # the stage's frozen leaves, a row per unit owned as its unit is
        sharding.add_rows(
            frozen.group,
            layout_.frozen.companions([u for u in units(n_layers) if u.group == stage]),
        )
        decode = layout_.frozen.codes.decode(frozen.group)
        lent = _lent_leaves(unit, decode, rows)
        policy = GroupPolicy(
            frozen.group, FROZEN_ROWS, written=False, decode=decode, lent_leaves=lent
        )
        _add_group(layout_, Group(frozen.group, stage_rows_, frozen.row_spec, None), policy, rows)
    for name, n_rows, tile_spec in tile_groups(leaves, layout_.tiles, sharding, units(n_layers)):
        written = not layout_.frozen.param_only(name)
        if not written:
            layout_.tiles.frozen.add(name)
        decode = layout_.frozen.codes.decode(name)
        lent_as = _lent_as(layout_, stage, written, decode, rows)
        policy = GroupPolicy(name, TILE, written=written, decode=decode, lent_as=lent_as)
        row_spec = layout_.frozen.codes.row_spec(name, tile_spec)
        _add_group(layout_, Group(name, n_rows, row_spec, None), policy, rows)


def _lent_leaves(unit: Unit, decode: Decode | None, rows: _Rows) -> tuple[int, ...]:
    """The leaves of the blocks' frozen row (``unit`` the first block) whose stored codes are lent
    to the op (``GroupPolicy.lent_leaves``, ``nf4_linear.lends_block_leaf``)."""
    if decode is None or unit.group != BLOCKS:
        return ()
    leaves = zip(decode.values.leaves, decode.codes, strict=True)
    return tuple(
        j
        for j, (leaf, code) in enumerate(leaves)
        if nf4_linear.lends_block_leaf(
            rows.takes_lent, f"{unit.name}.{leaf.path}", code, leaf.shape, rows.device, rows.compute
        )
    )


def _lent_as(
    layout_: Layout, stage: str, written: bool, decode: Decode | None, rows: _Rows
) -> torch.dtype | None:
    """The dtype a tile group's rows are lent to their op in as stored (``GroupPolicy.lent_as``):
    the 16-bit param dtype for a frozen tile of the head (the vocabulary's: a stage's tiled leaf is
    the op its stage runs, ``tiling.plan.backward_reads``) stored as values, not codes, on the CPU
    in fp32: ``tiling.linear_cross_entropy`` casts it a cache-sized chunk at a time, so no tile of
    the compute dtype is made. None elsewhere: the fetcher casts (a GPU's copy engine or a
    trained tile's backward want the compute dtype's tile)."""
    param = layout_.store.row_kinds.param_dtype
    on_cpu = rows.device.type == "cpu" and rows.compute == torch.float32
    frozen_16 = not written and decode is None and param.itemsize == 2
    return param if stage == HEAD and on_cpu and frozen_16 else None


def _runs(layout_: Layout, group: Group, policy: GroupPolicy, rows: _Rows) -> GroupPolicy:
    """``policy`` with a tile group's runs: its tiles fetched as one item (at most its leaf's) and
    its tiles' gradients sent as one update (``overlap.tile_runs``), whether it is a group of
    streamed experts (``tiling.layout.TiledLeaf.experts``), and where such a group's rows are NF4
    codes the op computes from as stored (``formats.nf4_linear.computes``), its codes lent to the
    op, never decoded (``lent_leaves``); any other group's as they are (1)."""
    if policy.unit != TILE:
        return policy
    n_tiles, padded = layout_.tiles.n_tiles()[group.name], group.part.padded_numel
    world = layout_.sharding.comm.world_size
    fetch_run = min(tile_run(padded, rows.compute, rows.depth), n_tiles)
    update = update_run(padded, rows.compute, rows.depth, n_tiles, world, rows.clipping)
    leaves = [leaf for stage in layout_.tiles.leaves.values() for leaf in stage]
    streamed = any(leaf.experts for leaf in leaves if leaf.group == group.name)
    fused = nf4_linear.computes(policy.decode, rows.device, rows.compute)
    lent = (0,) if streamed and fused else policy.lent_leaves
    return dataclasses.replace(
        policy, fetch_run=fetch_run, update_run=update, streamed=streamed, lent_leaves=lent
    )


def _stage_policy(
    layout_: Layout, stage: str, frozen: StageSplit | None, rows: _Rows
) -> GroupPolicy:
    """How a stage's own group is read: never written where every leaf of it is frozen, its frozen
    row fetched with each unit where it keeps one, the embedding's tied leaves brought along by the
    head."""
    companion = None if frozen is None else Companion(frozen.group, frozen.anchors)
    return GroupPolicy(
        stage,
        STAGE,
        written=not layout_.frozen.param_only(stage),
        decode=layout_.frozen.codes.decode(stage),
        companion=companion,
        tied=rows.tied if stage == HEAD else (),
    )


def _add_group(layout_: Layout, group: Group, policy: GroupPolicy, rows: _Rows) -> None:
    """Partition ``group`` (its ``part`` None so far), decide how each of its rows is read
    (``policy`` with the per-row rules of ``optim.passes`` answered: ``held``, ``lent``,
    ``resident``) and allocate its arrays."""
    store, spec = layout_.store, group.spec
    align = store.row_kinds.shard_align(
        group.name, spec.numel, policy.written
    )  # a frozen group's: 1
    group = group._replace(part=layout_.sharding.partition(spec.numel, align))
    row_units = store.row_units(group, layout_.n_layers)
    piece = rows.piece_numel
    held = [u.row for u in row_units if holds_layer(group, policy, u, piece)]
    lent = [
        u.row
        for u in row_units
        if lends_master(store, group, policy, u, rows.depth, piece, rows.clipping)
    ]
    resident = [u.row for u in row_units if keeps_resident(store, group, policy, u, piece)]
    policy = dataclasses.replace(
        policy, held=frozenset(held), lent=frozenset(lent), resident=frozenset(resident)
    )
    store.add_group(group, _runs(layout_, group, policy, rows))


def layout(
    model: Model,
    optimizer: Optimizer,
    config: Config,
    trees: dict | None = None,
    shapes_only: bool = False,
) -> Layout:
    """The layout ``zf.init`` would build for ``config``, its tiers ``MetaTier``s: shapes only,
    nothing allocated but the first unit of each group (initialised with seed 0 to learn its layout,
    and kept in ``trees`` by unit index for the next call; ``shapes_only``: only its shapes,
    ``shapes_of``, for a caller that never runs them)."""
    config = dataclasses.replace(config, offload_activations="none")
    trees = {} if trees is None else trees
    device = config.resolved_device()
    sharding = make_sharding(
        config.partition, current_comm(config.collective_timeout_s), model.n_layers
    )

    def made(placement: str, role: str) -> MetaTier:
        return MetaTier(placement, device if placement == "none" else torch.device("cpu"))

    def first_tree(unit: Unit) -> Any:
        if unit.index not in trees:
            tree = init_unit(model, unit, 0)
            trees[unit.index] = shapes_of(tree) if shapes_only else tree
        return trees[unit.index]

    return lay_out(model, optimizer, config, sharding, made, first_tree)
