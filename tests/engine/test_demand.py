"""A part declares what it costs: the estimate and the runtime's pool are sums of the parts'
demands.

``zinf_fn.planner.memory.demands`` lists the ``demand`` of every streaming part (fetcher, gradients,
optimizer read-ahead and write-behind, kept rows), each buffer with the phases of a step it is held
in. The pool's plan (``pool_plan``) is, per buffer size, the most the parts hold together in one
phase; the runtime makes exactly that pool at init (``BufferPool.reserve``), so a step that holds no
more than the parts declared makes no buffer: the pool after steps *is* the plan, in count and bytes
(a count, no timing). The estimate's working memory is that pool plus what the parts hold outside
it, and its NVMe traffic their sum.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import CFG, make_batches

import zinf_fn as zf
from layers import gpt, llama, lora, moe
from zinf_fn.layout.build import layout
from zinf_fn.planner.memory import demands, pool_plan, traffic
from zinf_fn.state import view

TILED = dataclasses.replace(
    CFG, attn_tiles=2, mlp_tiles=3, head_tiles=5
)  # uneven tiles: sizes of their own
# the GPT with its embedding and norms frozen: a param row only, the blocks' in "blocks:frozen"
FROZEN = "frozen"
LORA = llama.Config(
    vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=3, seq_len=16
)  # + LoRA
STREAMED = llama.Config(
    vocab_size=64,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    d_ff=48,
    n_layers=3,
    seq_len=16,
    moe=moe.Config(n_experts=8, top_k=2, d_model=32, d_ff=32, stream_experts=True),
)
STREAMED_LORA = dataclasses.replace(STREAMED)  # + LoRA on attention and the experts, the base nf4
# the same at width 64: each expert's rows are whole blocks of 64, so its nf4 codes are lent to the
# op as fetched, never decoded (``GroupPolicy.codes``)
LENT_LORA = dataclasses.replace(
    STREAMED,
    d_model=64,
    moe=moe.Config(n_experts=8, top_k=2, d_model=64, d_ff=64, stream_experts=True),
)
# the LoRA llama at width 64: its blocks' linears are whole blocks of 64, so their nf4 codes are
# lent to the op, the norms decoded, and block 0's frozen row held as both (``overlap.fetch.Kept``)
LENT_BLOCKS = dataclasses.replace(LORA, d_model=64, d_ff=128)
# the LoRA llama with its vocabulary in tiles: the frozen head's bf16 tiles are lent to the op as
# stored, gathered as bf16 (``GroupPolicy.lent_as``)
HEAD_LORA = dataclasses.replace(LORA, head_tiles=4, embed_tiles=3)
# (model, engine config): cpu, nvme, spilled, tiled, grad accum, clipping, frozen, int8 and their
# mixes
CONFIGS = [
    (CFG, dict(offload_params="cpu", offload_optimizer="cpu")),
    (CFG, dict(offload_params="nvme", offload_optimizer="nvme")),
    (CFG, dict(offload_params="nvme", offload_optimizer="nvme", clip_grad_norm=1.0)),
    (CFG, dict(offload_params="nvme", offload_optimizer="nvme", grad_accum=2)),
    (CFG, dict(offload_params="cpu", offload_optimizer="cpu", spill_optimizer="2:nvme")),
    (CFG, dict(offload_params="cpu", offload_optimizer="nvme", spill_params="2:nvme")),
    (CFG, dict(offload_params="nvme", offload_optimizer="cpu", param_dtype=torch.float32)),
    (CFG, dict(offload_optimizer="cpu", spill_optimizer="2:nvme", optimizer_piece_bytes=16 << 10)),
    (TILED, dict(offload_params="nvme", offload_optimizer="nvme")),
    (
        TILED,
        dict(offload_params="cpu", offload_optimizer="cpu"),
    ),  # runs of tiles cast and updated as one
    (
        TILED,
        dict(offload_params="cpu", offload_optimizer="cpu", grad_accum=2),
    ),  # a run's gradients copied
    (
        TILED,
        dict(offload_params="nvme", offload_optimizer="nvme", clip_grad_norm=1.0, grad_accum=2),
    ),
    (FROZEN, dict(offload_params="nvme", offload_optimizer="nvme")),
    (
        CFG,
        dict(offload_params="nvme", offload_optimizer="nvme", master="remainder", moments="int8"),
    ),
    (
        CFG,
        dict(
            offload_params="nvme",
            offload_optimizer="nvme",
            reuse_blocks=2,
            keep_activations=1 << 22,
        ),
    ),
    (FROZEN, dict(offload_params="nvme", offload_optimizer="cpu", reuse_blocks=1)),
    (
        FROZEN,
        dict(offload_params="nvme", offload_optimizer="cpu", param_dtype=torch.float32),
    ),  # held layers read from NVMe in the dtype they are gathered in: their staging rows kept
    (
        LORA,
        dict(offload_params="nvme", offload_optimizer="cpu", frozen_storage="nf4"),
    ),  # dequantized buffers
    (
        LORA,
        dict(
            offload_params="cpu", offload_optimizer="cpu", frozen_storage="int8", prefetch_depth=2
        ),
    ),
    (
        STREAMED,
        dict(offload_params="cpu", offload_optimizer="cpu"),
    ),  # experts as tiles, a run each leaf
    (
        STREAMED,
        dict(offload_params="nvme", offload_optimizer="nvme", grad_accum=2, prefetch_depth=2),
    ),
    (
        STREAMED_LORA,
        dict(offload_params="nvme", offload_optimizer="cpu", frozen_storage="nf4"),
    ),  # coded tiles
    (
        LENT_LORA,
        dict(offload_params="nvme", offload_optimizer="cpu", frozen_storage="nf4"),
    ),  # coded tiles lent to the op: no decoded buffer
    (
        STREAMED,
        dict(
            offload_params="nvme",
            offload_optimizer="nvme",
            grad_accum=2,
            prefetch_depth=2,
            keep_activations=1 << 30,
        ),
    ),  # kept blocks: no recompute in the backward
    (
        TILED,
        dict(offload_params="cpu", offload_optimizer="cpu", keep_activations=1 << 30),
    ),  # kept tiled linears
    (
        LENT_BLOCKS,
        dict(offload_params="nvme", offload_optimizer="cpu", frozen_storage="nf4"),
    ),  # block 0's lent row held: its decoded norms and its codes
    (LENT_BLOCKS, dict(offload_params="cpu", offload_optimizer="cpu", frozen_storage="nf4")),
    (HEAD_LORA, dict(offload_params="nvme", offload_optimizer="cpu")),  # a lent head, from NVMe
    (
        LENT_LORA,
        dict(
            offload_params="nvme", offload_optimizer="cpu", frozen_storage="nf4", keep_tiles=1 << 20
        ),
    ),  # lent expert tiles kept into the backward: their staging rows out
    (
        STREAMED_LORA,
        dict(
            offload_params="nvme",
            offload_optimizer="cpu",
            frozen_storage="int8",
            grad_accum=2,
            keep_tiles=3 << 12,
        ),
    ),  # decoded expert tiles kept, a budget of one expert (its two tiles: 12 KiB)
    (HEAD_LORA, dict(offload_params="cpu", offload_optimizer="cpu")),
]
NAMES = {
    id(CFG): "",
    id(TILED): "tiled,",
    id(LORA): "lora,",
    id(STREAMED): "experts,",
    id(STREAMED_LORA): "experts-lora,",
    id(LENT_LORA): "lent-experts-lora,",
    id(HEAD_LORA): "lent-head-lora,",
    id(LENT_BLOCKS): "lent-blocks-lora,",
}
IDS = [
    NAMES.get(id(cfg), "frozen,") + ",".join(f"{k}={v}" for k, v in kw.items())
    for cfg, kw in CONFIGS
]


def _setup(cfg, kw: dict, tmp_path) -> tuple[zf.Model, object, zf.Config]:
    """(model, optimizer, config) of a case; ``moments`` in ``kw`` is the optimizer's
    (``zf.adamw(moments=)``)."""
    kw = dict(kw)
    opt = zf.adamw(moments=kw.pop("moments", "fp32"))
    return _model(cfg), opt, zf.Config(nvme_path=str(tmp_path), **kw)


def _model(cfg) -> zf.Model:
    if cfg == FROZEN:
        return gpt.model(CFG)._replace(
            trainable=lambda path: not (path.startswith("embed.") or ".ln" in path)
        )
    if cfg is LORA or cfg is HEAD_LORA or cfg is LENT_BLOCKS:
        return lora.apply(llama.model(cfg), rank=4, alpha=8, targets=("attn.q", "attn.v"))
    if cfg is STREAMED_LORA or cfg is LENT_LORA:
        targets = ("attn.q", "mlp.experts.gate_up", "mlp.experts.down")
        return lora.apply(llama.model(cfg), rank=4, alpha=8, targets=targets)
    if cfg is STREAMED:
        return llama.model(cfg)
    return gpt.model(cfg)


@pytest.mark.parametrize("cfg,kw", CONFIGS, ids=IDS)
def test_the_estimate_is_the_planned_pool_and_what_the_parts_hold_beside_it(cfg, kw, tmp_path):
    model, opt, config = _setup(cfg, kw, tmp_path)
    est = zf.estimate(model, opt, config)
    built = layout(model, opt, config)
    parts = demands(built, config)
    pool = sum(
        n * dtype.itemsize * count for (n, dtype, _), count in pool_plan(built, config).items()
    )
    assert sum(est.working.values()) == pool + sum(
        d.held for d in parts
    )  # CPU compute: all host memory
    assert set(est.working) == {d.part for d in parts}
    assert est.host_peak - sum(est.working.values()) == est.tier_bytes("cpu") + est.tier_bytes(
        "none"
    )
    assert est.moved.get("nvme", 0) == sum(traffic(parts))


@pytest.mark.parametrize("cfg,kw", CONFIGS, ids=IDS)
def test_the_pool_after_steps_is_the_planned_pool(cfg, kw, tmp_path):
    """Made as planned before the first step (never more during init), and no buffer more over three
    steps: no part held more of a size, in any phase, than the parts declared together (a part over
    its demand would make the pool grow)."""
    model, opt, config = _setup(cfg, kw, tmp_path)
    plan = pool_plan(layout(model, opt, config), config)
    planned = (
        sum(plan.values()),
        sum(n * dtype.itemsize * count for (n, dtype, _), count in plan.items()),
    )
    state = zf.init(model, opt, config)
    after_init = view(state).counters()
    assert after_init.pool_made <= planned[0] and after_init.pool_bytes <= planned[1]
    for batch in make_batches(CFG if cfg == FROZEN else cfg, 3, 8, 1):
        state, _ = zf.train_step(state, batch)
    zf.flush(state)
    counters = view(state).counters()
    assert (counters.pool_made, counters.pool_bytes) == planned
    # the frozen layers the fetcher keeps: out for good (a lent row's two buffers)
    assert counters.pool_out == counters.held_buffers >= counters.held_layers
    zf.close(state)
