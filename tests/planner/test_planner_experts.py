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
from layers import llama, lora, moe
from zinf_fn.formats import nf4_linear
from zinf_fn.formats.codebook import leaf_nbytes
from zinf_fn.layout.build import init_unit, layout
from zinf_fn.layout.units import BLOCKS, Unit
from zinf_fn.planner import compute, experts
from zinf_fn.planner.machine import Machine
from zinf_fn.planner.sizes import plan_config
from zinf_fn.state import view
from zinf_fn.tiling.deferred import materialize

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


# -- the planner times lent experts as the step computes them --------------------------------------

LENT_MOE = llama.Config(
    vocab_size=64,
    d_model=64,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    n_layers=2,
    seq_len=8,
    moe=moe.Config(n_experts=4, top_k=2, d_model=64, d_ff=64, stream_experts=True),
)


@pytest.mark.parametrize("storage", ["nf4", "int8"])
def test_the_timed_block_computes_lent_experts_on_their_codes(storage, monkeypatch):
    """Where the layout lends a frozen expert's NF4 codes to its op (rows of whole blocks of 64),
    the planner's timed block runs that op on codes (``CodedMatrix.linear`` forward,
    ``grad_input`` in backward), as the step does; int8 codes are decoded by the fetcher, so their
    op is ``F.linear`` and no coded product runs."""
    calls = []
    for name in ("linear", "grad_input"):
        real = getattr(nf4_linear.CodedMatrix, name)

        def spy(self, *args, _real=real, _name=name):
            calls.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(nf4_linear.CodedMatrix, name, spy)
    model = lora.apply(llama.model(LENT_MOE), rank=2, alpha=4, targets=("attn.q", "attn.v"))
    tokens = torch.arange(2 * (LENT_MOE.seq_len + 1)).reshape(2, -1) % LENT_MOE.vocab_size
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    work = plan_config(model, zf.adamw(), zf.Config(frozen_storage=storage), batch).work
    assert work.forward_s > 0 and work.backward_s > 0
    if storage == "int8":
        assert calls == []
    else:  # every timed run of the block's forward and pull-back computes on codes
        assert calls.count("linear") > 0 and calls.count("grad_input") > 0


def test_lent_tiles_are_the_rows_the_engine_stores(tmp_path):
    """``planner.compute.lent_tiles`` holds an expert's codes bitwise as ``zf.init`` stores that
    expert's row (the same seed's layer 0), so what is timed is what the step reads."""
    model = lora.apply(llama.model(LENT_MOE), rank=2, alpha=4, targets=("attn.q", "attn.v"))
    config = zf.Config(frozen_storage="nf4", offload_params="cpu")
    built = layout(model, zf.adamw(), config)
    group = "blocks:mlp.experts.gate_up.w"
    decode = built.store.row_kinds.policy(group).codes_lent
    tree = materialize(init_unit(model, Unit(1, BLOCKS, 0), seed=0))  # its experts made
    node = tree["mlp"]["experts"]["gate_up"]["w"]
    lent = compute.lent_tiles(node, decode)
    state = zf.init(model, zf.adamw(), config, seed=0)
    v = view(state)
    for e, weight in enumerate(lent):
        row = v.view("param", group, e)  # layer 0's expert e
        assert torch.equal(row[: weight.stored.numel()], weight.stored)
        assert weight.shape == tuple(node.tiles[e].shape)
    zf.close(state)
