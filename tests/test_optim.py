"""Optimizers over flat shards against torch.optim on the same tensors.

The update runs torch's single-tensor AdamW ops in the same order, so results are bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

import zinf_fn as zf


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
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, foreach=False)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.9**s) if schedule else None
    state = opt.init(param)
    for step, g in enumerate(_grads(n, steps)):
        ref.grad = g.clone()   # before the update: it consumes g (its memory becomes scratch)
        param, state = opt.update(g, state, param, step)
        ref_opt.step()
        if lr_sched:
            lr_sched.step()
        torch.testing.assert_close(param, ref.detach(), rtol=0, atol=1e-7 if schedule else 0)
    torch.testing.assert_close(state[0], ref_opt.state[ref]["exp_avg"], rtol=0, atol=0)


def test_adamw_decay_mask_decays_only_masked_elements():
    opt = zf.adamw(lr=0.1, weight_decay=0.5)
    param = torch.ones(4)
    mask = torch.tensor([True, False, True, False])
    param, _ = opt.update(torch.zeros(4), opt.init(param), param, 0, decay_mask=mask)
    assert torch.equal(param, torch.tensor([0.95, 1.0, 0.95, 1.0]))


def test_sgd_momentum_equals_torch():
    n = 100
    opt = zf.sgd(lr=0.05, momentum=0.9)
    param = torch.randn(n, generator=torch.Generator().manual_seed(2))
    ref = torch.nn.Parameter(param.clone())
    ref_opt = torch.optim.SGD([ref], lr=0.05, momentum=0.9, foreach=False)
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


@pytest.mark.parametrize("kwargs", [dict(b1=1.0), dict(b2=-0.1), dict(eps=0.0), dict(weight_decay=-1.0)])
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
