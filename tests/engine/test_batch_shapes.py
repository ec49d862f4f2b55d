"""Batches of a few lengths in one run (rows padded to bucket lengths): the engine trains them as
plain PyTorch does, every placement bitwise alike, and a step is the same whatever shapes came
before it (nothing carried between steps depends on them)."""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
from engine_helpers import BETAS, CFG, EPS, LR, WD, max_abs_diff, run_engine, run_reference
from reference import make_batches

import checkpoints
import zinf_fn as zf
from layers import gpt

# short, then the longest (the offloaded rows grow), then between the two (a smaller one fits)
LENGTHS = (8, 16, 12, 16, 8)
PLACEMENTS = ("none", "cpu", "nvme")


def mixed_batches(batch_size: int = 8) -> list[dict]:
    """One batch per length of ``LENGTHS``, (batch_size, T) each."""
    return [make_batches(CFG, 1, batch_size, seed=i, seq_len=t)[0] for i, t in enumerate(LENGTHS)]


def placed(placement: str, tmp_path, **kw) -> zf.Config:
    """Every state and the boundary carries at ``placement`` (NVMe files under ``tmp_path``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    return zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        offload_activations=placement,
        nvme_path=str(tmp_path) if placement == "nvme" else None,
        **kw,
    )


def assert_same_bits(a, b) -> None:
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_mixed_lengths_train_bitwise_like_pytorch(grad_accum):
    data = mixed_batches()
    config = zf.Config(param_dtype=torch.float32, grad_accum=grad_accum)
    losses, final, initial, _ = run_engine(config, data=data)
    ref_losses, ref_final = run_reference(initial, grad_accum=grad_accum, data=data)
    # an fp32 run is the reference's own kernels in the same order (as tests/engine/test_engine.py)
    assert losses == ref_losses
    assert max_abs_diff(final, ref_final) == 0.0


@pytest.mark.parametrize("tiles", [1, 2])
@pytest.mark.parametrize("placement", PLACEMENTS[1:])
def test_mixed_lengths_bitwise_across_placements(tmp_path, placement, tiles):
    data = mixed_batches()
    cfg = dataclasses.replace(CFG, mlp_tiles=tiles, head_tiles=tiles)
    common = dict(param_dtype=torch.bfloat16, grad_accum=2)
    ref_losses, ref_final, _, _ = run_engine(zf.Config(**common), data=data, cfg=cfg)
    config = placed(placement, tmp_path, **common)
    losses, final, _, state = run_engine(config, data=data, cfg=cfg)
    assert losses == ref_losses
    assert_same_bits(final, ref_final)
    zf.close(state)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_each_step_as_in_a_fresh_state(tmp_path, placement):
    """The run over every length, against each step taken in a state restored afresh from a
    checkpoint of the step before (a state that has seen no other batch shape)."""
    data = mixed_batches()
    kw = dict(param_dtype=torch.bfloat16, grad_accum=2)
    _, final, _, state = run_engine(placed(placement, tmp_path / "run", **kw), data=data)
    zf.close(state)
    opt = zf.adamw(lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)  # run_engine's
    model = gpt.model(CFG)
    state = zf.init(model, opt, placed(placement, tmp_path / "fresh0", **kw), seed=0)
    for i, batch in enumerate(data):
        state, _ = zf.train_step(state, batch)
        path = str(tmp_path / f"ckpt{i}")
        checkpoints.save(path, state)
        zf.close(state)
        config = placed(placement, tmp_path / f"fresh{i + 1}", **kw)
        state = checkpoints.restore(path, model, opt, config)
    assert_same_bits(zf.gather_params(state), final)
    zf.close(state)
