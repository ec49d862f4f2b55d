"""Experts as tiles (``zinf_fn.tiling.experts``): the op over a ``TileSource`` against the whole
stacked block.

No tolerance: the op makes the same ``F.linear`` calls on the same rows in forward and the same
``mm`` calls autograd makes for ``F.linear`` in backward, so outputs and every gradient are
bitwise those of ``layers.moe`` over the stacked tensors, expert by expert.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tile_sources import LendingSource, RecordingSource

from layers import moe
from zinf_fn import tiling

PLAIN = moe.Config(n_experts=6, top_k=2, d_model=24, d_ff=20)
GPT_OSS = dataclasses.replace(
    PLAIN, softmax_after_topk=True, router_bias=True, expert_bias=True, swiglu_limit=7.0
)
NAMES = ("gate_up", "down")


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def whole_run(cfg: moe.Config, params: dict, x: torch.Tensor):
    """(y, dx, the stacked parameters' gradients) of the block over plain tensors."""
    tree = {
        "router": {k: leaf(v) for k, v in params["router"].items()},
        "experts": {n: {k: leaf(v) for k, v in params["experts"][n].items()} for n in NAMES},
    }
    xx = leaf(x)
    y, logits = moe.apply(cfg, tree, xx)
    (y.square().sum() + logits.sum()).backward()
    grads = {n: {k: v.grad for k, v in tree["experts"][n].items()} for n in NAMES}
    return y, xx.grad, tree["router"]["w"].grad, grads


def streamed_run(cfg: moe.Config, params: dict, x: torch.Tensor, source=LendingSource):
    """The same over ``source`` s of the experts' tiles (the engine's path); the sources too."""
    streamed_cfg = dataclasses.replace(cfg, stream_experts=True)
    # its deferred tiles made, as zf.init makes them one at a time
    tiled = tiling.materialize(moe.init(streamed_cfg, torch.Generator().manual_seed(0)))
    sources = {n: source(tiled["experts"][n]["w"]) for n in NAMES}
    tree = {
        "router": {k: leaf(v) for k, v in params["router"].items()},
        "experts": {
            n: {
                **{k: leaf(v) for k, v in params["experts"][n].items() if k != "w"},
                "w": sources[n],
            }
            for n in NAMES
        },
    }
    xx = leaf(x)
    y, logits = moe.apply(cfg, tree, xx)
    (y.square().sum() + logits.sum()).backward()
    grads = {
        n: {"b": tree["experts"][n]["b"].grad} if "b" in tree["experts"][n] else {} for n in NAMES
    }
    return y, xx.grad, tree["router"]["w"].grad, grads, sources


@pytest.mark.parametrize("cfg", [PLAIN, GPT_OSS], ids=["swiglu", "gpt_oss"])
def test_streamed_experts_equal_the_whole_block_bitwise(cfg):
    params = moe.init(cfg, torch.Generator().manual_seed(0))
    streamed = tiling.materialize(
        moe.init(dataclasses.replace(cfg, stream_experts=True), torch.Generator().manual_seed(0))
    )
    for n in NAMES:  # the same values, as E tiles (1, out, in)
        w = streamed["experts"][n]["w"]
        assert isinstance(w, tiling.RowTiles) and len(w.tiles) == cfg.n_experts
        assert torch.equal(tiling.untile(w), params["experts"][n]["w"])
    x = torch.randn(2, 5, cfg.d_model, generator=torch.Generator().manual_seed(1))
    y, dx, d_router, grads = whole_run(cfg, params, x)
    y2, dx2, d_router2, grads2, sources = streamed_run(cfg, params, x)
    assert torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(d_router, d_router2)
    for n in NAMES:
        whole = grads[n]["w"]
        got = torch.cat(
            [sources[n].grads.get(e, torch.zeros_like(whole[:1])) for e in range(cfg.n_experts)]
        )
        assert torch.equal(got, whole), n
        if cfg.expert_bias:
            assert torch.equal(grads2[n]["b"], grads[n]["b"]), n
    # and over RowTiles of tensors (autograd through each tile): the same outputs
    y3, _ = moe.apply(cfg, streamed, x)
    assert torch.equal(y3, y)


def test_an_expert_without_tokens_is_never_fetched():
    """Top-1 routing of 3 tokens over 6 experts leaves 3 or more experts without a token: the op
    fetches each used expert's tile once in forward and once in backward, one tile at a time, never
    an unused one; the hint names the used experts, in the order they are computed."""
    cfg = dataclasses.replace(PLAIN, top_k=1)
    params = moe.init(cfg, torch.Generator().manual_seed(0))
    x = torch.randn(1, 3, cfg.d_model, generator=torch.Generator().manual_seed(2))
    routing = moe.route(cfg, params["router"], x.reshape(-1, cfg.d_model))
    used = sorted(set(routing.experts.reshape(-1).tolist()))
    assert len(used) < cfg.n_experts
    *_, sources = streamed_run(cfg, params, x, source=RecordingSource)
    for n in NAMES:
        log = sources[n].log
        assert log[0] == ("will_use", tuple(used))
        fetched = [t for kind, t in log if kind == "fetch"]
        assert fetched == used + used[::-1]  # forward in expert order, backward in reverse
        assert sorted(sources[n].grads) == used and sources[n].peak_live == 1


def test_a_frozen_expert_weight_takes_no_gradient():
    """A source whose anchor takes no gradient (a frozen base under LoRA): no tile gradient."""
    params = moe.init(PLAIN, torch.Generator().manual_seed(0))
    x = torch.randn(1, 4, PLAIN.d_model, generator=torch.Generator().manual_seed(3))

    class FrozenSource(RecordingSource):
        def __init__(self, tiled):
            super().__init__(tiled)
            self.anchor = torch.zeros(0)

    y, dx, _, _ = whole_run(PLAIN, params, x)
    y2, dx2, _, _, sources = streamed_run(PLAIN, params, x, source=FrozenSource)
    assert torch.equal(y, y2) and torch.equal(dx, dx2)
    assert all(not s.grads for s in sources.values())


def test_expert_linear_refuses_tiles_that_are_not_experts():
    w = torch.randn(4, 6, 8)
    with pytest.raises(ValueError, match=r"expected the stacked experts as tile\(w, E, axis=0\)"):
        tiling.expert_linear(torch.randn(3, 8), tiling.tile(w, 2, axis=0), 0)
    assert torch.equal(tiling.expert_linear(torch.ones(3, 8), w, 1), torch.ones(3, 8) @ w[1].T)


def test_an_expert_the_union_adds_is_computed_on_no_rows():
    """Over several ranks ``will_use`` returns the union of the ranks' experts: an expert without
    local tokens is then fetched and computed on no rows, and emits a zero gradient, while the
    output and the other gradients stay bitwise the whole block's."""
    cfg = dataclasses.replace(PLAIN, top_k=1)

    class UnionSource(RecordingSource):
        def will_use(self, tiles, others=()):
            super().will_use(tiles, others)
            return tuple(range(len(self.tiles)))  # every expert, as another rank's tokens chose

    params = moe.init(cfg, torch.Generator().manual_seed(0))
    x = torch.randn(1, 3, cfg.d_model, generator=torch.Generator().manual_seed(2))
    y, dx, d_router, grads = whole_run(cfg, params, x)
    y2, dx2, d_router2, _, sources = streamed_run(cfg, params, x, source=UnionSource)
    assert torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(d_router, d_router2)
    for n in NAMES:
        assert sorted(sources[n].grads) == list(range(cfg.n_experts))  # every one fetched twice
        got = torch.cat([sources[n].grads[e] for e in range(cfg.n_experts)])
        assert torch.equal(got, grads[n]["w"]), n
