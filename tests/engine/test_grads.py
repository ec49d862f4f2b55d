"""Unit gradients handed to the update as their leaves (no flat copy) against the flat-buffer
path."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import max_abs_diff, run_engine

import zinf_fn as zf
from zinf_fn.scan.grads import LeafGrads, accumulate_
from zinf_fn.state import view
from zinf_fn.tree import flat_spec

FP32 = dict(param_dtype=torch.float32)
# Clipping at a norm no gradient reaches scales by exactly 1.0 (the update skips the multiply), so
# the two-pass path applies the same arithmetic through flat buffers stashed on the tier: a bitwise
# baseline.
NO_CLIP = 1e30


@pytest.mark.parametrize("placement", ["none", "cpu"])
def test_leaf_grads_train_bitwise_like_flat_buffers(placement):
    leaf = zf.Config(offload_params=placement, offload_optimizer=placement, **FP32)
    flat = zf.Config(
        offload_params=placement, offload_optimizer=placement, clip_grad_norm=NO_CLIP, **FP32
    )
    losses, final, _, state = run_engine(leaf, steps=5)
    assert view(state).counters().leaf_grads  # the one-pass step kept the leaves
    base, final0, _, _ = run_engine(flat, steps=5)
    assert losses == base
    assert max_abs_diff(final, final0) == 0.0


def _residual_param_model(d: int = 8, seq: int = 4, n_layers: int = 3) -> zf.Model:
    """Blocks ``x + p`` with p shaped like the carry: the vjp hands back one tensor as both the
    parameter's gradient and the carry's cotangent."""

    def embed_init(gen):
        return {"w": torch.randn(d, d, generator=gen) * 0.1}

    def block_init(gen, i):
        return {"p": torch.randn(2, seq, d, generator=gen) * 0.1}

    def head_init(gen):
        return {"w": torch.randn(d, generator=gen) * 0.1}

    return zf.Model(
        embed=zf.Stage(embed_init, lambda p, b: b["x"] @ p["w"]),
        block=zf.Stage(block_init, lambda p, x: x + p["p"]),
        head=zf.Stage(head_init, lambda p, x, b: ((x @ p["w"] - b["y"]) ** 2).mean()),
        n_layers=n_layers,
    )


def test_gradient_sharing_memory_with_a_cotangent_is_not_overwritten():
    gen = torch.Generator().manual_seed(3)
    data = [
        {"x": torch.randn(2, 4, 8, generator=gen), "y": torch.randn(2, 4, generator=gen)}
        for _ in range(4)
    ]
    runs = []
    for clip in (None, NO_CLIP):
        config = zf.Config(clip_grad_norm=clip, **FP32)
        state = zf.init(_residual_param_model(), zf.adamw(lr=1e-2), config, seed=0)
        losses = []
        for batch in data:
            state, m = zf.train_step(state, batch)
            losses.append(m["loss"])
        runs.append((losses, zf.gather_params(state)))
    assert runs[0][0] == runs[1][0]
    assert max_abs_diff(runs[0][1], runs[1][1]) == 0.0


def test_leaf_grads_clone_aliased_leaves_and_sum_norms_in_order():
    spec = flat_spec({"a": torch.zeros(3), "b": torch.zeros(2, 2)})
    shared = torch.arange(4.0)
    keep = torch.ones(3)
    grads = LeafGrads(spec)
    accumulate_(grads, spec, [keep, shared.view(2, 2)], True, keep=(keep,))
    a, b = (g for _, g in grads.spans())
    assert (
        a.untyped_storage().data_ptr() != keep.untyped_storage().data_ptr()
    )  # cloned: keep is needed
    assert (
        b.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    )  # owned: taken as is
    assert [off for off, _ in grads.spans()] == [0, 3]
    assert grads.sq_norm().item() == 3.0 + 14.0
    with pytest.raises(RuntimeError, match="flat buffer"):
        accumulate_(grads, spec, [keep, shared.view(2, 2)], False)
