"""``examples/train_larger_than_ram.py --moe``: a mixture of experts from its family's config.json,
LoRA over a frozen base on NVMe, trained on the stdlib corpus, at toy size (``--moe tiny``).

The reference is the same model trained by the engine in RAM (``offload_params="none"``) on the same
batches: a storage move, so the losses are equal bitwise. The parameter count the run reports is
the count of the model's own initial trees.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import optree
import pytest
import torch

import zinf_fn as zf
from layers import llama
from zinf_cli import corpus
from zinf_fn import tiling
from zinf_fn.formats import nf4_linear
from zinf_fn.io.direct_files import DirectFiles

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
    # the second ratio divides by more compute (the experts' and the rest, timed alone): never more
    assert out["last_step"]["other_compute_alone_s"] > 0
    assert 0 < out["roofline_ratio_all_compute"] <= out["roofline_ratio"]
    # the last step's wall on its thread: its CPU and its wait for a core fit in the wall (one
    # thread runs on one core at a time; 0.02 s: the two-decimal rounding of three figures)
    last = out["last_step"]
    waited = last["thread_runqueue_s"] or 0.0
    assert 0 < last["thread_cpu_s"] <= last["process_cpu_s"] + 0.01
    assert 0 <= waited and last["thread_cpu_s"] + waited <= out["step_s"][-1] + 0.02
    # the machine's stolen time over the step (all its cores', from /proc/stat where there is
    # one): within their wall
    stolen = last["machine_steal_s"]
    assert stolen is None or 0 <= stolen <= os.cpu_count() * out["step_s"][-1] + 0.02
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


def test_the_base_in_ram_run_reads_nothing_and_trains_as_the_nvme_run(script, tmp_path):
    """``--base-in-ram``, the baseline of the same steps with no disk: nothing read from NVMe a
    step, and the losses the run on NVMe makes (a storage move: equal bitwise)."""
    argv = ["--moe", "tiny", "--lora-rank", "4", "--frozen-storage", "nf4", "--steps", "2"]
    on_disk = script.main([*argv, "--path", str(tmp_path)])
    in_ram = script.main([*argv, "--base-in-ram", "--path", str(tmp_path)])
    assert on_disk["bytes_read_per_step"] > 0 and in_ram["bytes_read_per_step"] == 0
    assert in_ram["losses"] == on_disk["losses"]
    assert in_ram["roofline_ratio"] > 0
    # the disk alone is the last step's reads replayed: those through the file layer (the tier's
    # count adds the rows it served from memory: kept, or being written), none in RAM
    replayed = on_disk["last_step"]["disk_replayed_bytes"]
    assert 0 < replayed <= on_disk["bytes_read_per_step"]
    assert in_ram["last_step"]["disk_replayed_bytes"] == 0
    assert in_ram["last_step"]["disk_alone_s"] == 0
    last = on_disk["last_step"]
    assert 0 <= last["tile_fetches_wasted"] <= last["tile_fetches_prefetched"]


def test_the_disk_replay_reads_the_recorded_spans_again(script, tmp_path):
    """``moe_disk``: the reads a file layer issues are recorded as (path, file bytes, offset,
    bytes), and the replay reads exactly those spans again, in order (its own reads recorded)."""
    moe_disk = sys.modules["moe_disk"]
    data = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB, two files of 2 MiB
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for path, part in zip(paths, data.chunk(2), strict=True):
        part.numpy().tofile(path)
    files = DirectFiles(2, "test-replay", direct=False)
    spans, out = [], torch.empty(1 << 18, dtype=torch.int32)
    try:
        with moe_disk.disk_reads(spans):
            files.read(paths[1], 2 << 20, out, lambda: "b", ("read", "b"), 1 << 20).result()
            files.read(paths[0], 2 << 20, out, lambda: "a", ("read", "a"), 0).result()
    finally:
        files.close()
    assert spans == [(paths[1], 2 << 20, 1 << 20, 1 << 20), (paths[0], 2 << 20, 0, 1 << 20)]
    assert torch.equal(out, data[: 1 << 18])
    again = []
    with moe_disk.disk_reads(again):
        assert moe_disk.disk_seconds(spans, in_flight=1) > 0
    assert again == spans and moe_disk.replayed_bytes(spans) == 2 << 20
    assert moe_disk.disk_seconds([]) == 0.0


def test_base_in_ram_is_refused_without_moe(script, capsys):
    with pytest.raises(SystemExit):
        script.parse_args(["--base-in-ram", "--path", "."])
    assert "--base-in-ram: only with --moe" in capsys.readouterr().err


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


def test_the_layer_timed_alone_is_the_moe_layer_without_its_experts(script):
    """``other_compute_alone_s`` times block 0 of the run's model made over ``without_experts``:
    the same attention and norms as a layer of the MoE model, the same trainable leaves (LoRA on
    them), an MLP of width 1 in place of the router and experts (the router is timed beside it)."""
    moe_run, moe_alone = sys.modules["moe_run"], sys.modules["moe_alone"]
    args = script.parse_args(["--moe", "tiny", "--lora-rank", "4", "--path", "."])
    cfg = moe_run.model_config(args)
    moe_layer = _block_leaves(moe_run.make_model(args, cfg))
    dense = _block_leaves(moe_run.make_model(args, moe_alone.without_experts(cfg)))
    mlp = {k: v for k, v in dense.items() if ".mlp." in k}
    assert {k: v for k, v in moe_layer.items() if ".mlp." not in k} == {
        k: v for k, v in dense.items() if k not in mlp
    }
    assert any(trainable for _, trainable in dense.values())  # the LoRA leaves train
    assert all(shape in ((1, cfg.d_model), (cfg.d_model, 1)) for shape, _ in mlp.values())


def _block_leaves(model: zf.Model) -> dict:
    """``{full key path: (shape, trainable)}`` of block 0's tree of ``model``."""
    tree = tiling.materialize(model.block.init(torch.Generator().manual_seed(0), 0))
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    keys = [".".join(["blocks", "0", *map(str, path)]) for path in paths]
    return {
        key: (tuple(x.shape), zf.model.is_trainable(model, key))
        for key, x in zip(keys, leaves, strict=True)
    }


