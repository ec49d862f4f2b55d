"""The Hugging Face Llama-family reference run the model tests compare the engine against.

``reference_run(family)`` trains transformers' model with ``torch.optim.AdamW(fused=True)`` for
``STEPS`` steps at the hyper-parameters below (the tolerances that go with them are in
tests/models/test_llama.py).
"""

from __future__ import annotations

import optree
import torch
from dist_utils import rank_part
from hf_reference import engine_config, engine_weights, hf_loss, hf_model
from reference import make_batches

import zinf_fn as zf
from layers import llama
from zinf_fn import tiling

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1
STEPS = 10
# a Llama with its embedding and head tiled over the vocabulary (3 and 4 tiles)
VOCAB_TILED = llama.Config(
    vocab_size=64,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    d_ff=48,
    seq_len=8,
    head_tiles=4,
    embed_tiles=3,
)


def adamw():
    return zf.adamw(lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)


def placement_config(placement: str, tmp_path, **kw) -> zf.Config:
    nvme = {"nvme_path": str(tmp_path)} if placement == "nvme" else {}
    return zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        param_dtype=torch.float32,
        **nvme,
        **kw,
    )


def train_untiled(
    model: zf.Model, config: zf.Config, cfg, steps: int, rank: int = 0, world: int = 1
) -> tuple[list, dict]:
    """(losses, the final weights with every tiled leaf untiled) of ``steps`` steps of ``model``
    under ``config`` on ``make_batches(cfg, steps, 4, seed=1)`` (this ``rank``'s part of each in a
    world of ``world``: ``rank_part``), AdamW lr 3e-3, weight decay 0.1."""
    state = zf.init(model, zf.adamw(lr=3e-3, weight_decay=0.1), config, seed=0)
    losses = []
    for batch in make_batches(cfg, steps, 4, seed=1):
        state, metrics = zf.train_step(state, rank_part(batch, rank, world))
        losses.append(metrics["loss"])
    final = optree.tree_map(tiling.untile, zf.gather_params(state), is_leaf=tiling.is_tiled)
    zf.close(state)
    return losses, final


_REFERENCE_RUNS: dict = {}


def reference_run(family: str, grad_accum: int = 1):
    """``STEPS`` steps of the HF model with torch.optim.AdamW (``train_hf``, ``grad_accum``
    micro-batches per step): (initial state_dict, batches, losses, final)."""
    if (family, grad_accum) not in _REFERENCE_RUNS:
        hf = hf_model(
            family
        ).train()  # dropout is 0.0 in these configs: train() changes nothing numerically
        initial = {name: t.detach().clone() for name, t in hf.state_dict().items()}
        batches = make_batches(engine_config(hf), STEPS, batch_size=4, seed=1)
        losses = train_hf(hf, batches, grad_accum)
        weights = engine_weights(hf.state_dict(), engine_config(hf))
        final = {p: t.detach().clone() for p, t in weights.items()}
        _REFERENCE_RUNS[family, grad_accum] = (initial, batches, losses, final)
    return _REFERENCE_RUNS[family, grad_accum]


def train_hf(model: torch.nn.Module, batches: list, grad_accum: int = 1) -> list[float]:
    """``model`` (transformers', or PEFT's over it) trained in place on ``batches`` by
    ``torch.optim.AdamW(fused=True)`` over its trainable parameters, at the hyper-parameters above.
    With ``grad_accum`` k each batch is split into k micro-batches along B, as
    ``zf.Config(grad_accum=k)`` does, and ``loss_m / k`` is back-propagated for each; returns each
    step's loss (the mean of its k)."""
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        fused=True,
    )
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for inputs, targets in zip(
            batch["inputs"].chunk(grad_accum), batch["targets"].chunk(grad_accum), strict=True
        ):
            loss = hf_loss(model.train(), {"inputs": inputs, "targets": targets})
            (loss / grad_accum).backward()
            total += loss.item() / grad_accum
        opt.step()
        losses.append(total)
    return losses
