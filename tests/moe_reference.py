"""Tiny random transformers mixture-of-experts modules and their weights as ``layers.moe`` trees.

transformers is the reference: these build its own sparse-MoE blocks (``Qwen3MoeSparseMoeBlock``,
``MixtralSparseMoeBlock``, ``OlmoeSparseMoeBlock``, ``GptOssMLP``) from config classes with random
weights (nothing is downloaded). More tokens than experts, so top-k routing spreads tokens unevenly.
"""

from __future__ import annotations

import copy

import torch
import transformers
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.mixtral import modeling_mixtral
from transformers.models.olmoe import modeling_olmoe
from transformers.models.qwen3_moe import modeling_qwen3_moe

from layers import moe_config

SIZES = dict(
    vocab_size=64,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=32,
)
N_EXPERTS = 6

# family -> (config class, config kwargs, sparse block class)
FAMILIES = {
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            num_experts=N_EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=12,
            intermediate_size=24,
        ),
        modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
    ),
    "qwen3_moe_norm": (
        transformers.Qwen3MoeConfig,  # renormalised top-k weights
        dict(
            num_experts=N_EXPERTS,
            num_experts_per_tok=3,
            moe_intermediate_size=12,
            intermediate_size=24,
            norm_topk_prob=True,
        ),
        modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
    ),
    "mixtral": (
        transformers.MixtralConfig,
        dict(num_local_experts=N_EXPERTS, num_experts_per_tok=2, intermediate_size=12),
        modeling_mixtral.MixtralSparseMoeBlock,
    ),
    "olmoe": (
        transformers.OlmoeConfig,
        dict(num_experts=N_EXPERTS, num_experts_per_tok=2, intermediate_size=12),
        modeling_olmoe.OlmoeSparseMoeBlock,
    ),
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(num_local_experts=N_EXPERTS, num_experts_per_tok=2, intermediate_size=12),
        modeling_gpt_oss.GptOssMLP,
    ),
}


def hf_config(name: str):
    """The transformers config of family ``name`` (eager experts, so the reference is HF's loop)."""
    config_class, kwargs, _ = FAMILIES[name]
    config = config_class(**SIZES, **kwargs)
    config._experts_implementation = "eager"
    return config


def hf_block(name: str, seed: int = 0):
    """HF's sparse-MoE block of family ``name`` with N(0, 0.5) weights (routing far from ties) in
    fp32."""
    _, _, block_class = FAMILIES[name]
    block = block_class(hf_config(name))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return block


def block_config(name: str):
    """``layers.moe.Config`` of family ``name``, read from its config dict as the importer reads
    it."""
    return moe_config.block_config(hf_config(name).to_dict())


def ours_from_hf_block(name: str, block) -> dict:
    """The ``layers.moe`` tree holding ``block``'s weights (copies): HF's in-memory gate-first
    ``gate_up_proj`` as it is; gpt-oss's interleaved input x output one regrouped and transposed."""
    experts = block.experts
    if name != "gpt_oss":
        return {
            "router": {"w": block.gate.weight.detach().clone()},
            "experts": {
                "gate_up": {"w": experts.gate_up_proj.detach().clone()},
                "down": {"w": experts.down_proj.detach().clone()},
            },
        }
    gate_up = experts.gate_up_proj.detach()  # (E, D, 2I), gate/up interleaved, input x output
    bias = experts.gate_up_proj_bias.detach()  # (E, 2I) interleaved
    grouped = torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), -1)  # (E, D, 2I) gates first
    return {
        "router": {
            "w": block.router.weight.detach().clone(),
            "b": block.router.bias.detach().clone(),
        },
        "experts": {
            "gate_up": {
                "w": grouped.mT.contiguous(),
                "b": torch.cat((bias[..., 0::2], bias[..., 1::2]), -1),
            },
            "down": {
                "w": experts.down_proj.detach().mT.contiguous(),
                "b": experts.down_proj_bias.detach().clone(),
            },
        },
    }


def hf_router(name: str, block):
    """The router submodule of HF's block (``gate``, gpt-oss's ``router``)."""
    return block.router if name == "gpt_oss" else block.gate


def hf_grads(name: str, block) -> dict:
    """HF's parameter gradients after a backward, in the ``layers.moe`` tree's layout (a twin of
    ``block`` whose parameters hold the gradients, read as its weights)."""
    twin = copy.deepcopy(block)
    with torch.no_grad():
        for param, source in zip(twin.parameters(), block.parameters(), strict=True):
            param.copy_(source.grad)
    return ours_from_hf_block(name, twin)
