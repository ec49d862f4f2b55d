"""Optimizers over flat shards against torch.optim on the same tensors.

The updates run torch's fused kernels (``torch.optim.AdamW(fused=True)`` / ``SGD(fused=True)``) on
the same tensors, so results are bitwise equal to those. Against torch's default (single-tensor)
AdamW they agree to fp32 rounding: the fused kernel evaluates the same formula in another order, ~1
ulp per step at parameter scale 1, so after 12 steps a bound of 1e-6 absolute (~8 ulp of 1.0) holds
with margin while any wrong term (a missing decay, bias correction or eps) moves a parameter by ~lr
= 1e-2.
"""

from __future__ import annotations

import pytest
import torch

import zinf_fn as zf
from zinf_fn.optim import DecaySpans


def _grads(n, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(steps)]


@pytest.mark.parametrize("schedule", [False, True])
def test_adamw_equals_torch(schedule):
    n, steps = 257, 12
    sched = (lambda s: 1e-2 * (0.9**s)) if schedule else 1e-2
    opt = zf.adamw(lr=sched, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.05)
    param = torch.randn(n, generator=torch.Generator().manual_seed(1))
    ref = torch.nn.Parameter(param.clone())
    ref_opt = torch.optim.AdamW(
        [ref], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, fused=True
    )
    lr_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.9**s) if schedule else None
    state = opt.init(param)
    for step, g in enumerate(_grads(n, steps)):
        ref.grad = g.clone()  # before the update: it consumes g (its memory becomes scratch)
        param, state = opt.update(g, state, param, step)
        ref_opt.step()
        if lr_sched:
            lr_sched.step()
        torch.testing.assert_close(param, ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(state[0], ref_opt.state[ref]["exp_avg"], rtol=0, atol=0)
    torch.testing.assert_close(state[1], ref_opt.state[ref]["exp_avg_sq"], rtol=0, atol=0)


def test_adamw_agrees_with_torchs_default_implementation_to_rounding():
    n, steps = 1000, 12
    opt = zf.adamw(lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    param = torch.randn(n, generator=torch.Generator().manual_seed(1))
    ref = torch.nn.Parameter(param.clone())
    ref_opt = torch.optim.AdamW(
        [ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False
    )
    state = opt.init(param)
    for step, g in enumerate(_grads(n, steps)):
        ref.grad = g.clone()
        param, state = opt.update(g, state, param, step)
        ref_opt.step()
    assert (param - ref.detach()).abs().max() <= 1e-6


def test_adamw_decays_only_the_decayed_spans():
    opt = zf.adamw(lr=0.1, weight_decay=0.5)
    param = torch.ones(6)
    decay = DecaySpans(((0, 1), (3, 5)), 6)
    param, _ = opt.update(torch.zeros(6), opt.init(param), param, 0, decay)
    assert torch.equal(param, torch.tensor([0.95, 1.0, 1.0, 0.95, 0.95, 1.0]))
    assert DecaySpans(((0, 1), (3, 5)), 6).plain() == ((1, 3), (5, 6))
    assert decay.slice(2, 6) == DecaySpans(((1, 3),), 4)
    with pytest.raises(ValueError, match="decay spans cover 6 elements, the shard has 5"):
        opt.update(torch.zeros(5), opt.init(torch.ones(5)), torch.ones(5), 0, decay)


def test_adamw_with_decay_spans_equals_torch_with_two_param_groups():
    """HF-style decay/no-decay groups: the spans are the groups, each one fused call."""
    n, pieces = 1000, [(0, 300, True), (300, 500, False), (500, 800, True), (800, 1000, False)]
    opt = zf.adamw(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    param = torch.randn(n, generator=torch.Generator().manual_seed(3))
    refs = [torch.nn.Parameter(param[lo:hi].clone()) for lo, hi, _ in pieces]
    groups = [
        {
            "params": [r for r, p in zip(refs, pieces, strict=True) if p[2] == decayed],
            "weight_decay": 0.1 if decayed else 0.0,
        }
        for decayed in (True, False)
    ]
    ref_opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    decay, state = DecaySpans(((0, 300), (500, 800)), n), opt.init(param)
    for step, g in enumerate(_grads(n, 10)):
        for r, (lo, hi, _) in zip(refs, pieces, strict=True):
            r.grad = g[lo:hi].clone()
        param, state = opt.update(g, state, param, step, decay)
        ref_opt.step()
    assert torch.equal(param, torch.cat([r.detach() for r in refs]))


def test_sgd_momentum_equals_torch():
    n = 100
    opt = zf.sgd(lr=0.05, momentum=0.9)
    param = torch.randn(n, generator=torch.Generator().manual_seed(2))
    ref = torch.nn.Parameter(param.clone())
    ref_opt = torch.optim.SGD([ref], lr=0.05, momentum=0.9, fused=True)
    state = opt.init(param)
    for step, g in enumerate(_grads(n, 8)):
        ref.grad = g.clone()
        param, state = opt.update(g, state, param, step)
        ref_opt.step()
    torch.testing.assert_close(param, ref.detach(), rtol=0, atol=0)


def test_plain_sgd_has_no_state():
    opt = zf.sgd(lr=0.5)
    param = torch.ones(3)
    assert opt.init(param) == ()
    param, _ = opt.update(torch.ones(3), (), param, 0)
    assert param.tolist() == [0.5, 0.5, 0.5]


@pytest.mark.parametrize(
    "kwargs", [dict(b1=1.0), dict(b2=-0.1), dict(eps=0.0), dict(weight_decay=-1.0)]
)
def test_adamw_rejects_bad_hyperparameters(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        zf.adamw(**kwargs)


def test_clip_coefficient_matches_torch():
    from zinf_fn.optim import clip_coefficient

    grads = [torch.randn(10) * 3, torch.randn(5)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    coef = clip_coefficient(norm, 1.0)
    torch.testing.assert_close(params[0].grad, grads[0] * coef)
