"""Optax-style optimizers over flat fp32 shards.

An optimizer is an ``init``/``update`` pair in a NamedTuple::

    opt_state = opt.init(shard)                                   # a tuple of shard-shaped tensors
    new_param, new_state = opt.update(grad, opt_state, param, step, decay_mask=None)

``update`` consumes ``grad``, ``param`` and ``opt_state``: like donated arguments in JAX, param and
state are updated in place and returned, and grad may serve as scratch once read, so an update
allocates nothing. ``step`` counts the updates applied before
this one (0 on the first). ``decay_mask`` is a bool tensor shaped like the shard (True: decay this
element) that the engine builds from ``weight_decay_mask``, a predicate on key paths such as
``"blocks.3.attn.qkv.w"``; None decays everything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

Schedule = Callable[[int], float]


class Optimizer(NamedTuple):
    init: Callable
    update: Callable
    weight_decay_mask: Callable[[str], bool] | None = None
    hyperparams: dict | None = None   # plain data, for fingerprints and checkpoint manifests
    lr: float | Schedule | None = None


def learning_rate(lr: float | Schedule, step: int) -> float:
    """The lr for the update after ``step`` applied updates: a float, or a callable of the step."""
    return float(lr(step)) if callable(lr) else float(lr)


def _decay_(param: torch.Tensor, factor: float, mask: torch.Tensor | None) -> None:
    """param *= factor where mask (everywhere when mask is None)."""
    if factor == 1.0:
        return
    if mask is None:
        param.mul_(factor)
    else:
        param.mul_(torch.where(mask, factor, 1.0))


def adamw(lr: float | Schedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.01, mask: Callable[[str], bool] | None = None) -> Optimizer:
    """AdamW with decoupled weight decay and bias correction, as ``torch.optim.AdamW``.

    With t = step + 1 and lr_t = lr(step)::

        p <- p * (1 - lr_t * wd)                     (where the mask allows decay)
        m <- b1 m + (1 - b1) g                       v <- b2 v + (1 - b2) g^2
        p <- p - lr_t / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    The operations run in the order torch's implementation runs them, so the two agree to rounding.
    """
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"adamw: {name} must be in [0, 1), got {value}")
    if eps <= 0 or weight_decay < 0:
        raise ValueError(f"adamw: eps must be > 0 and weight_decay >= 0, got eps={eps}, weight_decay={weight_decay}")

    def init(shard: torch.Tensor):
        return (torch.zeros_like(shard, dtype=torch.float32), torch.zeros_like(shard, dtype=torch.float32))

    def update(grad, opt_state, param, step, decay_mask=None):
        m, v = opt_state
        t = step + 1
        lr_t = learning_rate(lr, step)
        _decay_(param, 1.0 - lr_t * weight_decay, decay_mask)
        m.lerp_(grad, 1.0 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        step_size = lr_t / (1.0 - b1**t)
        denom = torch.sqrt(v, out=grad)   # grad is spent: its memory holds the denominator
        denom.div_(math.sqrt(1.0 - b2**t)).add_(eps)
        param.addcdiv_(m, denom, value=-step_size)
        return param, (m, v)

    hyper = {"name": "adamw", "lr": _describe(lr), "b1": b1, "b2": b2, "eps": eps, "weight_decay": weight_decay}
    return Optimizer(init, update, mask, hyper, lr)


def sgd(lr: float | Schedule = 1e-2, momentum: float = 0.0, weight_decay: float = 0.0,
        mask: Callable[[str], bool] | None = None) -> Optimizer:
    """SGD with (PyTorch-style) momentum and decoupled weight decay::

        p <- p * (1 - lr_t * wd);   b <- momentum * b + g (b = g on the first step);   p <- p - lr_t * b
    """
    if momentum < 0:
        raise ValueError(f"sgd: momentum must be >= 0, got {momentum}")

    def init(shard):
        return (torch.zeros_like(shard, dtype=torch.float32),) if momentum else ()

    def update(grad, opt_state, param, step, decay_mask=None):
        lr_t = learning_rate(lr, step)
        _decay_(param, 1.0 - lr_t * weight_decay, decay_mask)
        if not momentum:
            param.add_(grad, alpha=-lr_t)
            return param, opt_state
        (buf,) = opt_state
        if step == 0:
            buf.copy_(grad)
        else:
            buf.mul_(momentum).add_(grad)
        param.add_(buf, alpha=-lr_t)
        return param, (buf,)

    hyper = {"name": "sgd", "lr": _describe(lr), "momentum": momentum, "weight_decay": weight_decay}
    return Optimizer(init, update, mask, hyper, lr)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` scales gradients by: min(1, max / (norm + 1e-6))."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def _describe(lr) -> float | str:
    return float(lr) if not callable(lr) else getattr(lr, "__name__", "schedule")
