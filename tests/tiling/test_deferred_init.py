"""Deferred tiles (``tiling.Deferred``): ``zf.init`` makes a layer's tiles one at a time, with the
same values as the eager tree.

A mixture-of-experts block with ``stream_experts`` declares each expert as a deferred tile; its
stored rows must equal, bitwise, the slices of the stacked experts ``moe.init`` builds for the same
seed without streaming (each expert comes from a generator of its own, so the order the tiles are
made in does not matter). The memory contract is counted, not timed: every tile a ``make`` returns
is tracked by a weak reference, and at most one is alive at any point of ``zf.init`` (the layer's
other tiles are not made yet or already gone), whatever the placement.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from functools import partial

import pytest
import torch

import zinf_fn as zf
from layers import moe
from zinf_fn import tiling
from zinf_fn.model import Model, Stage
from zinf_fn.tiling.layout import MADE_AHEAD

CFG = moe.Config(n_experts=6, top_k=2, d_model=16, d_ff=8)
LAYERS = 2


def _stage(init):
    return Stage(init, None)


def experts_model(cfg: moe.Config) -> Model:
    """A model whose blocks are MoE blocks (init only: ``zf.init`` never applies a block)."""

    def embed_init(gen):
        return {"w": torch.randn(4, generator=gen)}

    return Model(_stage(embed_init), _stage(partial(_block_init, cfg)), _stage(embed_init), LAYERS)


def _block_init(cfg, gen, i):
    return moe.init(cfg, gen)


def _stored_experts(state) -> list[dict]:
    """Each block's expert weights as ``zf.gather_params`` returns them, tiles joined."""
    blocks = zf.gather_params(state)["blocks"]
    return [{k: tiling.untile(b["experts"][k]["w"]) for k in ("gate_up", "down")} for b in blocks]


@pytest.mark.parametrize("placement", ["none", "cpu", "nvme"])
def test_streamed_experts_init_equals_the_stacked_tensors_bitwise(placement, tmp_path):
    for name in ("nvme", "nvme2"):
        (tmp_path / name).mkdir()
    config = zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        param_dtype=torch.float32,
        nvme_path=str(tmp_path / "nvme"),
    )
    whole = zf.init(experts_model(CFG), zf.adamw(), config, seed=3)
    streamed_cfg = dataclasses.replace(CFG, stream_experts=True)
    config = dataclasses.replace(config, nvme_path=str(tmp_path / "nvme2"))
    streamed = zf.init(experts_model(streamed_cfg), zf.adamw(), config, seed=3)
    assert zf.plan(streamed).count("experts.gate_up.w") >= 1  # a tile group of its own
    for a, b in zip(_stored_experts(whole), _stored_experts(streamed), strict=True):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    # ... and both are what moe.init draws for block 0's generator, made by hand
    gen = zf.state.init_unit(experts_model(CFG), zf.state.units(LAYERS)[1], 3)
    assert torch.equal(_stored_experts(whole)[0]["down"], gen["experts"]["down"]["w"])
    zf.close(whole)
    zf.close(streamed)


def test_deferred_tiles_equal_their_eager_twin_and_pass_the_planner():
    tree = moe.init(dataclasses.replace(CFG, stream_experts=True), torch.Generator().manual_seed(5))
    eager = moe.init(CFG, torch.Generator().manual_seed(5))
    made = tiling.materialize(tree)
    assert all(isinstance(t, torch.Tensor) for t in made["experts"]["down"]["w"].tiles)
    assert torch.equal(
        tiling.untile(tree["experts"]["gate_up"]["w"]), eager["experts"]["gate_up"]["w"]
    )
    assert torch.equal(made["router"]["w"], eager["router"]["w"])


class _Counted:
    """Tiles made by ``make`` and still referenced somewhere: ``alive`` now, ``peak`` ever (counted
    under a lock: ``zf.init`` makes tiles on threads of its own)."""

    def __init__(self):
        self.alive = 0
        self.peak = 0
        self.made = 0
        self.lock = threading.Lock()

    def make(self, shape, seed):
        tile = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        with self.lock:
            self.alive += 1
            self.made += 1
            self.peak = max(self.peak, self.alive)
        weakref.finalize(tile, self._gone)
        return tile

    def _gone(self):
        with self.lock:
            self.alive -= 1


@pytest.mark.parametrize("placement", ["none", "cpu", "nvme"])
def test_init_holds_a_few_deferred_tiles_at_a_time(placement, tmp_path):
    counted = _Counted()
    n_tiles, shape = 8, (1, 32, 16)

    def block_init(gen, i):
        seeds = torch.randint(0, 2**62, (n_tiles,), generator=gen).tolist()
        tiles = tuple(tiling.Deferred(shape, partial(counted.make, shape, s)) for s in seeds)
        return {"w": tiling.RowTiles(tiles), "b": torch.zeros(3)}

    model = Model(
        _stage(lambda gen: {"w": torch.zeros(2)}),
        _stage(block_init),
        _stage(lambda gen: {"w": torch.zeros(2)}),
        3,
    )
    config = zf.Config(
        offload_params=placement, offload_optimizer=placement, nvme_path=str(tmp_path)
    )
    state = zf.init(model, zf.adamw(), config)
    assert counted.made == 3 * n_tiles  # each tile made once, by the row that stores it
    # the tile written and those made ahead (tiling.layout.MADE_AHEAD), the layout step included
    assert counted.peak <= 1 + MADE_AHEAD
    assert counted.alive == 0
    zf.close(state)


def test_a_deferred_tile_that_makes_the_wrong_shape_is_named():
    bad = tiling.Deferred((1, 4), partial(torch.zeros, 1, 5))

    def block_init(gen, i):
        return {"w": tiling.RowTiles((bad, bad))}

    model = Model(
        _stage(lambda gen: {"w": torch.zeros(2)}),
        _stage(block_init),
        _stage(lambda gen: {"w": torch.zeros(2)}),
        1,
    )
    with pytest.raises(ValueError, match=r"blocks.0 init: tiled leaf 'w' tile 0.*\(1, 4\)"):
        zf.init(model, zf.adamw())
