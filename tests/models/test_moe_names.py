"""layers.moe_names against the files transformers' save_pretrained writes, and layers.moe_config's
reading and refusals of config.json fields.

Each family's tiny random model is saved into tmp_path; its layer's MoE tensors are imported through
the name map into stacked leaves, compared with the model's own in-memory (fused) weights, and
exported back: every move is a copy, stack, slice or transpose, so all comparisons are bitwise,
names included.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from moe_reference import FAMILIES, hf_config, ours_from_hf_block
from safetensors.torch import load_file

from layers import moe_config, moe_names

CAUSAL_LM = {
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "mixtral": transformers.MixtralForCausalLM,
    "olmoe": transformers.OlmoeForCausalLM,
    "gpt_oss": transformers.GptOssForCausalLM,
}
MOE_WORDS = ("expert", ".gate.", "router", "sinks")  # what marks a saved name as the MoE map's


def saved_layer(name: str, tmp_path) -> tuple[dict, object]:
    """Layer 1's saved tensors by layer-relative name, and the model they came from."""
    model = CAUSAL_LM[name](hf_config(name))
    model.save_pretrained(tmp_path)
    prefix = "model.layers.1."
    tensors = load_file(tmp_path / "model.safetensors")
    return {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}, model


@pytest.mark.parametrize("name", sorted(CAUSAL_LM))
def test_name_map_round_trips_save_pretrained(name, tmp_path):
    layer, model = saved_layer(name, tmp_path)
    rules = moe_names.RULES[name]
    n_experts = moe_config.block_config(model.config.to_dict()).n_experts
    covered = set(moe_names.hf_names(rules, n_experts))
    assert covered == {n for n in layer if any(word in n for word in MOE_WORDS)}
    leaves = moe_names.import_layer(rules, layer.__getitem__, n_experts)
    block = model.model.layers[1].mlp
    want = ours_from_hf_block(name, block)  # the in-memory fused weights, split as in test_moe
    for path in moe_names.leaf_paths(rules):
        if path == "attn.sinks":
            assert torch.equal(leaves[path], model.model.layers[1].self_attn.sinks.detach())
            continue
        node = want
        for key in path.split(".")[1:]:  # "mlp.experts.down.w" -> want["experts"]["down"]["w"]
            node = node[key]
        assert torch.equal(leaves[path], node), path
    exported = moe_names.export_layer(rules, leaves, n_experts)
    assert sorted(exported) == sorted(covered)
    for hf_name, tensor in exported.items():
        assert tensor.dtype == layer[hf_name].dtype and torch.equal(tensor, layer[hf_name]), hf_name
        assert tensor.is_contiguous()


def test_export_checks_expert_count():
    leaves = {path: torch.zeros(3, 2, 2) for path in moe_names.leaf_paths(moe_names.QWEN3_MOE)}
    with pytest.raises(ValueError, match="n_experts=4"):
        moe_names.export_layer(moe_names.QWEN3_MOE, leaves, 4)
    with pytest.raises(ValueError, match="mlp.router.w"):
        moe_names.export_layer(moe_names.QWEN3_MOE, {}, 3)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_block_config_round_trips(name):
    hf = hf_config(name).to_dict()
    cfg = moe_config.block_config(hf)
    family = hf["model_type"]
    fields = moe_config.block_fields(cfg, family, moe_config.aux_config(hf))
    assert moe_config.block_config({**hf, **fields}) == cfg
    assert all(hf[key] == value for key, value in fields.items())  # the fields transformers writes
    assert moe_config.aux_config(hf) == (False, hf["router_aux_loss_coef"])


REFUSED = {
    "first_k_dense_replace": transformers.DeepseekV3Config().to_dict(),
    "kv_lora_rank": {"model_type": "kimi_k2", "kv_lora_rank": 512},
    "q_lora_rank": {"model_type": "qwen3_moe", "q_lora_rank": 64},
    "n_shared_experts": {"model_type": "qwen3_moe", "n_shared_experts": 1},
    "mlp_only_layers": transformers.Qwen3MoeConfig(mlp_only_layers=[0]).to_dict(),
    "decoder_sparse_step": transformers.Qwen3MoeConfig(decoder_sparse_step=2).to_dict(),
    "router_jitter_noise": transformers.MixtralConfig(router_jitter_noise=0.1).to_dict(),
    "hidden_act": transformers.OlmoeConfig(hidden_act="gelu").to_dict(),
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_unsupported_moe_is_refused_by_field(field):
    with pytest.raises(ValueError, match=f"config.json: {field}="):
        moe_config.refuse_unsupported(REFUSED[field])


def test_supported_configs_pass():
    for name in FAMILIES:
        moe_config.refuse_unsupported(hf_config(name).to_dict())
    with pytest.raises(ValueError, match="model_type"):
        moe_config.block_config({"model_type": "llama"})
