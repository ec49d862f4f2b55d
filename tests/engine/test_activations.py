"""Offloaded layer-boundary checkpoints: the same bits come back, and training is bitwise
unchanged."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import run_engine

import zinf_fn as zf
from zinf_fn.io.buffers import BufferPool
from zinf_fn.offload.activations import OffloadedCheckpoints
from zinf_fn.offload.tiers import make_tier
from zinf_fn.overlap.stream import WriteBehind
from zinf_fn.overlap.window import Window
from zinf_fn.state import view


def _carry(m: int) -> dict:
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(3, 5, 8, generator=gen)
    return {
        "x": x.transpose(1, 2),  # non-contiguous
        "h": torch.randn(7, generator=gen).bfloat16(),
        "mask": torch.rand(3, 5, generator=gen) > 0.5,  # a bool leaf, passed through
        "pos": torch.arange(5, dtype=torch.int64),
        "tag": "not a tensor",
    }


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
@pytest.mark.parametrize("depth", [0, 2])
def test_keep_restore_round_trip_bitwise(tmp_path, placement, depth):
    n_layers, micro = 4, 2
    pool = BufferPool()
    tier = make_tier(placement, torch.device("cpu"), str(tmp_path), "rank0/activations")
    ckpt = OffloadedCheckpoints(
        tier, n_layers, pool, torch.device("cpu"), depth, WriteBehind(pool, depth), Window
    )
    for _ in range(2):  # two steps: rows are rewritten and read again
        kept = {layer: [_carry(10 * layer + m) for m in range(micro)] for layer in range(n_layers)}
        tokens = {layer: ckpt.keep(layer, carries) for layer, carries in kept.items()}
        for layer in reversed(range(n_layers)):
            restored = ckpt.restore(layer, tokens[layer])
            for want, got in zip(kept[layer], restored, strict=True):
                assert got["tag"] == "not a tensor"
                for name in ("x", "h", "mask", "pos"):
                    assert (
                        got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
                    )
                    assert torch.equal(
                        got[name].contiguous().view(torch.uint8),
                        want[name].contiguous().view(torch.uint8),
                    )
            ckpt.forget(layer)
    assert ckpt.pool.out == 0  # every staging buffer went back
    ckpt.close()


@pytest.mark.parametrize("placement,depth", [("cpu", 1), ("nvme", 0), ("nvme", 3)])
def test_training_with_offloaded_checkpoints_is_bitwise_the_same(tmp_path, placement, depth):
    common = dict(param_dtype=torch.bfloat16, grad_accum=2, prefetch_depth=depth)
    ref_losses, ref_final, _, _ = run_engine(zf.Config(**common))
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="nvme",
        offload_activations=placement,
        nvme_path=str(tmp_path),
        **common,
    )
    losses, final, _, state = run_engine(config)
    assert losses == ref_losses
    import optree

    for a, b in zip(optree.tree_leaves(final), optree.tree_leaves(ref_final), strict=True):
        assert torch.equal(a, b)
    tier = view(state).counters().tiers["activations"]
    assert (
        tier["bytes_written"] > 0 and tier["bytes_read"] == tier["bytes_written"]
    )  # every row out and back
