"""The read policy (``zinf_fn.layout.policy.GroupPolicy``): decided once by the layout step,
immutable, the one record the fetcher, the updater, the demands and the planner read, and what
``zf.plan`` prints of it."""

from __future__ import annotations

import dataclasses

import pytest
from engine_helpers import CFG

import zinf_fn as zf
from layers import gpt, llama, lora
from zinf_fn.layout.build import layout
from zinf_fn.optim.passes import holds_layer, keeps_resident, lends_master
from zinf_fn.optim.pieces import piece_numel

LLAMA = llama.Config(
    vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=3, seq_len=16
)


def lora_layout(config: zf.Config):
    model = lora.apply(llama.model(LLAMA), rank=4, alpha=8, targets=("attn.q", "attn.v"))
    return layout(model, zf.adamw(), config)


def test_a_lora_model_frozen_rows_are_decided_once(tmp_path):
    """LoRA on NVMe with NF4 base weights: the frozen embedding and head are never written, the
    blocks' frozen row is fetched with each block and decoded from NF4, and each row's held / lent /
    resident answer is the rule's (``optim.passes``) for that row."""
    config = zf.Config(
        frozen_storage="nf4",
        offload_params="nvme",
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
    )
    built = lora_layout(config)
    store, piece = built.store, piece_numel(config.optimizer_piece_bytes)
    clipping = config.clip_grad_norm is not None
    policies = store.row_kinds.policies
    assert list(policies) == list(store.groups)  # one record per group, in the store's order
    assert not policies["embed"].written and not policies["head"].written
    assert policies["blocks"].written
    frozen = policies["blocks:frozen"]
    assert frozen.unit == "frozen" and not frozen.written and frozen.decode.storage == "nf4"
    # the real shapes
    assert frozen.decode.values == built.frozen.codes.values_spec("blocks:frozen")
    assert policies["blocks"].companion.group == "blocks:frozen"
    assert policies["blocks"].companion.anchors == built.frozen.splits["blocks"].anchors
    for name, policy in policies.items():
        group = store.groups[name]
        for unit in store.row_units(group, built.n_layers):
            assert policy.holds(unit) == holds_layer(group, policy, unit, piece)
            assert policy.keeps(unit) == keeps_resident(store, group, policy, unit, piece)
            lends = lends_master(store, group, policy, unit, config.prefetch_depth, piece, clipping)
            assert policy.lends(unit) == lends
    # the frozen layers of the embedding and the first block (a small model's) are held once fetched
    assert policies["embed"].held == frozen.held == {0} and not policies["blocks"].held
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.written = True


def test_plan_prints_the_policy_of_groups_read_otherwise(tmp_path):
    """``zf.plan`` lists the groups read otherwise than a plain row (a tied head brings the
    embedding along), and nothing for a model whose every group is plain."""
    plain = zf.init(gpt.model(CFG), zf.adamw(), zf.Config())
    assert "read policy" not in zf.plan(plain)
    zf.close(plain)
    tied_model = gpt.model(dataclasses.replace(CFG, tie_embeddings=True))
    tied = zf.init(tied_model, zf.adamw(), zf.Config())
    assert "  head: stage, brings the embedding's tok.w along" in zf.plan(tied).splitlines()
    zf.close(tied)
