"""Shared drivers for the equivalence tests: the engine run and the plain-PyTorch reference run."""

from __future__ import annotations

import torch
from reference import RefGPT, load_tree, make_batches, tree_from_module

import zinf_fn as zf
from layers import gpt

CFG = gpt.Config(vocab_size=64, d_model=32, n_heads=2, n_layers=3, seq_len=16)
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1


def decay_predicate(path: str) -> bool:
    """Decay matrices only: no norms, no biases, no position table (a typical GPT mask)."""
    return path.endswith(".w") and ".ln" not in path and "ln_f" not in path and "pos" not in path


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 5)


def batches(n: int = 20, batch_size: int = 8, seed: int = 1):
    return make_batches(CFG, n, batch_size, seed)


def run_engine(
    config: zf.Config,
    steps: int = 20,
    mask: bool = False,
    schedule: bool = False,
    seed: int = 0,
    data=None,
    cfg: gpt.Config = CFG,
):
    """Train the functional GPT; returns (losses, final master params, initial params)."""
    lr = (lambda s: LR * warmup(s)) if schedule else LR
    opt = zf.adamw(
        lr=lr,
        b1=BETAS[0],
        b2=BETAS[1],
        eps=EPS,
        weight_decay=WD,
        mask=decay_predicate if mask else None,
    )
    state = zf.init(gpt.model(cfg), opt, config, seed=seed)
    initial = zf.gather_params(state)
    losses = []
    for batch in data or batches(steps):
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
    return losses, zf.gather_params(state), initial, state


def run_reference(
    initial: dict,
    steps: int = 20,
    grad_accum: int = 1,
    clip: float | None = None,
    mask: bool = False,
    schedule: bool = False,
    data=None,
    checkpoint: bool = False,
    cfg: gpt.Config = CFG,
):
    """The same training with nn.Module + torch.optim.AdamW (+ clip_grad_norm_, LambdaLR); a tied
    ``cfg`` ties ``lm_head.weight`` to the token embedding (one parameter)."""
    model = load_tree(RefGPT(cfg), initial)
    named = dict(model.named_parameters())
    if mask:
        decay = [p for n, p in named.items() if _ref_decays(n)]
        rest = [p for n, p in named.items() if not _ref_decays(n)]
        groups = [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]
    else:
        groups = [{"params": list(named.values()), "weight_decay": WD}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup) if schedule else None
    return reference_steps(
        model, opt, data or batches(steps), grad_accum, clip, list(model.parameters()), sched
    )


def reference_steps(
    model, opt, data, grad_accum: int, clip: float | None, params: list, sched=None
):
    """Train the ``nn.Module`` reference on ``data`` (each batch split into ``grad_accum``
    micro-batches, the loss their mean; ``clip_grad_norm_`` over ``params``): (the losses, the final
    parameter tree)."""
    losses = []
    for batch in data:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb_in, mb_t in zip(
            batch["inputs"].chunk(grad_accum), batch["targets"].chunk(grad_accum), strict=True
        ):
            loss = model(mb_in, mb_t)
            (loss / grad_accum).backward()
            total += loss.item() / grad_accum
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if sched:
            sched.step()
        losses.append(total)
    return losses, tree_from_module(model)


def _ref_decays(name: str) -> bool:
    """The reference names of the leaves ``decay_predicate`` decays."""
    return name.endswith("weight") and (
        "attn" in name or "mlp" in name or "tok_emb" in name or "lm_head" in name
    )


def max_abs_diff(a: dict, b: dict) -> float:
    import optree

    return max(
        float((x - y).abs().max())
        for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True)
    )
