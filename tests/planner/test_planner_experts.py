"""The planner knows streamed experts: a mixture of experts whose experts are fetch units
(``moe.Config(stream_experts=True)``) is estimated as ``zf.init`` allocates it, its expert units and
their window are counted, and its NVMe reads are the share of experts a step is expected to touch.

References: the bytes of the arrays ``zf.init`` allocated (as the dense planner tests do), and the
uniform-routing share measured by routing random tokens (a top-k of i.i.d. logits is a uniform
k-subset). No test here asserts a wall time.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from engine_internals import allocated, allocated_arrays

import zinf_fn as zf
from layers import llama, lora
from zinf_fn.formats.codebook import leaf_nbytes
from zinf_fn.layout.build import layout
from zinf_fn.planner import experts
from zinf_fn.planner.machine import Machine
from zinf_fn.planner.sizes import plan_config
from zinf_fn.state import view

E, TOP_K, SEQ, BATCH = 8, 2, 4, 1
QWEN3_MOE = {  # a tiny Qwen3-MoE config.json, read through layers' family config
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": E,
    "num_experts_per_tok": TOP_K,
    "moe_intermediate_size": 16,
    "norm_topk_prob": True,
}
MACHINE = Machine(1e9, 1e9, 1e10, 1e10)  # disk read / write, copy B/s, FLOP/s: no calibration run


def moe_model(stream: bool = True, rank: int = 0) -> zf.Model:
    cfg = llama.Config.from_hf(QWEN3_MOE, seq_len=SEQ)
    model = llama.model(
        dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, stream_experts=stream))
    )
    return lora.apply(model, rank=rank, targets=("attn.q", "attn.v")) if rank else model


def batch():
    tokens = torch.zeros(BATCH, SEQ + 1, dtype=torch.long)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


CONFIGS = [  # (LoRA rank, engine config)
    (0, dict(offload_params="cpu", offload_optimizer="cpu")),
    (0, dict(offload_params="nvme", offload_optimizer="nvme")),
    (4, dict(offload_params="nvme", offload_optimizer="cpu", frozen_storage="nf4")),
]


@pytest.mark.parametrize("rank,kw", CONFIGS, ids=str)
def test_estimate_of_streamed_experts_is_what_init_allocates(rank, kw, tmp_path):
    model, config = moe_model(rank=rank), zf.Config(nvme_path=str(tmp_path), **kw)
    est = zf.estimate(model, zf.adamw(), config)
    plan = experts.count(layout(model, zf.adamw(), config), config)
    state = zf.init(model, zf.adamw(), config)
    assert {k: v for k, v in est.states.items() if v} == allocated(state)
    # every expert of every layer is a unit of its own: layers x E x (gate_up, down)
    assert plan.units == 2 * E * 2 and plan.per_layer == E
    groups = [a for a in allocated_arrays(state, "param") if a.key.split("/")[0] in plan.groups]
    per_layer = E * (2 * 16 * 32 + 32 * 16)  # elements of both stacked weights
    # a frozen base stored nf4 keeps every expert's codes and scales (its bytes, as uint8)
    coded = "frozen_storage" in kw
    want = 2 * (leaf_nbytes("nf4", per_layer // E) * E if coded else per_layer)
    assert len(groups) == 2 and sum(a.numel for a in groups) == want
    on_disk = sum(a.nbytes for a in groups if a.tier == "nvme")
    # an expert row on NVMe is read in forward, and twice in backward, trained or frozen: by the
    # recompute (without a batch every leaf is planned recomputed, nothing kept) and by the
    # backward (a tile's fetch reads its row, lent master or not: tiling.plan.step_reads)
    assert plan.reads == (on_disk, 2 * on_disk)
    counters = view(state).counters()  # the pool made at init is within the planned one
    assert counters.pool_bytes <= sum(est.working.values())
    zf.close(state)


def test_touched_share_is_the_uniform_routing_expectation():
    """1 - (1 - k/E)^T against the share of experts that random routings touch (20k trials: the
    mean's standard error is < 0.002, the tolerance 0.01)."""
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 3, 10):
        logits = torch.rand(20_000, tokens, E, generator=gen)
        chosen = torch.zeros(20_000, E, dtype=torch.bool)
        chosen.scatter_(1, logits.topk(TOP_K, dim=-1).indices.reshape(20_000, -1), True)
        measured = chosen.float().mean().item()
        assert experts.touched_share(TOP_K, E, tokens) == pytest.approx(measured, abs=0.01)
    assert experts.touched_share(TOP_K, E, 0) == 0.0
    with pytest.raises(ValueError, match="top_k=9, n_experts=8"):
        experts.touched_share(9, E, 4)


def test_reads_of_a_frozen_base_scale_with_the_share_touched(tmp_path):
    """LoRA over an NF4 base on NVMe: the expected expert reads are the share of all expert reads,
    the rest of the traffic as without routing; the table says which."""
    model = moe_model(rank=4)
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="cpu",
        frozen_storage="nf4",
        nvme_path=str(tmp_path),
    )
    every = plan_config(model, zf.adamw(), config, batch(), timed=False)
    routed = plan_config(model, zf.adamw(), config, batch(), timed=False, top_k=TOP_K)
    found = routed.estimate.experts
    share = experts.touched_share(TOP_K, E, BATCH * SEQ)
    assert found.share == share and found.tokens == BATCH * SEQ
    assert found.expected_reads == tuple(int(share * r) for r in found.reads)
    unread = sum(found.reads) - sum(found.expected_reads)
    assert every.estimate.moved["nvme"] - routed.estimate.moved["nvme"] == unread
    assert sum(every.work.disk) - sum(routed.work.disk) == unread
    assert "uniform-routing expectation" in routed.estimate.table()
    assert "every expert read (no top_k given" in every.estimate.table()
    # the expert tile fetches a step is expected to make: the share of all of them
    assert routed.work.tile_fetches[0] < every.work.tile_fetches[0]


def test_a_model_without_streamed_experts_has_no_expert_line():
    config = zf.Config()
    assert experts.count(layout(moe_model(stream=False), zf.adamw(), config), config) is None
    assert "experts:" not in zf.estimate(moe_model(stream=False), zf.adamw(), config).table()


def test_command_line_plans_a_qwen3_moe(monkeypatch, capsys):
    """``python -m zinf_fn.planner --family qwen3_moe --experts --top-k --expert-width``."""
    from zinf_fn.planner import __main__ as cli

    monkeypatch.setattr(cli, "calibrate", lambda path: MACHINE)  # no calibration run in a test
    # the estimate alone: the step's compute is counted in FLOPs, not timed
    monkeypatch.setattr(cli, "plan_config", partial(plan_config, timed=False))
    cli.main(
        [
            "--family",
            "qwen3_moe",
            "--d-model",
            "32",
            "--layers",
            "2",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "8",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--expert-width",
            "16",
            "--vocab",
            "64",
            "--seq",
            "4",
            "--batch",
            "1",
        ]
    )
    out = capsys.readouterr().out
    share = experts.touched_share(2, 8, 4)
    assert "experts: 32 units (8 per layer x 2 leaves)" in out and f"{share:.1%} touched" in out
    assert "predicted:" in out
