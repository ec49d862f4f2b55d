"""The public state interface's views of the engine (``zinf_fn.state``): counters, tiers, the tier
seam, and the gathered trees (``zf.gather_params`` is ``zinf_fn.state.gather_params``)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import CFG, batches

import zinf_fn as zf
import zinf_fn.planner
import zinf_fn.state
from layers import gpt
from zinf_fn.state import Counters, view


def _init(**kw) -> zf.TrainState:
    return zf.init(gpt.model(CFG), zf.adamw(), zf.Config(**kw))


def test_gather_params_lives_in_the_state_interface():
    assert zf.gather_params is zinf_fn.state.gather_params
    assert not hasattr(zinf_fn.planner, "gather_params") and not hasattr(
        zinf_fn.planner, "gather_row"
    )
    state = _init()
    full = zf.gather_params(state)
    v = view(state)
    for unit in zinf_fn.state.units(CFG.n_layers):  # a gathered row is the flat tree of its unit
        flat = zinf_fn.state.gather_row(state, "master", unit)
        tree = full["blocks"][unit.row] if unit.group == "blocks" else full[unit.group]
        assert flat.numel() == v.groups[unit.group].spec.numel
        assert torch.equal(flat, torch.cat([x.flatten() for x in _leaves(tree)]))
    with pytest.raises(ValueError, match="kind must be 'master' or 'param'"):
        zf.gather_params(state, "opt.0")
    zf.close(state)


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree)


def test_counters_are_the_cumulative_figures_a_step_reports_differences_of():
    state = _init(offload_params="cpu", offload_optimizer="cpu")
    before = view(state).counters()
    assert isinstance(before, Counters) and set(before.tiers) == {"param", "optimizer"}
    state, metrics = zf.train_step(state, batches(1)[0])
    after = view(state).counters()
    for counter in ("bytes_read", "bytes_written"):  # both tiers are "cpu": the metric sums them
        moved = sum(
            after.tiers[role][counter] - before.tiers[role][counter] for role in after.tiers
        )
        assert moved == metrics[f"{counter}.cpu"]
    assert (
        after.pool_made == metrics["buffers"]
        and after.peak_live_layers == metrics["peak_live_layers"]
    )
    assert after.live_layers == 0 and after.pool_out == after.write_behind_buffers
    assert after.pool_peak_out >= after.pool_out
    zf.close(state)


@pytest.mark.parametrize("clip, leaves", [(None, True), (1.0, False)])
def test_counters_say_whether_a_step_kept_leaf_gradients(clip, leaves):
    state = _init(param_dtype=torch.float32, clip_grad_norm=clip)
    assert not view(state).counters().leaf_grads  # no step yet
    state, _ = zf.train_step(state, batches(1)[0])
    assert view(state).counters().leaf_grads == leaves  # clipping needs the flat buffers
    zf.close(state)


def test_tier_names_and_engine(tmp_path):
    state = _init(
        offload_params="nvme",
        offload_optimizer="cpu",
        spill_optimizer="2:nvme",
        nvme_path=str(tmp_path),
    )
    v = view(state)
    assert (v.tier_name("param"), v.tier_name("master"), v.tier_name("opt.0")) == (
        "nvme",
        "cpu+nvme",
        "cpu+nvme",
    )
    assert v.nvme_engine("param") == v.nvme_engine("master") == state.config.nvme_engine
    zf.close(state)
    state = _init()
    assert view(state).tier_name("param") == "none" and view(state).nvme_engine("param") is None
    zf.close(state)


class CountingTier:
    """Counts the calls a tier gets, by method, and forwards them."""

    def __init__(self, inner):
        self.inner, self.calls = inner, {}

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kwargs)

        return call


@pytest.mark.parametrize("kind", ["param", "master"])
def test_a_wrapped_tier_sees_the_next_steps_and_trains_the_same(kind, tmp_path):
    data = batches(2)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = _init(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path / "a"))
    wrapped = _init(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path / "b"))
    counting = view(wrapped).wrap_tier_(kind, CountingTier)
    for batch in data:
        plain, want = zf.train_step(plain, batch)
        wrapped, got = zf.train_step(wrapped, batch)
        assert got["loss"] == want["loss"]
    assert counting.calls.get("read_", 0) > 0 and counting.calls.get("write_", 0) > 0
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            _leaves(zf.gather_params(wrapped)), _leaves(zf.gather_params(plain)), strict=True
        )
    )
    zf.close(plain)
    zf.close(wrapped)
