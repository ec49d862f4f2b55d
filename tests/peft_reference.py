"""PEFT's LoRA trained step by step as the engine's reference: transformers' model wrapped by
``peft.get_peft_model``, its adapters started from the engine's init,
``torch.optim.AdamW(fused=True)``. Factors move between PEFT's layout and the engine's through
``checkpoints.peft_targets`` (stacked experts: ``layers.moe_lora``'s permutes, bitwise).
"""

from __future__ import annotations

import peft
import torch
from hf_reference import hf_model, tree_paths
from llama_reference import train_hf

import zinf_fn as zf
from checkpoints import peft_targets
from layers import llama
from layers.lora import LORA_LEAVES

# the LoRA of the llama tests (tests/models/test_lora.py, test_peft.py): rank, alpha, our targets'
# HF names
RANK, ALPHA = 4, 8
HF_TARGETS = {"attn.q": "q_proj", "attn.v": "v_proj", "mlp.down": "down_proj", "attn.o": "o_proj"}


def peft_llama(
    targets=("attn.q", "attn.v"), family: str = "llama3", seed: int = 0, rank: int = RANK
):
    """(base HF state_dict, a PEFT LoRA model of ``hf_model(family)`` with random nonzero A and
    B)."""
    hf = hf_model(family, seed)
    base = {n: t.detach().clone() for n, t in hf.state_dict().items()}
    config = peft.LoraConfig(
        r=rank, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=[HF_TARGETS[t] for t in targets]
    )
    model = peft.get_peft_model(hf, config)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return base, model.eval()


def lora_leaves(model) -> dict[str, torch.Tensor]:
    """A PEFT model's LoRA weights by our key paths (``blocks.0.attn.q.lora_a``)."""
    out = {}
    for name, p in model.named_parameters():
        for peft_leaf, ours in (("lora_A", "lora_a"), ("lora_B", "lora_b")):
            if f".{peft_leaf}." in name:
                module = name.removeprefix("base_model.model.").split(f".{peft_leaf}.")[0]
                out[f"{llama.hf_to_ours(module + '.weight')[: -len('.w')]}.{ours}"] = p
    return out


def peft_model(
    family: str,
    lm,
    state,
    modules: list[str],
    rank: int,
    alpha: float,
    parameters: list[str] | None = None,
):
    """hf_model(family) with PEFT LoRA (``rank``, ``alpha``) on ``modules`` and the expert
    ``parameters`` (PEFT's target_parameters), its A and B set to the engine ``state``'s (``lm``:
    the engine's LoRA model)."""
    ref = peft.get_peft_model(
        hf_model(family),
        peft.LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=0.0,
            target_modules=modules,
            target_parameters=parameters,
        ),
    )
    params = peft_params(ref)
    ours = tree_paths(zf.gather_params(state))
    with torch.no_grad():  # the reference starts from the engine's init of A (B = 0)
        for path, at in peft_targets.adapted(lm.config).items():
            factors = peft_targets.to_peft(at, ours[f"{path}.lora_a"], ours[f"{path}.lora_b"])
            for leaf, value in zip(LORA_LEAVES, factors, strict=True):
                params[peft_targets.peft_name(at, leaf)].copy_(value)
    return ref


def peft_params(ref) -> dict[str, torch.nn.Parameter]:
    """A PEFT model's LoRA parameters by the names its adapter file holds (no ``.default``)."""
    return {n.replace(".default", ""): p for n, p in ref.named_parameters() if "lora_" in n}


def our_leaves(lm, ref) -> dict[str, torch.Tensor]:
    """A PEFT model's LoRA factors by the engine's key paths, in the engine's layout."""
    params = peft_params(ref)
    out = {}
    for path, at in peft_targets.adapted(lm.config).items():
        stored = [params[peft_targets.peft_name(at, leaf)].detach() for leaf in LORA_LEAVES]
        factors = peft_targets.from_peft(at, *stored)
        out.update({f"{path}.{leaf}": t for leaf, t in zip(LORA_LEAVES, factors, strict=True)})
    return out


def peft_run(
    family: str,
    lm,
    state,
    batches: list,
    modules: list[str],
    rank: int,
    alpha: float,
    parameters: list[str] | None = None,
):
    """``(losses, leaves)``: PEFT's loss per batch and its trained LoRA factors by our key paths
    (our layout), from ``peft_model(...)`` trained on ``batches``."""
    ref = peft_model(family, lm, state, modules, rank, alpha, parameters)
    return train_hf(ref, batches), our_leaves(lm, ref)


def assert_adapter_loads(family: str, lm, path: str, final: dict):
    """``PeftModel.from_pretrained`` of hf_model(family) reads the adapter at ``path`` (written by
    ``checkpoints.to_peft``) as the engine's trained LoRA leaves ``final``, bitwise; returns the
    loaded model (eval mode)."""
    loaded = peft.PeftModel.from_pretrained(hf_model(family), path).eval()
    assert set(peft_params(loaded)) == set(peft_targets.peft_names(lm.config).values())
    got = our_leaves(lm, loaded)
    assert got
    for name, value in got.items():
        assert torch.equal(value, final[name]), name
    return loaded
