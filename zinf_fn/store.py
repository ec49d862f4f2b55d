"""The layout of model states: layer groups, their flat specs and partitions, and the tier arrays.

Each unit (``zinf_fn.layout.units``: the embedding, the blocks, the head) belongs to a *group* that
shares
one flat spec and partition; its states are rows of the group's arrays in a tier::

    "<group>/param"    param_dtype   the 16-bit copy that is gathered for compute  (param tier)
    "<group>/master"   fp32          the optimizer's master copy                   (optimizer tier)
    "<group>/remainder" int16        instead of the master, with ``master="remainder"``: the
                                     master's low half; the bf16 param row is its high half
                                     (``optim.remainder``)
    "<group>/opt.<i>"  fp32          optimizer state leaf i (Adam m, v)            (optimizer tier)
                       bf16 / uint8  the same, compressed (``adamw(moments="bf16" | "int8")``,
                                     the groups the predicate accepts): bf16 values, or int8 codes
                                     of blocks of 256
    "<group>/opt.<i>.absmax" fp32    int8 moments only: one scale per block (shard_numel // 256 a
                                     row)
    "<group>/grad"     fp32          gradients, only for the two-pass clipping path (optimizer tier)

The rows of a group are ``kinds_of(group)``, each ``row_numel(kind, group)`` elements of
``dtype_of(kind, group)``: the one list and the one size every part that walks a unit's rows uses
(allocation, the update's pieces, read-ahead, write-behind, the demands and the NVMe traffic,
state_bytes, init, checkpoints). How a group's rows are read and written is its
``zinf_fn.layout.policy.GroupPolicy``, decided by the layout step and handed to ``add_group``
(``policy``): a group that holds only frozen leaves (``zinf_fn.formats.frozen``: a wholly frozen
stage, a frozen tiled leaf's tiles, a stage's "<stage>:frozen" group) is never written and has the
param row only (``frozen`` names them, ``kinds_of`` says so); a row decoded after its gather
(``Config.frozen_storage``) is a uint8 row of its codes (``dtype_of``).

Where a row lives is one answer, ``placement_of``: every state kind has a ``Split`` (its placement,
and the slower one its units from ``first_spilled`` on spill to, ``offload.spill``); the spill tier
routes rows by it, the updater streams a unit's update by it and the planner's memory model counts
bytes by it.

The store sits above the tiers (``offload``) and the partitioning (``partition``) it holds: it is
given its tiers, already wrapped by the sharding, and its groups' partitions."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .layout.policy import GroupPolicy
from .layout.units import Unit, key, unit_of_row
from .offload.protocol import Tier
from .offload.spill import Split, placement_of
from .partition.shards import Partition
from .tree import FlatSpec

# an "opt.<i>" row's
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
SCALES = ".absmax"  # the suffix of a kind's per-block scale row: int8 moments' "opt.<i>.absmax"


class Group(NamedTuple):
    name: str
    rows: int
    spec: FlatSpec
    part: Partition


class RowFormats(NamedTuple):
    """The formats of a store's rows, each a decision of ``Config`` or the optimizer (``lay_out``).

    ``param_dtype``: the 16-bit copy's. ``master``: "fp32" (a "master" row) or "remainder" (an int16
    "remainder" row; the param row is the master's high half). ``ties_away``: the 16-bit copy of an
    fp32 master is rounded ties away (``Config.resolved_param_rounding``), not by torch's cast.
    ``moments``: the format ("fp32", "bf16", "int8": ``optim.formats.MomentsFormat.kind``) of the
    optimizer leaves ("opt.<i>") of the groups ``compress(group name, row numel)`` accepts (fp32 in
    the others); int8 in blocks of ``block`` elements. ``n_opt_leaves``: the optimizer's leaves
    (an "opt.<i>" row each); ``grad_arrays``: the clipped path stashes each gradient in a "grad"
    row."""

    param_dtype: torch.dtype
    master: str = "fp32"
    ties_away: bool = False
    moments: str = "fp32"
    compress: Callable[[str, int], bool] | None = None
    block: int = 256
    n_opt_leaves: int = 0
    grad_arrays: bool = False


class Store:
    """Every array of the model states of this rank, and which tier holds it.

    Thirty methods, for a reason not yet undone: besides the arrays (``add_group``, ``policy``,
    ``placement_of``, ``tier_of``, ``state_bytes``) it answers every question about a group's rows
    (their kinds, sizes, dtypes and spans under its ``RowFormats``), which every part asks of the
    one store; those row questions are the next thing to split out, beside the formats they read."""

    def __init__(
        self,
        param_tier: Tier,
        opt_tier: Tier,
        splits: dict[str, Split],
        formats: RowFormats,
        share_master: Callable[[str, str], None] | None = None,
    ):
        """``splits``: the ``Split`` of "params" and of "optimizer" the tiers were built with;
        ``formats``: the rows' formats. ``share_master(param_key, master_key)``, where the tiers
        allow it (``offload.tiers.can_share``): makes a group's param array the master array itself,
        instead of allocating a second one."""
        self.param_tier = param_tier
        self.splits = splits
        self.opt_tier = opt_tier
        self.param_dtype = formats.param_dtype
        self._share_master = share_master
        self.master_kind = "remainder" if formats.master == "remainder" else "master"
        self.ties_away = formats.ties_away or formats.master == "remainder"
        self.moments = formats.moments
        self._compress = formats.compress
        self.block = formats.block
        self.compressed: set[str] = set()  # the groups whose optimizer leaves are ``moments``
        self.policies: dict[str, GroupPolicy] = {}  # how each group's rows are read and written
        self.frozen: set[str] = set()  # the groups never written (``GroupPolicy.written``)
        self.groups: dict[str, Group] = {}
        self.n_opt_leaves = formats.n_opt_leaves
        self.has_grad_arrays = formats.grad_arrays
        # Callables ``guard(unit)`` run before a step changes any row of ``unit``
        # (checkpoints.save_async snapshots rows it has not saved yet); empty outside an in-flight
        # save.
        self.write_guards: list = []

    def add_group(self, group: Group, policy: GroupPolicy) -> None:
        """Allocate the arrays of a group (called once per group at init), whose rows are read and
        written as ``policy`` says (``zinf_fn.layout.policy``, the layout step's decision)."""
        self.groups[group.name] = group
        self.policies[group.name] = policy
        if not policy.written:
            # its own param array, even where trained groups share the master's
            self.frozen.add(group.name)
            self.param_tier.allocate(
                key(group.name, "param"),
                group.rows,
                group.part.shard_numel,
                self.dtype_of("param", group.name),
            )
            return
        if self.compresses(group.name, group.spec.numel):
            self.compressed.add(group.name)
        # internal invariant: the layout partitioned the group with ``shard_align`` (int8 blocks
        # never straddle shards)
        assert group.part.shard_numel % self.shard_align(group.name, group.spec.numel) == 0, group
        for kind in self.opt_kinds(self.has_grad_arrays, group.name):
            self.opt_tier.allocate(
                key(group.name, kind),
                group.rows,
                self.row_numel(kind, group.name),
                self.dtype_of(kind, group.name),
            )
        if self._share_master is not None:
            self._share_master(key(group.name, "param"), key(group.name, "master"))
        else:
            self.param_tier.allocate(
                key(group.name, "param"),
                group.rows,
                self.row_numel("param", group.name),
                self.param_dtype,
            )

    def policy(self, group: str) -> GroupPolicy:
        """How ``group``'s rows are read and written (``zinf_fn.layout.policy``)."""
        return self.policies[group]

    def compresses(self, name: str, numel: int, written: bool | None = None) -> bool:
        """Whether the group ``name`` of ``numel``-element rows keeps compressed moments (the
        predicate's answer, asked once per group: ``layout.compress_rule``); a group never written
        (``written``, its policy's; None: the added group's) keeps no moments."""
        written = self.policies[name].written if written is None else written
        return self._compress is not None and written and bool(self._compress(name, numel))

    def shard_align(self, name: str, numel: int, written: bool | None = None) -> int:
        """The multiple of elements the group's shards must be (``partition.shards.partition``'s
        ``align``): the block (256) for int8 moments, so a block never straddles a shard, and with
        pieces on multiples of it (``optim.pieces``) never a piece either: every world size and
        piece size cuts the same blocks of the unit's padded row; 1 otherwise. ``written``: as
        ``compresses``."""
        return self.block if self.moments == "int8" and self.compresses(name, numel, written) else 1

    @property
    def casts_copies(self) -> bool:
        """Whether an update casts its master into a 16-bit copy of its own (``optim.paramcast``):
        not where the param row is the master row (fp32 params), nor with a remainder master, whose
        param row is its high half."""
        return not (self.param_is_master or self.remainder)

    @property
    def param_is_master(self) -> bool:
        """Whether each group's param array *is* its master array (fp32 params,
        ``offload.tiers.can_share``): an update then writes no separate param copy."""
        return self._share_master is not None

    def shares_master(self, group: str) -> bool:
        """Whether ``group``'s param row is its master row: ``param_is_master``, and the group
        trains (a frozen group has no master; its param row is its own)."""
        return self.param_is_master and group not in self.frozen

    def placement_of(self, kind: str, unit: Unit) -> str:
        """Where ``unit``'s row of ``kind`` ("param", "master", "opt.<i>", "grad") lives
        (``placement_of``)."""
        return placement_of(self.splits["params" if kind == "param" else "optimizer"], unit.index)

    def row_units(self, group: Group, n_layers: int) -> list[Unit]:
        """The unit of each row of ``group``, in row order (a tile row as a unit of its tile group,
        with the index of the unit it belongs to)."""
        return [
            Unit(unit_of_row(group.name, r, group.rows, n_layers), group.name, r)
            for r in range(group.rows)
        ]

    def opt_kinds(self, grad_arrays: bool | None = None, group: str | None = None) -> list[str]:
        """The optimizer tier's kinds of a row: the master, the optimizer's leaves, the stashed
        gradient where the clipped path keeps one (``grad_arrays`` False: without it, as an update
        reads them). With ``group``: that group's rows, each leaf followed by its scale row where it
        is int8 ("opt.0.absmax"); a frozen group (``frozen``) has none."""
        if group in self.frozen:
            return []
        grads = self.has_grad_arrays if grad_arrays is None else grad_arrays
        kinds = [
            self.master_kind,
            *(f"opt.{i}" for i in range(self.n_opt_leaves)),
            *(["grad"] if grads else []),
        ]
        return kinds if group is None else self.rows_of(kinds, group)

    def scaled(self, group: str) -> bool:
        """Whether ``group``'s optimizer leaves are int8 codes with a per-block scale row each."""
        return self.moments == "int8" and group in self.compressed

    def rows_of(self, kinds: list[str], group: str) -> list[str]:
        """``kinds`` as ``group`` stores them: each optimizer leaf "opt.<i>" followed by its scale
        row "opt.<i>.absmax" where the group's moments are int8 (``scaled``)."""
        scaled = self.scaled(group)
        return [row for k in kinds for row in leaf_rows(k, scaled)]

    @property
    def lent_kind(self) -> str:
        """The row a unit's update lends its backward fetch (``optim.passes.lends_master``): the
        fp32 master, whose cast is the 16-bit copy, or with a remainder master the param row itself
        (the master's high half *is* the copy, and the update reads it anyway)."""
        return "param" if self.remainder else "master"

    @property
    def remainder(self) -> bool:
        """Whether the master is stored as the param row plus an int16 remainder row
        (``master="remainder"``)."""
        return self.master_kind == "remainder"

    def update_kinds(self, group: str | None = None) -> list[str]:
        """The kinds an update reads and writes per piece: the optimizer tier's (``opt_kinds``
        without the stashed gradient), and with a remainder master the param row first (the master's
        high half); with ``group``: that group's rows (``rows_of``)."""
        return [*(["param"] if self.remainder else []), *self.opt_kinds(False, group)]

    def kinds_of(self, group: str, grad_arrays: bool | None = None) -> list[str]:
        """Every kind of ``group``'s rows over both tiers, in a fixed order: "param", then
        ``opt_kinds`` (the master or remainder, "opt.<i>", "grad" where kept). The one list of a
        group's rows that checkpoints, the planner and the tiers walk; a format that stores a kind
        in more than one row (int8 moments: codes "opt.<i>" plus per-block scales "opt.<i>.absmax")
        adds its rows here, and ``row_numel`` sizes them. A frozen group (``frozen``) has
        ``["param"]`` only."""
        return ["param", *self.opt_kinds(grad_arrays, group)]

    def row_numel(self, kind: str, group: str) -> int:
        """Elements of one of this rank's rows of ``kind`` in ``group`` (padding included): the
        shard size, or fewer for a kind that stores one element per block (int8 moments'
        "opt.<i>.absmax")."""
        shard = self.groups[group].part.shard_numel
        return shard // self.block if kind.endswith(SCALES) else shard

    def unit_numel(self, kind: str, group: str) -> int:
        """Elements of a whole unit's row of ``kind`` in ``group`` over every rank, padding cut: the
        group's ``numel``, or for a per-block kind the blocks that hold those elements."""
        numel = self.groups[group].spec.numel
        return -(-numel // self.block) if kind.endswith(SCALES) else numel

    def span(self, kind: str, lo: int, hi: int) -> tuple[int, int]:
        """The elements of a row of ``kind`` that hold elements ``[lo, hi)`` of the unit's shard (on
        block boundaries for a per-block kind): ``(lo, hi)``, or the blocks' ``(lo // 256, hi //
        256)``."""
        return (lo // self.block, hi // self.block) if kind.endswith(SCALES) else (lo, hi)

    @staticmethod
    def whole_row(kind: str) -> bool:
        """Whether a streamed update reads ``kind``'s row whole with a unit's first piece and writes
        it whole after its last (the per-block scales: a piece's are a few bytes, far below a disk
        block, ``optim.readahead``)."""
        return kind.endswith(SCALES)

    def row_nbytes(self, kind: str, group: str) -> int:
        """Bytes of one of this rank's rows of ``kind`` in ``group``: ``row_numel`` x ``dtype_of``'s
        itemsize."""
        return self.row_numel(kind, group) * self.dtype_of(kind, group).itemsize

    def dtype_of(self, kind: str, group: str | None = None) -> torch.dtype:
        """The dtype of ``kind``'s rows (of ``group``): ``param_dtype`` (uint8 for a row decoded
        after its gather), int16 for "remainder", the moments' dtype for the optimizer leaves of a
        compressed group (bf16, or int8's uint8 codes), else fp32 (int8's scale rows
        "opt.<i>.absmax" too)."""
        if kind == "param":
            if group is None:
                return self.param_dtype
            return self.policies[group].gathered_as(self.param_dtype)
        if _is_leaf(kind) and group in self.compressed:
            return MOMENT_DTYPES[self.moments]
        return torch.int16 if kind == "remainder" else torch.float32

    def flat_dtype(self, group: str, compute_dtype: torch.dtype) -> torch.dtype:
        """The dtype a unit's param row is gathered into for compute (``overlap.fetch``): the
        compute dtype, or a decoded row's own bytes (``GroupPolicy.gathered_as``; decoded after,
        ``codebook.decode_row_``)."""
        return self.policies[group].gathered_as(compute_dtype)

    def moments_of(self, group: str) -> str:
        """The format of ``group``'s optimizer leaves: ``moments`` where the group is compressed,
        else "fp32"."""
        return self.moments if group in self.compressed else "fp32"

    def before_update(self, unit: Unit) -> None:
        """Run the write guards: returns once nobody still needs ``unit``'s rows as they are now."""
        for guard in list(self.write_guards):
            guard(unit)

    def group_of(self, unit: Unit) -> Group:
        return self.groups[unit.group]

    def tier_of(self, kind: str) -> Tier:
        return self.param_tier if kind == "param" else self.opt_tier

    def wrap_tier_(self, kind: str, wrap: Callable[[Tier], Tier]) -> Tier:
        """The tier that holds ``kind`` (and every kind it shares) becomes ``wrap(tier)``; returns
        the wrapper. The one change of a store after construction, and a seam for tests and
        benchmarks only (``StateView.wrap_tier_``: a throttled link, an injected fault), between
        steps: the engine reaches its tiers through the store, so the next step reads and writes
        through the wrapper."""
        wrapped = wrap(self.tier_of(kind))
        if kind == "param":
            self.param_tier = wrapped
        else:
            self.opt_tier = wrapped
        return wrapped

    def state_bytes(self) -> int:
        """Bytes of this rank's model states over all tiers (a param array that is the master counts
        once)."""
        total = 0
        for g in self.groups.values():
            kinds = self.kinds_of(g.name)[1 if self.shares_master(g.name) else 0 :]
            total += g.rows * sum(self.row_nbytes(k, g.name) for k in kinds)
        return total


def leaf_rows(kind: str, scaled: bool) -> tuple[str, ...]:
    """The rows ``kind`` is stored in: an optimizer leaf "opt.<i>" of int8 moments (``scaled``) in
    its codes row and its scale row "opt.<i>.absmax" (``optim.compressed.encode_leaf``'s order), any
    other in its own."""
    return (kind, kind + SCALES) if scaled and _is_leaf(kind) else (kind,)


def _is_leaf(kind: str) -> bool:
    """Whether ``kind`` is an optimizer leaf's own row ("opt.<i>"), not its scale row."""
    return kind.startswith("opt.") and not kind.endswith(SCALES)
