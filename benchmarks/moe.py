"""Streamed experts: a mixture-of-experts block's working memory with its experts fetched one at a
time, and the MoE step on NVMe against its bounds.

    python benchmarks/moe.py --quick --dir DIR     # a few minutes on 2 cores; JSON on the last line

``block_memory_streamed_over_whole``: a *probe* (a fresh subprocess, as ``benchmarks/tiling.py``'s)
trains a one-layer MoE decoder (hidden ``--d-model``, 16 experts top-2 of width ``--d-model`` / 2)
one step with bf16 parameters and AdamW states in CPU memory, prefetch depth 1. Its working memory
is the peak RSS of the step minus the RSS after ``zf.init`` less the staging pool made there
(``tiling.Prober``'s measure). The ratio is the probe with ``moe.Config(stream_experts=True)`` over
the probe with the block fetched whole; ``expected_ratio`` is (attention + router + the expert
tiles in flight: the tile window's runs, ``overlap.tile_runs.window_runs``, and the one computing) /
(attention + router + all E), in parameters.

``roofline_ratio``: the same decoder, ``--layers`` deep, experts streamed, trained in rounds beside
its twin in RAM (``overlap.run_rounds``: interleaved, steady state, the ratio of medians): the step
with parameters and optimizer states on NVMe over max(the step in RAM, the NVMe step's disk bytes
at the disk's bandwidth measured now under ``--dir``) (``overlap.roofline``). ``--keep-activations
BYTES`` (``Config.keep_activations``, both twins): blocks whose saved activations fit are not
recomputed in backward, so each touched expert is read twice a step, not three times.
``--roofline-only`` skips the memory probes. ``tile_wait_s`` / ``io_wait_s``: what the NVMe step's
ops waited for their tiles / the step for everything else (two more steps after the rounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks beside this one
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overlap import next_batch, roofline, run_rounds  # noqa: E402
from tiling import in_subprocess, reset_peak_rss, status_kib  # noqa: E402

import zinf_fn as zf  # noqa: E402
from layers import llama, moe  # noqa: E402
from zinf_fn.overlap import tile_runs  # noqa: E402
from zinf_fn.state import view  # noqa: E402

N_EXPERTS, TOP_K, DEPTH = 16, 2, 1


def model_config(d: int, layers: int, seq: int, stream: bool) -> llama.Config:
    """The benchmark's decoder: heads of 128, E = 16 experts top-2 of width d / 2, 256 symbols."""
    experts = moe.Config(
        n_experts=N_EXPERTS, top_k=TOP_K, d_model=d, d_ff=d // 2, stream_experts=stream
    )
    heads = max(1, d // 128)
    return llama.Config(
        vocab_size=256,
        d_model=d,
        n_heads=heads,
        n_kv_heads=heads,
        d_ff=d,
        n_layers=layers,
        seq_len=seq,
        moe=experts,
    )


def batch(cfg: llama.Config, rows: int, seed: int = 0) -> dict:
    tokens = torch.randint(
        0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=torch.Generator().manual_seed(seed)
    )
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def working_memory(cfg: llama.Config, rows: int) -> int:
    """Bytes the first step of ``cfg``'s decoder adds to the resident model states (in this process:
    peak RSS of the step minus the RSS after init less the staging pool)."""
    config = zf.Config(
        offload_params="cpu",
        offload_optimizer="cpu",
        param_dtype=torch.bfloat16,
        prefetch_depth=DEPTH,
    )
    state = zf.init(llama.model(cfg), zf.adamw(lr=1e-4), config, seed=0)
    gc.collect()
    base = status_kib("VmRSS") * 1024 - view(state).counters().pool_bytes
    reset_peak_rss()
    state, _ = zf.train_step(state, batch(cfg, rows))
    peak = status_kib("VmHWM") * 1024
    view(state).close()
    del state
    gc.collect()
    return peak - base


def probe(spec: list) -> dict:
    """``--probe [d, seq, rows]`` (a subprocess): the working memory of the one-layer decoder, whole
    and streamed, after a warm-up model paid the lazy imports and kernels."""
    d, seq, rows = spec
    torch.set_num_threads(2)
    working_memory(model_config(128, 1, 16, True), 1)  # warm-up
    return {
        str(stream): working_memory(model_config(d, 1, seq, stream), rows)
        for stream in (False, True)
    }


def expected_ratio(cfg: llama.Config) -> float:
    """(attention + router + expert tiles in flight) / (attention + router + all E), in
    parameters: the tile window's runs (``tile_runs.window_runs`` at ``DEPTH``) and the one
    computing, each at most an expert's gate_up tile (a run of one tile: the routed order
    alternates the leaves)."""
    d, e = cfg.d_model, cfg.moe
    attention = 2 * d * cfg.n_heads * cfg.head_dim + 2 * d * cfg.n_kv_heads * cfg.head_dim
    tile = 2 * d * e.d_ff  # an expert's gate_up, (1, 2 x d_ff, d)
    runs = [tile * 4 * tile_runs.tile_run(tile, torch.float32, DEPTH)]  # fp32 compute on CPU
    in_flight = (tile_runs.window_runs(runs, DEPTH) + 1) * tile
    router = e.n_experts * d
    return (attention + router + in_flight) / (attention + router + e.n_experts * 3 * d * e.d_ff)


def block_memory(args) -> dict:
    """The memory half of the result: the two probes' working memory and their ratio."""
    work = in_subprocess("probe", [args.d_model, args.seq, args.batch], script=__file__)
    whole, streamed = work["False"], work["True"]
    cfg = model_config(args.d_model, 1, args.seq, True)
    print(
        f"one MoE block, d {args.d_model}, {N_EXPERTS} experts: working memory whole "
        f"{whole / 2**20:.1f} MiB, streamed {streamed / 2**20:.1f} MiB",
        flush=True,
    )
    return {
        "block_memory_streamed_over_whole": round(streamed / whole, 3),
        "expected_ratio": round(expected_ratio(cfg), 3),
        "block_working_whole_MiB": round(whole / 2**20, 1),
        "block_working_streamed_MiB": round(streamed / 2**20, 1),
    }


def step_roofline(args) -> dict:
    """The NVMe half: the streamed decoder in RAM and on NVMe, in rounds; the roofline ratio."""
    cfg = model_config(args.d_model, args.layers, args.seq, True)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    path = tempfile.mkdtemp(prefix="moe-", dir=args.dir)
    try:
        base = zf.Config(
            param_dtype=torch.bfloat16, prefetch_depth=2, keep_activations=args.keep_activations
        )
        nvme = dataclasses.replace(
            base, offload_params="nvme", offload_optimizer="nvme", nvme_path=path
        )
        states = {
            name: zf.init(llama.model(cfg), zf.adamw(lr=1e-4), config, seed=0)
            for name, config in (("ram", base), ("nvme", nvme))
        }
        times, io = run_rounds(states, cfg, args)
        waits = exposed_waits(states, cfg, args)
        for state in states.values():
            view(state).close()
        median = {name: statistics.median(t) for name, t in times.items()}
        result = roofline(io["nvme"], times["nvme"], times["ram"], path)  # paired by round
        return {
            **result,
            "ram_step_s": round(median["ram"], 3),
            "nvme_step_s": round(median["nvme"], 3),
            **waits,
        }
    finally:
        shutil.rmtree(path, ignore_errors=True)


def exposed_waits(states: dict, cfg: llama.Config, args) -> dict:
    """Two more steps of the NVMe twin after the rounds: the median seconds a step's ops waited
    for their tiles (``tile_wait_s``, the tile prefetcher's) and for everything else the step
    waits on (``io_wait_s``: units, the optimizer's reads and writes)."""
    gen = torch.Generator().manual_seed(1)
    tile, other = [], []
    for _ in range(2):
        states["nvme"], metrics = zf.train_step(states["nvme"], next_batch(cfg, args, gen))
        tile.append(metrics.get("tile_wait_s", 0.0))
        other.append(metrics["io_wait_s"])
    return {
        "tile_wait_s": round(statistics.median(tile), 3),
        "io_wait_s": round(statistics.median(other), 3),
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--probe", help=argparse.SUPPRESS)  # a subprocess's spec (JSON)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="d_model 1024, 4 layers, 2x64 tokens, 3 rounds of 3 steps",
    )
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--run", type=int, default=3, help="steps per configuration in a round")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="directory of the NVMe tier")
    ap.add_argument(
        "--keep-activations",
        type=int,
        default=0,
        help="Config.keep_activations of the roofline twins (bytes; 0: every block recomputed)",
    )
    ap.add_argument("--roofline-only", action="store_true", help="skip the memory probes")
    ap.add_argument(
        "--tile-window-bytes",
        type=int,
        default=None,
        help="overlap.tile_runs.TILE_WINDOW_BYTES for this run (0: experts prefetch_depth ahead)",
    )
    args = ap.parse_args()
    if args.quick:
        args.d_model, args.layers, args.batch, args.seq = 1024, 4, 2, 64
        args.rounds, args.run = 3, 3
    return args


def main() -> None:
    args = parse_args()
    if args.tile_window_bytes is not None:  # before any state is made: its demand counts it
        tile_runs.TILE_WINDOW_BYTES = args.tile_window_bytes
    if args.probe:
        print(json.dumps(probe(json.loads(args.probe))))
        return
    result = {
        **({} if args.roofline_only else block_memory(args)),
        **step_roofline(args),
        "keep_activations": args.keep_activations,
        "tile_window_bytes": tile_runs.TILE_WINDOW_BYTES,
        "d_model": args.d_model,
        "n_experts": N_EXPERTS,
        "top_k": TOP_K,
        "n_layers": args.layers,
        "tokens_per_step": args.batch * args.seq,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
