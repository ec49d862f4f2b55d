"""Train a GPT whose model states do not fit in this machine's RAM: every state lives on NVMe.

The default model has ~2.2B parameters (d_model 2560, 28 layers). Its states -- the bf16 parameter
copy (2 bytes/param) plus the fp32 master, Adam m and Adam v (12 bytes/param) -- take ~31 GB on
disk, more than the 24 GiB of RAM. ``zf.init`` initialises it one layer at a time straight into the
NVMe tier; each step streams every layer's shard in, prefetched ``--depth`` layers ahead, and the
optimizer's rows are read ahead and written behind. Resident memory stays at a few layers' worth.

    python examples/train_larger_than_ram.py --path /mnt/nvme/run1            # ~31 GB of disk
    python examples/train_larger_than_ram.py --path /tmp/x --d-model 512 --heads 8 --layers 4
    --steps 2   # a small try python examples/train_larger_than_ram.py --path /mnt/nvme/run1
    --lora-rank 8   # LoRA: ~4.4 GB of disk

With ``--lora-rank R`` the same model is fine-tuned with LoRA adapters (``layers.lora``;
``--lora-targets``, default ``attn.qkv``): its frozen base is stored on NVMe as its bf16 copy only
(2 bytes/param), read in forward and again in backward and never written, and the adapters' states
live in RAM.

With ``--moe NAME`` the model is a mixture of experts instead, built from its family's config.json
through ``layers`` (``MOE_PRESETS``: ``qwen3-30b-a3b``, Qwen3-30B-A3B's dimensions, ~30.5B
parameters; ``tiny`` for a quick try), its experts streamed one fetch unit each
(``moe.Config(stream_experts=True)``; ``--whole-experts`` fetches a block's experts with it) and
initialised one expert at a time (``tiling.Deferred``). It trains on real text: byte-level tokens
(ids 0-255 of its vocabulary) of Python's standard-library sources (``zinf_cli.corpus``), the
default corpus of ``examples/train_gpt.py``.

    python examples/train_larger_than_ram.py --moe qwen3-30b-a3b --lora-rank 8 --frozen-storage nf4
    \
        --steps 3 --path /mnt/nvme/run1
    python examples/train_larger_than_ram.py --moe qwen3-30b-a3b --layers 2 --lora-rank 8 \
        --frozen-storage nf4 --steps 3 --path /tmp/x     # its dimensions, 2 of its 48 layers
    python examples/train_larger_than_ram.py --moe tiny --lora-rank 4 --steps 2 --path /tmp/x
    python examples/train_larger_than_ram.py --moe qwen3-30b-a3b --lora-rank 8 \
        --frozen-storage nf4 --steps 3 --path /tmp/x --base-in-ram    # the base in RAM: the floor

Its JSON line adds ``peak_rss_gib``, ``init_s``, ``step_s``, ``bytes_read_per_step``, ``losses``
and ``roofline_ratio``: the last step's seconds / max(the active experts' compute timed alone, the
disk alone for its bytes: the same reads replayed after the steps, ``examples/moe_disk.py``);
``roofline_ratio_all_compute`` divides by max(the experts' compute plus the rest of the step's
compute timed alone, the disk's time). ``last_step`` breaks the last step down: its waits for
fetches (``fetch_wait_s``, ``tile_wait_s``, ``io_wait_s``), the tile prefetcher's items fetched
ahead and those read for nothing (``tile_fetches_prefetched``, ``tile_fetches_wasted``),
``experts_routed`` (and the expert calls' rows: ``expert_calls``, ``expert_rows_mean``,
``expert_rows_max``), the compute timed alone in RAM (``examples/moe_alone.py``:
``expert_compute_alone_s``, its fp32 ``F.linear`` twin ``expert_compute_fp32_linear_s``, and
``other_compute_alone_s``: attention, norms, router and LoRA of every layer, the head and the
embedding), ``disk_alone_s`` (the replay; ``disk_replayed_bytes`` its bytes, and ``disk_probe_s``
the time a fresh file's probe gives the step's bytes: a cache's on a VM, ``moe_disk`` says why) and
``nf4_decode_cpu_s``.

The disk needed is printed first; the script refuses to start if ``--path`` has less free space.
It prints the peak resident memory (ru_maxrss) next to the state bytes on disk, and removes its
files at the end unless ``--keep``. Last line: JSON of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_run  # noqa: E402  (examples/moe_run.py: the --moe run)

import zinf_fn as zf  # noqa: E402
from layers import gpt, lora  # noqa: E402
from zinf_fn.state import view  # noqa: E402

GIB = 1 << 30
MARGIN = 1 * GIB  # metadata, partial last blocks, and some room to spare


def count_params(cfg: gpt.Config) -> dict:
    """Parameters per unit of ``layers.gpt`` (with biases): embed, each block, head."""
    d, v = cfg.d_model, cfg.vocab_size
    return {"embed": v * d + cfg.seq_len * d, "block": 12 * d * d + 13 * d, "head": 2 * d + v * d}


def disk_needed(cfg: gpt.Config, param_bytes: int = 2, trained: bool = True) -> int:
    """Bytes of model states on disk: the 16-bit params, plus fp32 master, m and v where they train
    (a frozen LoRA base keeps its 16-bit copy only; its adapters' states are in RAM)."""
    n = count_params(cfg)
    total = n["embed"] + cfg.n_layers * n["block"] + n["head"]
    return total * (param_bytes + (3 * 4 if trained else 0))


def du(path: str) -> int:
    """Bytes allocated under ``path`` (what the states really take on disk)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--path", required=True, help="an existing directory on the NVMe drive")
    parser.add_argument("--d-model", type=int, default=2560)
    parser.add_argument(
        "--layers", type=int, default=None, help="default: 28 (GPT), the preset's (--moe)"
    )
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--depth", type=int, default=1, help="prefetch depth (layers ahead)")
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="fine-tune LoRA adapters of this rank (0: all)"
    )
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument(
        "--lora-targets",
        nargs="+",
        default=None,
        help="the block linears adapted (default: attn.qkv; with --moe attn.q attn.v)",
    )
    parser.add_argument(
        "--moe",
        choices=sorted(moe_run.MOE_PRESETS),
        default=None,
        help="train this mixture of experts instead of the GPT",
    )
    parser.add_argument(
        "--whole-experts",
        action="store_true",
        help="with --moe: fetch a block's experts with it, not one by one",
    )
    parser.add_argument(
        "--vocab-tiles",
        type=int,
        default=None,
        help="with --moe: tiles of the embedding and the head over the vocabulary (default: the "
        "preset's, moe_run.VOCAB_TILES; 1: whole)",
    )
    parser.add_argument(
        "--frozen-storage",
        choices=("bf16", "int8", "nf4"),
        default="bf16",
        help="with --lora-rank: how the frozen base's block weights are stored",
    )
    parser.add_argument(
        "--keep-activations",
        type=int,
        default=None,
        help="Config.keep_activations (bytes): blocks whose activations fit are not recomputed "
        "(default: 512 MiB with --moe, where few tokens a step keep little and a recompute reads "
        "every touched expert again; 0 otherwise)",
    )
    parser.add_argument(
        "--keep-tiles",
        type=int,
        default=None,
        help="Config.keep_tiles (bytes): frozen experts' tiles a step keeps from its forward "
        "into its backward, read once a step instead of twice (default: moe_run.KEEP_TILES with "
        "--moe; 0 otherwise)",
    )
    parser.add_argument(
        "--base-in-ram",
        action="store_true",
        help="with --moe: the parameters in RAM instead of on --path (offload_params 'cpu'), as a "
        "baseline: the same steps' floor with no disk (the whole base must fit in RAM: a peak "
        "RSS of ~18 GiB for qwen3-30b-a3b in NF4)",
    )
    parser.add_argument("--trace", default=None, help="write a Chrome trace of every step here")
    parser.add_argument("--keep", action="store_true", help="keep the state files")
    args = parser.parse_args(argv)
    if args.lora_targets is None:
        args.lora_targets = ["attn.q", "attn.v"] if args.moe else ["attn.qkv"]
    if args.base_in_ram and not args.moe:
        parser.error("--base-in-ram: only with --moe")
    if args.layers is None and not args.moe:
        args.layers = 28
    return args


def check_disk(args, cfg: gpt.Config) -> int:
    """The model's parameter count, printed with the disk and RAM it needs; exits where the disk is
    short."""
    counts = count_params(cfg)
    n_params = counts["embed"] + args.layers * counts["block"] + counts["head"]
    needed = disk_needed(cfg, trained=not args.lora_rank)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(
        f"model: {n_params / 1e9:.2f}B parameters, {args.layers} layers of "
        f"{counts['block'] / 1e6:.1f}M"
        + (
            f", LoRA rank {args.lora_rank} on {' '.join(args.lora_targets)}"
            if args.lora_rank
            else ""
        )
    )
    print(
        f"disk needed: {needed / GIB:.1f} GiB of model states (+{MARGIN / GIB:.0f} GiB margin) "
        f"under {args.path}; "
        f"RAM: {ram / GIB:.1f} GiB"
    )
    if not os.path.isdir(args.path):
        sys.exit(f"error: --path {args.path!r} is not an existing directory")
    free = shutil.disk_usage(args.path).free
    if free < needed + MARGIN:
        sys.exit(
            f"error: {args.path!r} has {free / GIB:.1f} GiB free, the model states need "
            f"{(needed + MARGIN) / GIB:.1f} GiB; free some space, choose another --path, or shrink "
            "the model "
            "(--layers, --d-model)"
        )
    return n_params


def make_state(args, cfg: gpt.Config, run_dir: str):
    """The model (LoRA where ``--lora-rank``) initialised straight into its tiers: base on NVMe; a
    full fine-tune's optimizer on NVMe too, a LoRA's (the adapters') in RAM."""
    model = gpt.model(cfg)
    if args.lora_rank:
        model = lora.apply(
            model, rank=args.lora_rank, alpha=args.lora_alpha, targets=tuple(args.lora_targets)
        )
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="cpu" if args.lora_rank else "nvme",
        nvme_path=run_dir,
        param_dtype=torch.bfloat16,
        prefetch_depth=args.depth,
        trace=args.trace,
        frozen_storage=args.frozen_storage,
        keep_activations=args.keep_activations or 0,
    )
    warmup = lambda step: 1e-4 * min(1.0, (step + 1) / 100)  # a 100-step linear warm-up
    return zf.init(model, zf.adamw(lr=warmup, weight_decay=0.1), config, seed=0)


def run_steps(state, cfg: gpt.Config, args) -> tuple:
    """``--steps`` steps on random tokens, each printed; (state, seconds of each step)."""
    gen = torch.Generator().manual_seed(0)
    step_times = []
    for step in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
        t0 = time.perf_counter()
        state, metrics = zf.train_step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
        step_times.append(time.perf_counter() - t0)
        print(
            f"step {step}: loss {metrics['loss']:.4f}  {step_times[-1]:.1f} s  "
            f"read {metrics['bytes_read.nvme'] / GIB:.1f} GiB  written "
            f"{metrics['bytes_written.nvme'] / GIB:.1f} "
            f"GiB  exposed I/O wait {metrics['io_wait_s']:.1f} s  hidden I/O "
            f"{metrics['io_hidden_s']:.1f} s  "
            f"peak RSS {peak_rss() / GIB:.2f} GiB",
            flush=True,
        )
    return state, step_times, metrics


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.moe:
        return moe_run.main(args)
    cfg = gpt.Config(
        vocab_size=256,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        seq_len=args.seq,
    )
    n_params = check_disk(args, cfg)
    run_dir = os.path.join(args.path, "zinf-larger-than-ram")
    os.makedirs(run_dir, exist_ok=True)
    try:
        t0 = time.perf_counter()
        state = make_state(args, cfg, run_dir)
        init_s, on_disk = time.perf_counter() - t0, du(run_dir)
        print(
            f"init: {init_s:.0f} s, {on_disk / GIB:.1f} GiB on disk, peak RSS so far "
            f"{peak_rss() / GIB:.2f} GiB"
        )
        state, step_times, metrics = run_steps(state, cfg, args)
        view(state).close()
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        print(
            f"peak RSS {peak_rss() / GIB:.2f} GiB  vs  model states on disk {on_disk / GIB:.1f} "
            "GiB "
            f"(RAM {ram / GIB:.1f} GiB)"
        )
        print(
            json.dumps(
                {
                    "params": n_params,
                    "state_bytes_on_disk": on_disk,
                    "ram_bytes": ram,
                    "peak_rss_bytes": peak_rss(),
                    "init_s": round(init_s, 1),
                    "seconds_per_step": [round(s, 1) for s in step_times],
                    "d_model": args.d_model,
                    "n_layers": args.layers,
                    "tokens_per_step": args.batch * args.seq,
                    "prefetch_depth": args.depth,
                    "lora_rank": args.lora_rank,
                    "bytes_per_param": round(metrics["bytes_per_param"], 3),
                    "bytes_moved_per_step": metrics["state_bytes_moved"],
                }
            )
        )
    finally:
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    main()
