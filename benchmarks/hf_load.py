"""``checkpoints.from_hf`` load time and peak RSS for a random ~1B-parameter Llama saved by
transformers in bf16.

    python benchmarks/hf_load.py [--quick] [--dir DIR] [--family llama|qwen3_moe]

The model is TinyLlama-1.1B's shape (untied embeddings: vocab 32000, d 2048, 22 layers, GQA 32/4
heads, d_ff 5632); ``--quick`` is a ~100M model (d 768, 8 layers). It is built with random weights
and written by ``save_pretrained`` (bf16, transformers' default sharding) in a separate process, so
its memory is not counted. ``--family qwen3_moe``: a Qwen3-MoE of about the same size (32 experts of
width 512, 2 per token, d 1024, 16 layers; ``--quick``: 16 experts, d 768, 8 layers, ~210M), saved
one tensor per expert, which ``from_hf`` stacks into the expert leaves. A fresh child process then
imports everything, reads its RSS, and calls ``from_hf`` with params and optimizer state on NVMe
(``--dir``, created if missing; default a temporary directory). Its ``peak_rss_bytes`` is
``ru_maxrss`` after the call minus the RSS before it.

The bound: ``from_hf`` must never hold the whole model, only about one shard file's worth of it plus
the layer being written: ``rss_ratio = peak_rss / (largest_shard_bytes + largest_layer_bytes)``,
goal <= 1 (``largest_layer_bytes``: the biggest of embed, one block, head, as stored in the files).
Every file the benchmark wrote is deleted at the end. The last line printed is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MOE_SIZES = {  # transformers.Qwen3MoeConfig fields
    "1b": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        max_position_embeddings=2048,
    ),
    "100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        max_position_embeddings=2048,
    ),
}
SIZES = {  # transformers.LlamaConfig fields
    "1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
    "100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
}


def build(hf_dir: str, size: str, family: str = "llama") -> None:
    """Child: a random ``family`` model of ``size``, built in bf16, written by save_pretrained."""
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_default_dtype(
        torch.bfloat16
    )  # built in bf16: half the memory and time of fp32-then-cast
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**MOE_SIZES[size], tie_word_embeddings=False)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**SIZES[size], tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(hf_dir)


def measure(hf_dir: str, nvme_dir: str) -> dict:
    """Child: everything imported, then ``from_hf`` onto NVMe; its wall time and peak RSS above the
    start."""
    import torch

    import checkpoints
    import zinf_fn as zf

    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="nvme",
        nvme_path=nvme_dir,
        param_dtype=torch.bfloat16,
    )
    before = current_rss()
    t0 = time.perf_counter()
    model, state = checkpoints.from_hf(hf_dir, zf.adamw(lr=1e-5), config)
    load_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "load_s": load_s,
        "peak_rss_bytes": peak - before,
        "rss_before_bytes": before,
        "n_params": n_params(hf_dir),
    }


def current_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def n_params(hf_dir: str) -> int:
    import math

    from checkpoints.hf_files import HFWeights

    weights = HFWeights(hf_dir)
    return sum(math.prod(weights.shape(n)) for n in weights.names())


def file_sizes(hf_dir: str) -> tuple[int, int]:
    """(largest shard file, largest layer as stored): a layer is embed, one block or head."""
    from checkpoints.hf_files import HFWeights

    weights = HFWeights(hf_dir)
    layers: dict[str, int] = {}
    for name in weights.names():
        unit = _unit(name)
        reader = weights.readers[weights.file_of[name]]
        begin, end = reader.header[name]["data_offsets"]
        layers[unit] = layers.get(unit, 0) + end - begin
    shards = [os.path.getsize(os.path.join(hf_dir, f)) for f in weights.readers]
    return max(shards), max(layers.values())


def _unit(name: str) -> str:
    """The unit of an HF tensor: ``blocks.{i}`` for a decoder layer's, else embed or head."""
    if name.startswith("model.layers."):
        return "blocks." + name.split(".")[2]
    return "embed" if name.startswith("model.embed_tokens.") else "head"


def in_child(*args: str, timeout: float = 3600) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *args],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def run(size: str, root: str, family: str = "llama") -> dict:
    hf_dir, nvme_dir = os.path.join(root, "hf"), os.path.join(root, "nvme")
    os.makedirs(nvme_dir)
    t0 = time.perf_counter()
    in_child("--build", hf_dir, size, family)
    build_s = time.perf_counter() - t0
    got = json.loads(in_child("--measure", hf_dir, nvme_dir))
    shard, layer = file_sizes(hf_dir)
    return {
        "model": size,
        "family": family,
        **got,
        "build_s": build_s,
        "largest_shard_bytes": shard,
        "largest_layer_bytes": layer,
        "rss_ratio": got["peak_rss_bytes"] / (shard + layer),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a ~100M model instead of ~1.1B")
    p.add_argument(
        "--dir", help="directory for the HF files and the NVMe tier (created if missing)"
    )
    p.add_argument(
        "--family",
        choices=("llama", "qwen3_moe"),
        default="llama",
        help="the model's family (qwen3_moe: a mixture of experts)",
    )
    p.add_argument("--build", nargs=3, metavar=("HF_DIR", "SIZE", "FAMILY"), help=argparse.SUPPRESS)
    p.add_argument("--measure", nargs=2, metavar=("HF_DIR", "NVME_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.build:
        return build(*args.build)
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return {}
    made = args.dir is None or not os.path.exists(args.dir)
    base = tempfile.mkdtemp(prefix="zinf-hf-load-", dir=_make(args.dir))
    try:
        result = run("100m" if args.quick else "1b", base, args.family)
    finally:
        shutil.rmtree(base, ignore_errors=True)  # the HF files and the NVMe tier's files
        if made and args.dir:
            shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(result))
    return result


def _make(directory: str | None) -> str | None:
    if directory:
        os.makedirs(directory, exist_ok=True)
    return directory


if __name__ == "__main__":
    main()
