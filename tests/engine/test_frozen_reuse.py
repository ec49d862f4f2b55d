"""A LoRA step's two shortcuts, each bitwise the step without it: kept activations and reused
blocks.

``Config(keep_activations=bytes)``: a recorded block whose saved activations fit is not recomputed
in backward (``scan.tape.Kept``); its saved views of parameters and carry are rebuilt on the
refetched ones. ``Config(reuse_blocks=k)``: the forward's last k blocks stay fetched into the
backward (``units.reused``). Both hand the backward the same bits it recomputed or refetched before,
so losses, adapters and every gradient are bitwise the default run's; what changes is counted, not
timed: the matmuls a pull-back runs, the NVMe bytes a step reads (against the planner's traffic),
the plan.
"""

from __future__ import annotations

import optree
import pytest
import torch
from engine_helpers import BETAS, CFG, EPS, LR, WD, batches
from frozen_helpers import Matmuls, embed_and_norms_frozen, run_frozen, run_frozen_reference
from reference import make_batches

import zinf_fn as zf
from layers import gpt, llama, lora
from zinf_fn.layout.units import units
from zinf_fn.overlap.plan import train_plan
from zinf_fn.scan.tape import Kept, Tape
from zinf_fn.state import view

LLAMA = llama.Config(
    vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=3, seq_len=16
)
SHORTCUTS = [
    dict(keep_activations=1 << 20),
    dict(reuse_blocks=2),
    dict(keep_activations=1 << 20, reuse_blocks=3),
    dict(keep_activations=1, reuse_blocks=1),
]  # 1 byte: no tape fits, every block recomputed


def opt():
    return zf.adamw(lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)


def _lora_run(tmp_path, grad_accum: int = 1, steps: int = 3, **kw):
    lm = lora.apply(llama.model(LLAMA), rank=4, alpha=8, targets=("attn.q", "attn.v", "mlp.down"))
    tmp_path.mkdir()
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="cpu",
        nvme_path=str(tmp_path),
        grad_accum=grad_accum,
        **kw,
    )
    state = zf.init(lm, opt(), config, seed=0)
    losses, reads = [], []
    for batch in make_batches(LLAMA, steps, batch_size=2, seed=1):
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
        reads.append(metrics["bytes_read.nvme"])
    rows, params = (
        {g: view(state).shard_numel(g) for g in view(state).groups},
        zf.gather_params(state),
    )
    zf.close(state)
    return losses, params, reads, zf.estimate(lm, opt(), config).moved["nvme"], rows


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize(
    "kw", SHORTCUTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items())
)
def test_lora_shortcuts_train_bitwise_as_the_plain_step(kw, grad_accum, tmp_path):
    """Losses and every leaf after three steps equal the step without shortcuts; the backward reads
    the reused blocks' two rows (adapters, frozen base) no more, and the planner counts the same
    bytes."""
    base_losses, base_params, base_reads, base_traffic, rows = _lora_run(tmp_path / "a", grad_accum)
    losses, params, reads, traffic, _ = _lora_run(tmp_path / "b", grad_accum, **kw)
    assert losses == base_losses
    assert all(
        torch.equal(x, y)
        for x, y in zip(optree.tree_leaves(params), optree.tree_leaves(base_params), strict=True)
    )
    reused = min(kw.get("reuse_blocks", 0), LLAMA.n_layers)
    # block 0's frozen layer is held from its first fetch on in both runs
    # (optim.passes.holds_layer): reusing block 0 saves its adapters' row only
    frozen_reused = reused - (reused == LLAMA.n_layers)
    saved = 2 * (
        reused * rows["blocks"] + frozen_reused * rows["blocks:frozen"]
    )  # bf16 rows, read once less
    assert reads == [r - saved for r in base_reads]
    assert traffic == base_traffic - saved


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
def test_frozen_with_shortcuts_matches_requires_grad_false(placement, tmp_path):
    """The GPT with frozen embedding and norms, both shortcuts on, against nn.Module + AdamW(fused)
    bitwise."""
    config = zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        nvme_path=str(tmp_path),
        param_dtype=torch.float32,
        keep_activations=1 << 22,
        reuse_blocks=2,
    )
    losses, final, initial, _ = run_frozen(config, embed_and_norms_frozen)
    ref_losses, ref_final = run_frozen_reference(initial, embed_and_norms_frozen)
    assert losses == ref_losses
    assert all(
        torch.equal(x, y)
        for x, y in zip(optree.tree_leaves(final), optree.tree_leaves(ref_final), strict=True)
    )


def test_full_training_with_shortcuts_is_bitwise_the_default():
    """Nothing frozen, both shortcuts: the same losses and parameters as the default config."""

    def run(**kw):
        state = zf.init(gpt.model(CFG), opt(), zf.Config(param_dtype=torch.float32, **kw), seed=0)
        losses = []
        for batch in batches(4):
            state, metrics = zf.train_step(state, batch)
            losses.append(metrics["loss"])
        return losses, optree.tree_leaves(zf.gather_params(state))

    (a, pa), (b, pb) = run(), run(keep_activations=1 << 22, reuse_blocks=1)
    assert a == b and all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))


def _mlp(params, carry):
    (x,) = carry
    return (torch.tanh(x @ params[0].t()) @ params[1].t() + x,)  # (4, 8)


def _pulled_back(kept: Kept | None):
    """(gradients, matmuls the pull-back ran) of ``_mlp`` recorded with ``kept``, pulled back on
    copies."""
    gen = torch.Generator().manual_seed(0)
    w = [torch.randn(8, 8, generator=gen) for _ in range(2)]
    x, dy = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    tape = Tape(_mlp, [list(w), [x]], kept=kept)
    counting = Matmuls()
    with counting:
        grads = tape.pull_back([[t.clone() for t in w], [x.clone()]], (dy,))
    return grads, counting.count


def test_a_kept_tape_pulls_back_without_recomputing():
    """With room in ``Kept`` the pull-back runs the backward's 4 matmuls only (the recompute reruns
    the first matmul too: it stops at the second, whose saved tensors are its inputs) and
    gives the recomputing tape's gradients bitwise; its bytes go back to ``Kept`` after it. Without
    room (1 byte) the tape recomputes as one recorded without ``Kept``."""
    want, recomputed = _pulled_back(None)
    kept = Kept(1 << 20)
    grads, count = _pulled_back(kept)
    assert (recomputed, count, kept.held) == (5, 4, 0)
    assert all(
        torch.equal(a, b)
        for ga, gb in zip(grads, want, strict=True)
        for a, b in zip(ga, gb, strict=True)
    )
    small = Kept(1)
    grads, count = _pulled_back(small)
    assert (count, small.held) == (5, 0)
    assert all(
        torch.equal(a, b)
        for ga, gb in zip(grads, want, strict=True)
        for a, b in zip(ga, gb, strict=True)
    )


def test_the_plan_leaves_out_the_reused_blocks_backward_fetches():
    plan = [str(op).split() for op in train_plan(units(4), embed_trains=False, reuse=2)]
    assert [name for phase, name in plan if phase == "backward"] == ["blocks.1", "blocks.0"]
