"""The engine with int8 moments (``zf.adamw(moments="int8")``) in every placement, world size and
step path.

The update's bits depend on the blocks of 256 of each unit's padded row only: shards and pieces
start on block boundaries (``RowKinds.shard_align``, ``optim.pieces``), so a world of two (allgather
or broadcast), a spilled optimizer with two update workers, tiled leaves, gradient accumulation and
clipping all leave a unit's rows as one call of ``adamw_piece_`` over the whole row leaves them
(``compressed_helpers``), and every placement trains the same bits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from compressed_helpers import applied_gradient, mismatches, one_call, opt, train, unit_rows
from engine_helpers import CFG, batches

import zinf_fn as zf
from layers import gpt
from zinf_fn.state import view

PIECE = 4096  # the smallest piece (2048 elements): a block's rows are cut in several pieces
EVERY = {"compress": lambda path, numel: True}  # every group int8, the norms' and biases' too


def _step_mismatches(rank: int, world: int, extra: dict, nvme: str | None = None) -> list[str]:
    """Train 2 steps (this rank's part of each batch); the kinds of the rows whose second update
    differs from one call over the whole row (``one_call``), for every unit (the gathers are
    collectives)."""
    clip = extra.get(
        "clip_grad_norm", 1e9
    )  # a clip far above the norm stashes the gradient, coefficient 1
    config = zf.Config(
        offload_params="cpu",
        offload_optimizer="cpu",
        nvme_path=nvme,
        optimizer_piece_bytes=PIECE,
        **{**extra, "clip_grad_norm": clip},
    )
    state = zf.init(gpt.model(CFG), opt("int8", **EVERY), config, seed=0)
    data = [{k: t.chunk(world)[rank] for k, t in batch.items()} for batch in batches(2)]
    state, _ = zf.train_step(state, data[0])
    v = view(state)
    before = {
        u.name: unit_rows(v, r.unit, v.kinds(group=r.group)) for r in v.all_rows() for u in [r.unit]
    }
    state, metrics = zf.train_step(state, data[1])
    v, wrong = view(state), []
    for r in v.all_rows():
        after = unit_rows(v, r.unit, v.kinds(grads=True, group=r.group))
        grad = applied_gradient(after, metrics["grad_norm"], clip)
        wrong += mismatches(v, r.unit, after, one_call(v, r.unit, before[r.unit.name], grad, 1))
    zf.close(state)
    return wrong


def _world_mismatches(rank: int, world: int) -> dict:
    return {
        partition: _step_mismatches(
            rank, world, {"partition": partition, "grad_accum": 2, "clip_grad_norm": 0.5}
        )
        for partition in ("allgather", "broadcast")
    }


def test_a_world_of_two_updates_as_one_call_over_the_row():
    """World 2, allgather (each rank a shard of every row, split on a block boundary) and broadcast
    (each unit on its owner), with grad_accum 2 and clipping that scales: every unit's rows,
    gathered, are one call's."""
    from dist_utils import run_world

    for by_rank in run_world(2, _world_mismatches):
        assert by_rank == {"allgather": [], "broadcast": []}


@pytest.mark.parametrize(
    "extra",
    [
        {"grad_accum": 2},
        {"clip_grad_norm": 0.5},
        {"spill_optimizer": "2:nvme", "update_workers": 2},
    ],
    ids=["accum", "clip", "spilled"],
)
def test_one_rank_updates_as_one_call_over_the_row(tmp_path, extra):
    nvme = str(tmp_path) if "spill_optimizer" in extra else None
    assert _step_mismatches(0, 1, extra, nvme) == []


def _trajectory(config: zf.Config, model=None, steps: int = 3) -> tuple:
    """(losses, every row of every unit after the last step, by kind) of an int8 run."""
    state, losses, _ = train(
        zf.init(model or gpt.model(CFG), opt("int8"), config, seed=0), batches(steps)
    )
    v = view(state)
    rows = {
        (r.unit.name, k): unit_rows(v, r.unit, [k])[k]
        for r in v.rows()
        for k in v.kinds(group=r.group)
    }
    zf.close(state)
    return losses, rows


def test_every_placement_trains_the_same_bits(tmp_path):
    """Storage moves change no bit: none, cpu, nvme, the optimizer spilled to NVMe with two update
    workers, and the remainder master on NVMe against its fp32 twin on the host (the same tie rule),
    tiled leaves and all."""
    model = gpt.model(dataclasses.replace(CFG, mlp_tiles=3, head_tiles=2))

    def config(params: str, optimizer: str, sub: str = "", **kw) -> zf.Config:
        if sub:
            (tmp_path / sub).mkdir()
        return zf.Config(
            offload_params=params,
            offload_optimizer=optimizer,
            optimizer_piece_bytes=PIECE,
            nvme_path=str(tmp_path / sub) if sub else None,
            **kw,
        )

    want = _trajectory(config("none", "none"), model)
    for got in (
        _trajectory(config("cpu", "cpu"), model),
        _trajectory(config("nvme", "nvme", "a"), model),
        _trajectory(config("cpu", "cpu", "b", spill_optimizer="2:nvme", update_workers=2), model),
    ):
        assert got[0] == want[0]
        assert [k for k in want[1] if not torch.equal(got[1][k], want[1][k])] == []
    twin = _trajectory(config("cpu", "cpu", param_rounding="ties_away"), model)
    remainder = _trajectory(config("nvme", "nvme", "c", master="remainder"), model)
    assert remainder[0] == twin[0]
    assert [
        k for k in twin[1] if k[1] != "master" and not torch.equal(remainder[1][k], twin[1][k])
    ] == []


def _zero_loss(model: zf.Model) -> zf.Model:
    """``model`` whose head's loss is multiplied by 0: every gradient is exactly zero."""
    head = model.head

    def zero(params, carry, batch):
        loss = head.apply(params, carry, batch)  # a zf.TokenLoss (token_loss, the default)
        return loss._replace(sum=loss.sum * 0.0)

    return model._replace(head=head._replace(apply=zero))


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
def test_zero_gradients_leave_parameters_unchanged(tmp_path, placement):
    config = zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        optimizer_piece_bytes=PIECE,
        nvme_path=str(tmp_path) if placement == "nvme" else None,
        master="remainder",
    )
    state = zf.init(
        _zero_loss(gpt.model(CFG)),
        zf.adamw(lr=1e-2, weight_decay=0.0, moments="int8"),
        config,
        seed=0,
    )
    initial = zf.gather_params(state, "master")
    for batch in batches(3):
        state, metrics = zf.train_step(state, batch)
    assert metrics["grad_norm"] == 0.0
    for a, b in zip(
        torch.utils._pytree.tree_leaves(initial),
        torch.utils._pytree.tree_leaves(zf.gather_params(state, "master")),
        strict=True,
    ):
        assert torch.equal(a, b)
    zf.close(state)


def test_a_leaf_kept_fp32_keeps_fp32_moments():
    """The predicate keeps the head fp32 (and the default rule the small embedding): after a step
    their m and v are the fp32-moments run's rows, bitwise (the first update reads zero moments in
    both runs and applies the same fp32 values); the int8 blocks' stored moments are codes, another
    dtype."""
    config = zf.Config(offload_params="cpu", offload_optimizer="cpu")
    runs = []
    for optimizer in (opt("int8", compress=lambda path, numel: path == "blocks"), opt("fp32")):
        state = zf.init(gpt.model(CFG), optimizer, config, seed=0)
        state, _ = zf.train_step(state, batches(1)[0])
        v = view(state)
        runs.append(
            {
                (r.unit.name, k): v.gather_row(k, r.unit)
                for r in v.rows()
                for k in ("master", "opt.0", "opt.1")
            }
        )
        zf.close(state)
    int8, fp32 = runs
    assert all(torch.equal(int8[k], fp32[k]) for k in fp32 if not k[0].startswith("blocks"))
    assert all(
        int8[k].dtype == torch.uint8 for k in int8 if k[0].startswith("blocks") and k[1] != "master"
    )
