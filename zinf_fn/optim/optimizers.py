"""Optax-style optimizers over flat fp32 shards, on torch's fused kernels.

An optimizer is an ``init``/``update`` pair in a NamedTuple::

    opt_state = opt.init(shard)                                   # a tuple of shard-shaped tensors
    new_param, new_state = opt.update(grad, opt_state, param, step, decay=None)

``update`` consumes ``grad``, ``param`` and ``opt_state``: like donated arguments in JAX, param and
state are updated in place and returned, and grad may serve as scratch once read, so an update
allocates nothing. ``step`` counts the updates applied before this one (0 on the first). ``decay``
is a ``DecaySpans``: the element ranges of the shard that take weight decay, which the engine builds
from ``weight_decay_mask``, a predicate on key paths such as ``"blocks.3.attn.qkv.w"``; None decays
everything. No per-element mask exists: each run of spans is one call of the fused kernel.

``update_many(grads, opt_states, params, step, decays)`` (None where an optimizer has none) is
``update`` on each of several shards at once, in one fused kernel call per weight-decay value over
all of them (the small tiles of a run, ``optim.updater.Updater.submit_run``): the fused kernels
treat each tensor of a list on its own, so it gives the bits of one ``update`` per shard. ``update``
is ``update_many`` of one shard.

``adamw`` and ``sgd`` run ``torch._fused_adamw_`` / ``torch._fused_sgd_``, the kernels behind
``torch.optim.AdamW(fused=True)`` / ``SGD(fused=True)``: one multi-threaded pass over memory (CPU)
or one kernel (CUDA) per list of spans, bitwise what torch's fused optimizers compute on the same
tensors (tests/optim/test_optim.py); torch's default implementation agrees to fp32 rounding. """

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .formats import MOMENTS, CompressPredicate, MomentsFormat

Schedule = Callable[[int], float]


class Optimizer(NamedTuple):
    init: Callable
    update: Callable
    weight_decay_mask: Callable[[str], bool] | None = None
    hyperparams: dict | None = None  # plain data, for fingerprints and checkpoint manifests
    lr: float | Schedule | None = None
    moments: MomentsFormat = MomentsFormat()  # how m and v are stored (adamw's ``moments=``)
    # which leaves keep ``moments``' format (None: formats' default)
    compress: CompressPredicate | None = None
    # ``update`` over lists of shards, one fused call (None: per shard)
    update_many: Callable | None = None


class DecaySpans(NamedTuple):
    """``spans``: sorted, disjoint ``[lo, hi)`` ranges of a shard of ``numel`` elements that take
    weight decay; every other element takes none."""

    spans: tuple[tuple[int, int], ...]
    numel: int

    def plain(self) -> tuple[tuple[int, int], ...]:
        """The complement: the ranges that take no decay."""
        out, prev = [], 0
        for lo, hi in self.spans:
            if lo > prev:
                out.append((prev, lo))
            prev = hi
        return (*out, (prev, self.numel)) if prev < self.numel else tuple(out)

    def slice(self, lo: int, hi: int) -> DecaySpans:
        """The spans of elements ``[lo, hi)``, counted from ``lo``."""
        cut = tuple((max(a, lo) - lo, min(b, hi) - lo) for a, b in self.spans if a < hi and b > lo)
        return DecaySpans(cut, hi - lo)


def decay_groups(
    decay: DecaySpans | None, numel: int, weight_decay: float
) -> list[tuple[float, tuple]]:
    """``[(weight decay, spans), ...]`` covering ``[0, numel)``: one call of a fused kernel each."""
    if decay is None or weight_decay == 0.0:
        return [(weight_decay, ((0, numel),))]
    if decay.numel != numel:
        raise ValueError(f"decay spans cover {decay.numel} elements, the shard has {numel}")
    return [(g, s) for g, s in ((weight_decay, decay.spans), (0.0, decay.plain())) if s]


def learning_rate(lr: float | Schedule, step: int) -> float:
    """The lr for the update after ``step`` applied updates: a float, or a callable of the step."""
    return float(lr(step)) if callable(lr) else float(lr)


def _views(t: torch.Tensor, spans: tuple) -> list[torch.Tensor]:
    return [t[lo:hi] for lo, hi in spans]


