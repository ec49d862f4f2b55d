"""The tile prefetcher's window for streamed experts, sized in bytes: small expert runs, whose
compute on their few routed rows is far shorter than their read, are issued further ahead than
``prefetch_depth`` (their reads started as they enter the window), up to ``TILE_WINDOW_BYTES`` of
them and at most ``TILE_WINDOW_RUNS``; other tiles (a tiled linear's, tiled to bound memory) stay
``prefetch_depth`` ahead. The pool made still equals the parts' demand
(tests/engine/test_demand.py runs streamed experts on NVMe with grad_accum 2).

Counted, not timed: how far ahead of the run taken the window has issued runs.
"""

from __future__ import annotations

import dataclasses

import torch
from reference import make_batches

import zinf_fn as zf
from layers import gpt, llama, moe
from zinf_fn.overlap import prefetch, tile_runs
from zinf_fn.overlap.window import Window
from zinf_fn.tiling.runs import RunFetcher

MOE = moe.Config(n_experts=16, top_k=2, d_model=32, d_ff=16, stream_experts=True)
CFG = llama.Config(
    vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2, seq_len=8, moe=MOE
)
DEPTH = 2


def test_the_window_holds_as_many_runs_as_its_bytes_allow():
    """``window_runs``: ``depth`` for large runs, more for small ones (``TILE_WINDOW_BYTES`` of
    them, at most ``TILE_WINDOW_RUNS``), never fewer than ``depth``; 0 (nothing ahead) stays 0."""
    budget, most = tile_runs.TILE_WINDOW_BYTES, tile_runs.TILE_WINDOW_RUNS
    assert tile_runs.window_runs([budget], DEPTH) == DEPTH
    assert tile_runs.window_runs([budget // 4, budget // 8], DEPTH) == 4  # the largest run's
    assert tile_runs.window_runs([1], DEPTH) == most
    assert tile_runs.window_runs([1], 0) == 0
    assert tile_runs.window_runs([], DEPTH) == DEPTH  # no streamed experts


def test_a_window_widens_over_the_items_further_lets_in():
    """``window.Window(further=, reach=)``: past ``depth``, the items right after it for which
    ``further`` holds, up to ``reach`` ahead; the first it refuses ends the window."""
    small = {2, 3, 4, 6}
    issued: list[int] = []
    window = Window(
        range(10), issued.append, lambda _: None, 2, further=small.__contains__, reach=6
    )
    window.advance(0)
    assert issued == [0, 1, 2, 3, 4]  # 5 is not small: the window ends there
    assert list(window.span(4)) == [4, 5, 6]  # depth first, whatever further says
    assert list(window.span(7)) == [7, 8]


def _widened(cursor: int, n: int, depth: int, reach: int, further) -> range:
    """The window's span by its definition: ``depth`` items, then those ``further`` lets in."""
    end, last = min(cursor + depth, n), min(cursor + reach, n)
    while end < last and further(end):
        end += 1
    return range(cursor, end)


class Further:
    """A window's ``further`` over a plan of flags that a test may change, recording what it is
    asked."""

    def __init__(self, plan: list[bool]):
        self.plan, self.asked = plan, []

    def __call__(self, j: int) -> bool:
        self.asked.append(j)
        return self.plan[j]


def test_a_window_asks_further_once_of_an_item_it_holds_for_until_the_plan_changes():
    """``Window.span`` remembers the positions ``further`` held for, so a window moved one item
    asks it of the items past them only; a revision (``replanned``) forgets them: over random
    plans and revisions, each span is its definition's, and no item ``further`` held for is asked
    again before the plan changes."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        further = Further([bool(b) for b in torch.rand(40, generator=gen) < 0.8])
        plan = further.plan
        window = Window(range(40), lambda j: j, lambda _: None, 2, further=further, reach=9)
        held: set[int] = set()  # the items further held for, since the plan last changed
        for cursor in range(40):
            if torch.rand(1, generator=gen) < 0.1:  # a revision: the plan changes from here
                plan[cursor:] = [bool(b) for b in torch.rand(40 - cursor, generator=gen) < 0.8]
                window.replanned()
                held.clear()
            further.asked.clear()
            span = window.span(cursor)
            assert span == _widened(cursor, 40, 2, 9, plan.__getitem__), (cursor, plan)
            assert not held & set(further.asked), (cursor, further.asked)
            held |= {j for j in further.asked if plan[j]}


def _ahead(model: zf.Model, config: zf.Config, batch: dict, monkeypatch) -> int:
    """The most runs the tile prefetcher (the step's prefetcher of tile runs, ``RunFetcher``)
    issued ahead of the one taken, over one training step."""
    seen = {"taken": -1, "ahead": 0}
    issue, get = prefetch.Prefetcher._issue, prefetch.Prefetcher.get

    def logged_issue(self, j):
        if isinstance(self.fetcher, RunFetcher):
            seen["ahead"] = max(seen["ahead"], j - seen["taken"])
        return issue(self, j)

    def logged_get(self, j):
        if isinstance(self.fetcher, RunFetcher):
            seen["taken"] = j
        return get(self, j)

    state = zf.init(model, zf.adamw(lr=1e-3), config, seed=0)
    monkeypatch.setattr(prefetch.Prefetcher, "_issue", logged_issue)
    monkeypatch.setattr(prefetch.Prefetcher, "get", logged_get)
    for b in batch:
        state, _ = zf.train_step(state, b)
    zf.close(state)
    return seen["ahead"]


def test_streamed_experts_are_fetched_further_ahead_than_tiled_linears(monkeypatch):
    """Runs of one tile (``TILE_RUN_BYTES`` 1 byte): the experts' window reaches past
    ``prefetch_depth`` (to ``TILE_WINDOW_RUNS`` runs of these tiny tiles, less where a layer's
    runs end at a unit without tiles); a tiled GPT's linears stay ``prefetch_depth`` ahead. Two
    steps each."""
    monkeypatch.setattr(tile_runs, "TILE_RUN_BYTES", 1)
    config = zf.Config(param_dtype=torch.float32, prefetch_depth=DEPTH)
    experts = _ahead(llama.model(CFG), config, make_batches(CFG, 2, 4, seed=1), monkeypatch)
    assert experts > DEPTH, experts
    tiled = dataclasses.replace(
        gpt.Config(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=16), mlp_tiles=4
    )
    linears = _ahead(gpt.model(tiled), config, make_batches(tiled, 2, 4, seed=1), monkeypatch)
    assert linears == DEPTH, linears
