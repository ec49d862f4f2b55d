"""Frozen leaves (``zf.Model.trainable``): stored as a 16-bit param row only, read for compute,
never written.

A frozen leaf has no master, no optimizer state and no gradient. Where it is stored depends on its
stage:

- a stage whose every leaf is frozen (LoRA's embedding and head) keeps its group, which has only a
  "param" row (``Store.kinds_of`` gives ``["param"]``); so does the tile group of a frozen tiled
  leaf;
- the frozen leaves of a stage that also has trainable leaves (LoRA: every block) go into a group of
  their own, ``"<stage>:frozen"`` (``frozen_group``), with only a "param" row, one row per unit of
  the stage. In the stage's group each is replaced by an *anchor*, a zero-size fp32 leaf at its key
  path (as a tiled leaf's is, ``tiling.layout``), so the trainable remainder is a smaller group with
  the usual rows. The fetcher reads a unit's frozen row with its own row and puts the frozen leaves
  back into the unit's tree (``assemble``), so ``apply`` sees the whole tree.

Every group that holds only frozen leaves (``param_only``) is written once, at init, and never
after: its units are *whole* (``whole``): no gradient buffer, no reduce-scatter, no norm part, no
update, no read-ahead. The pull-back gives frozen leaves ``requires_grad=False`` (``of``), so
autograd computes only the carry's and the trainable leaves' gradients (no dW of a frozen linear),
and the embedding is not fetched again in backward where nothing of it trains (``embed_trains``).
Training equals plain PyTorch with ``requires_grad=False`` on the frozen leaves; any optimizer may
run, since no frozen leaf is in a row it updates. A remainder master
(``Config(master="remainder")``) keeps no remainder row of a frozen group: its master is the bf16
copy.

Full key paths (``"blocks.3.attn.q.w"``) are asked of the predicate for every unit; the blocks share
one layout, so every block must give the same answer for a leaf (``split_`` raises otherwise). A
tied leaf (``zf.Tie``) takes the embedding path's answer.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, NamedTuple

import optree
import torch

from ..layout.units import BLOCKS, EMBED, HEAD, Unit, unit_name, units
from ..model import Model, is_trainable
from ..tree import FlatSpec, LeafSpec
from .codebook import FROZEN_BLOCK, QUANTIZED, Decode, decode_row_, encode_leaf, leaf_nbytes

FROZEN = "frozen"  # the suffix of a stage's frozen group: "blocks:frozen"


def frozen_group(stage: str) -> str:
    """The group of ``stage``'s frozen leaves where the stage also has trainable ones:
    "blocks:frozen"."""
    return f"{stage}:{FROZEN}"


def is_frozen_group(group: str) -> bool:
    """Whether ``group`` is a stage's frozen group ("blocks:frozen", ``frozen_group``)."""
    return group.endswith(f":{FROZEN}")


class FrozenUnit(NamedTuple):
    """A unit's row in its stage's frozen group: ``group``/``row`` address it like any
    ``store.Unit``."""

    index: int  # scan position of the unit it belongs to
    group: str  # "blocks:frozen"
    row: int  # the unit's row (its layer for a block)
    stage: str

    @property
    def name(self) -> str:
        """The owning unit's name ("blocks.3"): the key-path prefix of its leaves."""
        return unit_name(self.stage, self.row)


class StageSplit(NamedTuple):
    """The frozen leaves of a stage that also has trainable ones: their indices among the leaves of
    the stage's tree (tiled nodes as anchors), where the stage's group holds anchors, and the frozen
    group's spec (one leaf per frozen leaf, at its key path in the stage's tree, in tree order)."""

    stage: str
    anchors: tuple[int, ...]
    spec: FlatSpec
    # quantized storage: the byte row's layout (uint8 leaves); None: ``spec``
    stored: FlatSpec | None = None
    # per leaf of ``stored``: "nf4" / "int8", or "" (its 16-bit values' bytes)
    codes: tuple[str, ...] = ()

    @property
    def group(self) -> str:
        return frozen_group(self.stage)

    @property
    def row_spec(self) -> FlatSpec:
        """The layout of the frozen group's row: ``stored`` (bytes) where it is quantized, else
        ``spec``."""
        return self.spec if self.stored is None else self.stored


