"""The token-weighted loss (``zf.TokenLoss``): with targets -100 the step's loss and gradient are
the mean over every target token of the global batch, at any grad_accum and world size; packed rows
attend within their examples only.

The reference is the plain loop with autograd on the whole batch: ``token_mean(plain_loss(...))``
and its gradient, one SGD step ``p - lr * g`` per batch. Rows hold unequal numbers of target tokens
(one none at all), so a mean of per-micro-batch or per-rank means would differ from it by up to ~40%
here.

Tolerance: the engine sums the same per-token terms in another order (per micro-batch, then over
ranks through gloo) and scales once by world/N instead of dividing inside the loss: ~1e-7 relative
per element, as in tests/partition/test_distributed.py, whose SGD bound (params 1e-6 absolute) and
loss bound (1e-6 relative) we keep. Packed vs alone: the same attention over the same keys, with a
boolean mask instead of ``is_causal`` (another SDPA kernel): fp32 rounding, bound 1e-5.
"""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
from dist_utils import run_world

import zinf_fn as zf
from layers import gpt, llama
from zinf_fn.state import view

LR, STEPS, BATCH = 0.5, 2, 8
# masked (prompt) positions per row: unequal counts, row 3 has none
PREFIX = (0, 3, 15, 16, 8, 1, 12, 5)
# the small Llama of every llama case
LLAMA = llama.Config(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=16
)
MODELS = {
    "llama": dataclasses.replace(LLAMA, token_loss=True),
    # the default Config: token_loss is on unless a user turns it off
    "llama/default": LLAMA,
    "llama/tiled": dataclasses.replace(
        LLAMA, n_kv_heads=4, head_tiles=2, mlp_tiles=2, token_loss=True
    ),
    "gpt/tied": gpt.Config(
        vocab_size=64,
        d_model=32,
        n_heads=2,
        n_layers=2,
        seq_len=16,
        tie_embeddings=True,
        token_loss=True,
    ),
}


def test_token_loss_is_the_default():
    assert llama.Config().token_loss and gpt.Config().token_loss


def _module(name: str):
    return gpt if name.startswith("gpt") else llama


def masked_batches(cfg, n: int = STEPS, seed: int = 1) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=gen)
        targets = tokens[:, 1:].clone()
        for r, p in enumerate(PREFIX):
            targets[r, :p] = -100
        out.append({"inputs": tokens[:, :-1].clone(), "targets": targets})
    return out


def _config(accum: int, placement: str = "none") -> zf.Config:
    return zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        grad_accum=accum,
        param_dtype=torch.float32,
    )


def _train(name: str, accum: int, rank: int = 0, world: int = 1):
    cfg = MODELS[name]
    state = zf.init(
        _module(name).model(cfg),
        zf.sgd(lr=LR),
        _config(accum, "cpu" if world > 1 else "none"),
        seed=0,
    )
    initial, losses, calls = zf.gather_params(state), [], view(state).comm.calls
    for batch in masked_batches(cfg):
        n = BATCH // world
        state, m = zf.train_step(state, {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()})
        losses.append(m["loss"])
    eval_loss = float(
        zf.eval_step(state, {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()})
    )
    counts = calls[("all_reduce_sum", "target tokens")]
    return {
        "initial": initial,
        "final": zf.gather_params(state),
        "losses": losses,
        "eval": eval_loss,
        "count_reductions": counts,
    }


def _reference(name: str, initial: dict):
    """SGD with autograd on the plain loop over whole batches; (losses, final params, last params'
    eval)."""
    model = _module(name).model(MODELS[name])
    params = optree.tree_map(lambda x: x.clone().requires_grad_(), initial)
    if (
        model.ties
    ):  # the tied weight is the embedding's: one leaf (plain_loss reads it from params["embed"])
        params["head"] = {k: v for k, v in params["head"].items() if k != "lm_head"}
    losses = []
    for batch in masked_batches(MODELS[name]):
        loss = zf.token_mean(zf.plain_loss(model, params, batch))
        leaves = optree.tree_leaves(params)
        grads = torch.autograd.grad(loss, leaves)
        with torch.no_grad():
            for p, g in zip(leaves, grads, strict=True):
                p -= LR * g
        losses.append(float(loss.detach()))
    with torch.no_grad():
        eval_loss = float(zf.token_mean(zf.plain_loss(model, params, batch)))
    return losses, params, eval_loss


