"""Routed tiles: the tile plan of ops that fetch only some tiles, told which when they run.

A mixture of experts computes only the experts its tokens were routed to (``tiling.experts``), each
expert's linears one after another; which experts is known once the router has run, before the first
expert. On one rank the order is the plan's first (``predicted_first``): the experts the last step's
routing predicted, whose reads were issued before the router ran, then the others in increasing
order (over several ranks, the union's increasing order). The op says so (``TileSource.will_use``),
and the pass of the tile plan (``tiling.plan.PassOps``: one micro-batch of one unit fetch) is
rewritten: its forward fetches exactly those tiles in that order, its backward the same in reverse
(autograd pulls the experts back in reverse), and the backward unit of the same layer, later in the
step, is rewritten the same way from the forward's routing (its recompute routes the same tokens the
same way)::

    planned   forward  gate_up 0 1 2 3, down 0 1 2 3         (every tile, leaf by leaf)
    routed    forward  gate_up 1, down 1, gate_up 3, down 3  (experts 1 and 3 have tokens)
              backward down 3, gate_up 3, down 1, gate_up 1

A block whose tape keeps its activations (``Config.keep_activations``, ``scan.tape.Kept``) runs
no recompute in its backward: the forward tells so once it has recorded the block
(``Routes.keep``), and that micro-batch's backward pass loses its forward (``without_recompute``);
until it tells, the last step's kept passes are the prediction (``Learnt``), as the last step's
routing of the layer is the prediction of which experts its first fetches bring, before the router
runs (step 1 plans every expert until then).

So the prefetcher fetches what the op asks for, ahead, and nothing for an expert without tokens but
the few fetches it issued for the unit's pass before the router ran. The plan is only a prediction:
a tile asked for out of it is still fetched on demand (``tiling.step_tiles``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from ..overlap.plan import FetchOp
from .layout import TileLayout, TileOp, TileUnit
from .plan import PassOps, unit_passes, unit_tile_ops
from .runs import Runs, SectionRuns, cut_section


def routed_ops(ops: tuple[TileOp, ...], order: list[TileOp], always: bool) -> tuple[TileOp, ...]:
    """``ops`` with every op of ``order``'s groups replaced by ``order``, which goes where the
    first of them was; where there was none, at the end if ``always``, else nowhere."""
    groups = {op.unit.group for op in order}
    kept = [op for op in ops if op.unit.group not in groups]
    first = next((j for j, op in enumerate(ops) if op.unit.group in groups), None)
    if first is None:
        return (*kept, *order) if always else tuple(kept)
    at = sum(1 for op in ops[:first] if op.unit.group not in groups)
    return (*kept[:at], *order, *kept[at:])


def routed_pass(planned: PassOps, order: tuple[TileUnit, ...], recomputes: bool) -> PassOps:
    """``planned`` with the tiles of ``order``'s leaves fetched as ``order`` says: in that order in
    forward (where ``recomputes`` or the pass's forward has them already: a backward unit's
    recompute may leave them out), reversed in backward (where the pass has a backward)."""
    forward = [TileOp(u, "forward") for u in order]
    backward = [TileOp(u, "backward") for u in reversed(order)]
    return PassOps(
        routed_ops(planned.forward, forward, recomputes),
        routed_ops(planned.backward, backward, False) if planned.backward else (),
    )


def predicted_first(tiles: tuple[int, ...], planned: tuple[int, ...]) -> tuple[int, ...]:
    """``tiles`` (the ones an op will fetch) in the order it computes them: those of ``planned``
    (``Routes.planned``: the plan's prediction, whose reads the prefetcher issued first) in their
    planned order, then the others, increasing; so the op computes what has arrived while the
    reads of what the prediction missed go on."""
    wanted = set(tiles)
    first = [t for t in planned if t in wanted]
    return (*first, *sorted(wanted.difference(first)))


def without_recompute(one: PassOps) -> PassOps:
    """A backward unit's pass whose block kept its activations: its backward's tiles only."""
    return PassOps((), one.backward)


# a unit by (group, row), as the next step's plan finds it again
UnitKey = tuple[str, int]


class Learnt(NamedTuple):
    """What one training step's ops told, the next step's prediction until its own ops tell.

    ``kept``: per backward unit, the micro-batches whose tapes kept their activations
    (``Routes.keep``); ``routed``: per forward unit, the routings its ops told, ``(micro-batch,
    order)`` in the order told (``Routes.tell``)."""

    kept: Mapping[UnitKey, frozenset[int]]
    routed: Mapping[UnitKey, tuple[tuple[int, tuple[TileUnit, ...]], ...]]

    def experts(self, streamed: Callable[[str], bool]) -> int:
        """The experts the step's routed ops computed: (layer, micro-batch, expert) triples of the
        tile groups ``streamed`` says are experts (not a vocabulary's tiles, which an embedding's
        lookup routes too), an expert counted once whatever number of its weights it fetched, and
        once for its forward and the backward's recompute, which tells the same routing again (each
        is also computed in the backward, to its input or its gradient)."""
        return sum(
            len({(m, u.index, u.tile) for m, order in orders for u in order if streamed(u.group)})
            for orders in self.routed.values()
        )


class Routes:
    """The passes of one step's tile plan that routing rewrote, by plan index and micro-batch; a
    unit fetch's tile ops with them (``section_ops``).

    ``before`` (the last training step's ``learnt``): its routings and kept tapes are this step's
    prediction, so the first fetches of a routed op follow the experts its layer used last step,
    not every expert; step 1 (nothing learnt) plans every expert until the router tells."""

    def __init__(
        self,
        layout: TileLayout,
        plan: list[FetchOp],
        n_micro: int,
        train: bool,
        before: Learnt | None = None,
        known: dict | None = None,
    ):
        """``known``: the planned passes of earlier steps (``TileEngine.passes``, by unit fetch and
        the layout's learnt order), kept and added to: a unit's planned passes are the same every
        step until the layout learns another order."""
        self.layout, self.plan, self.n_micro, self.train = layout, plan, n_micro, train
        self._known = {} if known is None else known
        self.passes: dict[int, dict[int, PassOps]] = {}  # plan index -> micro-batch -> pass
        # backward plan index -> its micro-batches whose tapes keep their activations
        self.kept: dict[int, frozenset[int]] = {}
        self._told: dict[tuple[int, frozenset], int] = {}  # routings told per unit fetch and leaves
        self._orders: list[tuple[int, int, tuple[TileUnit, ...]]] = []  # (entry, m, order) told
        self._planned: dict[int, list[PassOps]] = {}  # unit_passes of each entry, as computed
        if before is not None:
            self._predict(before)

    def _predict(self, before: Learnt) -> None:
        """The last step's kept tapes and routings, by unit, on this step's plan entries."""
        for i, op in enumerate(self.plan):
            key = (op.unit.group, op.unit.row)
            if op.phase == "backward" and key in before.kept:
                self.kept[i] = before.kept[key]
            if op.phase == "forward":
                for m, order in before.routed.get(key, ()):
                    if m < self.n_micro:
                        self._route(i, m, order)

    def learnt(self) -> Learnt:
        """This step's kept tapes and told routings by unit: the next step's ``before``."""
        routed: dict[UnitKey, list] = {}
        for i, m, order in self._orders:
            routed.setdefault(self._key(i), []).append((m, order))
        return Learnt(
            {self._key(j): m for j, m in self.kept.items()},
            {key: tuple(orders) for key, orders in routed.items()},
        )

    def _key(self, i: int) -> UnitKey:
        return (self.plan[i].unit.group, self.plan[i].unit.row)

    def section_ops(self, i: int) -> list[TileOp]:
        """Plan entry i's tile fetches, its routed passes in (``tiling.plan.step_tile_plan``'s
        section i)."""
        kept, routed = self.kept.get(i, frozenset()), self.passes.get(i, {})
        passes = [
            without_recompute(routed.get(m, one)) if m in kept else routed.get(m, one)
            for m, one in enumerate(self._unit_passes(i))
        ]
        return unit_tile_ops(self.layout, self.plan[i], self.n_micro, self.train, None, passes)

    def keep(self, i: int, micro_batches: frozenset[int]) -> list[int]:
        """Forward entry i's block keeps the activations of ``micro_batches`` (``scan.tape.Kept``):
        its layer's backward unit runs no recompute for them, so those passes fetch only their
        backward's tiles. Returns the plan entries whose sections changed."""
        j = self._backward_of(i)
        if j is None or self.kept.get(j, frozenset()) == micro_batches:
            return []
        self.kept[j] = micro_batches
        return [j]

    def all_kept(self, i: int) -> bool:
        """Whether entry i's every micro-batch keeps its activations (its unit recomputes
        nothing)."""
        return len(self.kept.get(i, ())) == self.n_micro

    def relearnt(self) -> None:
        """The layout learnt another order of use or recompute (``TileLayout.observe_use``): the
        passes not routed are planned anew."""
        self._planned.clear()

    def _unit_passes(self, i: int) -> list[PassOps]:
        if i not in self._planned:
            op, group = self.plan[i], self.plan[i].unit.group
            # what unit_passes reads: the unit fetch, and the layout's learnt order of its stage
            learnt = (self.layout.use_order.get(group), self.layout.recomputed.get(group))
            key = (op.unit, op.phase, self.n_micro, self.train, learnt)
            if key not in self._known:
                self._known[key] = unit_passes(self.layout, op, self.n_micro, self.train)
            self._planned[i] = self._known[key]
        return self._planned[i]

    def tell(self, i: int, order: tuple[TileUnit, ...]) -> list[int]:
        """Plan entry i's op fetches ``order`` next: the m-th such call for the same leaves in the
        unit fetch is micro-batch m's pass. A forward unit's routing is its layer's backward unit's
        too (the same tokens, routed again by its recompute). Returns the plan entries whose
        sections changed."""
        key = (i, frozenset(u.group for u in order))
        m = self._told.get(key, 0)
        self._told[key] = m + 1
        if m >= self.n_micro:
            return []  # a second use in one apply: out of the plan, fetched on demand
        self._orders.append((i, m, order))
        return self._route(i, m, order)

    def planned(self, i: int, groups: frozenset[str]) -> tuple[int, ...]:
        """The tiles of ``groups`` (the leaves of one op) that plan entry i's next pass to be told
        (``tell``) plans, in the plan's order: in a forward unit, before the op tells, the last
        step's routing of the layer (``Learnt``), whose first tiles the prefetcher may have
        fetched already; in a backward unit's recompute, the order its forward told."""
        m = self._told.get((i, groups), 0)
        if m >= self.n_micro:
            return ()
        ops = self._pass(i, m).forward
        return tuple(dict.fromkeys(op.unit.tile for op in ops if op.unit.group in groups))

    def _route(self, i: int, m: int, order: tuple[TileUnit, ...]) -> list[int]:
        """Micro-batch m's pass of forward entry i, and of its layer's backward unit, fetch the
        tiles of ``order``'s leaves as ``order`` says; returns the entries whose sections
        changed."""
        self.passes.setdefault(i, {})[m] = routed_pass(self._pass(i, m), order, recomputes=True)
        j = self._backward_of(i)
        if j is None:
            return [i]
        self.passes.setdefault(j, {})[m] = routed_pass(self._pass(j, m), order, recomputes=False)
        return [i, j]

    def _pass(self, i: int, m: int) -> PassOps:
        planned = self.passes.get(i, {}).get(m)
        return self._unit_passes(i)[m] if planned is None else planned

    def _backward_of(self, i: int) -> int | None:
        """The plan index of the backward fetch of forward entry i's unit, if the step has one."""
        op = self.plan[i]
        if op.phase != "forward" or not self.train:
            return None
        return next(
            (
                j
                for j in range(i + 1, len(self.plan))
                if self.plan[j].phase == "backward" and self.plan[j].unit == op.unit
            ),
            None,
        )


def rerouted(
    runs: Runs, routes: Routes, changed: list[int], boundary: int, length: Callable
) -> Runs:
    """``runs`` with the sections ``changed`` cut anew from ``routes`` (``length``: a run's tiles,
    ``tiling.runs.cut_section``), for a prefetcher whose next run starts at op ``boundary``: a
    section ahead of it is cut whole; the one it is in, from the boundary on (a run starts there),
    unless the routing rewrote ops behind it (a plan that mispredicted: that section waits for the
    next full cut); one behind it is left as it is. In time linear in the sections' ops, not the
    step's."""
    cut: dict[int, SectionRuns] = {}
    for i in changed:
        start, end = runs.section(i)
        ops = routes.section_ops(i)
        if start >= boundary:
            cut[i] = cut_section(ops, length)
        elif boundary < end and ops[: boundary - start] == runs.parts[i].ops[: boundary - start]:
            cut[i] = cut_section(ops, length, cut_at=boundary - start)
    return runs.replaced(cut)
