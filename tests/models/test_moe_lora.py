"""LoRA on stacked experts (layers.moe_lora, moe's expert linears) against PEFT's target_parameters
adapter on transformers' own expert tensors (Qwen3-MoE: gate_up_proj (E, 2I, D); gpt-oss: the
interleaved, input x output gate_up_proj (E, D, 2I)), forward and gradients.

Tolerance: PEFT adds B @ A to the expert weight before its product, ours adds x @ A.T @ B.T after
it; the same sums grouped differently, a few ulps of the outputs, so 1e-5 of the largest magnitude.
The weight moves between PEFT's layout and ours are reshapes and permutes: compared bitwise.
"""

from __future__ import annotations

import types

import peft
import pytest
import torch
import transformers
from moe_reference import block_config, hf_config, ours_from_hf_block

from layers import moe, moe_lora

TOL = 1e-5
RANK, ALPHA = 2, 4.0
CAUSAL_LM = {
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "gpt_oss": transformers.GptOssForCausalLM,
}
TARGETS = {"gate_up_proj": "gate_up", "down_proj": "down"}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def peft_block(name: str):
    """Layer 0's sparse-MoE block of a PEFT model adapting both expert tensors, weights random."""
    model = CAUSAL_LM[name](hf_config(name))
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_parameters=[f"mlp.experts.{t}" for t in TARGETS]
    )
    peft_model = peft.get_peft_model(model, config)
    block = peft_model.base_model.model.model.layers[0].mlp
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return block


def wrappers(block) -> dict:
    """Our expert leaf name -> the PEFT ParamWrapper adapting its HF tensor."""
    found = {}
    node = block.experts
    while isinstance(node, peft.tuners.lora.ParamWrapper):
        found[TARGETS[node.parameter_name]] = node
        node = node.base_layer
    return found


def ours_from_peft_block(name: str, block) -> dict:
    """Our tree: the base weights as test_moe reads them, plus each wrapper's factors."""
    experts = block.experts.get_base_layer()
    if name == "gpt_oss":
        base = types.SimpleNamespace(experts=experts, router=block.router)
    else:
        base = types.SimpleNamespace(experts=experts, gate=block.gate)
    tree = ours_from_hf_block(name, base)
    for leaf, wrapper in wrappers(block).items():
        a, b = moe_lora.from_peft(
            wrapper.lora_A["default"].weight.detach(),
            wrapper.lora_B["default"].weight.detach(),
            block_config(name).n_experts,
            interleaved=name == "gpt_oss" and leaf == "gate_up",
        )
        tree["experts"][leaf].update(lora_a=a, lora_b=b)
    return tree


@pytest.mark.parametrize("name", sorted(CAUSAL_LM))
def test_expert_lora_equals_peft(name):
    block = peft_block(name)
    cfg = block_config(name)
    tree = ours_from_peft_block(name, block)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1)) * 3.0
    grad_out = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(2))
    want = block(x)
    want = want[0] if name == "gpt_oss" else want
    (want * grad_out).sum().backward()
    lora_leaves = []
    for leaf in TARGETS.values():
        node = tree["experts"][leaf]
        node["lora_scale"] = ALPHA / RANK
        lora_leaves += [node["lora_a"].requires_grad_(True), node["lora_b"].requires_grad_(True)]
    got, _ = moe.apply(cfg, tree, x)
    assert rel_err(got, want.detach()) <= TOL
    grads = torch.autograd.grad((got * grad_out).sum(), lora_leaves)
    for leaf, wrapper in wrappers(block).items():
        interleaved = name == "gpt_oss" and leaf == "gate_up"
        want_a, want_b = moe_lora.from_peft(
            wrapper.lora_A["default"].weight.grad,
            wrapper.lora_B["default"].weight.grad,
            cfg.n_experts,
            interleaved=interleaved,
        )
        index = list(TARGETS.values()).index(leaf)
        assert rel_err(grads[2 * index], want_a) <= TOL
        assert rel_err(grads[2 * index + 1], want_b) <= TOL


@pytest.mark.parametrize("interleaved", [False, True])
def test_peft_layout_round_trips(interleaved):
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(RANK * 5, 16, generator=gen)
    b = torch.randn(24, RANK * 5, generator=gen)
    ours = moe_lora.from_peft(a, b, 5, interleaved)
    assert ours[0].shape == (5, RANK, 16) and ours[1].shape == (5, 24, RANK)
    back = moe_lora.to_peft(*ours, interleaved)
    assert torch.equal(back[0], a) and torch.equal(back[1], b)


def test_init_starts_at_the_base():
    tree = moe_lora.init(torch.Generator().manual_seed(4), RANK, 5, 16, 24)
    assert tree["lora_a"].shape == (5, RANK, 16) and not tree["lora_b"].any()
    assert tree["lora_a"].abs().max() <= 16**-0.5  # PEFT's bound 1/sqrt(in)
