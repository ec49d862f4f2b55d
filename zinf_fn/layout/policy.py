"""How a group's rows are read and written: a record per group, decided once by the layout step.

The layout step (``zinf_fn.layout.build``, what ``zf.init`` and the planner's layout builds run)
decides for each group, before its arrays are allocated, what its rows are and how every part treats
them, and hands the record to the store (``Store.add_group``, ``RowKinds.policy``). The fetcher, the
updater,
the read-ahead, each part's ``demand`` and the planner read it instead of testing flags::

    unit        what a row is: a stage's unit ("stage"), a stage's frozen leaves fetched with its
                unit ("frozen", ``zinf_fn.formats.frozen``), a tile of a tiled leaf ("tile",
                ``tiling``)
    written     False: frozen, a param row only, written at init and never after (no master)
    decode      the stored format the param row is decoded from after its gather
                (``codebook.Decode``: int8 / NF4 codes, ``Config.frozen_storage``); None: cast
    lent_leaves the leaves of a ``decode`` row whose stored codes are lent to the op, which
                computes from them (a frozen NF4 expert's fused linear, a frozen linear of a block
                whose model ``takes_lent`` it: ``formats.nf4_linear``); the fetcher decodes the
                others into a buffer of the compute dtype (``decoded``). ``codes``: LENT where
                some are, else DECODED
    lent_as     the dtype a row no ``decode`` names is lent to its op in, as stored, in place of
                a cast to the compute dtype: a frozen 16-bit tile of the vocabulary head, whose op
                casts it a cache-sized chunk at a time (``tiling.cross_entropy``); None: cast
    companion   the frozen group each unit's row is fetched with, and where its leaves go back
    tied        the embedding's leaves the head's fetch brings along (``zf.Model.ties``)
    held        rows whose layer the fetcher keeps once fetched (``optim.passes.holds_layer``)
    lent        rows whose update lends its master to the backward fetch (``passes.lends_master``)
    resident    rows whose 16-bit row on NVMe stays in memory (``passes.keeps_resident``)
    fetch_run   a tile group's tiles fetched as one item (``overlap.tile_runs.tile_run``)
    streamed    a tile group of streamed experts (``tiling.layout.TiledLeaf.experts``): its runs,
                small against their read, widen the tile window (``overlap.tile_runs.window_runs``)
    update_run  a tile group's tiles whose gradients are one update (``tile_runs.update_run``)

A new storage format is a new ``Decode`` (its decoder beside it, ``codebook.decode_row_``); a new
kind of unit (a mixture of experts' expert units, cut from a block's stacked leaves as tiles are cut
from a leaf) is a new ``unit``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..formats.codebook import Decode
from ..formats.frozen import FrozenUnit
from ..formats.nf4_linear import LentLeaves
from ..tree import FlatSpec, LeafSpec
from .units import BLOCKS, Unit

STAGE, FROZEN_ROWS, TILE = "stage", "frozen", "tile"  # the kinds of unit a group's rows are
DECODED, LENT = "decoded", "lent"  # where a coded row's values are made (``GroupPolicy.codes``)


class Companion(NamedTuple):
    """The frozen group whose row of a unit is fetched with the unit's own, and the indices of the
    leaves of the unit's tree (its group's anchors) the frozen leaves go back to
    (``frozen.assemble_frozen``)."""

    group: str
    anchors: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class GroupPolicy:
    """How the rows of one group are read and written (the module docstring lists the fields)."""

    group: str
    unit: str = STAGE
    written: bool = True
    decode: Decode | None = None
    lent_leaves: tuple[int, ...] = ()
    lent_as: torch.dtype | None = None
    companion: Companion | None = None
    tied: tuple[str, ...] = ()
    held: frozenset[int] = frozenset()
    lent: frozenset[int] = frozenset()
    resident: frozenset[int] = frozenset()
    fetch_run: int = 1
    update_run: int = 1
    streamed: bool = False

    def holds(self, unit: Unit) -> bool:
        """Whether the fetcher keeps ``unit``'s layer (a row of this group) once fetched."""
        return unit.row in self.held

    def lends(self, unit: Unit) -> bool:
        """Whether ``unit``'s update lends its master row to its backward fetch."""
        return unit.row in self.lent

    def keeps(self, unit: Unit) -> bool:
        """Whether ``unit``'s 16-bit row stays in memory, written through (``offload.resident``)."""
        return unit.row in self.resident

    def reads_early(self, unit: Unit) -> bool:
        """Whether ``unit``'s row may be read for the next step as this one's backward ends: a row
        never written after init whose layer is not held (``Fetcher.read_early``)."""
        return not self.written and not self.holds(unit)

    def gathered_as(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The dtype a row is gathered into for compute: ``compute_dtype``, a decoded row's own
        bytes (uint8, which no cast may touch), or the stored dtype it is lent in (``lent_as``)."""
        if self.decode is not None:
            return torch.uint8
        return compute_dtype if self.lent_as is None else self.lent_as

    @property
    def codes(self) -> str:
        """LENT where the codes of some of its leaves are lent to the op (``lent_leaves``), else
        DECODED."""
        return LENT if self.lent_leaves else DECODED

    @functools.cached_property
    def decoded(self) -> Decode | None:
        """How the fetcher decodes a row it gathered into a buffer of the compute dtype
        (``Fetcher._decoded``): ``decode``, or where some leaves are lent (``lent_leaves``) the
        others only, back to back (``Decode.values`` of those leaves; ``lent_tree`` puts the whole
        tree together); None: the layer is the gathered row (cast, or its one leaf's codes
        lent)."""
        if self.decode is None or not self.lent_leaves:
            return self.decode
        if len(self.lent_leaves) == len(self.decode.codes):
            return None
        return _without(self.decode, self.lent_leaves)

    @property
    def codes_lent(self) -> Decode | None:
        """How the codes of a row lent to its op are read (``formats.nf4_linear.lent``); None: the
        op sees values."""
        return self.decode if self.lent_leaves else None

    def lent_tree(self, row: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        """The leaves of a row some of whose leaves are lent (``lent_leaves``), in tree order: a
        lent leaf's stored bytes (a uint8 view of the gathered ``row``), any other its values in
        ``values`` (the buffer ``decoded`` filled), shaped."""
        decode, values_spec = self.decode, self.decoded.values
        others = iter(values_spec.leaves)
        leaves = []
        for j, stored in enumerate(decode.stored.leaves):
            if j in self.lent_leaves:
                leaves.append(row[stored.offset : stored.offset + stored.numel])
                continue
            leaf = next(others)
            leaves.append(values[leaf.offset : leaf.offset + leaf.numel].view(leaf.shape))
        return leaves

    def companion_of(self, unit: Unit) -> FrozenUnit | None:
        """``unit``'s row in its stage's frozen group, fetched with it; None where there is none."""
        if self.companion is None:
            return None
        return FrozenUnit(unit.index, self.companion.group, unit.row, unit.group)

    @property
    def plain(self) -> bool:
        """Whether its rows are read as a plain row of its kind: read, cast, written by their
        update, nothing held, lent, kept, decoded or fetched along (its tile runs show in the fetch
        plan)."""
        return (
            self.written
            and self.decode is None
            and self.lent_as is None
            and self.companion is None
            and not self.tied
            and not (self.held or self.lent or self.resident)
        )

    def describe(self) -> str:
        """One line: "blocks:frozen: frozen rows, never written, decoded from nf4, held rows 0"
        (fields that differ from a plain trained stage's only)."""
        parts = [self.unit if self.unit == STAGE else f"{self.unit} rows"]
        parts += [] if self.written else ["never written"]
        parts += [] if self.decoded is None else [f"decoded from {self.decoded.storage}"]
        parts += _lent_words(self)
        stored = self.lent_as
        parts += [] if stored is None else [f"lent to the op as stored ({_name(stored)})"]
        parts += [] if self.companion is None else [f"fetched with {self.companion.group}"]
        parts += [] if not self.tied else [f"brings the embedding's {', '.join(self.tied)} along"]
        named = (("held", self.held), ("lent", self.lent), ("kept resident", self.resident))
        for name, rows in named:
            parts += [f"{name} rows {', '.join(map(str, sorted(rows)))}"] if rows else []
        return f"{self.group}: " + ", ".join(parts)


def lent_leaves(policy: Callable[[str], GroupPolicy]) -> LentLeaves | None:
    """The leaves of a block's tree the fetcher hands as their stored NF4 bytes: those of the
    blocks' frozen row its policy lends (``GroupPolicy.lent_leaves``), at their places in the
    block's tree (its companion's anchors); None where there are none. ``policy``: a group's
    policy (``RowKinds.policy``)."""
    companion = policy(BLOCKS).companion
    if companion is None:
        return None
    frozen = policy(companion.group)
    if not frozen.lent_leaves:
        return None
    values = frozen.decode.values.leaves
    leaves = tuple((companion.anchors[j], values[j].shape) for j in frozen.lent_leaves)
    return LentLeaves(leaves, frozen.decode.dtype)


def _lent_words(policy: GroupPolicy) -> list[str]:
    """``describe``'s words for the codes ``policy`` lends to the op: "its nf4 codes lent to the op"
    (a row of one leaf), "the nf4 codes of attn.q.w, attn.o.w lent to the op"; none where none."""
    lent = policy.codes_lent
    if lent is None:
        return []
    if len(lent.codes) == 1:
        return [f"its {lent.storage} codes lent to the op"]
    paths = ", ".join(lent.values.leaves[j].path for j in policy.lent_leaves)
    return [f"the {lent.storage} codes of {paths} lent to the op"]


def _without(decode: Decode, lent: tuple[int, ...]) -> Decode:
    """``decode`` of the leaves not in ``lent`` only: their values back to back, read from their
    places in the row (``Decode.stored``'s offsets)."""
    keep = [j for j in range(len(decode.codes)) if j not in lent]
    leaves, offset = [], 0
    for j in keep:
        leaf = decode.values.leaves[j]
        leaves.append(LeafSpec(leaf.path, leaf.shape, offset, leaf.numel))
        offset += leaf.numel
    values = FlatSpec(None, tuple(leaves), offset)
    stored = FlatSpec(None, tuple(decode.stored.leaves[j] for j in keep), decode.stored.numel)
    codes = tuple(decode.codes[j] for j in keep)
    return decode._replace(values=values, stored=stored, codes=codes)


def _name(dtype: torch.dtype) -> str:
    """A dtype's name: "bfloat16" for ``torch.bfloat16``."""
    return str(dtype).removeprefix("torch.")


def describe(policies: dict[str, GroupPolicy]) -> str:
    """The read policy of every group read otherwise than a plain row of its kind (read, cast,
    written by its update), one line each under "read policy:", for ``zf.plan``; "" where every
    group is plain."""
    lines = [f"  {p.describe()}" for p in policies.values() if not p.plain]
    return "\n".join(["read policy:", *lines]) if lines else ""
