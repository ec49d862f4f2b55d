"""Tiles during a step: the run's tile engine (``TileEngine``: what every step's tiles share, and
the step's ``StepTiles``, ``tiling.step_tiles``), and the handles ``apply`` sees bound to the live
unit (the handle is ``tiling.handles``; gradient emission per tile is ``tiling.leaf_tiles``).

While a unit with tiled leaves is materialised (between ``io.get`` and ``io.release`` of the scan),
every call of its stage's ``apply`` gets, in place of each anchor, a handle
(``tiling.handles.TileHandle``, a ``tiling.TileSource``) whose ``fetch(t)`` materialises tile t
through the runtime's ``Fetcher`` (read shard, allgather, cast: the same path as a unit),
``release(t)`` gives it back, and ``emit_grad(t, g)`` sends its gradient to the updater once every
micro-batch has contributed (a run of small tiles' as one: ``TileGrads``).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

from ..layout.units import BLOCKS, EMBED, HEAD, Unit
from ..model import Model, Stage
from ..overlap.fetch import Fetcher
from ..overlap.plan import FetchOp
from ..overlap.tile_runs import kept_tiles, store_window, update_run
from .layout import TiledLeaf, TileLayout, TileUnit
from .leaf_tiles import TileGrads
from .routed import Learnt, UnitKey
from .step_tiles import StepTiles


class TileEngine:
    """Owns tiling for a runtime: the layout, the model whose applies see tile handles, per-step
    state."""

    def __init__(
        self,
        fetcher: Fetcher,
        depth: int,
        executor: ThreadPoolExecutor | None,
        layout: TileLayout,
        clipping: bool = False,
        issuer: ThreadPoolExecutor | None = None,
        keep_tiles: int = 0,
    ):
        """``layout``: the tiled leaves the layout step found (``zinf_fn.layout.build``), its
        ``frozen`` tile groups without gradient among them; ``clipping``: the gradients wait for
        the global norm (each tile's stashed: ``update_run``); ``executor`` and ``issuer``: the
        runtime's fetch and issue threads (``overlap.prefetch.Prefetcher``); ``keep_tiles``: bytes
        of frozen streamed tiles a training step keeps into its backward (``Config.keep_tiles``)."""
        self.clipping = clipping
        self.layout = layout
        self.fetcher, self.depth, self.executor = fetcher, depth, executor
        self.issuer = issuer
        # what the last training step's ops told (``tiling.routed.Learnt``): the next step's
        # prediction of its kept tapes and its routings, by unit
        self.kept: dict[UnitKey, frozenset[int]] = {}
        self.routed: dict[UnitKey, tuple] = {}
        self._streamed: dict[str, bool] = {}  # tile group -> its policy's ``streamed``
        # tiles of each group a training step keeps from forward into backward (``tiling.keep``)
        world = fetcher.sharding.comm.world_size
        self.keeps = kept_tiles(fetcher.store, fetcher.compute_dtype, world, keep_tiles)
        # made once per run, the same every step: each unit's tiles of a leaf (``tile_units``), and
        # the planned passes of each unit fetch by the layout's learnt order (``Routes``)
        self._tile_units: dict[tuple, list[TileUnit]] = {}
        self.passes: dict[tuple, list] = {}
        self.last = {
            "tile_fetches_prefetched": 0,
            "tile_fetches_on_demand": 0,
            "tile_fetches_wasted": 0,
            "tile_wait_s": 0.0,
            "tile_refill_s": 0.0,
            "experts_routed": 0,
        }

    def begin(
        self, plan: list[FetchOp], out: TileGrads | None, n_micro: int, train: bool
    ) -> StepTiles | None:
        """The tiles' state of a step, or None when the model has no tiled leaf; ``out`` takes the
        tiles' gradients (``TileGrads``; None in an evaluation)."""
        if not self.layout:
            return None
        return StepTiles(self, plan, out, n_micro, train)

    def window(self) -> int:
        """How far ahead the tile prefetcher issues runs of streamed experts
        (``overlap.tile_runs.store_window``; other runs: ``depth``)."""
        f = self.fetcher
        return store_window(f.store, f.compute_dtype, self.depth)

    def tile_units(self, leaf: TiledLeaf, unit: Unit) -> list[TileUnit]:
        """``leaf``'s tiles 0..T-1 in ``unit`` (``TileLayout.tile_unit``), made once per run."""
        key = (leaf.group, unit)
        units = self._tile_units.get(key)
        if units is None:
            make = self.layout.tile_unit
            units = self._tile_units[key] = [make(leaf, unit, t) for t in range(leaf.n_tiles)]
        return units

    def streamed(self, group: str) -> bool:
        """Whether tile group ``group``'s policy streams it (``GroupPolicy.streamed``), asked once
        per group: the window asks it of every run it may widen over, at every tile taken."""
        known = self._streamed.get(group)
        if known is None:
            known = self._streamed[group] = self.fetcher.store.row_kinds.policy(group).streamed
        return known

    def learnt(self) -> Learnt:
        """The last training step's ``Learnt`` (nothing before the first)."""
        return Learnt(dict(self.kept), dict(self.routed))

    def update_run(self, leaf: TiledLeaf) -> int:
        """How many adjacent tiles of ``leaf`` send their gradients as one update
        (``overlap.tile_runs.update_run``)."""
        f = self.fetcher
        return update_run(
            f.store.groups[leaf.group].part.padded_numel,
            f.compute_dtype,
            self.depth,
            leaf.n_tiles,
            f.sharding.comm.world_size,
            self.clipping,
        )

    def finish(self, step: StepTiles) -> None:
        """The step's tile fetch counts become ``last`` (a step's metrics); a training step's kept
        tapes and told routings, the next one's prediction (``kept``, ``routed``)."""
        learnt = step.routes.learnt()
        if step.train:
            for mine, theirs in ((self.kept, learnt.kept), (self.routed, learnt.routed)):
                mine.clear()
                mine.update(theirs)
        p = step.prefetcher
        self.last.update(
            tile_fetches_prefetched=p.prefetched,
            tile_fetches_on_demand=p.on_demand,
            tile_fetches_wasted=p.wasted,
            tile_wait_s=p.wait_s,  # how long the ops waited for their tiles
            tile_refill_s=p.refill_s,  # and issued the next ones after each
            experts_routed=learnt.experts(self.streamed),
        )

    def model(self, model: Model, step: StepTiles | None) -> Model:
        """``model`` with each stage that has tiled leaves binding ``step``'s tile handles into its
        params first (``StepTiles.bind``); ``model`` itself where there is no step's tiles."""
        if step is None:
            return model
        return model._replace(
            embed=self._stage(EMBED, model.embed, step),
            block=self._stage(BLOCKS, model.block, step),
            head=self._stage(HEAD, model.head, step),
        )

    def _stage(self, stage: str, s: Stage, step: StepTiles) -> Stage:
        if not self.layout.leaves.get(stage):
            return s
        return Stage(s.init, functools.partial(apply_with_tiles, stage, s.apply, step))


def apply_with_tiles(stage: str, apply, step: StepTiles, params, *args):
    """A stage's ``apply`` with ``step``'s tile handles in place of its tiled leaves' anchors."""
    return apply(step.bind(stage, params), *args)
