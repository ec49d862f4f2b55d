"""A recipe reaches every engine option; its optimizer is the one a Hugging Face user knows: the
schedules are transformers' (after the warmup), weight decay leaves out biases and norm weights as
transformers' Trainer does; the planner's fit check refuses a run over its budget, naming the budget
and the option that would make it fit; ``param_dtype=fp32`` keeps an fp32 base exact."""

from __future__ import annotations

import math

import pytest
import torch
from cli_helpers import TINY_GPT

from layers import gpt, llama
from zinf_cli import finetune, finetune_options, pretrain, recipe
from zinf_cli.engine import bound, engine_config, optimizer_of
from zinf_cli.schedules import decays, warmup_then
from zinf_fn.planner import StepTime
from zinf_fn.tree import flat_spec

WARMUP, TOTAL, PEAK = 5, 40, 3e-3


def _hf_lambda(kind: str, floor: float):
    """transformers' own schedule (a LambdaLR's factor of the peak) for ``kind`` and ``floor``."""
    from transformers import optimization as o

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=PEAK)
    if kind == "constant":
        return o.get_constant_schedule_with_warmup(opt, WARMUP).lr_lambdas[0]
    if kind == "linear":
        return o.get_linear_schedule_with_warmup(opt, WARMUP, TOTAL).lr_lambdas[0]
    if floor:
        schedule = o.get_cosine_with_min_lr_schedule_with_warmup(
            opt, WARMUP, TOTAL, min_lr_rate=floor
        )
        return schedule.lr_lambdas[0]
    return o.get_cosine_schedule_with_warmup(opt, WARMUP, TOTAL).lr_lambdas[0]


@pytest.mark.parametrize(
    ("kind", "floor"), [("cosine", 0.0), ("cosine", 0.1), ("linear", 0.0), ("constant", 0.0)]
)
def test_schedules_are_transformers_after_the_warmup(kind, floor):
    ours, theirs = warmup_then(kind, PEAK, WARMUP, TOTAL, floor), _hf_lambda(kind, floor)
    for step in range(WARMUP, TOTAL + 1):  # the warmup differs by design: ours trains at step 0
        assert ours(step) == pytest.approx(PEAK * theirs(step), rel=1e-12, abs=1e-15), step
    assert ours(0) == PEAK / WARMUP


@pytest.mark.parametrize(
    "model",
    [
        llama.model(
            llama.Config(vocab_size=64, d_model=32, n_heads=2, n_layers=1, seq_len=8, d_ff=64)
        ),
        gpt.model(gpt.Config(vocab_size=64, d_model=32, n_heads=2, n_layers=1, seq_len=8)),
    ],
)
def test_weight_decay_leaves_out_biases_and_norm_weights(model):
    """transformers' Trainer decays every parameter but biases and LayerNorm / RMSNorm weights: in
    these models, exactly the leaves of two or more dimensions."""
    gen = torch.Generator().manual_seed(0)
    for unit, tree in (
        ("embed", model.embed.init(gen)),
        ("blocks.0", model.block.init(gen, 0)),
        ("head", model.head.init(gen)),
    ):
        for leaf in flat_spec(tree).leaves:
            assert decays(f"{unit}.{leaf.path}") == (len(leaf.shape) >= 2), (unit, leaf.path)


def test_every_engine_option_reaches_the_config_and_the_optimizer():
    argv = [
        "offload_params=cpu",
        "offload_optimizer=nvme",
        "master=remainder",
        "moments=int8",
        "prefetch_depth=2",
        "keep_activations=4096",
        "keep_tiles=8192",
        "reuse_blocks=1",
        "spill_params=2:nvme",
        "grad_accum=4",
        "clip=0.5",
        "b1=0.8",
        "b2=0.99",
        "eps=1e-6",
        "weight_decay=0.1",
        "host_budget=2GiB",
        "param_dtype=bf16",
    ]
    args = recipe.resolve("zinf-fn finetune", "", finetune_options.OPTIONS, argv)
    config = engine_config(args, "/tmp/nvme")
    want = {
        "offload_params": "cpu",
        "offload_optimizer": "nvme",
        "master": "remainder",
        "prefetch_depth": 2,
        "keep_activations": 4096,
        "keep_tiles": 8192,
        "reuse_blocks": 1,
        "spill_params": "2:nvme",
        "grad_accum": 4,
        "clip_grad_norm": 0.5,
        "host_memory_budget": 2 << 30,
        "param_dtype": torch.bfloat16,
    }
    assert {k: getattr(config, k) for k in want} == want
    hyper = optimizer_of(args).hyperparams
    assert (hyper["b1"], hyper["b2"], hyper["eps"], hyper["weight_decay"], hyper["moments"]) == (
        0.8,
        0.99,
        1e-6,
        0.1,
        "int8",
    )


def test_a_run_over_its_budget_is_refused_naming_the_budget_and_the_fix(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"host_budget 1MiB: the run needs .* GiB of host memory "
        r".*; placement=nvme would make it fit",
    ):
        finetune.main(["placement=cpu", "host_budget=1MiB", f"run_dir={tmp_path / 'host'}"])
    with pytest.raises(
        ValueError,
        match=r"disk_budget 1KiB: the run needs .* of disk under "
        r"nvme_path; moments=int8 and master=remainder",
    ):
        finetune.main(["placement=nvme", "disk_budget=1KiB", f"run_dir={tmp_path / 'disk'}"])
    # zinf-fn train checks the same fit before its first step
    with pytest.raises(
        ValueError,
        match=r"host_budget 1MiB: the run needs .* GiB of host memory "
        r".*; placement=nvme would make it fit",
    ):
        pretrain.main(
            [*TINY_GPT, "placement=cpu", "host_budget=1MiB", f"run_dir={tmp_path / 'gpt'}"]
        )


def test_param_dtype_fp32_keeps_an_fp32_base_exact(tmp_path):
    """A LoRA run with ``param_dtype=fp32`` over the demo's fp32 Llama: the merged export's weights
    that no adapter touches are the base's, bitwise (bf16 would have rounded them at import)."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    result = finetune.main(
        [
            "steps=2",
            "warmup=1",
            "lora_rank=4",
            "merge=true",
            "param_dtype=fp32",
            "placement=cpu",
            "export_dtype=fp32",
            "seq_len=32",
            "batch_size=2",
            f"run_dir={run}",
        ]
    )
    base = load_file(str(run / "demo" / "random-llama" / "model.safetensors"))
    merged = load_file(str(tmp_path / "run" / "hf" / "model.safetensors"))
    untouched = [k for k in base if ".q_proj." not in k and ".v_proj." not in k]
    assert untouched and all(merged[k].equal(base[k]) for k in untouched)
    assert math.isfinite(result["last_loss"])


def test_a_step_is_disk_bound_where_its_io_outlasts_compute_and_optimizer():
    """The disk overlaps the compute and the optimizer (``zinf_fn.planner.timing``): it bounds the
    step only where it takes longer than both together."""
    assert bound(StepTime(1.0, 2.0, compute=1.0, optimizer=0.5, disk=2.0)).startswith("disk-bound")
    assert bound(StepTime(1.0, 1.0, compute=1.0, optimizer=0.5, disk=1.4)).startswith("compute")
