"""The engine with compressed moments (``zf.adamw(moments="bf16" | "int8")``): the optimizer leaves
of the groups whose whole flat row ``formats.compressed_leaf`` accepts are bf16 rows, or int8 code
rows with a per-block scale row each ("opt.<i>.absmax"), updated by
``optim.compressed.adamw_piece_`` piece by piece; the bf16 rounding and the int8 blocks are keyed by
the element's index in the unit's row, so the pieces give the bits of one call over the whole row
(``compressed_helpers``).

The gradient a step applied is read back from the clipped path's stashed "grad" rows (a clip far
above the norm: the coefficient is exactly 1, the rows are the gradients as applied).
"""

from __future__ import annotations

import pytest
import torch
from compressed_helpers import mismatches, one_call, opt, train, unit_rows
from engine_helpers import CFG, batches

import zinf_fn as zf
from layers import gpt
from zinf_fn.optim import formats
from zinf_fn.state import view


def _opt():
    return opt("bf16")


@pytest.mark.parametrize("moments", ["bf16", "int8"])
@pytest.mark.parametrize("placement", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("piece", [4096, 16 << 20], ids=["pieces", "whole"])
@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_engine_update_equals_one_call_over_the_row(tmp_path, moments, placement, piece, master):
    config = zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        optimizer_piece_bytes=piece,
        nvme_path=str(tmp_path) if placement == "nvme" else None,
        clip_grad_norm=1e9,
        master=master,
    )
    state = zf.init(gpt.model(CFG), opt(moments), config, seed=0)
    v = view(state)
    assert (
        v.dtype("opt.0", "blocks") == {"bf16": torch.bfloat16, "int8": torch.uint8}[moments]
    )  # 12k elements a row
    assert v.dtype("opt.0", "embed") == torch.float32  # 2.5k: fp32 by the default rule
    data = batches(2)
    state, _ = zf.train_step(state, data[0])
    v = view(state)
    before = {r: unit_rows(v, r.unit, v.kinds(group=r.group)) for r in v.rows()}
    state, _ = zf.train_step(state, data[1])
    v = view(state)
    wrong = []
    for r in v.rows():
        after = unit_rows(v, r.unit, v.kinds(grads=True, group=r.group))
        wrong += mismatches(v, r.unit, after, one_call(v, r.unit, before[r], after["grad"], 1))
    assert not wrong
    zf.close(state)


def _train(config: zf.Config, steps: int = 2):
    state, losses, metrics = train(zf.init(gpt.model(CFG), _opt(), config, seed=0), batches(steps))
    out = losses, zf.gather_params(state, "master"), metrics
    zf.close(state)
    return out


def test_leaf_gradients_give_the_flat_gradient_bits():
    """Without clipping (one rank, one micro-batch, fp32 compute) the update takes the vjp's leaves
    (``scan.grads.LeafGrads``): a compressed piece gathers them into one gradient, zero in the
    padding."""
    leaves = _train(
        zf.Config(offload_params="cpu", offload_optimizer="cpu", optimizer_piece_bytes=4096)
    )
    flat = _train(
        zf.Config(
            offload_params="cpu",
            offload_optimizer="cpu",
            optimizer_piece_bytes=4096,
            clip_grad_norm=1e9,
        )
    )
    assert leaves[0] == flat[0]
    for a, b in zip(
        torch.utils._pytree.tree_leaves(leaves[1]),
        torch.utils._pytree.tree_leaves(flat[1]),
        strict=True,
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_sizes_and_nvme_traffic_follow_the_moments(tmp_path, moments):
    """What the rows take: m and v of a compressed group as ``formats.moments_nbytes`` counts them
    (bf16 4 bytes an element, int8 2 plus an fp32 scale per block of 256 each), 8 bytes an element
    elsewhere. The planner's bytes per tier and NVMe traffic, the state's own count
    (``state_bytes``) and the engine's counters agree."""
    config = zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path))
    est = zf.estimate(gpt.model(CFG), opt(moments), config)
    state = zf.init(gpt.model(CFG), opt(moments), config, seed=0)
    v = view(state)
    fmt = formats.MomentsFormat(moments)
    shards = {name: (g.rows, g.part.shard_numel) for name, g in v.groups.items()}
    want = sum(
        rows * (formats.moments_nbytes(fmt, n) if name == "blocks" else 8 * n)
        for name, (rows, n) in shards.items()
    )
    assert est.states[("nvme", "opt")] == want and v.state_bytes() == sum(est.states.values())
    for batch in batches(2):
        state, metrics = zf.train_step(state, batch)
    zf.flush(state)
    assert metrics["bytes_read.nvme"] + metrics["bytes_written.nvme"] == est.moved["nvme"]
    zf.close(state)


def test_int8_rows_are_named_and_sized_by_the_store():
    """An int8 group's rows: each leaf's uint8 codes then its fp32 scales, one per block of 256 (the
    vocabulary checkpoints code against: ``kinds(group=)``, ``row_numel``, ``dtype``, ``span``); its
    shards are whole blocks; a group the predicate keeps fp32 has fp32 leaves and no scale rows."""
    keep_head = opt("int8", compress=lambda path, numel: numel >= 4096 and path != "head")
    v = view(zf.init(gpt.model(CFG), keep_head, zf.Config(), seed=0))
    assert v.kinds(group="blocks") == [
        "param",
        "master",
        "opt.0",
        "opt.0.absmax",
        "opt.1",
        "opt.1.absmax",
    ]
    assert (
        v.kinds(group="head")
        == v.kinds(group="embed")
        == v.kinds()
        == ["param", "master", "opt.0", "opt.1"]
    )
    shard = v.shard_numel("blocks")
    assert shard % 256 == 0 and v.row_numel("opt.1.absmax", "blocks") == shard // 256
    assert [v.dtype(k, "blocks") for k in v.kinds(group="blocks")[2:]] == [
        torch.uint8,
        torch.float32,
    ] * 2
    assert v.dtype("opt.0", "head") == torch.float32 and v.span("opt.0.absmax", 2048, 4096) == (
        8,
        16,
    )
    assert v.span("opt.0", 2048, 4096) == (2048, 4096)


def test_plan_shows_the_formats():
    state = zf.init(gpt.model(CFG), _opt(), zf.Config(master="remainder"), seed=0)
    assert (
        "formats: master remainder (int16 rows beside the bf16 params); moments bfloat16 in "
        "blocks, "
        "fp32 in embed, head"
    ) in zf.plan(state)
    assert "formats: master fp32; moments fp32" in zf.plan(
        zf.init(gpt.model(CFG), zf.adamw(), zf.Config())
    )
    int8 = zf.init(gpt.model(CFG), opt("int8"), zf.Config(), seed=0)
    assert (
        'moments int8 (uint8 codes "opt.<i>", an fp32 absmax per 256 elements "opt.<i>.absmax") '
        "in blocks, fp32 in embed, head"
    ) in zf.plan(int8)
