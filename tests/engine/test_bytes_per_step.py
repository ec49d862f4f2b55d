"""Bytes a step moves per parameter with every state on NVMe: the floor of 28, for bf16 and fp32
params.

AdamW's master, m and v are read and written once (24 bytes), the 16-bit copy is read once, for the
forward pass, and written once (4 bytes): the backward pass casts the master read ahead for the
update instead of reading the copy again, and an fp32 param copy *is* the master (read for the
forward pass, never written separately). Bitwise equality to the in-RAM run is
tests/offload/test_nvme.py's.

A unit whose row is larger than four optimizer pieces does not lend its master (it would be held
whole from the backward fetch to the update): its backward fetch reads the 16-bit copy again, 2
bytes per parameter more (4 with fp32 params, whose copy is the master). Bitwise equality with
pieces that small is tests/optim/test_optimizer_pieces.py's.
"""

from __future__ import annotations

import re

import pytest
import torch
from engine_helpers import CFG, batches, run_engine

import zinf_fn as zf
from layers import gpt
from zinf_fn.state import view


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_step_moves_28_bytes_per_param_on_nvme(tmp_path, dtype, depth):
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
        param_dtype=dtype,
        prefetch_depth=depth,
    )
    opt = zf.adamw()
    state = zf.init(gpt.model(CFG), opt, config)
    for batch in batches(3):
        state, metrics = zf.train_step(state, batch)
        assert metrics["bytes_per_param"] == 28.0
    moved = metrics["bytes_read.nvme"] + metrics["bytes_written.nvme"]
    assert moved == metrics["state_bytes_moved"]


def test_an_fp32_param_copy_on_nvme_is_the_master(tmp_path):
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
        param_dtype=torch.float32,
    )
    state = zf.init(gpt.model(CFG), zf.adamw(), config)
    v = view(state)
    assert v.param_is_master
    assert not (
        tmp_path / "rank0" / "params" / "blocks" / "param"
    ).exists()  # no second fp32 copy on disk
    (tmp_path / "bf16").mkdir()
    _, _, _, bf16 = run_engine(
        zf.Config(
            offload_params="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path / "bf16"),
            param_dtype=torch.bfloat16,
        ),
        steps=1,
    )
    ratio = v.state_bytes() / view(bf16).state_bytes()
    assert ratio == pytest.approx(
        12 / 14
    )  # master, m, v: 12 bytes per param; bf16 adds a 2-byte copy


@pytest.mark.parametrize("dtype, extra", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_units_larger_than_four_pieces_read_their_copy_for_the_backward_pass(
    tmp_path, dtype, extra
):
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
        param_dtype=dtype,
        optimizer_piece_bytes=4096,
    )  # 2048 elements: a block is 6.2 pieces
    state = zf.init(gpt.model(CFG), zf.adamw(), config)
    groups = view(state).groups
    lent = {name: g.part.shard_numel <= 4 * 2048 for name, g in groups.items()}
    assert lent == {"embed": True, "blocks": False, "head": True}
    numel = {
        name: g.spec.numel * (CFG.n_layers if name == "blocks" else 1) for name, g in groups.items()
    }
    # only the blocks' backward fetches read their copy again (the head is fetched once for both
    # passes)
    expected = 28 + extra * numel["blocks"] / sum(numel.values())
    for batch in batches(2):
        state, metrics = zf.train_step(state, batch)
        assert metrics["bytes_per_param"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "kw",
    [
        dict(offload_params="nvme", offload_optimizer="nvme"),  # every master lent
        dict(
            offload_params="nvme", offload_optimizer="nvme", optimizer_piece_bytes=4096
        ),  # blocks lend none
        dict(
            offload_params="nvme", offload_optimizer="nvme", param_dtype=torch.float32
        ),  # param = master
        dict(
            offload_params="nvme", offload_optimizer="nvme", clip_grad_norm=0.5
        ),  # stashed gradients
        dict(
            offload_params="cpu", offload_optimizer="cpu", spill_optimizer="2:nvme"
        ),  # spilled optimizer
        dict(offload_params="nvme", offload_optimizer="cpu", prefetch_depth=2),  # params only
    ],
    ids=str,
)
def test_the_estimate_predicts_the_bytes_a_step_moves_on_nvme(tmp_path, kw):
    config = zf.Config(nvme_path=str(tmp_path), **kw)
    est = zf.estimate(gpt.model(CFG), zf.adamw(), config)
    state = zf.init(gpt.model(CFG), zf.adamw(), config)
    for batch in batches(2):
        state, metrics = zf.train_step(state, batch)
    on_nvme = [
        k
        for k in metrics
        if re.fullmatch(r"(nvme\.)?bytes_(read|written)\.(nvme|[a-z]+\+nvme)", k)
        and (k.startswith("nvme.") or k.endswith(".nvme"))
    ]
    assert est.moved.get("nvme", 0) == sum(metrics[k] for k in on_nvme) > 0
