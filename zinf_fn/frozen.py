"""Frozen leaves (``zf.Model.trainable``): which leaves of each unit training leaves exactly as they are.

This is the first slice of frozen-parameter support (issue 23, part 1): a frozen leaf

- gets a gradient of exactly zero: the scan replaces its vjp gradient by zeros before it is accumulated
  (``scan.grads.without_frozen``), so it adds nothing to the global norm and to the reduce-scatter's sums;
- takes no weight decay (the decay mask is narrowed to trainable leaves, ``decay_mask``);
- is therefore left bitwise unchanged by ``zf.adamw`` and ``zf.sgd``: with a zero gradient, zero moments
  (or momentum) and no decay their update is ``p - lr * 0 == p``, and the 16-bit copy recast from an
  unchanged master is the same copy.

Training equals plain PyTorch with ``requires_grad=False`` on the frozen leaves (the trainable leaves'
and the carry's gradients do not depend on whether a sibling input requires grad).

A unit whose every leaf is frozen (the embedding, a frozen tiled leaf's tiles, ...) moves nothing back:
its gradient is dropped where the scan emits it (no reduce-scatter, no update) and its rows are never
written after init (``whole``, ``trained``).

Not yet (the storage half of the issue): a frozen leaf still has its master, moments and gradient span
in its unit's rows, a unit with some trainable leaves is still rewritten whole after each step, and its
gradient is still computed before it is zeroed or dropped. Optimizers other than adamw and sgd are
refused at ``zf.init`` when anything is frozen.

Full key paths (``"blocks.3.attn.q.w"``) are asked of the predicate for every unit; the blocks share one
layout, so every block must give the same answer for a leaf (``FrozenLeaves`` raises otherwise).
"""

from __future__ import annotations

from collections.abc import Callable

from .model import Model, is_trainable
from .store import Store
from .units import Unit, units

ZERO_GRAD_IS_IDENTITY = ("adamw", "sgd")   # optimizers whose update leaves p as it is for grad 0, state 0, no decay


class FrozenLeaves:
    """``of(unit)``: the indices (in its group's flat spec) of the unit's frozen leaves; checked at init."""

    def __init__(self, model: Model, store: Store, tiled: dict[str, tuple], optimizer_name: str | None):
        self.model = model
        self._of: dict[str, tuple[int, ...]] = {}
        self._tiles: set[str] = set()   # the tile groups (``tiling.layout``) of frozen tiled leaves
        self._whole: set[str] = set()   # the groups whose every (non-empty) leaf is frozen
        self._n = {name: _n_leaves(store, name) for name in store.groups}
        if model.trainable is None:
            return
        for unit in units(model.n_layers):
            frozen = self._frozen_in(unit, store)
            if unit.group in self._of and self._of[unit.group] != frozen:
                raise ValueError(self._differs(unit, store, frozen))
            self._of[unit.group] = frozen
        for leaf in (leaf for leaves in tiled.values() for leaf in leaves):
            self._check_tiled(leaf)
        self._whole = self._tiles | {group for group, frozen in self._of.items()
                                     if frozen and len(frozen) == self._n[group]}
        if self and optimizer_name not in ZERO_GRAD_IS_IDENTITY:
            raise ValueError(f"zf.Model.trainable freezes leaves, which the engine supports for the optimizers "
                             f"{ZERO_GRAD_IS_IDENTITY} only (a zero gradient leaves their parameters unchanged); "
                             f"got {optimizer_name!r}")

    def _check_tiled(self, leaf) -> None:
        """A tiled leaf is frozen in every unit of its stage or in none (its tile group's one answer)."""
        answers = {u.name: is_trainable(self.model, f"{u.name}.{leaf.path}")
                   for u in units(self.model.n_layers) if u.group == leaf.stage}
        if len(set(answers.values())) > 1:
            frozen = sorted(name for name, trains in answers.items() if not trains)
            raise ValueError(f"zf.Model.trainable: the tiled leaf {leaf.path!r} is frozen in {frozen} only; every "
                             f"block shares one layout, so the predicate must answer the same for every block")
        if not next(iter(answers.values())):
            self._tiles.add(leaf.group)

    def _frozen_in(self, unit: Unit, store: Store) -> tuple[int, ...]:
        spec = store.group_of(unit).spec
        return tuple(j for j, leaf in enumerate(spec.leaves)
                     if leaf.numel and not is_trainable(self.model, f"{unit.name}.{leaf.path}"))

    def _differs(self, unit: Unit, store: Store, frozen: tuple[int, ...]) -> str:
        spec = store.group_of(unit).spec
        first = self._of[unit.group]
        path = next(spec.leaves[j].path for j in sorted(set(first) ^ set(frozen)))
        return (f"zf.Model.trainable: leaf {path!r} is {'frozen' if path in _paths(spec, frozen) else 'trainable'} "
                f"in {unit.name} but {'frozen' if path in _paths(spec, first) else 'trainable'} in blocks.0; every "
                f"block shares one layout, so the predicate must answer the same for blocks.<i>.{path} for every i")

    def __bool__(self) -> bool:
        return any(self._of.values()) or bool(self._tiles)

    def of(self, unit) -> tuple[int, ...]:
        """Frozen leaf indices of ``unit``'s group spec (a tile unit: ``(0,)`` where its tiled leaf is frozen)."""
        return (0,) if unit.group in self._tiles else self._of.get(unit.group, ())

    def whole(self, unit) -> bool:
        """Whether every leaf of ``unit`` (or the tiled leaf of a tile unit) is frozen: its gradient is dropped
        where the scan emits it (no reduce-scatter, no norm part, no update) and its rows are never written."""
        return unit.group in self._whole

    def describe(self) -> str:
        """One line for ``zf.plan``: "frozen: embed, blocks:mlp.fc.w (every leaf: nothing moves back); leaves
        frozen in blocks (2 of 12), head (2 of 3)"."""
        if not self:
            return "frozen: none"
        whole = sorted(self._whole)
        some = [f"{g} ({len(f)} of {self._n[g]})" for g, f in self._of.items() if f and g not in self._whole]
        parts = ([f"{', '.join(whole)} (every leaf: nothing moves back)"] if whole else []) + (
            [f"leaves frozen in {', '.join(some)}"] if some else [])
        return "frozen: " + "; ".join(parts)

    def trained(self, all_units: list) -> list:
        """``all_units`` without the wholly frozen ones (``whole``): the units the optimizer updates."""
        return [u for u in all_units if not self.whole(u)]

    def decay_mask(self, mask: Callable[[str], bool] | None) -> Callable[[str], bool] | None:
        """The optimizer's weight-decay mask narrowed to trainable leaves (None stays None without frozen leaves)."""
        if not self:
            return mask
        model = self.model
        return lambda path: is_trainable(model, path) and (mask is None or mask(path))


def _n_leaves(store: Store, group: str) -> int:
    return sum(1 for leaf in store.groups[group].spec.leaves if leaf.numel)


def _paths(spec, indices: tuple[int, ...]) -> set[str]:
    return {spec.leaves[j].path for j in indices}
