"""The router statistics travel through the engine's carry.

A tiny MoE language model whose embed puts ``moe_aux.zeros_stats`` in the carry, whose blocks add
their router's sums, and whose head adds coef x the load-balancing loss, run by ``zf.eval_step`` and
``zf.train_step``, equals transformers' sparse-MoE blocks with HF's ``load_balancing_loss_func``
over the same router logits (what ``output_router_logits=True`` adds).

Tolerances: the forward is the same fp32 ops as HF's per expert (test_moe), so the losses agree to
1e-6 relative. Gradients are read back from one SGD step (lr = 1, no momentum): ``old - new`` is the
engine's gradient up to the rounding of the fp32 subtraction at the weights' magnitude (|w| < 4, an
ulp of 2**-21), so they are compared to HF's within 1e-5 of the largest gradient plus 1e-6.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from moe_reference import block_config, hf_config
from transformers.models.qwen3_moe import modeling_qwen3_moe

import zinf_fn as zf
from layers import embedding, moe, moe_aux

CFG = dataclasses.replace(block_config("qwen3_moe"), init_std=0.5)  # routing far from ties
VOCAB = 64
LAYERS = 2
COEF = 0.5  # large, so that the aux loss's gradient is a visible part of the routers' gradients


def embed_init(gen):
    return {"tok": embedding.init(gen, VOCAB, CFG.d_model, std=1.0)}


def embed_apply(params, batch):
    x = F.embedding(batch["inputs"], params["tok"]["w"])  # (B, T, D)
    return {"x": x, "router": moe_aux.zeros_stats(CFG.n_experts, x.device)}


def block_init(gen, i):
    return {"moe": moe.init(CFG, gen)}


def block_apply(params, carry):
    y, logits = moe.apply(CFG, params["moe"], carry["x"])
    return {"x": carry["x"] + y, "router": moe_aux.accumulate(carry["router"], logits, CFG.top_k)}


def head_init(gen):
    return {"out": torch.randn(VOCAB, CFG.d_model, generator=gen, device=gen.device) * 0.1}


def head_apply(params, carry, batch):
    logits = F.linear(carry["x"], params["out"])  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1))
    rows = LAYERS * batch["inputs"].numel()
    return loss + COEF * moe_aux.aux_loss(carry["router"], rows)


def toy_model() -> zf.Model:
    return zf.Model(
        zf.Stage(embed_init, embed_apply),
        zf.Stage(block_init, block_apply),
        zf.Stage(head_init, head_apply),
        n_layers=LAYERS,
    )


def hf_blocks(params: dict) -> list:
    """transformers' Qwen3-MoE sparse blocks holding the engine's block weights."""
    blocks = []
    for tree in params["blocks"]:
        block = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(hf_config("qwen3_moe"))
        experts = tree["moe"]["experts"]
        with torch.no_grad():
            block.gate.weight.copy_(tree["moe"]["router"]["w"])
            block.experts.gate_up_proj.copy_(experts["gate_up"]["w"])  # (E, 2I, D), gate first
            block.experts.down_proj.copy_(experts["down"]["w"])
        blocks.append(block)
    return blocks


def hf_loss(params: dict, blocks: list, tok: torch.Tensor, out: torch.Tensor, batch: dict):
    """HF's MoE causal-LM loss over ``blocks``: cross-entropy + COEF x load_balancing_loss_func."""
    x = F.embedding(batch["inputs"], tok)
    router_logits = []
    for block in blocks:
        router_logits.append(block.gate(x)[0])  # what HF's OutputRecorder collects per layer
        x = x + block(x)
    logits = F.linear(x, out)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1))
    balance = modeling_qwen3_moe.load_balancing_loss_func
    aux = balance(tuple(router_logits), CFG.n_experts, CFG.top_k)
    return loss + COEF * aux


def test_engine_carries_router_stats_as_hf():
    gen = torch.Generator().manual_seed(5)
    batch = {
        "inputs": torch.randint(0, VOCAB, (2, 9), generator=gen),
        "targets": torch.randint(0, VOCAB, (2, 9), generator=gen),
    }
    config = zf.Config(param_dtype=torch.float32)
    state = zf.init(toy_model(), zf.sgd(lr=1.0), config, seed=0)
    before = zf.gather_params(state)
    blocks = hf_blocks(before)
    tok = before["embed"]["tok"]["w"].clone().requires_grad_(True)
    out = before["head"]["out"].clone().requires_grad_(True)
    want = hf_loss(before, blocks, tok, out, batch)
    want.backward()
    got = zf.eval_step(state, batch)
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
    state, _ = zf.train_step(state, batch)
    after = zf.gather_params(state)
    pairs = [
        (before["embed"]["tok"]["w"] - after["embed"]["tok"]["w"], tok.grad),
        (before["head"]["out"] - after["head"]["out"], out.grad),
    ]
    for old, new, block in zip(before["blocks"], after["blocks"], blocks, strict=True):
        router_step = old["moe"]["router"]["w"] - new["moe"]["router"]["w"]
        pairs.append((router_step, block.gate.weight.grad))
        hf_grads = {
            "gate_up": block.experts.gate_up_proj.grad,
            "down": block.experts.down_proj.grad,
        }
        for name, grad in hf_grads.items():
            step = old["moe"]["experts"][name]["w"] - new["moe"]["experts"][name]["w"]
            pairs.append((step, grad))
    for ours, ref in pairs:
        assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-6
    zf.close(state)