class Coded(NamedTuple):
    """A param row stored as codes: its leaves (real shapes, ``spec``), the byte layout of the row
    (``stored``, uint8 leaves) and each leaf's code ("nf4" / "int8", or "": its 16-bit values'
    bytes)."""

    spec: FlatSpec
    stored: FlatSpec
    codes: tuple[str, ...]


def quantized_layout(
    spec: FlatSpec, storage: str, itemsize: int, stage: str
) -> tuple[FlatSpec, tuple[str, ...]]:
    """(the byte layout of a frozen group's row, each leaf's code) where ``storage`` quantizes its
    2-D leaves (and stacked 3-D ones: a block's experts): each leaf at a 4-byte aligned offset (its
    fp32 scales, or its 16-bit values, are viewed in place)."""
    leaves, codes, offset = [], [], 0
    for leaf in spec.leaves:
        code = storage if len(leaf.shape) >= 2 else ""   # a matrix, or a stack of them (experts)
        if code and leaf.numel % FROZEN_BLOCK:
            raise ValueError(
                f"Config.frozen_storage={storage!r}: frozen weight {stage}.{leaf.path} of shape "
                f"{leaf.shape} has {leaf.numel} elements, not a multiple of the block "
                f"of {FROZEN_BLOCK}; "
                "pass frozen_storage='bf16', or give the weight a size that 64 "
                "divides"
            )
        nbytes = leaf_nbytes(code, leaf.numel) if code else leaf.numel * itemsize
        leaves.append(LeafSpec(leaf.path, (nbytes,), offset, nbytes))
        codes.append(code)
        offset += -(-nbytes // 4) * 4
    return FlatSpec(spec.treedef, tuple(leaves), offset), tuple(codes)


def split_frozen(tree: Any, anchors: tuple[int, ...]) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """(``tree`` with a zero-size fp32 anchor at each of the leaf indices ``anchors``, the leaves
    taken out)."""
    leaves, treedef = optree.tree_flatten(tree)
    taken = tuple(leaves[j] for j in anchors)
    for j in anchors:
        leaves[j] = torch.zeros(0)
    return optree.tree_unflatten(treedef, leaves), taken


def assemble_frozen(rest: Any, frozen: tuple, anchors: tuple[int, ...]) -> Any:
    """The whole tree: ``rest`` (anchors in place of the frozen leaves) with ``frozen`` at the
    ``anchors``."""
    leaves, treedef = optree.tree_flatten(rest)
    for j, leaf in zip(anchors, frozen, strict=True):
        leaves[j] = leaf
    return optree.tree_unflatten(treedef, leaves)


class FrozenLeaves:
    """Which groups hold only frozen leaves, which stages keep a frozen group, and which leaves of
    each unit take no gradient; filled by the layout step (``split_``, once per stage, before its
    groups exist).

    Twenty-four methods, for a reason not yet undone: it answers every question about frozen leaves
    (which groups, which leaves train, a unit's companion row, and a quantized row's codes: its
    spec, encode, decode), which the layout step, the fetcher, the runtime and checkpoints ask; the
    codes' questions are the next to split out, beside ``formats.codebook``."""

    def __init__(
        self, model: Model, storage: str = "bf16", param_dtype: torch.dtype = torch.bfloat16
    ):
        """``storage``: ``Config.frozen_storage`` ("bf16", or "int8" / "nf4": a frozen group's 2-D
        and 3-D leaves as codes); ``param_dtype``: the 16-bit dtype its other leaves are stored in
        and its values are rounded to."""
        self.model, self.storage, self.param_dtype = model, storage, param_dtype
        # stage -> its frozen group (stages with both kinds of leaves)
        self.splits: dict[str, StageSplit] = {}
        self._param_only: set[str] = set()  # groups stored as a param row only
        # stage -> its spec's leaves that take no gradient
        self._no_grad: dict[str, tuple[int, ...]] = {}
        # stage -> (frozen, all) leaves (tiled ones included)
        self._counts: dict[str, tuple[int, int]] = {}
        # group -> how its param row is stored as codes (a frozen group's, a frozen tile group's)
        self._coded: dict[str, Coded] = {}
        self._stage_trains: dict[str, bool] = {}

    def split_(self, unit: Unit, rest: Any, tiled: tuple) -> tuple[Any, StageSplit | None]:
        """The stage of ``unit`` (its first unit) laid out: (its group's tree, anchors in place of
        frozen leaves where the stage keeps a frozen group; that group's split or None). ``rest`` is
        the unit's tree with its tiled nodes as anchors, ``tiled`` the stage's ``TiledLeaf`` s.
        Marks the param-only groups."""
        paths, leaves, _ = optree.tree_flatten_with_path(rest)
        names = [".".join(map(str, p)) for p in paths]
        frozen = tuple(j for j, path in enumerate(names) if not self._trains(unit.group, path))
        anchors = {leaf.anchor_index for leaf in tiled}
        real = [j for j in range(len(leaves)) if j not in anchors]
        stored = tuple(j for j in frozen if j not in anchors)
        self._no_grad[unit.group] = frozen + self._tied_no_grad(unit, len(leaves))
        self._counts[unit.group] = (len(frozen), len(leaves))
        self._param_only.update(leaf.group for leaf in tiled if leaf.anchor_index in frozen)
        self._stage_trains[unit.group] = len(frozen) < len(leaves)
        if not stored:
            if not real and len(frozen) == len(leaves):  # only frozen tiled leaves' anchors
                self._param_only.add(unit.group)
            return rest, None
        # every stored leaf frozen: the stage's own group is param-only
        if len(stored) == len(real):
            self._param_only.add(unit.group)
            return rest, None
        kept, taken = split_frozen(rest, stored)
        offsets = [0, *accumulate(x.numel() for x in taken)]
        spec = FlatSpec(
            optree.tree_structure(taken),
            tuple(
                LeafSpec(names[j], tuple(x.shape), offset, x.numel())
                for j, x, offset in zip(stored, taken, offsets, strict=False)
            ),
            offsets[-1],
        )
        split = StageSplit(unit.group, stored, spec)
        if (
            self.storage in QUANTIZED
            and unit.group == BLOCKS
            and any(len(x.shape) >= 2 for x in taken)
        ):
            split = split._replace(
                **dict(
                    zip(
                        ("stored", "codes"),
                        quantized_layout(spec, self.storage, self.param_dtype.itemsize, unit.group),
                        strict=True,
                    )
                )
            )
        self.splits[unit.group] = split
        self._param_only.add(frozen_group(unit.group))
        if split.stored is not None:
            self._coded[split.group] = Coded(split.spec, split.stored, split.codes)
        return kept, self.splits[unit.group]

    def code_tiles_(self, leaves: tuple) -> None:
        """Frozen tiled leaves of the blocks (``TiledLeaf`` s, their groups param-only after
        ``split_``) whose tiles are matrices or stacks of them (streamed experts' (1, out, in)) are
        stored as codes where the storage quantizes, as the frozen group's leaves are."""
        if self.storage not in QUANTIZED:
            return
        for leaf in leaves:
            if leaf.stage == BLOCKS and self.param_only(leaf.group) and len(leaf.shapes[0]) >= 2:
                spec = leaf.spec()
                stored, codes = quantized_layout(
                    spec, self.storage, self.param_dtype.itemsize, leaf.stage
                )
                self._coded[leaf.group] = Coded(spec, stored, codes)

    def row_spec(self, group: str, spec: FlatSpec) -> FlatSpec:
        """The layout of ``group``'s param row, whose leaves ``spec`` gives: its bytes where it is
        stored as codes (``code_tiles_``), else ``spec``."""
        return self._coded[group].stored if group in self._coded else spec

    def _trains(self, stage: str, path: str) -> bool:
        """The predicate's answer for leaf ``path`` of ``stage``, the same in every unit of it (else
        raises)."""
        if self.model.trainable is None:
            return True
        answers = {
            u.name: is_trainable(self.model, f"{u.name}.{path}")
            for u in units(self.model.n_layers)
            if u.group == stage
        }
        if len(set(answers.values())) > 1:
            first, answer = next(iter(answers.items()))
            other = next(name for name, a in answers.items() if a != answer)
            state = {True: "trainable", False: "frozen"}
            raise ValueError(
                f"zf.Model.trainable: leaf {path!r} is {state[not answer]} in {other} but "
                f"{state[answer]} in {first}; every block shares one layout, so the "
                "predicate must "
                f"answer the same for blocks.<i>.{path} for every i"
            )
        return next(iter(answers.values()))

    def _tied_no_grad(self, unit: Unit, n_own: int) -> tuple[int, ...]:
        """The head's tied leaves (after its own ``n_own`` in what it applies) that take no
        gradient: those of a frozen embedding leaf."""
        if unit.group != HEAD:
            return ()
        return tuple(
            n_own + k
            for k, tie in enumerate(self.model.ties)
            if not is_trainable(self.model, f"{EMBED}.{tie.embed}")
        )

    def __bool__(self) -> bool:
        return any(n for n, _ in self._counts.values())

    def param_only(self, group: str) -> bool:
        """Whether ``group`` holds only frozen leaves: a "param" row and nothing else (the store
        asks it)."""
        return group in self._param_only

    def of(self, unit) -> tuple[int, ...]:
        """Indices of the leaves of ``unit``'s tree (its group's spec; for the head, then its tied
        leaves) that take no gradient: frozen leaves (anchors where they are stored apart), frozen
        tiled leaves' anchors."""
        return self._no_grad.get(unit.group, ())

    def whole(self, unit) -> bool:
        """Whether ``unit``'s row (a stage's, a tile's, a frozen group's) holds only frozen leaves:
        nothing of it moves back (no gradient buffer, reduce-scatter, norm part or update) and its
        rows are never written."""
        return unit.group in self._param_only

    def embed_trains(self) -> bool:
        """Whether any leaf of the embedding trains (a tiled one included): else its backward is not
        run and the embedding is not fetched again (``overlap.plan.train_plan``)."""
        return self._stage_trains.get(EMBED, True)

    def trained(self, all_units: list) -> list:
        """``all_units`` without the wholly frozen ones (``whole``): the units the optimizer
        updates."""
        return [u for u in all_units if not self.whole(u)]

    def companion(self, unit) -> FrozenUnit | None:
        """``unit``'s row in its stage's frozen group, fetched with it; None where its stage keeps
        none."""
        split = self.splits.get(unit.group) if isinstance(unit, Unit) else None
        return None if split is None else FrozenUnit(unit.index, split.group, unit.row, unit.group)

    def companions(self, all_units: list) -> list[FrozenUnit]:
        """The frozen rows of ``all_units``, in their order."""
        return [c for c in map(self.companion, all_units) if c is not None]

    def split_tree(self, unit, tree: Any) -> tuple[Any, tuple | None]:
        """(``unit``'s tree as its group stores it, its frozen leaves or None) of a whole tree
        (tiled nodes as anchors): what init and imports write."""
        split = self.splits.get(unit.group)
        return (tree, None) if split is None else split_frozen(tree, split.anchors)

    def assemble(self, unit, rest: Any, frozen: tuple) -> Any:
        """``unit``'s whole tree from its group's tree and its frozen row's leaves (``unflatten`` of
        the row)."""
        return assemble_frozen(rest, frozen, self.splits[unit.group].anchors)

    def quantized(self, group: str) -> bool:
        """Whether ``group`` is a frozen group (or a frozen tile group) stored quantized
        (``Config.frozen_storage``): a uint8 param row."""
        return group in self._coded

    def values_spec(self, group: str) -> FlatSpec | None:
        """The leaves (real shapes) a quantized frozen group's byte row holds; None for any other
        group."""
        return self._coded[group].spec if self.quantized(group) else None

    def values_numel(self, group: str, padded: int) -> int:
        """Elements of the flat row of values that fills a row of ``group`` (``Runtime.load_row_``):
        ``padded`` (its padded row), or a quantized frozen group's leaves' elements (quantized as
        the row is written)."""
        spec = self.values_spec(group)
        return padded if spec is None else spec.numel

    def stored_row(
        self, group: str, flat: torch.Tensor, local: tuple[int, int], padded: int, cast_
    ) -> torch.Tensor:
        """This rank's param row (elements ``local`` = ``[start, end)`` of its padded row) of frozen
        ``group`` from ``flat`` (``Runtime.load_row_``'s): its ``param_dtype`` copy (``cast_(out,
        x)`` rounds it), or the bytes of the codes of a quantized row, whose ``flat`` holds its
        leaves' values (``values_numel``)."""
        start, end = local
        values = flat[: self.values_spec(group).numel] if self.quantized(group) else flat[start:end]
        param = torch.empty(values.numel(), dtype=self.param_dtype)
        cast_(param, values)
        return self.encode_row(group, param, padded)[start:end] if self.quantized(group) else param

    def shard_elements(self, group: str, part) -> int:
        """Parameters in this rank's shard of a row of ``group`` (``part`` its partition):
        ``shard_numel``, or a quantized frozen row's share of its leaves' elements (its shard's
        bytes of the padded row's)."""
        spec = self.values_spec(group)
        return (
            part.shard_numel if spec is None else spec.numel * part.shard_numel // part.padded_numel
        )

    def encode_row(self, group: str, values: torch.Tensor, numel: int) -> torch.Tensor:
        """The uint8 (``numel``,) row of quantized frozen ``group`` (padding zero) holding its
        leaves' 16-bit ``values`` (``values_spec``'s flat row, in ``param_dtype``): codes and
        scales, or the values' bytes."""
        split = self._coded[group]
        row = torch.zeros(numel, dtype=torch.uint8)
        for leaf, stored, code in zip(
            split.spec.leaves, split.stored.leaves, split.codes, strict=True
        ):
            x = values[leaf.offset : leaf.offset + leaf.numel]
            row[stored.offset : stored.offset + stored.numel] = (
                encode_leaf(code, x) if code else x.view(torch.uint8)
            )
        return row

    def decode(self, group: str) -> Decode | None:
        """How a quantized frozen group's row is decoded (``codebook.decode_row_``); else None."""
        if not self.quantized(group):
            return None
        coded = self._coded[group]
        return Decode(self.storage, coded.spec, coded.stored, coded.codes, self.param_dtype)

    def decode_row_(self, group: str, row: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``values_spec``'s numel, any dtype and device; written, returned) filled with
        the values the uint8 ``row`` of quantized frozen ``group`` holds (``encode_row``'s):
        ``codebook.decode_row_``."""
        return decode_row_(self.decode(group), row, out)

    def describe(self) -> str:
        """One line for ``zf.plan``: "frozen: embed, head (every leaf: a param row only, nothing
        moves back); blocks 8 of 14 leaves (in blocks:frozen, a param row only)" (quantized: ", its
        2-D weights nf4")."""
        if not self:
            return "frozen: none"
        whole = [g for g in self._counts if g in self._param_only]
        some = [
            f"{g} {n} of {m} leaves"
            + (
                f" (in {frozen_group(g)}, a param row only{self._stored(g)})"
                if g in self.splits
                else ""
            )
            for g, (n, m) in self._counts.items()
            if n and g not in self._param_only
        ]
        tiles = sorted(g for g in self._param_only if ":" in g and not is_frozen_group(g))
        parts = (
            [f"{', '.join(whole + tiles)} (every leaf: a param row only, nothing moves back)"]
            if whole or tiles
            else []
        ) + some
        return "frozen: " + "; ".join(parts)

    def _stored(self, stage: str) -> str:
        """ ", its 2-D weights nf4" where ``stage``'s frozen group is quantized (``describe``)."""
        return f", its 2-D weights {self.storage}" if self.splits[stage].stored is not None else ""
