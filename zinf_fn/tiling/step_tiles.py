"""The tiles' side of one step (``StepTiles``): its tile plan and prefetcher, and the unit whose
tiles are live; made by the run's ``tiling.runtime.TileEngine`` for each step.

The tile plan of a step (``tiling.plan.step_tile_plan``) is data known before the step, with the
last training step's routings and kept tapes as its prediction (``tiling.routed.Learnt``); the
prefetcher (``overlap.prefetch.Prefetcher``, the layers' one) runs it ``depth`` items ahead (runs of
streamed experts further: ``TileEngine.window``), an item a run of small tiles (``tiling.runs``)
whose tier reads start as it enters the window. A request that comes in another order than planned
is served on demand and the plan cursor moves to it; nothing waits for a fetch that was not issued,
so a wrong plan costs fetches, never a deadlock.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING, Any

import optree
import torch

from ..overlap.fetch import Layer
from ..overlap.plan import KEPT, LEARNT, ROUTED, FetchOp, PassPlan
from ..overlap.prefetch import Prefetcher
from ..overlap.tile_runs import tile_run
from .handles import TileHandle
from .keep import KeptTiles
from .layout import TileOp, TileUnit
from .leaf_tiles import LeafTiles, TileGrads
from .plan import computes_grads
from .routed import Routes, predicted_first, rerouted
from .runs import ReadyTiles, RunFetcher, Runs, TileRun, cut_section

if TYPE_CHECKING:
    from .runtime import TileEngine


def find_planned(ops: list[TileOp], cursor: int, key: tuple[str, int]) -> int | None:
    """The next position of tile ``key`` (``(group, row)``) in one section's ``ops``, searching on
    from ``cursor`` (a position in the section, clamped to it), then wrapping; None: not planned
    there."""
    c = min(max(cursor, 0), len(ops))
    for j in itertools.chain(range(c, len(ops)), range(0, c)):  # no list of the section built
        if (ops[j].unit.group, ops[j].unit.row) == key:
            return j
    return None


class StepTiles:
    """The tiles' side of one step: its tile plan and prefetcher, and the unit whose tiles are
    live.

    The tile plan is a ``PassPlan`` of ``Runs`` (``runs``): cut before the step from the last
    step's prediction, then revised as the step's ops tell their routing (``will_use``), their
    kept activations (``recorded``) and their order of use (``leave``), each revision a new value
    that the prefetcher follows (``Prefetcher.revise``). Its state besides: the units live
    (``active``, ``entered``, ``used``) and the tiles of runs taken (``ready``), by stage."""

    def __init__(
        self,
        engine: TileEngine,
        plan: list[FetchOp],
        out: TileGrads | None,
        n_micro: int,
        train: bool,
    ):
        """``out``: where the tiles' gradients go (None: an evaluation, which makes none)."""
        self.engine, self.plan, self.out = engine, plan, out
        self.n_micro, self.train = n_micro, train
        self.fetcher = engine.fetcher
        self.routes = Routes(
            engine.layout, plan, n_micro, train, engine.learnt(), known=engine.passes
        )
        self.runs = PassPlan(self._cut())  # revised by the prefetcher as the ops tell
        runs = RunFetcher(engine.fetcher)
        self.prefetcher = Prefetcher(
            self.runs,
            runs,
            engine.depth,
            engine.executor,
            self._starter(runs),
            self._streamed,
            engine.window(),
            issuer=engine.issuer,
        )
        self.ready = ReadyTiles(engine.fetcher)  # tiles of runs taken, not yet asked for
        # frozen streamed tiles kept from their forward fetch into their backward (a training step)
        self.kept = KeptTiles(engine.fetcher, engine.keeps if train else {})
        self.active: dict[str, list[LeafTiles]] = {}
        # per live stage: its unit's position in the step's plan
        self.entered: dict[str, int] = {}
        # per live stage: its leaves in the order first fetched
        self.used: dict[str, list[int]] = {}

    def _starter(self, runs: RunFetcher):
        """The prefetcher's ``start``: the job issuing the reads of the run at window position j,
        of the plan as it is now (its latest revision: a revision is appended before the window
        refills), run on the issue thread where the step reads from NVMe."""

        def start(j: int):
            return functools.partial(runs.start, self.runs[j])

        return start

    def _streamed(self, j: int) -> bool:
        """Whether run j of the plan as it is now is a streamed expert's (its group's policy's
        ``streamed``): the prefetcher's window widens over such runs (``TileEngine.window``)."""
        runs = self.runs.now
        return j < len(runs) and self.engine.streamed(runs[j].group)

    def _cut(self) -> Runs:
        """The step's tile plan (its routed passes in) cut into the prefetcher's runs, section by
        section (``tiling.runs``)."""
        n = len(self.plan)
        return Runs([cut_section(self.routes.section_ops(i), self._run_length) for i in range(n)])

    def _run_length(self, unit: TileUnit) -> int:
        """Tiles of ``unit``'s leaf fetched as one item (``overlap.tile_runs.tile_run``)."""
        fetcher = self.engine.fetcher
        padded = fetcher.store.group_of(unit).part.padded_numel
        return tile_run(padded, fetcher.compute_dtype, self.engine.depth)

    def _position(self) -> int:
        """The plan position of the prefetcher's cursor: the first op of the next run to take."""
        runs = self.runs.now
        cursor = self.prefetcher.cursor
        return runs.start[cursor] if cursor < len(runs) else len(runs.ops)

    def fetch_tile(self, unit: TileUnit, entry: int) -> Layer:
        """Tile ``unit`` materialised; ``entry`` is the plan index of the asking unit, whose ops'
        section of the tile plan is searched. A request in another order than planned is served on
        demand and the plan cursor moves to it."""
        key = (unit.group, unit.row)
        layer = self.ready.pop(key)
        if layer is not None:  # fetched with an earlier tile of its run
            return layer
        runs = self.runs.now
        start, _ = runs.section(entry)
        j = find_planned(runs.parts[entry].ops, self._position() - start, key)
        # on demand: queued behind the fetches already issued, on the same fetch thread
        if j is None:
            return self.prefetcher.fetch_unplanned(TileRun(unit.group, (unit.row,), (unit,)))[0]
        layers = self.prefetcher.get(runs.run_of[start + j])
        layer = next(x for x in layers if (x.unit.group, x.unit.row) == key)
        self.ready.keep(layers, layer)
        return layer

    def enter(self, i: int, layer: Layer) -> Layer:
        """Plan entry i was materialised: its tiled leaves become fetchable until ``leave``."""
        op, layout = self.plan[i], self.engine.layout
        # the step's first tiles are issued behind the first units, not on demand
        self.prefetcher.refill()
        if layout.leaves.get(op.unit.group):
            assert op.unit.group not in self.active, f"{op.unit.name}: two live units of one stage"
            # and the leaf trains: a frozen one's op makes no dW
            grads = computes_grads(op, self.train)
            self.active[op.unit.group] = [
                LeafTiles(
                    leaf,
                    k,
                    self,
                    self.engine.tile_units(leaf, op.unit),
                    i,
                    grads and leaf.group not in layout.frozen,
                )
                for k, leaf in enumerate(layout.leaves[op.unit.group])
            ]
            self.used[op.unit.group], self.entered[op.unit.group] = [], i
        return layer

    def leave(self, layer: Layer) -> None:
        """The unit is released: send its remaining tile gradients, give back any tile still held.

        What the unit's applies did becomes the plan of the rest of this step and every later one,
        where it differs from what was planned (``observed``); the prefetcher then fetches what
        really comes next.
        """
        group = layer.unit.group
        live = self.active.pop(group, ())
        for tiles in live:
            if tiles.grads:
                tiles.flush()
            tiles.close()
            self.ready.release(tiles.leaf.group)  # tiles of a run the applies did not ask for
        i = self.entered.pop(group, None)
        if i is not None and self.plan[i].phase == "backward":
            self.kept.forget(self.plan[i].unit)  # its layer's kept tiles: their backward is done
        if i is not None and self.observed(group, i, live):
            old = self.runs.now
            self.routes.relearnt()
            new = self._cut()
            # the plan up to here shrank
            moved = old.before(old.section(i)[1]) - new.before(new.section(i)[1])
            self.prefetcher.revise(new, moved, LEARNT)

    def observed(self, group: str, entry: int, live: list[LeafTiles]) -> bool:
        """Record in the layout what the released unit's applies did; True if that changed the plan.

        A forward unit's first fetch of each leaf is the stage's use order
        (``TileLayout.observe_use``; tree order until then). A backward unit fetched a leaf once per
        tile and micro-batch where its recompute did not run that leaf's forward (``scan.tape``
        stops before the ops nothing needed, such as a block's last linear): the leaves it did run
        are the recompute's (``TileLayout.observe_recompute``), and so are those whose op told its
        routing there (``will_use``: only a recompute runs an op's forward in a backward unit).
        Frozen leaves too (a frozen linear's backward fetches its tiles for dx all the same), so the
        plan of a LoRA base prefetches no tile for a recompute that never runs. A backward unit
        whose every tape kept its activations ran no recompute: nothing to learn.
        """
        used, layout = self.used.pop(group, None), self.engine.layout
        phase = self.plan[entry].phase
        if phase == "forward":
            return bool(used) and layout.observe_use(group, used)
        if phase == "backward" and live and self.train and not self.routes.all_kept(entry):
            ran = [t.index for t in live if t.told or t.fetches > t.leaf.n_tiles * self.n_micro]
            return layout.observe_recompute(group, ran)
        return False

    def will_use(self, leaf: LeafTiles, tiles: tuple[int, ...], others: list) -> tuple[int, ...]:
        """The tiles of ``leaf`` (and of ``others``, leaves of the same unit) an op fetches next:
        ``tiles``, or with several ranks their union over ranks (a collective on the gradient path:
        every rank's op calls it at the same point, and every rank then fetches the same tiles in
        the same order, each fetch a collective of the fetch path)."""
        comm = self.fetcher.sharding.comm
        if comm.world_size > 1:
            used = torch.zeros(leaf.leaf.n_tiles)
            used[list(tiles)] = 1.0
            comm.all_reduce_sum_(used, f"{leaf.units[0].label}: tiles any rank uses")
            tiles = tuple(used.nonzero().flatten().tolist())
        else:  # the tiles the plan predicted first: their fetches are under way, or done
            groups = frozenset(x.units[0].group for x in (leaf, *others))
            tiles = predicted_first(tiles, self.routes.planned(leaf.entry, groups))
        order = tuple(x.units[t] for t in tiles for x in (leaf, *others))
        for x in (leaf, *others):
            x.told += 1
        self._reroute(self.routes.tell(leaf.entry, order), ROUTED)
        return tiles

    def recorded(self, layer: Layer, kept: list[bool]) -> None:
        """The forward unit ``layer`` recorded its block over every micro-batch; where ``kept[m]``
        (``scan.tape.Tape.kept``) micro-batch m's backward recomputes nothing, so the plan of its
        layer's backward unit fetches no tile for that recompute (``Routes.keep``)."""
        i = self.entered.get(layer.unit.group)
        if i is None:
            return
        micro = frozenset(m for m, k in enumerate(kept) if k)
        self._reroute(self.routes.keep(i, micro), KEPT)

    def _reroute(self, changed: list[int], cause: str) -> None:
        """The plan sections ``changed`` cut anew (``tiling.routed.rerouted``) for ``cause``
        (``overlap.plan.ROUTED`` or ``KEPT``): the plan's next revision, which the prefetcher
        follows from its cursor on."""
        if not changed:
            return
        boundary = self._position()
        old = self.runs.now
        new = rerouted(old, self.routes, changed, boundary, self._run_length)
        self.prefetcher.revise(new, old.before(boundary) - new.before(boundary), cause)

    def bind(self, stage: str, params: Any) -> Any:
        """``params`` with each anchor of ``stage``'s tiled leaves replaced by a ``TileHandle``."""
        live = self.active.get(stage)
        if live is None:
            raise RuntimeError(
                f"{stage}.apply was called while no unit of {stage!r} is materialised"
            )
        leaves, treedef = optree.tree_flatten(params)
        for tiles in live:
            leaf = tiles.leaf
            leaves[leaf.anchor_index] = TileHandle(
                self, leaf, tiles.index, tiles.units[0].layer, leaves[leaf.anchor_index]
            )
        return optree.tree_unflatten(treedef, leaves)

    def close(self) -> None:
        for group in list(self.active):
            for tiles in self.active.pop(group):
                tiles.close()
        self.ready.release()
        self.prefetcher.close()
        self.kept.close()
        self.engine.finish(self)
