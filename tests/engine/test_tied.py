"""Tied input/output embeddings (``zf.Tie``): one weight, stored and updated once, used by embed and
head.

The reference is ``RefGPT`` with ``lm_head.weight = tok_emb.weight`` (one ``nn.Parameter``) and
``torch.optim.AdamW(fused=True)``. Autograd sums the head's and the embedding's gradient of the
shared leaf per micro-batch (``h + e``, then ``.grad`` accumulates over micro-batches); the engine
holds the head's part until the embedding's backward and adds it in the same order, so without
clipping the training is bitwise equal, in every placement and with gradient accumulation. With
clipping the norm is summed in float64 over flat shards (see test_engine's tolerances: rel 1e-5 on
losses, 1e-4 on params). World size 2 against world size 1: test_distributed's bounds (Adam params
1e-4, losses 1e-6 relative).
"""

from __future__ import annotations

import json
import os

import optree
import pytest
import torch
from dist_utils import rank_part, run_world
from engine_helpers import CFG, batches, max_abs_diff, run_engine, run_reference
from reference import RefGPT, load_tree

import checkpoints
import zinf_fn as zf
from layers import gpt
from zinf_fn.state import view

TIED = gpt.Config(**{**CFG.__dict__, "tie_embeddings": True})
FP32 = dict(param_dtype=torch.float32)
STEPS = 10


def _config(placement: str, tmp_path, **kw) -> zf.Config:
    nvme = dict(nvme_path=str(tmp_path)) if placement == "nvme" else {}
    return zf.Config(offload_params=placement, offload_optimizer=placement, **nvme, **FP32, **kw)


@pytest.mark.parametrize(
    ("placement", "grad_accum"), [("none", 1), ("cpu", 1), ("nvme", 1), ("cpu", 2), ("nvme", 2)]
)
def test_tied_training_is_bitwise_torch_adamw(placement, grad_accum, tmp_path):
    config = _config(placement, tmp_path, grad_accum=grad_accum)
    losses, final, initial, _ = run_engine(config, steps=STEPS, cfg=TIED)
    ref_losses, ref_final = run_reference(initial, steps=STEPS, grad_accum=grad_accum, cfg=TIED)
    assert losses == ref_losses
    assert max_abs_diff(final, ref_final) == 0.0
    assert (
        final["head"]["lm_head"]["w"] is final["embed"]["tok"]["w"]
    )  # gather_params: both places, one tensor


def test_tied_training_with_mask_and_schedule_is_bitwise():
    losses, final, initial, _ = run_engine(
        zf.Config(**FP32), steps=STEPS, mask=True, schedule=True, cfg=TIED
    )
    ref_losses, ref_final = run_reference(initial, steps=STEPS, mask=True, schedule=True, cfg=TIED)
    assert losses == ref_losses
    assert max_abs_diff(final, ref_final) == 0.0


@pytest.mark.parametrize(("placement", "grad_accum"), [("cpu", 1), ("nvme", 2)])
def test_tied_training_with_clipping_matches_torch(placement, grad_accum, tmp_path):
    config = _config(placement, tmp_path, grad_accum=grad_accum, clip_grad_norm=0.5)
    losses, final, initial, _ = run_engine(config, steps=STEPS, cfg=TIED)
    ref_losses, ref_final = run_reference(
        initial, steps=STEPS, grad_accum=grad_accum, clip=0.5, cfg=TIED
    )
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_abs_diff(final, ref_final) < 1e-4


def test_the_head_gradient_counts_the_embedding_is_updated_once():
    """Dropping either use's gradient, or updating the weight twice, would change the run: the
    engine's tied weight moves exactly as the reference's, which an untied run of the same initial
    weights does not."""
    _, tied, initial, state = run_engine(zf.Config(**FP32), steps=3, cfg=TIED)
    v = view(state)
    assert [leaf.path for leaf in v.groups["head"].spec.leaves] == [
        "ln_f.b",
        "ln_f.w",
    ]  # stored once: embed
    assert v.ties == (zf.Tie("tok.w", "lm_head.w"),)
    untied_initial = {
        **initial,
        "head": {**initial["head"], "lm_head": {"w": initial["embed"]["tok"]["w"].clone()}},
    }
    _, untied = run_reference(untied_initial, steps=3)
    assert max_abs_diff(tied["embed"], untied["embed"]) > 0


def test_plain_loss_is_the_tied_reference():
    model = gpt.model(TIED)
    state = zf.init(model, zf.adamw(lr=1e-3), zf.Config(**FP32))
    params = zf.gather_params(state)
    ref = load_tree(RefGPT(TIED), params)
    batch = batches(1)[0]
    assert torch.equal(zf.plain_loss(model, params, batch), ref(batch["inputs"], batch["targets"]))
    assert torch.equal(
        zf.eval_step(state, batch), ref(batch["inputs"], batch["targets"]).detach().double()
    )


