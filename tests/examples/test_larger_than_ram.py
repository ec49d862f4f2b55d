"""``examples/train_larger_than_ram.py --moe``: a mixture of experts from its family's config.json,
LoRA over a frozen base on NVMe, trained on the stdlib corpus, at toy size (``--moe tiny``).

The reference is the same model trained by the engine in RAM (``offload_params="none"``) on the same
batches: a storage move, so the losses are equal bitwise. The parameter count the run reports is
the count of the model's own initial trees.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import optree
import pytest
import torch

import zinf_fn as zf
from layers import llama
from zinf_cli import corpus
from zinf_fn import tiling

EXAMPLES = Path(__file__).parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the script imports its sibling moe_run by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(EXAMPLES))
    yield _load("train_larger_than_ram")
    sys.path.remove(str(EXAMPLES))


def test_the_moe_run_trains_as_the_same_model_in_ram(script, tmp_path):
    argv = [
        "--moe",
        "tiny",
        "--lora-rank",
        "4",
        "--steps",
        "2",
        "--whole-experts",
        "--path",
        str(tmp_path),
    ]
    out = script.main(argv)
    assert not (tmp_path / "zinf-larger-than-ram").exists()  # its files removed
    assert out["bytes_read_per_step"] > 0 and out["peak_rss_gib"] > 0 and out["roofline_ratio"] > 0
    args = script.parse_args(argv)
    moe_run = sys.modules["moe_run"]
    config = dataclasses.replace(
        moe_run.engine_config(args, str(tmp_path)),
        offload_params="none",
        offload_optimizer="none",
        nvme_path=None,
    )
    state = zf.init(
        moe_run.make_model(args, moe_run.model_config(args)),
        zf.adamw(lr=1e-4, weight_decay=0.0),
        config,
        seed=0,
    )
    batches = corpus.batches(corpus.load_corpus(None), args.batch, args.seq, seed=0)
    losses = []
    for _ in range(args.steps):
        state, metrics = zf.train_step(state, next(batches))
        losses.append(round(float(metrics["loss"]), 4))
    assert out["losses"] == losses


def test_the_reported_parameters_are_the_model_s(script):
    moe_run = sys.modules["moe_run"]
    args = script.parse_args(["--moe", "tiny", "--path", "."])
    cfg = moe_run.model_config(args)
    assert cfg.moe.stream_experts and cfg.moe.n_experts == 8
    model = llama.model(cfg)
    gen = torch.Generator().manual_seed(0)
    trees = [model.embed.init(gen), model.head.init(gen)]
    trees += [model.block.init(gen, i) for i in range(cfg.n_layers)]
    numel = sum(x.numel() for x in optree.tree_leaves(tiling.materialize(trees)))
    assert moe_run.count_params(cfg) == numel


def test_qwen3_30b_a3b_has_its_dimensions(script):
    moe_run = sys.modules["moe_run"]
    cfg = moe_run.model_config(script.parse_args(["--moe", "qwen3-30b-a3b", "--path", "."]))
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        2048,
        48,
        32,
        4,
        128,
    )
    assert (cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.d_ff, cfg.vocab_size) == (
        128,
        8,
        768,
        151_936,
    )
    assert 30.4e9 < moe_run.count_params(cfg) < 30.6e9  # Qwen3-30B-A3B: 30.5B parameters