def _max_diff(a: dict, b: dict) -> float:
    a = {k: v for k, v in a.items() if k != "head"} | {
        "head": {k: v for k, v in a["head"].items() if k in b["head"]}
    }
    pairs = zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True)
    return max(float((x - y).detach().abs().max()) for x, y in pairs)


def _check(name: str, run: dict) -> None:
    ref_losses, ref_params, ref_eval = _reference(name, run["initial"])
    assert _max_diff(run["final"], ref_params) < 1e-6, name
    for got, want in zip(run["losses"], ref_losses, strict=True):
        assert abs(got - want) / want < 1e-6, (name, got, want)
    assert abs(run["eval"] - ref_eval) / ref_eval < 1e-6
    assert run["count_reductions"] == STEPS + 1  # one count per step, one for the evaluation


@pytest.mark.parametrize("name", list(MODELS))
def test_grad_accum_4_equals_one_big_batch(name):
    _check(name, _train(name, accum=4))


def _world(rank: int, world: int) -> dict:
    return {name: _train(name, 4, rank, world) for name in ("llama", "gpt/tied")}


def test_world_2_grad_accum_4_equals_one_big_batch():
    results = run_world(2, _world)
    for name, run in results[0].items():
        assert results[1][name]["losses"] == run["losses"]
        _check(name, run)


def test_mean_of_means_would_differ():
    """The check above can fail: the mean of the 4 micro-batches' means is far from the token
    mean."""
    batch = masked_batches(MODELS["llama"])[0]
    counts = (
        (batch["targets"] != -100).sum(1).float()
    )  # one row per micro-batch at grad_accum 8 / world 1
    per_row = torch.rand(BATCH, generator=torch.Generator().manual_seed(0)) + 1.0
    token_mean = (per_row * counts).sum() / counts.sum()
    mean_of_means = per_row[counts > 0].mean()
    assert abs(float(token_mean - mean_of_means)) > 1e-3


def test_no_target_tokens_is_a_clear_error():
    cfg = MODELS["llama"]
    state = zf.init(llama.model(cfg), zf.sgd(lr=LR), _config(1), seed=0)
    batch = masked_batches(cfg)[0]
    batch["targets"][:] = -100
    with pytest.raises(ValueError, match="no target tokens"):
        zf.train_step(state, batch)


def test_scalar_head_with_count_targets_is_refused():
    cfg = dataclasses.replace(MODELS["llama"], token_loss=False)
    model = llama.model(cfg)._replace(count_targets=lambda b: (b["targets"] != -100).sum())
    state = zf.init(model, zf.sgd(lr=LR), _config(1), seed=0)
    with pytest.raises(ValueError, match="expected zf.TokenLoss"):
        zf.train_step(state, masked_batches(cfg)[0])


@pytest.mark.parametrize("name", ["llama", "gpt/tied"])
def test_packed_logits_equal_each_example_alone(name):
    cfg, module = dataclasses.replace(MODELS[name], token_loss=False), _module(name)
    params = {
        "embed": module.embed_init(cfg, torch.Generator().manual_seed(0)),
        "blocks": [
            module.block_init(cfg, torch.Generator().manual_seed(1 + i), i) for i in range(2)
        ],
        "head": module.head_init(cfg, torch.Generator().manual_seed(9)),
    }
    lengths = (5, 7, 1, 3)  # the last 3 positions: padding, a segment of its own
    gen = torch.Generator().manual_seed(3)
    examples = [torch.randint(0, cfg.vocab_size, (1, n), generator=gen) for n in lengths]
    packed = torch.cat(examples, dim=1)  # (1, 16)
    segments = torch.cat([torch.full((1, n), k) for k, n in enumerate(lengths)], dim=1)
    got = module.logits(params, cfg, packed, segments)
    at = 0
    for ex in examples:
        alone = module.logits(params, cfg, ex)
        torch.testing.assert_close(got[:, at : at + ex.shape[1]], alone, rtol=0, atol=1e-5)
        at += ex.shape[1]
    # and the mask matters: without segments the second example would see the first
    assert (module.logits(params, cfg, packed)[:, 5:12] - got[:, 5:12]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["llama", "gpt/tied"])