def test_the_expert_rows_recorded_are_each_routed_pair_once(script):
    """``moe_run.expert_rows``: while open, every expert call's rows, one entry an expert a
    token chose; the (token, expert) pairs they sum to are the tokens times top-k. Closed, the
    layer is as it was."""
    moe_run = sys.modules["moe_run"]
    from layers import moe

    cfg = moe.Config(n_experts=8, top_k=2, d_model=16, d_ff=8)
    params = moe.init(cfg, torch.Generator().manual_seed(0))
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    routing = moe.route(cfg, params["router"], x)
    original = moe.expert_apply
    rows: list[int] = []
    with moe_run.expert_rows(rows):
        y = moe.experts_apply(cfg, params["experts"], x, routing)
    assert moe.expert_apply is original
    assert sum(rows) == 24 * 2 and len(rows) == len(set(routing.experts.flatten().tolist()))
    assert torch.equal(y, moe.experts_apply(cfg, params["experts"], x, routing))


def test_the_layer_timed_alone_lends_the_frozen_linears_as_the_step_does(script):
    """With its NF4 base lent (``lent``), the layer ``other_compute_alone_s`` times holds each
    frozen linear the model names (``Model.takes_lent``) as its NF4 codes, as the engine lends it
    to the fused kernels; the LoRA leaves and the norms stay tensors."""
    moe_run, moe_alone = sys.modules["moe_run"], sys.modules["moe_alone"]
    args = script.parse_args(["--moe", "tiny", "--lora-rank", "4", "--path", "."])
    model = moe_run.make_model(args, moe_alone.without_experts(moe_run.model_config(args)))
    tree = model.block.init(torch.Generator().manual_seed(0), 0)
    paths, leaves, _ = optree.tree_flatten_with_path(moe_alone.with_grads(model, tree, lent=True))
    pairs = zip(paths, leaves, strict=True)
    coded = {".".join(map(str, p)) for p, x in pairs if not torch.is_tensor(x)}
    # the width-1 stand-in MLP's whole-block rows are lent too (the step has none: a few flops)
    assert coded == {f"attn.{p}.w" for p in "qkvo"} | {"mlp.gate.w", "mlp.up.w"}
    assert all(isinstance(x, nf4_linear.CodedMatrix) or torch.is_tensor(x) for x in leaves)
