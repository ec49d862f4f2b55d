"""The layout of model states: layer groups, their flat specs and partitions, and the tier arrays.

Each unit (``zinf_fn.layout.units``: the embedding, the blocks, the head) belongs to a *group* that
shares one flat spec and partition; its states are rows of the group's arrays in a tier::

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

What the rows of a group are (their kinds, dtypes and sizes) and how they are read and written (the
group's ``zinf_fn.layout.policy.GroupPolicy``, decided by the layout step and handed to
``add_group``) is the store's ``row_kinds`` (``zinf_fn.layout.kinds.RowKinds``), which every part
asks directly; the store holds the tiers, the groups and their partitions.

Where a row lives is one answer, ``placement_of``: every state kind has a ``Split`` (its placement,
and the slower one its units from ``first_spilled`` on spill to, ``offload.spill``); the spill tier
routes rows by it, the updater streams a unit's update by it and the planner's memory model counts
bytes by it.

The store sits above the tiers (``offload``) and the partitioning (``partition``) it holds: it is
given its tiers, already wrapped by the sharding, and its groups' partitions."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .layout.kinds import RowFormats, RowKinds
from .layout.policy import GroupPolicy
from .layout.units import Unit, key, unit_of_row
from .offload.protocol import Tier
from .offload.spill import Split, placement_of
from .partition.shards import Partition
from .tree import FlatSpec


class Group(NamedTuple):
    name: str
    rows: int
    spec: FlatSpec
    part: Partition


class Store:
    """Every array of the model states of this rank, and which tier holds it; what its rows are is
    its ``row_kinds`` (``zinf_fn.layout.kinds.RowKinds``)."""

    row_kinds: RowKinds  # what each group's rows are, asked directly by every part

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
        self._share_master = share_master
        self.row_kinds = RowKinds(formats, param_is_master=share_master is not None)
        self.groups: dict[str, Group] = {}
        # Callables ``guard(unit)`` run before a step changes any row of ``unit``
        # (checkpoints.save_async snapshots rows it has not saved yet); empty outside an in-flight
        # save.
        self.write_guards: list = []

    def add_group(self, group: Group, policy: GroupPolicy) -> None:
        """Allocate the arrays of a group (called once per group at init), whose rows are read and
        written as ``policy`` says (``zinf_fn.layout.policy``, the layout step's decision)."""
        self.groups[group.name] = group
        kinds = self.row_kinds
        kinds.add(policy, group.spec.numel, group.part.shard_numel)
        if not policy.written:
            # its own param array, even where trained groups share the master's
            self.param_tier.allocate(
                key(group.name, "param"),
                group.rows,
                group.part.shard_numel,
                kinds.dtype_of("param", group.name),
            )
            return
        # internal invariant: the layout partitioned the group with ``shard_align`` (int8 blocks
        # never straddle shards)
        assert group.part.shard_numel % kinds.shard_align(group.name, group.spec.numel) == 0, group
        for kind in kinds.opt_kinds(kinds.has_grad_arrays, group.name):
            self.opt_tier.allocate(
                key(group.name, kind),
                group.rows,
                kinds.row_numel(kind, group.name),
                kinds.dtype_of(kind, group.name),
            )
        if self._share_master is not None:
            self._share_master(key(group.name, "param"), key(group.name, "master"))
        else:
            self.param_tier.allocate(
                key(group.name, "param"),
                group.rows,
                kinds.row_numel("param", group.name),
                kinds.param_dtype,
            )

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
        rows = self.row_kinds
        for g in self.groups.values():
            kinds = rows.kinds_of(g.name)[1 if rows.shares_master(g.name) else 0 :]
            total += g.rows * sum(rows.row_nbytes(k, g.name) for k in kinds)
        return total
