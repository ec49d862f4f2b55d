"""PEFT's LoRA trained step by step as the engine's reference: transformers' model wrapped by
``peft.get_peft_model``, its adapters started from the engine's init,
``torch.optim.AdamW(fused=True)``.
"""

from __future__ import annotations

import peft
import torch
from hf_reference import hf_loss, hf_model, tree_paths
from llama_reference import BETAS, EPS, LR, WD

import checkpoints
import zinf_fn as zf


def peft_run(family: str, lm, state, batches: list, modules: list[str], rank: int, alpha: float):
    """``(losses, leaves)``: PEFT's loss per batch and its trained LoRA parameters by our key paths,
    from hf_model(family) with LoRA (``rank``, ``alpha``) on ``modules``, its A and B first set
    to the engine ``state``'s (``lm``: the engine's LoRA model)."""
    ref = peft.get_peft_model(hf_model(family), peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=modules))
    names = {peft_name: ours for ours, peft_name in checkpoints.peft.peft_names(lm.config).items()}
    leaves = {names[n.replace(".default", "")]: p
              for n, p in ref.named_parameters() if "lora_" in n}
    ours = tree_paths(zf.gather_params(state))
    with torch.no_grad():   # the reference starts from the engine's init of A (B = 0)
        for path, p in leaves.items():
            p.copy_(ours[path])
    return train_peft(ref, batches), leaves


def train_peft(ref, batches: list) -> list[float]:
    """PEFT model ``ref`` trained on ``batches`` by ``torch.optim.AdamW(fused=True)`` over its
    trainable parameters; the loss of every step."""
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, betas=BETAS,
                            eps=EPS, weight_decay=WD, fused=True)
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = hf_loss(ref.train(), batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def assert_adapter_loads(family: str, lm, path: str, final: dict) -> None:
    """``PeftModel.from_pretrained`` of hf_model(family) reads the adapter at ``path`` (written by
    ``checkpoints.to_peft``) as the engine's trained LoRA leaves ``final``, bitwise."""
    names = {peft_name: ours for ours, peft_name in checkpoints.peft.peft_names(lm.config).items()}
    loaded = peft.PeftModel.from_pretrained(hf_model(family), path).eval()
    lora_params = [(n, p) for n, p in loaded.named_parameters() if "lora_" in n]
    assert lora_params
    for n, p in lora_params:
        assert torch.equal(p, final[names[n.replace(".default", "")]]), n
