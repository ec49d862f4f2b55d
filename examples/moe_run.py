"""The ``--moe`` run of ``train_larger_than_ram.py``: a mixture of experts larger than RAM, on NVMe.

The model is its family's ``config.json`` read by ``layers.llama.Config.from_hf`` (``MOE_PRESETS``),
its experts streamed one fetch unit each (``moe.Config(stream_experts=True)``) and initialised one
expert at a time. With ``--lora-rank`` the base is frozen (``--frozen-storage`` nf4: its blocks' 2-D
weights as 4-bit codes) and only the adapters train, their states in RAM. The data is real text:
byte-level tokens (ids 0-255) of Python's standard-library sources (``zinf_cli.corpus``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import resource
import shutil
import time

import moe_alone  # examples/moe_alone.py: the compute timed alone
import moe_clocks  # examples/moe_clocks.py: where a step's wall went
import moe_disk  # examples/moe_disk.py: the disk timed alone
import torch

import zinf_fn as zf
from layers import llama, lora, moe
from zinf_cli import corpus
from zinf_fn.formats import codebook
from zinf_fn.planner.machine import disk_bandwidth
from zinf_fn.state import view

GIB = 1 << 30
# the activations a step keeps by default (``--keep-activations``): a block's at 32 tokens are a
# few MiB, and a kept block is not recomputed: each touched expert is read twice a step, not thrice
KEEP_ACTIVATIONS = 512 << 20
KEEP_TILES = 1 << 30  # Config.keep_tiles of the --moe runs
_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "norm_topk_prob": True,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
MOE_PRESETS = {  # config.json dicts
    # Qwen/Qwen3-30B-A3B's dimensions: ~30.5B parameters, ~3.3B active per token
    "qwen3-30b-a3b": {
        **_QWEN3_MOE,
        "vocab_size": 151_936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "max_position_embeddings": 40_960,
    },
    # the same family at toy size: a quick try and the test's
    "tiny": {
        **_QWEN3_MOE,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "max_position_embeddings": 4096,
    },
}
# the embedding's and the head's tiles over the vocabulary: a 30B-A3B tile is 4,748 x 2048, 39 MB in
# fp32 (19 MB stored in bf16), fetched alone
VOCAB_TILES = {"qwen3-30b-a3b": 32, "tiny": 4}


def model_config(args) -> llama.Config:
    """The preset's ``llama.Config`` at ``--seq`` tokens (``--layers`` overrides its depth), its
    experts streamed unless ``--whole-experts``, its vocabulary in ``--vocab-tiles`` tiles (the
    preset's ``VOCAB_TILES`` by default) each drawn from a seed of its own
    (``llama.Config.vocab_tile_seeds``: made one at a time, never the whole table)."""
    hf = dict(MOE_PRESETS[args.moe])
    if args.layers:
        hf["num_hidden_layers"] = args.layers
    tiles = args.vocab_tiles or VOCAB_TILES[args.moe]
    cfg = llama.Config.from_hf(
        hf, seq_len=args.seq, embed_tiles=tiles, head_tiles=tiles, vocab_tile_seeds=tiles > 1
    )
    block = dataclasses.replace(cfg.moe, stream_experts=not args.whole_experts)
    return dataclasses.replace(cfg, moe=block)


def count_params(cfg: llama.Config) -> int:
    """Parameters of the base model: embedding, head, and per layer attention (q, k, v, o and the
    q/k norms), two norms, the router and E experts of gate, up and down."""
    d, heads, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attention = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 2 * hd
    experts = cfg.moe.n_experts * (3 * d * cfg.moe.d_ff + d)  # + the router's row of each
    return 2 * cfg.vocab_size * d + d + cfg.n_layers * (attention + 2 * d + experts)


def engine_config(args, run_dir: str) -> zf.Config:
    """The base on NVMe (bf16, or ``--frozen-storage`` codes where frozen; in RAM with
    ``--base-in-ram``); the optimizer in RAM for LoRA, on NVMe for a full fine-tune."""
    keep = KEEP_ACTIVATIONS if args.keep_activations is None else args.keep_activations
    tiles = KEEP_TILES if args.keep_tiles is None else args.keep_tiles
    return zf.Config(
        offload_params="cpu" if args.base_in_ram else "nvme",
        offload_optimizer="cpu" if args.lora_rank else "nvme",
        nvme_path=run_dir,
        param_dtype=torch.bfloat16,
        prefetch_depth=args.depth,
        frozen_storage=args.frozen_storage,
        trace=args.trace,
        keep_activations=keep,
        keep_tiles=tiles,
    )


def make_model(args, cfg: llama.Config) -> zf.Model:
    model = llama.model(cfg)
    if not args.lora_rank:
        return model
    return lora.apply(
        model, rank=args.lora_rank, alpha=args.lora_alpha, targets=tuple(args.lora_targets)
    )


def train(args, state) -> tuple:
    """``--steps`` steps on windows of the stdlib corpus: (state, losses, step seconds, NVMe bytes
    read by each step, the last step's metrics, with its experts' rows and its disk reads)."""
    batches = corpus.batches(corpus.load_corpus(None), args.batch, args.seq, seed=0)
    losses, seconds, reads, rows, spans = [], [], [], [], []
    metrics = {}
    for step in range(args.steps):
        batch = next(batches)
        rows.clear()
        spans.clear()
        t0, clock0 = time.perf_counter(), moe_clocks.thread_clock()
        with expert_rows(rows), moe_disk.disk_reads(spans):
            state, metrics = zf.train_step(state, batch)
        seconds.append(time.perf_counter() - t0)
        metrics = {
            **metrics,
            **moe_clocks.clock_spent(clock0, moe_clocks.thread_clock()),
            "expert_rows": list(rows),
            "disk_spans": list(spans),
        }
        losses.append(float(metrics["loss"]))
        reads.append(int(metrics.get("bytes_read.nvme", 0)))  # none: --base-in-ram
        print(
            f"step {step}: loss {losses[-1]:.4f}  {seconds[-1]:.1f} s  read "
            f"{reads[-1] / GIB:.2f} GiB  peak RSS {peak_rss() / GIB:.2f} GiB",
            flush=True,
        )
    return state, losses, seconds, reads, metrics


@contextlib.contextmanager
def expert_rows(rows: list[int]):
    """While open, the rows of each expert the step computes (``moe.routed_apply``'s used experts'
    counts) appended to ``rows``: the row counts the step's experts computed, which their compute
    timed alone follows (``moe_alone.active_experts_seconds``)."""
    apply = moe.routed_apply

    def counted(cfg, params, x, used, counts):
        rows.extend(int(counts[e]) for e in used)
        return apply(cfg, params, x, used, counts)

    moe.routed_apply = counted
    try:
        yield rows
    finally:
        moe.routed_apply = apply


def train_frozen(args, state) -> tuple:
    """``train`` with the objects alive now frozen out of the cyclic collector (``gc.freeze``),
    unfrozen after. They (~300k: torch's, the engine's) live for the run, and a full collection
    traverses them all (~0.2-0.35 s each here; one every three steps at 6 layers, more with more
    layers, as the tile path's young garbage grows). Freezing is the process's choice, so the
    example makes it, not the engine."""
    gc.collect()
    gc.freeze()
    try:
        return train(args, state)
    finally:
        gc.unfreeze()


def decode_seconds(cfg: llama.Config, nbytes: int) -> float:
    """The CPU seconds of NF4-decoding ``nbytes`` of stored codes as the fetch decodes them: one
    expert's gate_up tile into a reused buffer of the compute dtype (fp32 on the CPU; the values
    rounded to bf16), scaled by bytes, the best of 5 in the CPU time of the calling thread, which
    runs the decode alone (a shared machine's load inflates it less than wall time, and the time of
    the process's other threads, an idle OpenMP worker spinning among them, is not counted). What
    a frozen NF4 base's fetches cost beyond the disk; given every byte a step reads, an upper bound
    (the embedding's and head's tiles are bf16)."""
    numel = 2 * cfg.moe.d_ff * cfg.d_model
    x = torch.randn(numel).mul_(0.02).to(torch.bfloat16)
    stored = codebook.encode_leaf("nf4", x)
    out = torch.empty(numel)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the torch twin too, where no C compiler built the kernels
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        if not codebook.decode_leaf_("nf4", stored, out, torch.bfloat16):
            out.copy_(codebook.decode_leaf("nf4", stored, (numel,), torch.bfloat16, native=False))
        best = min(best, time.thread_time() - t0)
    torch.set_num_threads(threads)
    return best * nbytes / stored.numel()


def decoded_bytes(v, read: int, lent: bool, n_layers: int) -> int:
    """The bytes of codes a step decodes (of ``view(state)`` ``v``): every byte it reads (``read``,
    an upper bound), or where the experts' NF4 codes are ``lent`` to their op (never decoded), the
    blocks' frozen rows only, each read in forward and again in backward (an upper bound too:
    their linears' codes are lent as well, and only the router and norms decoded)."""
    if not lent or "blocks:frozen" not in v.groups:
        return read
    row = v.row_numel("param", "blocks:frozen") * v.dtype("param", "blocks:frozen").itemsize
    return 2 * n_layers * row


def main(args) -> dict:
    """Build, initialise and train the ``--moe`` model; print and return the run's JSON."""
    cfg = model_config(args)
    run_dir = os.path.join(args.path, "zinf-larger-than-ram")
    os.makedirs(run_dir, exist_ok=True)
    try:
        return _run(args, cfg, run_dir)
    finally:
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def _run(args, cfg: llama.Config, run_dir: str) -> dict:
    model, config = make_model(args, cfg), engine_config(args, run_dir)
    optimizer = zf.adamw(lr=1e-4, weight_decay=0.0)
    est = zf.estimate(model, optimizer, config, top_k=cfg.moe.top_k)
    print(
        f"{args.moe}: {count_params(cfg) / 1e9:.2f}B parameters, {cfg.n_layers} layers, "
        f"{cfg.moe.n_experts} experts top-{cfg.moe.top_k}; {est.disk / GIB:.1f} GiB of states "
        f"on disk\n{est.table()}",
        flush=True,
    )
    t0 = time.perf_counter()
    state = zf.init(model, optimizer, config, seed=0)
    init_s = time.perf_counter() - t0
    print(f"init: {init_s:.0f} s, peak RSS so far {peak_rss() / GIB:.2f} GiB", flush=True)
    state, losses, seconds, reads, metrics = train_frozen(args, state)
    lent = bool(args.lora_rank) and args.frozen_storage == "nf4" and cfg.moe.stream_experts
    decoded = decoded_bytes(view(state), reads[-1], lent, cfg.n_layers)
    view(state).close()
    rss = peak_rss()  # the run's: before the timings alone below allocate their weights
    # the last step's reads replayed alone, the best of a few (``moe_disk``: a fresh file's
    # probe times a cache)
    replays = [moe_disk.disk_seconds(metrics["disk_spans"]) for _ in range(moe_disk.REPLAYS)]
    probe_bps, _ = disk_bandwidth(run_dir)  # a fresh file's, for comparison
    probe = reads[-1] / max(probe_bps, 1.0)  # its time for the step's bytes
    # where no read went through the file layer (a tier on tensorstore's driver) but bytes were
    # read, the probe's time for them: the one disk term there is
    replayed = bool(metrics["disk_spans"]) or reads[-1] == 0
    disk = min(replays) if replayed else probe
    routed = int(metrics.get("experts_routed", 0))
    rows = metrics["expert_rows"]
    rows = rows if len(rows) == routed else []  # a recomputed block calls its experts again
    compute, fp32_linear, other = alone_seconds(args, cfg, routed, rows)
    out = {
        "moe": args.moe,
        "params": count_params(cfg),
        "layers": cfg.n_layers,
        "experts_streamed": cfg.moe.stream_experts,
        "lora_rank": args.lora_rank,
        "frozen_storage": args.frozen_storage,
        "tokens_per_step": args.batch * args.seq,
        "data": "stdlib sources, byte-level ids 0-255",
        "peak_rss_gib": round(rss / GIB, 3),
        "init_s": round(init_s, 1),
        "step_s": [round(s, 2) for s in seconds],
        "bytes_read_per_step": reads[-1],
        "disk_bytes": est.disk,
        "roofline_ratio": round(seconds[-1] / max(compute, disk), 3),
        # the step over all its compute timed alone (the experts' and the rest) or the disk
        "roofline_ratio_all_compute": round(seconds[-1] / max(compute + other, disk), 3),
        # where the last step's time goes (``last_step``)
        "last_step": last_step(
            metrics,
            (compute, fp32_linear, other),
            (disk, replays, probe),
            decode_seconds(cfg, decoded),
        ),
        "losses": [round(v, 4) for v in losses],
    }
    print(json.dumps(out))
    return out


def _rounded(x: float | None) -> float | None:
    return x if x is None else round(x, 2)


def last_step(
    metrics: dict, alone: tuple[float, float, float], disk: tuple, decode_s: float
) -> dict:
    """Where the last step's time goes: compute waiting on fetches (disk, NF4 decode, casts not
    hidden; the units' and the tiles'), the experts' calls and rows, the step's thread's clocks,
    the experts' compute as the step does it and by fp32 ``F.linear`` and the rest of the compute
    (``alone``: ``alone_seconds``), the disk (``disk``: its seconds, those of each replay of its
    reads alone, and a fresh file's probe's for its bytes) and the NF4 decode of its bytes
    (``decode_s``), each alone."""
    compute, fp32_linear, other = alone
    return {
        "fetch_wait_s": round(metrics["fetch_wait_s"], 2),
        # the ops' waits for their tiles (``Prefetcher.get`` of the tile prefetcher), which
        # ``fetch_wait_s`` (the layers' prefetcher) does not count
        "tile_wait_s": round(metrics.get("tile_wait_s", 0.0), 2),
        # and the compute thread's time issuing the next tiles after each (its work, not a wait)
        "tile_refill_s": round(metrics.get("tile_refill_s", 0.0), 2),
        # the tile prefetcher's items fetched ahead, and of them those no op took (a predicted
        # expert the step's routing did not choose): read for nothing
        "tile_fetches_prefetched": int(metrics.get("tile_fetches_prefetched", 0)),
        "tile_fetches_wasted": int(metrics.get("tile_fetches_wasted", 0)),
        "io_wait_s": round(metrics["io_wait_s"], 2),
        # (layer, micro-batch, expert) triples the step computed
        "experts_routed": int(metrics.get("experts_routed", 0)),
        # the experts computed (moe.routed_apply's) and their rows: the most, the mean (the
        # alone timing follows each call's rows where the calls are the routed experts: no
        # block recomputed)
        "expert_calls": len(metrics["expert_rows"]),
        "expert_rows_max": max(metrics["expert_rows"], default=0),
        "expert_rows_mean": round(mean_of(metrics["expert_rows"]), 2),
        # the step's wall on its own thread: its CPU, its wait for a core (None off Linux), and
        # the process's CPU (the fetch, I/O, update and OpenMP threads' besides); the rest of
        # the wall the thread slept (``moe_clocks.clock_spent``)
        "thread_cpu_s": round(metrics["thread_cpu_s"], 2),
        "thread_runqueue_s": _rounded(metrics["thread_runqueue_s"]),
        "process_cpu_s": round(metrics["process_cpu_s"], 2),
        # the machine's cores' time the hypervisor gave elsewhere during the step (both cores';
        # None off Linux): on a shared virtual machine, wall no clock above counts
        "machine_steal_s": _rounded(metrics["machine_steal_s"]),
        "expert_compute_alone_s": round(compute, 2),
        "expert_compute_fp32_linear_s": round(fp32_linear, 2),
        # the rest of the step's compute timed alone in RAM: attention, norms, router and LoRA
        # of every layer, the head and the embedding (``moe_alone.other_compute_seconds``); to
        # 0.1 ms, as a tiny model's is a few milliseconds
        "other_compute_alone_s": round(other, 4),
        # the disk alone: its reads replayed (``moe_disk``), the best replay, each, their bytes;
        # and a fresh file's probe's time for the bytes it read (``planner.machine.disk_bandwidth``:
        # a cache's, on a VM)
        "disk_alone_s": round(disk[0], 2),
        "disk_replays_s": [round(s, 2) for s in disk[1]],
        "disk_replayed_bytes": moe_disk.replayed_bytes(metrics["disk_spans"]),
        "disk_probe_s": round(disk[2], 2),
        "nf4_decode_cpu_s": round(decode_s, 2),
    }


def alone_seconds(
    args, cfg: llama.Config, routed: int, rows: list[int]
) -> tuple[float, float, float]:
    """The step's compute timed alone (``moe_alone``): its ``routed`` experts (on ``rows`` rows
    each, where given) as the step computes them (over a frozen NF4 base, the fused kernel on the
    codes, ``GroupPolicy.codes``: lent), the same by fp32 ``F.linear``, and the rest of its
    compute."""
    tokens = args.batch * args.seq
    lent = bool(args.lora_rank) and args.frozen_storage == "nf4" and cfg.moe.stream_experts
    compute = moe_alone.active_experts_seconds(cfg, tokens, lent, routed, rows)
    fp32_linear = (
        moe_alone.active_experts_seconds(cfg, tokens, False, routed, rows) if lent else compute
    )
    dense = make_model(args, moe_alone.without_experts(cfg))
    # the frozen attention's NF4 codes lent to the fused kernels, as the step computes them
    lent_linears = bool(args.lora_rank) and args.frozen_storage == "nf4"
    other = moe_alone.other_compute_seconds(dense, cfg, (args.batch, args.seq), lent_linears)
    return compute, fp32_linear, other


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def mean_of(values: list[int]) -> float:
    return sum(values) / max(len(values), 1)