def test_a_head_that_returns_the_tied_leaf_is_refused():
    model = gpt.model(TIED)
    untied_head = gpt.model(CFG).head
    with pytest.raises(ValueError, match=r"head.init returned 'lm_head.w', expected it absent"):
        zf.init(model._replace(head=untied_head), zf.adamw(lr=1e-3), zf.Config(**FP32))
    with pytest.raises(ValueError, match=r"embed tree has no leaf at key path 'tok.weight'"):
        zf.init(
            model._replace(ties=(zf.Tie("tok.weight", "lm_head.w"),)),
            zf.adamw(lr=1e-3),
            zf.Config(**FP32),
        )
    with pytest.raises(ValueError, match="head_tiles=1"):
        gpt.Config(tie_embeddings=True, head_tiles=2)


def test_checkpoint_saves_the_tied_weight_once_and_resumes_bitwise(tmp_path):
    data = batches(6)
    config = zf.Config(offload_params="cpu", offload_optimizer="cpu", **FP32)
    straight, final, _, _ = run_engine(config, data=data, cfg=TIED)
    opt = zf.adamw(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    state = zf.init(gpt.model(TIED), opt, config)
    for batch in data[:3]:
        state, _ = zf.train_step(state, batch)
    checkpoints.save(str(tmp_path / "ckpt"), state)
    manifest = json.load(open(tmp_path / "ckpt" / "manifest.json"))
    assert manifest["ties"] == [{"embed": "tok.w", "head": "lm_head.w"}]
    assert [leaf["path"] for leaf in manifest["groups"]["head"]["leaves"]] == ["ln_f.b", "ln_f.w"]
    state = checkpoints.restore(str(tmp_path / "ckpt"), gpt.model(TIED), opt, config)
    losses = []
    for batch in data[3:]:
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
    assert losses == straight[3:]
    assert max_abs_diff(zf.gather_params(state), final) == 0.0
    manifest["ties"] = []  # a manifest that says the model was untied: the restore refuses it
    with open(tmp_path / "ckpt" / "manifest.json", "w") as f:
        json.dump(manifest, f)
    with pytest.raises(checkpoints.CheckpointError, match=r"ties.*expected .*tok\.w"):
        checkpoints.restore(str(tmp_path / "ckpt"), gpt.model(TIED), opt, config)


def _world_run(rank: int, world: int, partition: str, grad_accum: int) -> tuple:
    config = zf.Config(
        offload_params="cpu",
        offload_optimizer="cpu",
        partition=partition,
        grad_accum=grad_accum,
        **FP32,
    )
    state = zf.init(gpt.model(TIED), zf.adamw(lr=3e-3, weight_decay=0.1), config)
    losses = []
    for batch in batches(4):
        state, metrics = zf.train_step(state, rank_part(batch, rank, world))
        losses.append(metrics["loss"])
    return losses, zf.gather_params(state)


WORLD_CASES = [("allgather", 2), ("broadcast", 1)]


def _world_cases(rank: int, world: int) -> list:
    """This rank's run of each of ``WORLD_CASES``, all in one world."""
    return [_world_run(rank, world, partition, accum) for partition, accum in WORLD_CASES]


@pytest.fixture(scope="module")
def world_of_two() -> list:
    """Each rank's runs of ``WORLD_CASES``: one spawned world of 2 for them all."""
    return run_world(2, _world_cases)


@pytest.mark.parametrize("case", range(len(WORLD_CASES)), ids=["allgather-2", "broadcast-1"])
def test_tied_world_of_two_trains_as_a_world_of_one(case, world_of_two):
    one_losses, one = _world_run(0, 1, "allgather", WORLD_CASES[case][1])
    for losses, params in (runs[case] for runs in world_of_two):
        assert losses == pytest.approx(one_losses, rel=1e-6)
        assert max_abs_diff(params, one) < 1e-4
        assert torch.equal(params["head"]["lm_head"]["w"], params["embed"]["tok"]["w"])
    assert os.environ.get("RANK") is None  # the world ran in child processes only


def test_tied_model_with_tiled_blocks_trains_like_untiled():
    """Ties and tiling together (the head's packed tree keeps its own leaves' indices): tiled blocks
    only reassociate fp32 sums, so test_tiling_engine's bound (1e-4, 3% of one lr step) holds."""
    from zinf_fn import tiling

    tiled = gpt.Config(**{**TIED.__dict__, "mlp_tiles": 2, "attn_tiles": 2})
    losses, final, _, _ = run_engine(zf.Config(**FP32), steps=5, cfg=TIED)
    tiled_losses, tiled_final, _, _ = run_engine(
        zf.Config(offload_params="cpu", offload_optimizer="cpu", **FP32), steps=5, cfg=tiled
    )
    untiled = optree.tree_map(tiling.untile, tiled_final, is_leaf=tiling.is_tiled)
    assert tiled_losses == pytest.approx(losses, rel=1e-5)
    assert max_abs_diff(untiled, final) < 1e-4
