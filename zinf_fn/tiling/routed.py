"""Routed tiles: the tile plan of ops that fetch only some tiles, told which when they run.

A mixture of experts computes only the experts its tokens were routed to (``tiling.experts``), in
increasing order, each expert's linears one after another; which experts is known once the router
has run, before the first expert. The op says so (``TileSource.will_use``), and the pass of the
tile plan (``tiling.plan.PassOps``: one micro-batch of one unit fetch) is rewritten: its forward
fetches exactly those tiles in that order, its backward the same in reverse (autograd pulls the
experts back in reverse), and the backward unit of the same layer, later in the step, is rewritten
the same way from the forward's routing (its recompute routes the same tokens the same way)::

    planned   forward  gate_up 0 1 2 3, down 0 1 2 3         (every tile, leaf by leaf)
    routed    forward  gate_up 1, down 1, gate_up 3, down 3  (experts 1 and 3 have tokens)
              backward down 3, gate_up 3, down 1, gate_up 1

So the prefetcher fetches what the op asks for, ahead, and nothing for an expert without tokens but
the few fetches it issued for the unit's pass before the router ran. The plan is only a prediction:
a tile asked for out of it is still fetched on demand (``tiling.runtime``).
"""

from __future__ import annotations

from ..overlap.plan import FetchOp
from .layout import TileLayout, TileOp, TileUnit
from .plan import PassOps, step_tile_plan, unit_passes


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


class Routes:
    """The passes of one step's tile plan that routing rewrote, by (plan index, micro-batch); the
    step's tile plan with them (``tile_plan``)."""

    def __init__(self, layout: TileLayout, plan: list[FetchOp], n_micro: int, train: bool):
        self.layout, self.plan, self.n_micro, self.train = layout, plan, n_micro, train
        self.passes: dict[tuple[int, int], PassOps] = {}
        self._told: dict[tuple[int, frozenset], int] = {}  # routings told per unit fetch and leaves

    def tile_plan(self) -> tuple[list[TileOp], list[tuple[int, int]]]:
        """``tiling.plan.step_tile_plan`` with the routed passes."""
        return step_tile_plan(self.layout, self.plan, self.n_micro, self.train, self.passes)

    def tell(self, i: int, order: tuple[TileUnit, ...]) -> None:
        """Plan entry i's op fetches ``order`` next: the m-th such call for the same leaves in the
        unit fetch is micro-batch m's pass. A forward unit's routing is its layer's backward unit's
        too (the same tokens, routed again by its recompute)."""
        key = (i, frozenset(u.group for u in order))
        m = self._told.get(key, 0)
        self._told[key] = m + 1
        if m >= self.n_micro:
            return  # a second use in one apply: out of the plan, fetched on demand
        self.passes[(i, m)] = routed_pass(self._pass(i, m), order, recomputes=True)
        j = self._backward_of(i)
        if j is not None:
            self.passes[(j, m)] = routed_pass(self._pass(j, m), order, recomputes=False)

    def _pass(self, i: int, m: int) -> PassOps:
        planned = self.passes.get((i, m))
        if planned is None:
            planned = unit_passes(self.layout, self.plan[i], self.n_micro, self.train)[m]
        return planned

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
