"""The step-time model's pieces: the time model on a known synthetic Machine, the NVMe bytes per
phase against the engine's own counters, the timed stages' arithmetic and caching. No test asserts a
wall time."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import CFG

import zinf_fn as zf
from layers import gpt
from zinf_fn.planner import auto, compute, sizes
from zinf_fn.planner.machine import Machine
from zinf_fn.planner.memory import Traffic
from zinf_fn.planner.sizes import Work, plan_config
from zinf_fn.planner.timing import predict
from zinf_fn.state import view

MACHINE = Machine(disk_read_bps=1e9, disk_write_bps=2e9, copy_bps=1e10, matmul_flops=1e10)


def sample_batch(batch: int = 4):
    tokens = torch.zeros(batch, CFG.seq_len + 1, dtype=torch.long)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def planned(**kw):
    return plan_config(gpt.model(CFG), zf.adamw(), zf.Config(**kw), sample_batch(), timed=False)


def test_timed_work_is_the_compute_and_untimed_falls_back_to_flops():
    est = planned().estimate
    flops = Work(forward_flops=4e9, head_flops=1e9, params=0, units=0)
    untimed = predict(est, flops, MACHINE._replace(copy_bps=1e30))
    assert untimed.compute == pytest.approx(
        (4e9 + 3 * 3e9 + 2 * 1e9) / 1e10
    )  # backward: 3x a block, 2x the head
    timed = predict(
        est, flops._replace(forward_s=0.25, backward_s=0.5), MACHINE._replace(copy_bps=1e30)
    )
    assert (
        timed.compute == 0.75
        and timed.forward == pytest.approx(0.25)
        and timed.backward == pytest.approx(0.5)
    )


def test_disk_overlaps_compute_except_its_exposed_share():
    est = planned().estimate
    work = Work(
        0.0,
        0.0,
        params=0,
        units=4,
        forward_s=1.0,
        backward_s=2.0,
        disk=Traffic(read_forward=int(1e9), read_backward=int(2e9), written=int(2e9)),
    )
    fast = MACHINE._replace(copy_bps=1e30, disk_exposed=0.0)
    t = predict(est, work, fast)
    assert t.disk == pytest.approx(1.0 + 2.0 + 1.0)  # 1 GB/s reads, 2 GB/s writes
    assert (t.forward, t.backward) == pytest.approx(
        (1.0, 3.0)
    )  # backward: the disk (3 s) exceeds compute (2 s)
    half = predict(est, work, fast._replace(disk_exposed=0.5))
    assert (half.forward, half.backward) == pytest.approx((1.5, 3.5))
    per_unit = predict(est, work, fast._replace(unit_overhead_s=0.01))
    assert per_unit.step == pytest.approx(
        t.step + 0.01 * (4 + 3)
    )  # the backward fetches one unit fewer


def _nvme_counters(metrics: dict) -> tuple[int, int]:
    read = sum(
        v
        for k, v in metrics.items()
        if k.startswith("bytes_read.") and "nvme" in k and "inflight" not in k
    )
    return read, sum(
        v for k, v in metrics.items() if k.startswith("bytes_written.") and "nvme" in k
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(offload_params="nvme", offload_optimizer="nvme"),  # masters lent: params read once
        dict(offload_params="nvme", offload_optimizer="cpu"),  # params read in both passes
        dict(offload_params="cpu", offload_optimizer="nvme"),
        dict(
            offload_params="nvme", offload_optimizer="nvme", clip_grad_norm=1.0
        ),  # grads stashed, no lending
        dict(
            offload_params="nvme", offload_optimizer="nvme", prefetch_depth=0
        ),  # no read-ahead, no lending
        dict(
            offload_params="nvme", offload_optimizer="nvme", optimizer_piece_bytes=4096
        ),  # rows too big to lend
        dict(
            offload_params="nvme", offload_optimizer="nvme", param_dtype=torch.float32
        ),  # the param row is the master
    ],
    ids=str,
)
def test_nvme_traffic_is_what_the_engine_counts(kw, tmp_path):
    config = zf.Config(nvme_path=str(tmp_path), **kw)
    disk = plan_config(gpt.model(CFG), zf.adamw(), config, sample_batch(), timed=False).work.disk
    state = zf.init(gpt.model(CFG), zf.adamw(), config)
    for _ in range(
        2
    ):  # the second step: the first has no previous writes to wait for, else the same
        state, metrics = zf.train_step(state, sample_batch())
    view(state).close()
    assert (disk.read_forward + disk.read_backward, disk.written) == _nvme_counters(metrics)


def test_spilled_traffic_moves_the_spilled_units_only(tmp_path):
    kw = dict(
        offload_params="cpu",
        spill_params="3:nvme",
        offload_optimizer="cpu",
        spill_optimizer="2:nvme",
        nvme_path=str(tmp_path),
    )
    spilled = planned(**kw).work.disk
    everything = planned(
        **{
            **kw,
            "spill_params": None,
            "spill_optimizer": None,
            "offload_params": "nvme",
            "offload_optimizer": "nvme",
        }
    ).work.disk
    assert (
        0 < spilled.read_backward < everything.read_backward
        and 0 < spilled.read_forward < everything.read_forward
    )
    state = zf.init(gpt.model(CFG), zf.adamw(), zf.Config(**kw))
    for _ in range(2):
        state, metrics = zf.train_step(state, sample_batch())
    view(state).close()
    read, written = _nvme_counters(
        metrics
    )  # a spill tier's counter also counts the writes of its RAM rows
    assert spilled.read_forward + spilled.read_backward == read and spilled.written < written


def test_stage_seconds_add_up_per_block_and_micro_batch():
    s = compute.StageSeconds(
        embed_forward=1.0, block_forward=2.0, head=3.0, block_backward=4.0, embed_backward=5.0
    )
    assert s.forward(n_blocks=3, micro_batches=2) == 2 * (1 + 3 * 2)
    assert s.backward(n_blocks=3, micro_batches=2) == 2 * (3 + 3 * 4 + 5)


def test_plan_config_times_the_stages_once_per_dtype_and_estimate_never(monkeypatch):
    calls = []

    def fake(model, embed, block, head, micro, device, lent=None, frozen=None, block_lent=None):
        calls.append(micro["inputs"].shape)
        return compute.StageSeconds(0.001, 0.01, 0.002, 0.03, 0.004)

    monkeypatch.setattr(sizes, "time_stages", fake)
    zf.estimate(gpt.model(CFG), zf.adamw(), zf.Config(), sample_batch())
    assert not calls
    work = plan_config(gpt.model(CFG), zf.adamw(), zf.Config(grad_accum=2), sample_batch()).work
    assert calls == [torch.Size([2, CFG.seq_len])]  # one micro-batch
    assert work.forward_s == pytest.approx(2 * (0.001 + CFG.n_layers * 0.01))
    assert work.backward_s == pytest.approx(2 * (0.002 + CFG.n_layers * 0.03 + 0.004))
    calls.clear()
    found = auto.candidates(gpt.model(CFG), zf.adamw(), zf.Config(), sample_batch(), MACHINE)
    assert len(found) > 1 and len(calls) == 1  # every placement computes the same: timed once


def test_time_stages_runs_the_engines_kernels_on_a_tied_model():
    tied = gpt.model(dataclasses.replace(CFG, tie_embeddings=True))
    work = plan_config(
        tied, zf.adamw(), zf.Config(), sample_batch()
    ).work  # the head gets its tied leaf
    assert work.forward_s > 0 and work.backward_s > 0 and work.head_flops > 0


def test_the_optimizer_term_counts_trainable_elements_only():
    """A LoRA model's update touches its adapters alone: ``Work.params`` is their element count, and
    the predicted optimizer time falls with it (the frozen base has no master, moments or
    update)."""
    from layers import lora

    full = planned()
    adapted = plan_config(
        lora.apply(gpt.model(CFG), rank=4, alpha=8, targets=("attn.qkv",)),
        zf.adamw(),
        zf.Config(),
        sample_batch(),
        timed=False,
    )
    d, layers = CFG.d_model, CFG.n_layers
    assert adapted.work.params == layers * 4 * (d + 3 * d)  # A (4 x d) and B (3d x 4) per block
    assert full.work.params > 10 * adapted.work.params
    fast = MACHINE._replace(copy_bps=1e9)
    assert predict(adapted.estimate, adapted.work, fast).optimizer == pytest.approx(
        adapted.work.params * (7 * 4 + 2) / 1e9
    )
