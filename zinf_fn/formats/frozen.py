"""Frozen leaves (``zf.Model.trainable``): stored as a 16-bit param row only, read for compute,
never written.

A frozen leaf has no master, no optimizer state and no gradient. Where it is stored depends on its
stage:

- a stage whose every leaf is frozen (LoRA's embedding and head) keeps its group, which has only a
  "param" row (``RowKinds.kinds_of`` gives ``["param"]``); so does the tile group of a frozen tiled
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
one layout, so every block must give the same answer for a leaf (``split_stage_`` raises otherwise).
A tied leaf (``zf.Tie``) takes the embedding path's answer.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, NamedTuple

import optree
import torch

from ..layout.units import BLOCKS, EMBED, HEAD, Unit, unit_name, units
from ..model import Model, is_trainable
from ..tree import FlatSpec, LeafSpec
from .codebook import QUANTIZED
from .frozen_codes import FrozenCodes

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
    each unit take no gradient; filled by the layout step (``split_stage_``, once per stage, before
    its groups exist). How a frozen row is stored (its 16-bit values or codes) is its ``codes``
    (``formats.frozen_codes.FrozenCodes``)."""

    codes: FrozenCodes  # which frozen rows are stored as codes, and how

    def __init__(
        self, model: Model, storage: str = "bf16", param_dtype: torch.dtype = torch.bfloat16
    ):
        """``storage``: ``Config.frozen_storage`` ("bf16", or "int8" / "nf4": a frozen group's 2-D
        and 3-D leaves as codes); ``param_dtype``: the 16-bit dtype its other leaves are stored in
        and its values are rounded to."""
        self.model = model
        self.codes = FrozenCodes(storage, param_dtype)
        # stage -> its frozen group (stages with both kinds of leaves)
        self.splits: dict[str, StageSplit] = {}
        self._param_only: set[str] = set()  # groups stored as a param row only
        # stage -> its spec's leaves that take no gradient
        self._no_grad: dict[str, tuple[int, ...]] = {}
        # stage -> (frozen, all) leaves (tiled ones included)
        self._counts: dict[str, tuple[int, int]] = {}
        self._stage_trains: dict[str, bool] = {}

    def split_stage_(self, unit: Unit, rest: Any, tiled: tuple) -> tuple[Any, StageSplit | None]:
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
            self.codes.storage in QUANTIZED
            and unit.group == BLOCKS
            and any(len(x.shape) >= 2 for x in taken)
        ):
            coded = self.codes.code_(split.group, spec, unit.group)
            split = split._replace(stored=coded.stored, codes=coded.codes)
        self.splits[unit.group] = split
        self._param_only.add(frozen_group(unit.group))
        return kept, self.splits[unit.group]

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

    def describe(self) -> str:
        """One line for ``zf.plan``: "frozen: embed, head (every leaf: a param row only, nothing
        moves back); blocks 8 of 14 leaves (in blocks:frozen, a param row only)" (quantized: ", its
        2-D weights nf4")."""
        if not self:
            return "frozen: none"
        storage = self.codes.storage
        whole = [g for g in self._counts if g in self._param_only]
        some = [
            f"{g} {n} of {m} leaves"
            + (
                f" (in {frozen_group(g)}, a param row only{_coded_note(self.splits[g], storage)})"
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


def _coded_note(split: StageSplit, storage: str) -> str:
    """ ", its 2-D weights nf4" where ``split``'s frozen group is stored as codes
    (``FrozenLeaves.describe``)."""
    return f", its 2-D weights {storage}" if split.stored is not None else ""
