"""Frozen leaves (``zf.Model.trainable``, ``zinf_fn.formats.frozen``) against plain PyTorch with
``requires_grad=False``.

Without clipping the engine runs the same fp32 kernels in the same order as the reference (see
test_engine.py), and neither side computes a frozen leaf's gradient (``requires_grad=False`` on
both), so losses and parameters agree bitwise.
With clipping the norm is summed in float64 over flat shards (test_engine.py's tolerance). Frozen
leaves are compared bitwise with their initial values in every case, and the storage moves with each
other.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import rank_part
from engine_helpers import BETAS, CFG, EPS, LR, WD, batches, max_abs_diff
from frozen_helpers import (
    assert_frozen_unchanged,
    embed_and_norms_frozen,
    only_mlp_trains,
    run_frozen,
    run_frozen_reference,
)

import zinf_fn as zf
from layers import gpt

FP32 = dict(param_dtype=torch.float32)


@pytest.mark.parametrize("trainable", [embed_and_norms_frozen, only_mlp_trains])
@pytest.mark.parametrize("placement", ["none", "cpu", "nvme", "cpu+nvme"])
def test_frozen_matches_requires_grad_false(placement, trainable, tmp_path):
    """ "cpu+nvme": every row of units 2.. (a block's frozen row with its block's) spilled to
    NVMe."""
    fast, _, slow = placement.partition("+")
    spill = {"spill_params": f"2:{slow}", "spill_optimizer": f"2:{slow}"} if slow else {}
    config = zf.Config(
        offload_params=fast,
        offload_optimizer=fast,
        grad_accum=2,
        nvme_path=str(tmp_path) if "nvme" in placement else None,
        **spill,
        **FP32,
    )
    losses, final, initial, _ = run_frozen(config, trainable)
    ref_losses, ref_final = run_frozen_reference(initial, trainable, grad_accum=2)
    assert losses == ref_losses
    assert max_abs_diff(final, ref_final) == 0.0
    assert_frozen_unchanged(initial, final, trainable)
    assert max_abs_diff(final, initial) > 0  # the trainable leaves did train


@pytest.mark.parametrize("placement", ["none", "cpu"])
def test_frozen_with_clipping(placement):
    config = zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        grad_accum=2,
        clip_grad_norm=0.5,
        **FP32,
    )
    losses, final, initial, _ = run_frozen(config, embed_and_norms_frozen)
    ref_losses, ref_final = run_frozen_reference(
        initial, embed_and_norms_frozen, grad_accum=2, clip=0.5
    )
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_abs_diff(final, ref_final) < 1e-4
    assert_frozen_unchanged(initial, final, embed_and_norms_frozen)


def test_frozen_bf16_copies_unchanged_and_placements_bitwise(tmp_path):
    results = []
    for placement in ("none", "cpu", "nvme"):
        (tmp_path / placement).mkdir()
        config = zf.Config(
            offload_params=placement,
            offload_optimizer=placement,
            grad_accum=2,
            nvme_path=str(tmp_path / placement) if placement == "nvme" else None,
            param_dtype=torch.bfloat16,
        )
        losses, final, initial, (before16, after16) = run_frozen(config, only_mlp_trains)
        assert_frozen_unchanged(initial, final, only_mlp_trains)
        assert_frozen_unchanged(before16, after16, only_mlp_trains)
        results.append((losses, final))
    for losses, final in results[1:]:
        assert losses == results[0][0]
        assert max_abs_diff(final, results[0][1]) == 0.0


def test_trainable_none_is_unchanged():
    config = zf.Config(**FP32)
    a = run_frozen(config, None, steps=3)
    b = run_frozen(config, lambda path: True, steps=3)
    assert a[0] == b[0]
    assert max_abs_diff(a[1], b[1]) == 0.0


def test_block_dependent_predicate_is_refused():
    with pytest.raises(ValueError, match=r"blocks\.1.*mlp\.fc\.w|mlp\.fc\.w.*blocks\.1"):
        zf.init(
            gpt.model(CFG)._replace(trainable=lambda path: path != "blocks.1.mlp.fc.w"),
            zf.adamw(),
            zf.Config(**FP32),
        )


def test_plan_marks_frozen_units():
    state = zf.init(
        gpt.model(CFG)._replace(trainable=embed_and_norms_frozen), zf.adamw(), zf.Config(**FP32)
    )
    assert (
        "frozen: embed (every leaf: a param row only, nothing moves back); blocks 4 of 12 leaves "
        "(in "
        "blocks:frozen, a param row only); head 2 of 3 leaves (in head:frozen, a param row only)"
    ) in zf.plan(state)
    assert "backward embed" not in zf.plan(state)  # nothing of it trains: no backward, no refetch
    assert "frozen" not in zf.plan(zf.init(gpt.model(CFG), zf.adamw(), zf.Config(**FP32)))


@pytest.mark.parametrize(
    "compressed", [dict(master="remainder", param_rounding=None), dict(moments="bf16")]
)
def test_frozen_unchanged_with_compressed_states(compressed):
    moments = compressed.pop("moments", "fp32")
    config = zf.Config(
        param_dtype=torch.bfloat16, grad_accum=2, **{k: v for k, v in compressed.items() if v}
    )
    opt = zf.adamw(lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD, moments=moments)
    _, final, initial, (before16, after16) = run_frozen(
        config, only_mlp_trains, steps=3, optimizer=opt
    )
    assert_frozen_unchanged(initial, final, only_mlp_trains)
    assert_frozen_unchanged(before16, after16, only_mlp_trains)
    assert max_abs_diff(final, initial) > 0


def test_frozen_unchanged_with_sgd_momentum():
    opt = zf.sgd(lr=0.1, momentum=0.9, weight_decay=0.01)
    _, final, initial, _ = run_frozen(
        zf.Config(**FP32), embed_and_norms_frozen, steps=3, optimizer=opt
    )
    assert_frozen_unchanged(initial, final, embed_and_norms_frozen)
    assert max_abs_diff(final, initial) > 0


def test_any_optimizer_leaves_frozen_leaves_alone():
    """No frozen leaf is in a row an update touches: an optimizer that decays everything (no mask, a
    name the engine does not know) trains the rest and leaves every frozen leaf bitwise as it
    was."""
    opt = zf.adamw(lr=LR, weight_decay=0.5)._replace(hyperparams={"name": "mine"})
    _, final, initial, _ = run_frozen(
        zf.Config(**FP32), embed_and_norms_frozen, steps=3, optimizer=opt
    )
    assert_frozen_unchanged(initial, final, embed_and_norms_frozen)
    assert max_abs_diff(final, initial) > 0


def _frozen_world(rank: int, world: int) -> dict:
    """Per partition mode: (losses, final master params, initial params) of a world's run (rank's
    slice)."""
    out = {}
    for partition in ("allgather", "broadcast"):
        config = zf.Config(
            offload_params="cpu",
            offload_optimizer="cpu",
            grad_accum=2,
            clip_grad_norm=0.5,
            partition=partition,
            **FP32,
        )
        opt = zf.adamw(lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
        state = zf.init(
            gpt.model(CFG)._replace(trainable=embed_and_norms_frozen), opt, config, seed=0
        )
        initial, losses = zf.gather_params(state), []
        for batch in batches(3):
            state, metrics = zf.train_step(state, rank_part(batch, rank, world))
            losses.append(metrics["loss"])
        out[partition] = (losses, zf.gather_params(state), initial)
    return out


def test_frozen_in_a_world_of_two_trains_as_a_world_of_one():
    """Tolerances as tests/partition/test_distributed.py (a different summation order over ranks);
    frozen leaves bitwise."""
    from dist_utils import run_world

    one = _frozen_world(0, 1)
    for rank_result in run_world(2, _frozen_world):
        for partition, (losses, final, initial) in rank_result.items():
            ref_losses, ref_final, _ = one[partition]
            assert losses == pytest.approx(ref_losses, rel=1e-6)
            assert max_abs_diff(final, ref_final) < 1e-4
            assert_frozen_unchanged(initial, final, embed_and_norms_frozen)
            assert max_abs_diff(final, initial) > 0
