"""Spillover placement: a state kind's rows split over two tiers is the same training, bit for bit.

A split (``Config.spill_params`` / ``spill_optimizer``, or "auto" with a budget) only moves rows
between tiers, so every parameter, master and moment after N steps must equal a single-tier run's
bitwise, at one rank and at two; the split shows in ``zf.plan`` and in a checkpoint's manifest, and
a checkpoint restores into another split bitwise.
"""

from __future__ import annotations

import json
import os

import optree
import pytest
import torch
from dist_utils import run_world
from engine_helpers import CFG, batches, run_engine
from engine_internals import tier_of

import checkpoints
import zinf_fn as zf
from layers import gpt
from zinf_fn.layout.units import Unit
from zinf_fn.offload.spill import SpillTier
from zinf_fn.state import view

STEPS = 3


def bits(tree) -> list[torch.Tensor]:
    return [x.contiguous().view(torch.uint8) for x in optree.tree_leaves(tree)]


def states_of(state) -> dict:
    """Every row of every kind this rank holds, read through the public state interface."""
    v, out = view(state), {}
    for row in v.rows():
        for kind in v.kinds():
            buf = torch.empty(v.shard_numel(row.group), dtype=v.dtype(kind))
            v.read_(kind, row.group, row.row, buf).result()  # sync: read
            out[(kind, row.group, row.row)] = buf.view(torch.uint8)
    return out


def run(config: zf.Config):
    _, params, _, state = run_engine(config, steps=STEPS, data=batches(STEPS))
    out = params, states_of(state)
    zf.close(state)
    return out


SPLITS = [
    dict(offload_optimizer="cpu", spill_optimizer="2:nvme"),
    dict(
        offload_optimizer="none",
        spill_optimizer="4:nvme",
        offload_params="cpu",
        spill_params="1:nvme",
    ),
    dict(
        offload_optimizer="none",
        spill_optimizer="1:cpu",
        offload_params="none",
        spill_params="3:cpu",
    ),
    dict(
        offload_optimizer="cpu",
        spill_optimizer="0:nvme",
        offload_params="none",
        spill_params="5:nvme",
    ),
]


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_spilled_training_equals_single_tier_bitwise(split, tmp_path):
    ref_params, ref_states = run(zf.Config())
    params, states = run(zf.Config(nvme_path=str(tmp_path), **split))
    assert all(torch.equal(a, b) for a, b in zip(bits(ref_params), bits(params), strict=True))
    assert states.keys() == ref_states.keys()
    assert all(torch.equal(states[k], ref_states[k]) for k in states)


def test_spill_rows_are_routed_by_unit(tmp_path):
    """Units 0..k-1 (embed, blocks) in the fast member, the rest (later blocks, head) in the slow
    one."""
    state = zf.init(
        gpt.model(CFG),
        zf.adamw(),
        zf.Config(offload_optimizer="cpu", spill_optimizer="2:nvme", nvme_path=str(tmp_path)),
    )
    v = view(state)
    tier = tier_of(state, "master")
    assert isinstance(tier, SpillTier) and tier.name == "cpu+nvme"
    assert v.placement_of("master", Unit(0, "embed", 0)) == tier.fast.name == "cpu"
    assert v.placement_of("master", Unit(1, "blocks", 0)) == "cpu"
    assert [v.placement_of("master", Unit(r + 1, "blocks", r)) for r in range(3)] == [
        "cpu",
        "nvme",
        "nvme",
    ]
    assert v.placement_of("opt.0", Unit(4, "head", 0)) == tier.slow.name == "nvme"
    assert v.placement_of("param", Unit(4, "head", 0)) == "none"
    assert tier.split_rows("blocks/master", 3) == (1, 2)
    zf.close(state)


def test_split_shows_in_plan_and_manifest(tmp_path):
    config = zf.Config(offload_optimizer="cpu", spill_optimizer="2:nvme", nvme_path=str(tmp_path))
    state = zf.init(gpt.model(CFG), zf.adamw(), config)
    text = zf.plan(state)
    assert "optimizer: cpu+nvme" in text and "units 0..1 in cpu, 2..4 in nvme" in text
    checkpoints.save(str(tmp_path / "ckpt"), state)
    with open(os.path.join(tmp_path / "ckpt", "manifest.json")) as f:
        manifest = json.load(f)
    assert (
        manifest["config"]["offload_optimizer"] == "cpu"
        and manifest["config"]["spill_optimizer"] == "2:nvme"
    )
    zf.close(state)


def test_restore_into_another_split_is_bitwise(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    config = zf.Config(
        offload_optimizer="cpu", spill_optimizer="2:nvme", nvme_path=str(tmp_path / "a")
    )
    _, _, _, state = run_engine(config, steps=STEPS, data=batches(STEPS))
    saved = states_of(state)
    checkpoints.save(str(tmp_path / "ckpt"), state)
    zf.close(state)
    other = zf.Config(
        offload_params="cpu",
        spill_params="3:nvme",
        offload_optimizer="none",
        spill_optimizer="4:cpu",
        nvme_path=str(tmp_path / "b"),
    )
    restored = checkpoints.restore(str(tmp_path / "ckpt"), gpt.model(CFG), zf.adamw(), other)
    assert view(restored).tier_name("param") == "cpu+nvme"
    got = states_of(restored)
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in got)
    zf.close(restored)


def _world_params(rank, world_size, split, path):
    data = [optree.tree_map(lambda x: x.chunk(world_size)[rank], b) for b in batches(STEPS)]
    config = zf.Config(
        nvme_path=path if split else None, **split
    )  # each rank under its own rank<r>/
    _, params, _, state = run_engine(config, steps=STEPS, data=data)
    zf.close(state)
    return [x.contiguous().view(torch.uint8) for x in optree.tree_leaves(params)]


def _world_run(rank, world_size, split, path) -> tuple:
    """This rank's (single-tier, spilled) parameters, both runs in one world."""
    return _world_params(rank, world_size, {}, path), _world_params(rank, world_size, split, path)


def test_spill_at_world_size_two_is_bitwise(tmp_path):
    split = dict(
        offload_params="cpu",
        spill_params="2:nvme",
        offload_optimizer="cpu",
        spill_optimizer="3:nvme",
    )
    (plain0, spilled0), (plain1, spilled1) = run_world(2, _world_run, split, str(tmp_path))
    for a, b in zip(plain0 + plain1, spilled0 + spilled1, strict=True):
        assert torch.equal(a, b)


def test_bad_splits_name_the_field():
    with pytest.raises(ValueError, match="Config.spill_optimizer='2:none'"):
        zf.Config(offload_optimizer="cpu", spill_optimizer="2:none")
    with pytest.raises(ValueError, match="Config.spill_params='x'"):
        zf.Config(spill_params="x")
    with pytest.raises(ValueError, match="Config.spill_optimizer.*auto"):
        zf.Config(
            offload_optimizer="auto",
            host_memory_budget=1 << 30,
            spill_optimizer="1:nvme",
            nvme_path="/tmp",
        )
    with pytest.raises(ValueError, match="host_memory_budget"):
        zf.Config(offload_optimizer="auto")
    with pytest.raises(ValueError, match="partition='allgather'"):
        zf.Config(
            offload_optimizer="cpu",
            spill_optimizer="1:nvme",
            nvme_path="/tmp",
            partition="broadcast",
        )
