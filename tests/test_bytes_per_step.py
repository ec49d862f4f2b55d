"""Bytes a step moves per parameter with every state on NVMe: the floor of 28, for bf16 and fp32 params.

AdamW's master, m and v are read and written once (24 bytes), the 16-bit copy is read once, for the
forward pass, and written once (4 bytes): the backward pass casts the master read ahead for the update
instead of reading the copy again, and an fp32 param copy *is* the master (read for the forward pass,
never written separately). Bitwise equality to the in-RAM run is tests/test_nvme.py's.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import CFG, batches, run_engine

import zinf_fn as zf
from layers import gpt


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_step_moves_28_bytes_per_param_on_nvme(tmp_path, dtype, depth):
    config = zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path),
                       param_dtype=dtype, prefetch_depth=depth)
    opt = zf.adamw()
    state = zf.init(gpt.model(CFG), opt, config)
    for batch in batches(3):
        state, metrics = zf.train_step(state, batch)
        assert metrics["bytes_per_param"] == 28.0
    moved = metrics["bytes_read.nvme"] + metrics["bytes_written.nvme"]
    assert moved == metrics["state_bytes_moved"]


def test_an_fp32_param_copy_on_nvme_is_the_master(tmp_path):
    config = zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path),
                       param_dtype=torch.float32)
    state = zf.init(gpt.model(CFG), zf.adamw(), config)
    store = state.runtime.store
    assert store.param_is_master
    assert not (tmp_path / "rank0" / "params" / "blocks" / "param").exists()   # no second fp32 copy on disk
    (tmp_path / "bf16").mkdir()
    _, _, _, bf16 = run_engine(zf.Config(offload_params="nvme", offload_optimizer="nvme",
                                         nvme_path=str(tmp_path / "bf16"), param_dtype=torch.bfloat16), steps=1)
    ratio = store.state_bytes() / bf16.runtime.store.state_bytes()
    assert ratio == pytest.approx(12 / 14)   # master, m, v: 12 bytes per param; bf16 adds a 2-byte copy