def adamw(
    lr: float | Schedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: Callable[[str], bool] | None = None,
    moments: str = "fp32",
    compress: CompressPredicate | None = None,
) -> Optimizer:
    """AdamW with decoupled weight decay and bias correction, as ``torch.optim.AdamW(fused=True)``.

    ``moments``: how m and v are stored, "fp32", "bf16" (stochastic rounding) or "int8" (block-wise,
    as bitsandbytes' 8-bit AdamW); see ``optim.formats``. ``compress(path, numel)`` says which
    leaves take that format (the others keep fp32); None: leaves of at least 4096 elements
    (``formats.compressed_leaf``). The compressed update of a piece is
    ``optim.compressed.adamw_piece_``; ``update`` here is the fp32 one.

    With t = step + 1 and lr_t = lr(step)::

        p <- p * (1 - lr_t * wd)                     (in the decayed spans)
        m <- b1 m + (1 - b1) g                       v <- b2 v + (1 - b2) g^2
        p <- p - lr_t / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    in one fused pass per run of spans (``torch._fused_adamw_``); ``grad`` is read only.
    """
    _check_adamw(b1, b2, eps, weight_decay)
    _check_moments(moments, compress)

    def init(shard: torch.Tensor):
        # fp32 zeros whatever ``moments``: the engine stores them in the group's format (zero is
        # exact in each)
        return (
            torch.zeros_like(shard, dtype=torch.float32),
            torch.zeros_like(shard, dtype=torch.float32),
        )

    def update_many(grads, opt_states, params, step, decays):
        # the fused kernel's step: incremented first
        t = torch.tensor(float(step + 1), device=params[0].device)
        lr_t = learning_rate(lr, step)
        for wd, (ps, gs, ms, vs) in _by_decay(
            grads, opt_states, params, decays, weight_decay
        ).items():
            torch._fused_adamw_(
                ps,
                gs,
                ms,
                vs,
                [],
                [t] * len(ps),
                lr=lr_t,
                beta1=b1,
                beta2=b2,
                weight_decay=wd,
                eps=eps,
                amsgrad=False,
                maximize=False,
            )
        return params, opt_states

    hyper = {
        "name": "adamw",
        "lr": _describe(lr),
        "b1": b1,
        "b2": b2,
        "eps": eps,
        "weight_decay": weight_decay,
        "moments": moments,
    }
    return Optimizer(
        init, _one(update_many), mask, hyper, lr, MomentsFormat(moments), compress, update_many
    )


def _check_adamw(b1: float, b2: float, eps: float, weight_decay: float) -> None:
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"adamw: {name} must be in [0, 1), got {value}")
    if eps <= 0 or weight_decay < 0:
        raise ValueError(
            f"adamw: eps must be > 0 and weight_decay >= 0, got eps={eps}, "
            f"weight_decay={weight_decay}"
        )


def _check_moments(moments: str, compress) -> None:
    if moments not in MOMENTS:
        raise ValueError(
            f"adamw: moments={moments!r} is not a moments format; expected one of {MOMENTS}, "
            f"e.g. zf.adamw(lr=3e-4, moments='int8')"
        )
    if compress is not None and not callable(compress):
        raise TypeError(
            f"adamw: compress must be a callable (path, numel) -> bool or None, got {compress!r}"
        )


def sgd(
    lr: float | Schedule = 1e-2,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    mask: Callable[[str], bool] | None = None,
) -> Optimizer:
    """SGD with (PyTorch-style) momentum and decoupled weight decay::

        p <- p * (1 - lr_t * wd)   (in the decayed spans)
        b <- momentum * b + g      (b = g on the first step)
        p <- p - lr_t * b

    The update is ``torch._fused_sgd_`` (``SGD(fused=True)``'s kernel, without its coupled L2
    decay); the decoupled decay is one more pass over the decayed spans when ``weight_decay`` is
    set. """
    if momentum < 0:
        raise ValueError(f"sgd: momentum must be >= 0, got {momentum}")

    def init(shard):
        return (torch.zeros_like(shard, dtype=torch.float32),) if momentum else ()

    def update_many(grads, opt_states, params, step, decays):
        lr_t = learning_rate(lr, step)
        for wd, (ps, *_) in _by_decay(grads, opt_states, params, decays, weight_decay).items():
            if wd:
                torch._foreach_mul_(ps, 1.0 - lr_t * wd)
        buffers = [b for state in opt_states for b in state]
        torch._fused_sgd_(
            list(params),
            list(grads),
            buffers,
            weight_decay=0.0,
            momentum=momentum,
            lr=lr_t,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            is_first_step=step == 0,
        )
        return params, opt_states

    hyper = {"name": "sgd", "lr": _describe(lr), "momentum": momentum, "weight_decay": weight_decay}
    return Optimizer(init, _one(update_many), mask, hyper, lr, update_many=update_many)


def _one(update_many: Callable) -> Callable:
    """``update`` as ``update_many`` of one shard (the one rule of the update, whatever the number
    of shards)."""

    def update(grad, opt_state, param, step, decay: DecaySpans | None = None):
        params, states = update_many([grad], [opt_state], [param], step, [decay])
        return params[0], states[0]

    return update


def _by_decay(
    grads, opt_states, params, decays, weight_decay: float
) -> dict[float, list[list[torch.Tensor]]]:
    """``{weight decay: [param views, grad views, views of each state tensor...]}``: the spans of
    every shard (``decay_groups`` of each), one fused kernel call per weight decay."""
    calls: dict[float, list[list[torch.Tensor]]] = {}
    for grad, state, param, decay in zip(grads, opt_states, params, decays, strict=True):
        for wd, spans in decay_groups(decay, param.numel(), weight_decay):
            lists = calls.setdefault(wd, [[] for _ in range(2 + len(state))])
            for out, t in zip(lists, (param, grad, *state), strict=True):
                out.extend(_views(t, spans))
    return calls


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` scales gradients by: min(1, max / (norm +
    1e-6))."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def _describe(lr) -> float | str:
    return float(lr) if not callable(lr) else getattr(lr, "__name__", "schedule")
