"""The engine with bf16 moments (``zf.adamw(moments="bf16")``): the optimizer leaves of the groups whose
whole flat row ``formats.compressed_leaf`` accepts are bf16 rows, updated by ``optim.compressed.adamw_piece_``
piece by piece; its stochastic rounding is keyed by the element's index in the unit's row, so the pieces
give the bits of one call over the whole row.

The gradient a step applied is read back from the clipped path's stashed "grad" rows (a clip far above the
norm: the coefficient is exactly 1, the rows are the gradients as applied).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import BETAS, CFG, EPS, LR, WD, batches

import zinf_fn as zf
from layers import gpt
from zinf_fn.optim import compressed as C
from zinf_fn.state import view


def _opt():
    return zf.adamw(lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD, moments="bf16")


def _rows(v, unit, kinds) -> dict[str, torch.Tensor]:
    out = {}
    for kind in kinds:
        buf = torch.empty(v.shard_numel(unit.group), dtype=v.dtype(kind, unit.group))
        v.read_(kind, unit.group, unit.row, buf).result()   # sync: read
        out[kind] = buf
    return out


def _master(v, rows) -> torch.Tensor | C.RemainderMaster:
    return C.RemainderMaster(rows["param"], rows["remainder"]) if "remainder" in rows else rows["master"]


@pytest.mark.parametrize("placement", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("piece", [4096, 16 << 20], ids=["pieces", "whole"])
@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_engine_update_equals_one_call_over_the_row(tmp_path, placement, piece, master):
    config = zf.Config(offload_params=placement, offload_optimizer=placement, optimizer_piece_bytes=piece,
                       nvme_path=str(tmp_path) if placement == "nvme" else None, clip_grad_norm=1e9, master=master)
    state = zf.init(gpt.model(CFG), _opt(), config, seed=0)
    v = view(state)
    assert v.dtype("opt.0", "blocks") == torch.bfloat16   # 12k elements a row: compressed by the default rule
    assert v.dtype("opt.0", "embed") == torch.float32     # 2.5k: fp32
    kinds = ["param", *v.kinds()[1:3 + 1]]
    data = batches(2)
    state, _ = zf.train_step(state, data[0])
    zf.flush(state)
    v = view(state)
    before = {r: _rows(v, r.unit, kinds) for r in v.rows()}
    state, _ = zf.train_step(state, data[1])
    zf.flush(state)
    v = view(state)
    hyper = C.AdamWHyper(BETAS[0], BETAS[1], EPS, WD)
    for r in v.rows():
        after, rows = _rows(v, r.unit, [*kinds, "grad"]), before[r]
        moments = (C.Bf16Moments if r.group in ("blocks",) else C.Fp32Moments)(rows["opt.0"], rows["opt.1"])
        ref_master = _master(v, rows)
        C.adamw_piece_(after["grad"], ref_master, moments, hyper, 1, LR, 0, r.unit.index)
        for kind in kinds:
            if kind == "param" and master == "fp32":
                continue   # an fp32 master's 16-bit copy is cast by the engine, not by the kernel
            assert torch.equal(after[kind], rows[kind]), f"{r.unit.name} {kind}"
    zf.close(state)


def _train(config: zf.Config, steps: int = 2):
    state = zf.init(gpt.model(CFG), _opt(), config, seed=0)
    losses = []
    for batch in batches(steps):
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
    out = losses, zf.gather_params(state, "master"), metrics
    zf.close(state)
    return out


def test_leaf_gradients_give_the_flat_gradient_bits():
    """Without clipping (one rank, one micro-batch, fp32 compute) the update takes the vjp's leaves
    (``scan.grads.LeafGrads``): a compressed piece gathers them into one gradient, zero in the padding."""
    leaves = _train(zf.Config(offload_params="cpu", offload_optimizer="cpu", optimizer_piece_bytes=4096))
    flat = _train(zf.Config(offload_params="cpu", offload_optimizer="cpu", optimizer_piece_bytes=4096,
                            clip_grad_norm=1e9))
    assert leaves[0] == flat[0]
    for a, b in zip(torch.utils._pytree.tree_leaves(leaves[1]), torch.utils._pytree.tree_leaves(flat[1]),
                    strict=True):
        assert torch.equal(a, b)


def test_sizes_and_nvme_traffic_follow_the_moments(tmp_path):
    config = zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path))
    est = zf.estimate(gpt.model(CFG), _opt(), config)
    fp32 = zf.estimate(gpt.model(CFG), zf.adamw(lr=LR), config)
    state = zf.init(gpt.model(CFG), _opt(), config, seed=0)
    v = view(state)
    blocks = CFG.n_layers * v.shard_numel("blocks")
    assert fp32.states[("nvme", "opt")] - est.states[("nvme", "opt")] == 2 * 2 * blocks   # m, v: 4 -> 2 bytes
    for batch in batches(2):
        state, metrics = zf.train_step(state, batch)
    zf.flush(state)
    assert metrics["bytes_read.nvme"] + metrics["bytes_written.nvme"] == est.moved["nvme"]
    zf.close(state)


def test_int8_moments_are_refused_at_init():
    with pytest.raises(ValueError, match="moments='int8'.*'fp32'.*'bf16'"):
        zf.init(gpt.model(CFG), zf.adamw(moments="int8"), zf.Config(), seed=0)


def test_plan_shows_the_formats():
    state = zf.init(gpt.model(CFG), _opt(), zf.Config(master="remainder"), seed=0)
    assert ("formats: master remainder (int16 rows beside the bf16 params); moments bfloat16 in blocks, "
            "fp32 in embed, head") in zf.plan(state)
    assert "formats: master fp32; moments fp32" in zf.plan(zf.init(gpt.model(CFG), zf.adamw(), zf.Config()))
