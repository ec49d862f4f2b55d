"""What each group's rows are: their kinds, dtypes and sizes under the configured formats.

The rows of a group are ``kinds_of(group)``, each ``row_numel(kind, group)`` elements of
``dtype_of(kind, group)``: the one list and the one size every part that walks a unit's rows uses
(allocation, the update's pieces, read-ahead, write-behind, the demands and the NVMe traffic,
state_bytes, init, checkpoints). They are pure functions of each group's read policy
(``zinf_fn.layout.policy.GroupPolicy``), its sizes and the formats the config and the optimizer
chose (``RowFormats``); the store holds one ``RowKinds`` (``Store.row_kinds``) and every part asks
it directly. A group that holds only frozen leaves (``zinf_fn.formats.frozen``) is never written
and has the param row only (``frozen`` names them, ``kinds_of`` says so); a row decoded after its
gather (``Config.frozen_storage``) is a uint8 row of its codes (``dtype_of``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .policy import GroupPolicy

# an "opt.<i>" row's
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
SCALES = ".absmax"  # the suffix of a kind's per-block scale row: int8 moments' "opt.<i>.absmax"


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


class RowKinds:
    """The kinds, dtypes and sizes of every group's rows under ``RowFormats``, and how each group's
    rows are read and written (its ``GroupPolicy``).

    Its attributes are set once, in the constructor; its tables of groups are filled by the layout
    step, a group at a time as the store allocates it (``add``), and only read after."""

    param_dtype: torch.dtype  # the 16-bit copy's
    master_kind: str  # "master", or "remainder"
    remainder: bool  # the master is the param row plus an int16 "remainder" row
    ties_away: bool  # the 16-bit copy is rounded ties away (always with a remainder master)
    moments: str  # the compressed groups' optimizer leaves' format: "fp32", "bf16", "int8"
    block: int  # int8 moments' block
    n_opt_leaves: int  # the optimizer's leaves, an "opt.<i>" row each
    has_grad_arrays: bool  # the clipped path stashes each gradient in a "grad" row
    # each trained group's param array *is* its master array (fp32 params,
    # ``offload.tiers.can_share``): an update then writes no separate param copy
    param_is_master: bool
    # an update casts its master into a 16-bit copy of its own (``optim.paramcast``): not where the
    # param row is the master row (fp32 params), nor with a remainder master, whose param row is its
    # high half
    casts_copies: bool
    # the row a unit's update lends its backward fetch (``optim.passes.lends_master``): the fp32
    # master, whose cast is the 16-bit copy, or with a remainder master the param row itself (the
    # master's high half *is* the copy, and the update reads it anyway)
    lent_kind: str

    def __init__(self, formats: RowFormats, param_is_master: bool):
        """``formats``: the rows' formats; ``param_is_master``: each trained group's param array is
        its master array."""
        self.param_dtype = formats.param_dtype
        self.master_kind = "remainder" if formats.master == "remainder" else "master"
        self.remainder = self.master_kind == "remainder"
        self.ties_away = formats.ties_away or self.remainder
        self.moments = formats.moments
        self._compress = formats.compress
        self.block = formats.block
        self.n_opt_leaves = formats.n_opt_leaves
        self.has_grad_arrays = formats.grad_arrays
        self.param_is_master = param_is_master
        self.casts_copies = not (param_is_master or self.remainder)
        self.lent_kind = "param" if self.remainder else "master"
        self.policies: dict[str, GroupPolicy] = {}  # how each group's rows are read and written
        self.compressed: set[str] = set()  # the groups whose optimizer leaves are ``moments``
        self.frozen: set[str] = set()  # the groups never written (``GroupPolicy.written``)
        self._sizes: dict[str, tuple[int, int]] = {}  # group -> (numel, shard_numel)

    def add(self, policy: GroupPolicy, numel: int, shard_numel: int) -> None:
        """Record the group ``policy.group`` of ``numel``-element rows, ``shard_numel`` of them
        this rank's, read and written as ``policy`` says (``Store.add_group``, once per group)."""
        name = policy.group
        self.policies[name] = policy
        self._sizes[name] = (numel, shard_numel)
        if not policy.written:
            self.frozen.add(name)
        elif _compresses(self._compress, name, numel, True):
            self.compressed.add(name)

    def policy(self, group: str) -> GroupPolicy:
        """How ``group``'s rows are read and written (``zinf_fn.layout.policy``)."""
        return self.policies[group]

    def shard_align(self, name: str, numel: int, written: bool | None = None) -> int:
        """The multiple of elements the group's shards must be (``partition.shards.partition``'s
        ``align``): the block (256) for int8 moments, so a block never straddles a shard, and with
        pieces on multiples of it (``optim.pieces``) never a piece either: every world size and
        piece size cuts the same blocks of the unit's padded row; 1 otherwise. ``written``: whether
        the group is ever written (its policy's; None: the added group's)."""
        written = self.policies[name].written if written is None else written
        if self.moments == "int8" and _compresses(self._compress, name, numel, written):
            return self.block
        return 1

    def shares_master(self, group: str) -> bool:
        """Whether ``group``'s param row is its master row: ``param_is_master``, and the group
        trains (a frozen group has no master; its param row is its own)."""
        return self.param_is_master and group not in self.frozen

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

    def rows_of(self, kinds: list[str], group: str) -> list[str]:
        """``kinds`` as ``group`` stores them: each optimizer leaf "opt.<i>" followed by its scale
        row "opt.<i>.absmax" where the group's moments are int8 codes with a per-block scale row
        each."""
        scaled = self.moments_of(group) == "int8"
        return [row for k in kinds for row in leaf_rows(k, scaled)]

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
        shard = self._sizes[group][1]
        return shard // self.block if kind.endswith(SCALES) else shard

    def unit_numel(self, kind: str, group: str) -> int:
        """Elements of a whole unit's row of ``kind`` in ``group`` over every rank, padding cut: the
        group's ``numel``, or for a per-block kind the blocks that hold those elements."""
        numel = self._sizes[group][0]
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

    def moments_of(self, group: str) -> str:
        """The format of ``group``'s optimizer leaves: ``moments`` where the group is compressed,
        else "fp32"."""
        return self.moments if group in self.compressed else "fp32"


def _compresses(
    compress: Callable[[str, int], bool] | None, name: str, numel: int, written: bool
) -> bool:
    """Whether the group ``name`` of ``numel``-element rows keeps compressed moments (the
    predicate ``compress``'s answer, asked once per group: ``layout.compress_rule``); a group never
    ``written`` keeps no moments."""
    return compress is not None and written and bool(compress(name, numel))


def leaf_rows(kind: str, scaled: bool) -> tuple[str, ...]:
    """The rows ``kind`` is stored in: an optimizer leaf "opt.<i>" of int8 moments (``scaled``) in
    its codes row and its scale row "opt.<i>.absmax" (``optim.compressed.encode_leaf``'s order), any
    other in its own."""
    return (kind, kind + SCALES) if scaled and _is_leaf(kind) else (kind,)


def _is_leaf(kind: str) -> bool:
    """Whether ``kind`` is an optimizer leaf's own row ("opt.<i>"), not its scale row."""
    return kind.startswith("opt.") and not kind.endswith(SCALES)
