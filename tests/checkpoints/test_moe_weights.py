"""checkpoints.moe_weights: a saved MoE checkpoint read as one virtual tensor per stacked leaf.

Each family's tiny random model (two layers) is saved by transformers' save_pretrained and read
through ``hf_files.HFWeights``; every virtual leaf's header shape equals the tensor read, and the
tensor equals the model's own in-memory weights bitwise (reading moves and stacks, never computes).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from moe_reference import hf_config, ours_from_hf_block

from checkpoints import CheckpointError
from checkpoints.hf_files import HFWeights
from checkpoints.moe_weights import ExpertWeights
from layers import decoder_names, moe_config, moe_names

CAUSAL_LM = {
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "mixtral": transformers.MixtralForCausalLM,
    "olmoe": transformers.OlmoeForCausalLM,
    "gpt_oss": transformers.GptOssForCausalLM,
}


def saved(name: str, tmp_path):
    model = CAUSAL_LM[name](hf_config(name))
    model.save_pretrained(tmp_path)
    return model, moe_config.block_config(model.config.to_dict()).n_experts


@pytest.mark.parametrize("name", sorted(CAUSAL_LM))
def test_virtual_leaves_equal_the_model(name, tmp_path):
    model, n_experts = saved(name, tmp_path)
    rules = moe_names.RULES[name]
    weights = ExpertWeights(HFWeights(str(tmp_path)), rules, n_experts, n_layers=2)
    assert not [n for n in weights.names() if ".experts." in n and not n.endswith((".w", ".b"))]
    templates = dict(decoder_names.moe_leaves(name))
    for i, layer in enumerate(model.model.layers):
        want = ours_from_hf_block(name, layer.mlp)
        for leaf in moe_names.leaf_paths(rules):
            virtual = f"model.layers.{i}.{leaf}"
            assert virtual in weights.names()
            assert templates[f"model.layers.{{i}}.{leaf}"] == f"blocks.{{i}}.{leaf}"
            got = weights.get(virtual)
            assert tuple(got.shape) == tuple(weights.shape(virtual))
            if leaf == "attn.sinks":
                assert torch.equal(got, layer.self_attn.sinks.detach())
                continue
            node = want
            for key in leaf.split(".")[1:]:
                node = node[key]
            assert torch.equal(got, node), virtual


def test_missing_expert_is_refused(tmp_path):
    _, n_experts = saved("qwen3_moe", tmp_path)
    with pytest.raises(CheckpointError, match=r"mlp\.experts\.6\..*missing"):
        ExpertWeights(HFWeights(str(tmp_path)), moe_names.QWEN3_MOE, n_experts + 1, n_layers=2)
