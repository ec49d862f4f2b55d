"""The step's in-step events are entries of its plan (``overlap.plan.step_plan``): data that
``zf.plan`` prints and the step driver runs on the entry that names them, nothing else."""

from __future__ import annotations

import pytest
from engine_helpers import CFG, batches

import zinf_fn as zf
from layers import gpt
from zinf_fn.layout.units import units
from zinf_fn.optim.updater import Updater
from zinf_fn.overlap.fetch import Fetcher
from zinf_fn.overlap.plan import BEGIN_UPDATES, READ_EARLY, step_plan, train_plan


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("clipping", [False, True])
def test_step_plan_marks_its_events_on_the_train_plan(depth, clipping):
    """The optimizer's reads begin ``depth`` entries before the head; the next step's early reads on
    the backward's last entry, and only without clipping; the fetches are the train plan's."""
    all_units = units(CFG.n_layers)
    plan = step_plan(all_units, True, 0, depth, clipping)
    head = all_units[-1].index
    marked = {i: op.events for i, op in enumerate(plan) if op.events}
    want = {head - depth: (BEGIN_UPDATES,)}
    if not clipping:
        want[len(plan) - 1] = (READ_EARLY,)
    assert marked == want
    fetches = [(op.unit, op.phase) for op in train_plan(all_units)]
    assert [(op.unit, op.phase) for op in plan] == fetches


def test_zf_plan_prints_the_events():
    """Each event at the end of its entry's line: depth 1 begins the optimizer's reads on the last
    block's forward, the early reads on the embedding's backward (the last entry)."""
    state = zf.init(gpt.model(CFG), zf.adamw(lr=1e-3), zf.Config(prefetch_depth=1))
    events = [
        line.split()[:4] + line.split("; then ")[1:]
        for line in zf.plan(state).splitlines()
        if "; then " in line
    ]
    last = CFG.n_layers - 1
    assert events == [
        [str(last + 1), "fetch", "forward", f"blocks.{last}", BEGIN_UPDATES],
        [str(2 * CFG.n_layers + 2), "fetch", "backward", "embed", READ_EARLY],
    ]


def test_the_step_starts_each_event_on_its_entry(monkeypatch):
    """With prefetch depth 0 every fetch runs on demand, in plan order: each event comes right after
    the fetch of the entry that names it, once a step."""
    log = []
    fetch, begin_step, read_early = Fetcher.fetch, Updater.begin_step, Fetcher.read_early

    def logged_fetch(self, unit, started=None):
        log.append(unit.name)
        return fetch(self, unit, started)

    def logged_begin(self, all_units, clipping):
        log.append(BEGIN_UPDATES)
        begin_step(self, all_units, clipping)

    def logged_early(self, all_units, most):
        log.append(READ_EARLY)
        read_early(self, all_units, most)

    monkeypatch.setattr(Fetcher, "fetch", logged_fetch)
    monkeypatch.setattr(Updater, "begin_step", logged_begin)
    monkeypatch.setattr(Fetcher, "read_early", logged_early)
    state = zf.init(gpt.model(CFG), zf.adamw(lr=1e-3), zf.Config(prefetch_depth=0))
    log.clear()
    zf.train_step(state, batches(1)[0])
    plan = step_plan(units(CFG.n_layers), True, 0, 0, False)
    want = []
    for op in plan:
        want += [op.unit.name, *op.events]
    assert log == want
