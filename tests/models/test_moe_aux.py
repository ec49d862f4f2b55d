"""The router's aux loss with gradient accumulation and data parallelism (docs/models.md, "Aux loss
with grad_accum and world size"), against transformers' model trained by a plain loop and by its
``Trainer``, on the tiny Qwen3-MoE of tests/hf_reference.py with the aux loss on (coefficient 0.5,
so that it shows).

Tolerances: as tests/models/test_moe_families.py (fp32 on both sides: losses 1e-5 relative,
weights 1e-5 absolute, 0.3% of one step's move at lr 3e-3; world 2 through its helper).
"""

from __future__ import annotations

import copy

import pytest
import transformers
from hf_reference import engine_config, engine_weights, train_engine
from hf_workers import adamw, assert_world_two_trains_like_world_one, save_hf
from llama_reference import BETAS, EPS, LR, placement_config, reference_run
from reference import make_batches

import checkpoints
import zinf_fn as zf

FAMILY = "qwen3_moe_aux"
COEF = 0.5  # its router_aux_loss_coef


def test_aux_loss_is_the_mean_of_the_micro_batches_aux_losses(tmp_path):
    """grad_accum 2: each micro-batch's loss is HF's model loss of that micro-batch (its
    cross-entropy plus coef x the load-balancing loss of its own routers), and the step's loss is
    their mean, as HF's model trained by a plain loop back-propagating loss_m / 2. The aux loss is
    not a mean over rows: the run differs from the grad_accum 1 one."""
    _, batches, ref_losses, ref_final = reference_run(FAMILY, grad_accum=2)
    save_hf(FAMILY, tmp_path / "hf")
    _, state = checkpoints.from_hf(
        str(tmp_path / "hf"), adamw(), placement_config("cpu", tmp_path, grad_accum=2)
    )
    state, losses, final = train_engine(state, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for path, want in ref_final.items():
        assert (final[path] - want).abs().max() <= 1e-5, path
    whole_batch = reference_run(FAMILY)[2]
    assert max(abs(a - b) for a, b in zip(losses, whole_batch, strict=True)) > 1e-4


def test_aux_loss_at_world_two_is_the_mean_of_the_ranks_aux_losses(tmp_path):
    """World 2: each rank's half of the batch is one micro-batch of the grad_accum 2 run above."""
    assert_world_two_trains_like_world_one(FAMILY, tmp_path, split=2)


def trainer_run(hf, batches: list, directory) -> dict:
    """``transformers.Trainer`` over ``batches`` (their rows in order, 2 per micro-batch,
    gradient_accumulation_steps 2, so one step per batch) with fused AdamW at a constant lr, no
    clipping and no weight decay (the Trainer decays no bias or norm weight, the engine every
    weight); the trained weights by our key paths."""
    rows = [
        {"input_ids": x, "labels": y, "shift_labels": y}  # our targets, already shifted
        for batch in batches
        for x, y in zip(batch["inputs"], batch["targets"], strict=True)
    ]
    args = transformers.TrainingArguments(
        output_dir=str(directory),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=len(batches),
        learning_rate=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        weight_decay=0.0,
        optim="adamw_torch_fused",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trained = copy.deepcopy(hf)
    transformers.Trainer(model=trained, args=args, train_dataset=rows).train()
    state_dict = {n: t.detach() for n, t in trained.state_dict().items()}
    return engine_weights(state_dict, engine_config(trained))


def test_transformers_trainer_weights_the_aux_loss_by_grad_accum(tmp_path):
    """transformers' Trainer at gradient_accumulation_steps 2 trains as the engine with the aux
    coefficient doubled: its model loss per micro-batch is CE_sum / num_items_in_batch + coef x
    aux, which it does not divide by the 2 steps. The engine keeps coef (and so differs)."""
    hf = save_hf(FAMILY, tmp_path / "hf")
    batches = make_batches(engine_config(hf), 3, batch_size=4, seed=1)
    want = trainer_run(hf, batches, tmp_path / "trainer")
    optimizer = zf.adamw(lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=0.0)
    errors = {}
    for coef in (COEF, 2 * COEF):
        _, state = checkpoints.from_hf(
            str(tmp_path / "hf"),
            optimizer,
            placement_config("none", tmp_path, grad_accum=2),
            overrides={"aux_coef": coef},
        )
        final = train_engine(state, batches)[2]
        errors[coef] = max((final[p] - t).abs().max().item() for p, t in want.items())
    assert errors[2 * COEF] <= 1e-5
    assert errors[COEF] > 1e-3
