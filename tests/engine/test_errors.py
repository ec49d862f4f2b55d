"""Bad input gets a ValueError / TypeError that names the problem."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import CFG, batches, max_abs_diff

import zinf_fn as zf
from layers import gpt


def _state(model=None, **config):
    return zf.init(model or gpt.model(CFG), zf.adamw(), zf.Config(**config))


def _toy(block_init=None, block_apply=None, head_apply=None) -> zf.Model:
    """A 2-layer toy model over carries (B, 4), to break one piece at a time."""
    d = 4
    embed = zf.Stage(lambda g: {"w": torch.randn(d, d, generator=g)}, lambda p, b: b["x"] @ p["w"])
    block = zf.Stage(
        block_init or (lambda g, i: {"w": torch.randn(d, d, generator=g)}),
        block_apply or (lambda p, x: torch.tanh(x @ p["w"])),
    )
    head = zf.Stage(
        lambda g: {"w": torch.randn(d, 1, generator=g)},
        head_apply or (lambda p, x, b: ((x @ p["w"]).squeeze(-1) - b["y"]).pow(2).mean()),
    )
    return zf.Model(embed, block, head, n_layers=2)


TOY_BATCH = {"x": torch.randn(8, 4), "y": torch.randn(8)}


def test_batch_with_wrong_dtype():
    state = _state()
    bad = dict(batches(1)[0], inputs=batches(1)[0]["inputs"].float())
    with pytest.raises(TypeError, match="inputs"):
        zf.train_step(state, bad)


def test_batch_with_wrong_shape_names_seq_len():
    state = _state()
    long = {k: torch.zeros(8, CFG.seq_len + 1, dtype=torch.long) for k in ("inputs", "targets")}
    with pytest.raises(ValueError, match="seq_len"):
        zf.train_step(state, long)


def test_batch_that_differs_from_the_first():
    state = _state()
    state, _ = zf.train_step(state, batches(1)[0])
    # a shorter batch is fine (tests/engine/test_batch_shapes.py); another number of dims is not
    extra_dim = {k: v[:, :8, None] for k, v in batches(1)[0].items()}
    with pytest.raises(ValueError, match="differs from the first batch"):
        zf.train_step(state, extra_dim)


def test_batch_not_divisible_by_grad_accum():
    state = _state(grad_accum=3)
    with pytest.raises(ValueError, match="grad_accum=3"):
        zf.train_step(state, batches(1)[0])


def test_block_that_changes_the_carry_names_the_layer():
    model = _toy(
        block_apply=lambda p, x: torch.cat([x @ p["w"], x], dim=-1) if x.shape[-1] == 4 else x
    )
    state = zf.init(model, zf.adamw(), zf.Config(param_dtype=torch.float32))
    with pytest.raises(ValueError, match=r"blocks\.0: block.apply changed the carry"):
        zf.train_step(state, TOY_BATCH)


def test_block_init_that_differs_between_layers_names_the_key_path():
    def block_init(g, i):
        return {"w": torch.randn(4, 4, generator=g), **({"extra": torch.zeros(2)} if i else {})}

    model = _toy(block_init=block_init)
    with pytest.raises(ValueError, match=r"block.init\(gen, 1\).*'extra'"):
        zf.init(model, zf.adamw(), zf.Config())


def test_non_scalar_loss():
    model = _toy(head_apply=lambda p, x, b: (x @ p["w"]).squeeze(-1))
    state = zf.init(model, zf.adamw(), zf.Config())
    with pytest.raises(ValueError, match=r"scalar .*shape \(8,\)"):
        zf.train_step(state, TOY_BATCH)


def test_unknown_placement():
    with pytest.raises(ValueError, match="'gpu'.*'none', 'cpu', 'nvme'"):
        zf.Config(offload_params="gpu")


def test_nvme_without_path():
    with pytest.raises(ValueError, match="nvme_path"):
        zf.Config(offload_optimizer="nvme")


def test_consumed_state_is_an_error():
    state = _state()
    new_state, _ = zf.train_step(state, batches(1)[0])
    with pytest.raises(ValueError, match="consumed by zf.train_step"):
        zf.train_step(state, batches(1)[0])
    with pytest.raises(ValueError, match="consumed"):
        zf.eval_step(state, batches(1)[0])
    zf.train_step(new_state, batches(1)[0])  # the returned state is live


def test_wrong_argument_types():
    with pytest.raises(TypeError, match="zf.Model"):
        zf.init(object(), zf.adamw())
    with pytest.raises(TypeError, match="optimizer"):
        zf.init(gpt.model(CFG), torch.optim.AdamW)
    with pytest.raises(TypeError, match="TrainState"):
        zf.train_step({"not": "a state"}, batches(1)[0])


def test_eval_step_changes_nothing():
    state = _state(param_dtype=torch.float32)
    before = zf.gather_params(state)
    loss = zf.eval_step(state, batches(1)[0])
    assert loss.ndim == 0 and torch.isfinite(loss)
    after = zf.gather_params(state)
    assert max_abs_diff(before, after) == 0.0