def test_engine_trains_on_packed_batches(name):
    """A packed batch (with segments) through the engine gives the plain loop's loss."""
    cfg = MODELS[name]
    model = _module(name).model(cfg)
    state = zf.init(model, zf.sgd(lr=LR), _config(2), seed=0)
    initial = zf.gather_params(state)
    batch = masked_batches(cfg)[0]
    batch["segments"] = (torch.arange(cfg.seq_len) // 5).expand(BATCH, -1).clone()
    want = float(zf.token_mean(zf.plain_loss(model, initial, batch)))
    state, m = zf.train_step(state, batch)
    assert abs(m["loss"] - want) / want < 1e-6


@pytest.mark.parametrize("name", ["llama", "llama/tiled"])
@pytest.mark.parametrize("accum", [1, 4])
def test_token_loss_is_bitwise_the_mean_where_nothing_is_masked(name, accum):
    """Unmasked, every micro-batch holds B*T/k targets: world/N equals (1/k) * (1/(B*T/k)) exactly
    (k a power of two), so the token-weighted step is bit for bit the mean step; with even counts
    the logged loss is the mean of the micro-batches' means, as the mean step logs it."""
    runs = []
    for token_loss in (True, False):
        cfg = dataclasses.replace(MODELS[name], token_loss=token_loss)
        state = zf.init(llama.model(cfg), zf.sgd(lr=LR), _config(accum), seed=0)
        losses = []
        for batch in masked_batches(cfg):
            batch["targets"] = torch.roll(batch["inputs"], -1, dims=1)  # nothing masked
            state, m = zf.train_step(state, batch)
            losses.append(m["loss"])
        runs.append((losses, zf.gather_params(state)))
    (token_losses, token_params), (mean_losses, mean_params) = runs
    assert _max_diff(token_params, mean_params) == 0.0
    assert token_losses == mean_losses


def test_readme_example_is_bitwise_unchanged_by_the_token_loss_default():
    """The README's GPT run (its zf.Config and optimizer, a smaller GPT): the default head
    (token_loss) trains and logs bit for bit what the mean head (token_loss=False) does where
    nothing is masked."""
    runs = []
    for token_loss in (True, False):
        cfg = gpt.Config(
            vocab_size=256, d_model=64, n_heads=4, n_layers=2, seq_len=32, token_loss=token_loss
        )
        config = zf.Config(
            offload_params="cpu",
            offload_optimizer="cpu",
            param_dtype=torch.bfloat16,
            grad_accum=4,
            clip_grad_norm=1.0,
            prefetch_depth=1,
        )
        opt = zf.adamw(
            lr=lambda step: 3e-4 * min(1, (step + 1) / 100),
            b1=0.9,
            b2=0.95,
            weight_decay=0.1,
            mask=lambda path: path.endswith(".w") and ".ln" not in path,
        )
        state = zf.init(gpt.model(cfg), opt, config, seed=0)
        gen = torch.Generator().manual_seed(5)
        losses, norms = [], []
        for _ in range(3):
            tokens = torch.randint(0, 256, (8, 33), generator=gen)  # (B, T + 1)
            state, m = zf.train_step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
            losses.append(m["loss"])
            norms.append(m["grad_norm"])
        runs.append(
            (
                losses,
                norms,
                zf.gather_params(state),
                float(zf.eval_step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})),
            )
        )
        zf.close(state)
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1] and runs[0][3] == runs[1][3]
    assert _max_diff(runs[0][2], runs[1][2]) == 0.0
    assert gpt.Config().token_loss and llama.Config().token_loss  # the default
