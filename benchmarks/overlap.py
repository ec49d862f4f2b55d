"""Does the prefetcher hide NVMe behind compute? Step time with states on NVMe over step time in
RAM.

Three copies of the same GPT train on the same batches, in rounds alternating in one process so
the machine's drift hits all alike:

    ram           every state in RAM (placement "none")
    nvme          params + optimizer on NVMe, prefetch_depth = --depth (read-ahead, write-behind)
    prefetch_off  params + optimizer on NVMe, prefetch_depth = 0 (every read and write waited for)

The first step of each is warm-up and not counted. Then, in each round (in the order listed,
reversed in every other round: ``round_order``), every configuration runs ``--run`` consecutive
steps, as training does: a step returns with the write-behind of its last updated layers (block 0,
the embedding) still in flight, and those writes complete under the next step's forward pass. The
steps after the round's first are timed: each of them starts with its predecessor's writes in
flight and leaves its own in flight, the steady state of a training run. The
round's first step only brings the configuration into that state (it starts from a flushed tier),
and the round ends with ``runtime.flush()``, untimed, so no configuration's writes run during
another configuration's steps. This machine's compute speed drifts by 2x within seconds, so the
ratio is the median over rounds of (nvme step / ram step) within the same round; the exposed-wait
estimate (ram step + the extra time compute waited on I/O) / ram step is printed too. With enough
arithmetic per layer (d_model 1024, a few hundred tokens per step) the I/O of layer l+1 fits under
the compute of layer l, as the paper argues.

    python benchmarks/overlap.py --quick          # d_model 1024, 4 layers, 512 tokens, 4 rounds of
    3 steps, 8 timed python benchmarks/overlap.py --quick --cpu-table   # first: CPU a step per
    thread and phase (``cpu_table``)

``--cpu-table`` measures, before the rounds, the same steps of the RAM and NVMe configurations (fp32
and compressed states) with each thread's CPU clock read around them (``cpu_table``): where the NVMe
step spends the CPU its RAM twin does not, on two cores the compute's own; the table to stderr, its
JSON as the last line's "cpu_table".

The bytes a step moves: ``bytes_per_param`` is the nvme configuration's step metric (bf16 params;
``bytes_per_param_fp32`` from two more steps of the same model with fp32 params on NVMe), 28 at best
(master, m and v read and written, the 16-bit copy read once and written once). ``roofline_ratio`` =
nvme step / max(ram step, the nvme step's bytes read from the disk / disk read bandwidth + bytes
written / disk write bandwidth; reads served from memory, a write in flight or a kept row, are left
out), the disk measured in this run under ``--dir`` (``nvme_bandwidth.Raw``: O_DIRECT, 8 requests in
flight, about one step's bytes): 1.0 is a step as fast as compute or the disk allows. Like
``value``, it is the median over rounds of that ratio within a round (the NVMe and RAM steps of
the same round, seconds apart), not the ratio of medians taken over different rounds.

Compressed states (issue 22): two more configurations of the same model, ``master="remainder"`` with
``zf.adamw(moments="int8")``: ``ram_compressed`` (every state in RAM, the compute bound of such a
step: the int8 update is not the fp32 one) and ``nvme_compressed`` (everything on NVMe).
``bytes_per_param_compressed`` is the latter's step metric (the goal <= 14.5: the copy read for
forward, read once for the backward fetch and the update together, written; the remainder, m and v
codes read and written; the scales), and ``roofline_ratio_compressed`` = nvme_compressed step /
max(ram_compressed step, its disk time), as above.

Last line: JSON {"metric": "step_time_ratio_nvme_over_ram", "value": ..., "prefetch_off": ...,
"bytes_per_param": ..., "roofline_ratio": ..., "bytes_per_param_compressed": ...,
"roofline_ratio_compressed": ...}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu_table  # noqa: E402
from nvme_bandwidth import BLOCK, Raw  # noqa: E402

import zinf_fn as zf  # noqa: E402
from layers import gpt  # noqa: E402
from zinf_fn.state import view  # noqa: E402


def make_states(cfg: gpt.Config, path: str, depth: int, mmap: int | None) -> dict:
    """The five configurations; ``mmap``: their ``Config.host_mmap_threshold`` (0 under
    --malloc-cache, so that an NVMe init does not undo it for the process)."""
    nvme = {
        "offload_params": "nvme",
        "offload_optimizer": "nvme",
        "prefetch_depth": depth,
        "host_mmap_threshold": mmap,
    }
    compressed = {"master": "remainder"}
    configs = {
        "ram": zf.Config(prefetch_depth=depth, host_mmap_threshold=mmap),
        "nvme": zf.Config(nvme_path=f"{path}/a", **nvme),
        "prefetch_off": zf.Config(nvme_path=f"{path}/b", **{**nvme, "prefetch_depth": 0}),
        "ram_compressed": zf.Config(prefetch_depth=depth, host_mmap_threshold=mmap, **compressed),
        "nvme_compressed": zf.Config(nvme_path=f"{path}/c", **nvme, **compressed),
    }
    for sub in ("a", "b", "c"):
        Path(path, sub).mkdir()
    return {
        name: zf.init(
            gpt.model(cfg),
            zf.adamw(lr=1e-4, moments="int8" if "compressed" in name else "fp32"),
            config,
        )
        for name, config in configs.items()
    }


def next_batch(cfg: gpt.Config, args, gen: torch.Generator) -> dict:
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def timed_run(state, data: list) -> tuple:
    """Train on ``data`` step after step; (state, seconds of the steps after the first, their I/O
    counters).

    Each timed step starts with the previous step's write-behind in flight and returns with its own
    in flight (the steady state); the writes of the last step are flushed after the clock stopped.
    """
    state, _ = zf.train_step(state, data[0])  # the writes of this step are in flight for the next
    wait = hidden = read = written = from_writes = 0.0
    t0 = time.perf_counter()
    for batch in data[1:]:
        state, metrics = zf.train_step(state, batch)
        wait, hidden = wait + metrics["io_wait_s"], hidden + metrics["io_hidden_s"]
        read += sum(v for k, v in metrics.items() if k.startswith("bytes_read."))
        written += sum(v for k, v in metrics.items() if k.startswith("bytes_written."))
        from_writes += sum(
            v
            for k, v in metrics.items()  # reads that skipped the disk
            if k.startswith(("bytes_read_inflight.", "bytes_read_resident."))
        )
    seconds = time.perf_counter() - t0
    view(
        state
    ).flush()  # sync: this configuration's last writes end before the next configuration runs
    return (
        state,
        seconds,
        (wait, hidden, read + written, from_writes, read, written, metrics["bytes_per_param"]),
    )


def disk_bandwidth(directory: str, nbytes: int) -> tuple[float, float]:
    """(read, write) bytes per second of the disk under ``directory``: O_DIRECT on one file of about
    ``nbytes`` (``nvme_bandwidth.Raw``; the write fsynced, the read from the device), best of
    two."""
    raw = Raw(directory, max(BLOCK, nbytes // BLOCK * BLOCK))
    try:
        raw.write()  # allocation: training overwrites rows allocated at init, so this is not timed
        writes, reads = [raw.write() for _ in range(2)], [raw.read() for _ in range(2)]
    finally:
        os.unlink(raw.path)
    return raw.nbytes / min(reads), raw.nbytes / min(writes)


def fp32_bytes_per_param(cfg: gpt.Config, args, path: str) -> float:
    """bytes_per_param of the second step of the same model with fp32 params, everything on NVMe."""
    Path(path).mkdir()
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="nvme",
        nvme_path=path,
        param_dtype=torch.float32,
        prefetch_depth=args.depth,
        host_mmap_threshold=0 if args.malloc_cache else None,
    )
    state = zf.init(gpt.model(cfg), zf.adamw(lr=1e-4), config)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        state, metrics = zf.train_step(state, next_batch(cfg, args, gen))
    view(state).close()
    return metrics["bytes_per_param"]


def keep_freed_memory() -> None:
    """mallopt(M_MMAP_THRESHOLD, 1 GiB) and mallopt(M_TRIM_THRESHOLD, 2 GiB - 1): freed memory is
    reused instead of faulted in afresh. mallopt takes a C int: 8 GiB, passed before, wrapped to 0,
    a threshold that gave the heap's top back to the kernel at every free (~35 thousand fresh pages
    faulted in a step, every configuration alike)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    for param, value in ((-3, 1 << 30), (-1, (1 << 31) - 1)):  # M_MMAP_, M_TRIM_THRESHOLD
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            raise OSError(f"mallopt({param}, {value}) was refused")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="d_model 1024, 4 layers, 4x128 tokens, 4 rounds of 3 steps (8 timed)",
    )
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timed rounds (after 1 warm-up step per configuration)",
    )
    parser.add_argument(
        "--run",
        type=int,
        default=3,
        help="consecutive steps per configuration in a round (>= 2); all but the first are timed",
    )
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="directory for the NVMe tier (created)"
    )
    parser.add_argument(
        "--cpu-table",
        action="store_true",
        help="CPU a step per thread and per phase of the RAM and NVMe configurations",
    )
    parser.add_argument(
        "--malloc-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep freed memory in glibc's heap (mallopt), so large temporaries are not "
        "page-faulted in afresh every step (as a GPU's caching allocator would not); applies to "
        "all configurations alike. Without it ~1.2 GB of fresh pages are faulted in per step at "
        "d_model 1024, which cost from ~nothing to 2-3x the step on this machine depending on "
        "the host's load, inflating compute and flattering the ratio; the configurations get "
        "Config(host_mmap_threshold=0), whose NVMe default (1 MiB) would undo it",
    )
    args = parser.parse_args()
    if args.run < 2:
        parser.error(f"--run must be >= 2 (the first step of a round is not timed), got {args.run}")
    if args.quick:
        args.d_model, args.layers, args.batch, args.seq, args.rounds, args.run = (
            1024,
            4,
            4,
            128,
            4,
            3,
        )
    return args


def model_config(args) -> gpt.Config:
    """The benchmark's GPT: ``--d-model`` wide (64 per head), ``--layers`` deep, ``--seq`` tokens,
    256 symbols."""
    return gpt.Config(
        vocab_size=256,
        d_model=args.d_model,
        n_heads=max(1, args.d_model // 64),
        n_layers=args.layers,
        seq_len=args.seq,
    )


def run_rounds(states: dict, cfg: gpt.Config, args) -> tuple[dict, dict]:
    """A warm-up step of each configuration, then ``args.rounds`` rounds of ``args.run`` steps of
    each on the same batches: (seconds per timed step, per round; the I/O counters per timed step,
    per round)."""
    gen = torch.Generator().manual_seed(0)
    times = {name: [] for name in states}
    io = {name: [] for name in states}
    for name in states:  # warm-up: every buffer made, every code path run once
        states[name], _ = zf.train_step(states[name], next_batch(cfg, args, gen))
        view(states[name]).flush()
    for r in range(args.rounds):
        data = [next_batch(cfg, args, gen) for _ in range(args.run)]
        for name in round_order(list(states), r):
            states[name], seconds, counters = timed_run(states[name], data)
            times[name].append(seconds / (args.run - 1))
            per_step, bytes_per_param = (
                counters[:6],
                counters[6],
            )  # sums over the timed steps; a ratio
            io[name].append((*(x / (args.run - 1) for x in per_step), bytes_per_param))
        print(
            f"round {r}: " + "  ".join(f"{n} {times[n][-1]:.2f}s/step" for n in states), flush=True
        )
    return times, io


def round_order(names: list[str], r: int) -> list[str]:
    """The configurations in the order round ``r`` runs them: as listed in even rounds, reversed in
    odd ones. Each twin of a ratio (ram and nvme, ram_compressed and nvme_compressed) runs beside
    the other, first in one round and second in the next, so a drift within a round, or a
    configuration that slows the one after it, weighs on both sides alike; in a fixed order ram
    always ran first, right after the previous round's flush."""
    return names if r % 2 == 0 else names[::-1]


def summary(times: dict, io: dict, args) -> dict:
    """The step-time ratios (medians over rounds of the ratio within a round) and exposed waits,
    printed."""
    median = {name: statistics.median(t) for name, t in times.items()}
    ratio = {
        name: statistics.median(a / b for a, b in zip(times[name], times["ram"], strict=True))
        for name in times
    }
    extra_wait = {
        name: statistics.median(x[0] for x in io[name]) - statistics.median(x[0] for x in io["ram"])
        for name in times
    }
    for name in times:
        wait, hidden, nbytes, from_writes = (
            statistics.median(x[i] for x in io[name]) for i in range(4)
        )
        print(
            f"{name:15s} step {median[name]:.3f}s  exposed I/O wait {wait:.3f}s  hidden I/O "
            f"{hidden:.3f}s  "
            f"moved {nbytes / 1e9:.2f} GB/step (reads served from memory: writes in flight, kept "
            "rows "
            f"{from_writes / 1e9:.3f} GB)"
        )
    return {
        "metric": "step_time_ratio_nvme_over_ram",
        "value": round(ratio["nvme"], 3),
        "prefetch_off": round(ratio["prefetch_off"], 3),
        "wait_estimate": round(1 + extra_wait["nvme"] / median["ram"], 3),
        "wait_estimate_prefetch_off": round(1 + extra_wait["prefetch_off"] / median["ram"], 3),
        "d_model": args.d_model,
        "malloc_cache": args.malloc_cache,
        "n_layers": args.layers,
        "tokens_per_step": args.batch * args.seq,
        "prefetch_depth": args.depth,
        "rounds": args.rounds,
        "steps_per_round": args.run,
        **{f"{name}_step_s": round(m, 3) for name, m in median.items()},
    }


def main() -> None:
    args = parse_args()
    if args.malloc_cache:
        keep_freed_memory()
    cfg = model_config(args)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    path = tempfile.mkdtemp(prefix="overlap-", dir=args.dir)
    phases = cpu_table.install() if args.cpu_table else None
    try:
        states = make_states(cfg, path, args.depth, 0 if args.malloc_cache else None)
        rows = {} if phases is None else cpu_rows(states, cfg, args, phases)
        times, io = run_rounds(states, cfg, args)
        result = summary(times, io, args)
        for state in states.values():
            view(state).close()
        result.update(roofline(io["nvme"], times["nvme"], times["ram"], path))
        compressed = roofline(
            io["nvme_compressed"], times["nvme_compressed"], times["ram_compressed"], path
        )
        result.update({f"{k}_compressed": v for k, v in compressed.items()})
        result["bytes_per_param_fp32"] = round(fp32_bytes_per_param(cfg, args, f"{path}/fp32"), 3)
        print(json.dumps({**result, **({"cpu_table": rows} if rows else {})}))
    finally:
        shutil.rmtree(path, ignore_errors=True)


def cpu_rows(states: dict, cfg: gpt.Config, args, phases) -> dict:
    """``cpu_table.report`` of the RAM and NVMe configurations (fp32 and compressed states)."""
    names = ("ram", "nvme", "ram_compressed", "nvme_compressed")
    picked = {name: states[name] for name in names}
    rows = cpu_table.report(picked, functools.partial(next_batch, cfg, args), 2, args.run, phases)
    states.update(picked)
    return rows


def roofline(nvme_io: list, nvme_steps: list, ram_steps: list, path: str) -> dict:
    """bytes_per_param of an NVMe configuration and its step over the bound of compute (its RAM
    twin's step) and the disk, measured now: the median over rounds of the ratio within a round
    (``nvme_steps[r] / max(ram_steps[r], disk)``), as ``value``, so that the machine's drift between
    rounds (2x within seconds) cancels instead of pairing one round's NVMe step with another's RAM
    step."""
    # the disk's bytes: reads served from memory (a write in flight, a kept row) did not reach it
    read, written = (
        statistics.median(x[4] - x[3] for x in nvme_io),
        statistics.median(x[5] for x in nvme_io),
    )
    read_bw, write_bw = disk_bandwidth(path, int(read + written))
    disk_s = read / read_bw + written / write_bw
    print(
        f"disk: read {read_bw / 1e9:.2f} GB/s, write {write_bw / 1e9:.2f} GB/s; the nvme step's "
        "bytes take "
        f"{disk_s:.3f}s at that speed"
    )
    return {
        "bytes_per_param": round(statistics.median(x[6] for x in nvme_io), 3),
        "roofline_ratio": round(
            statistics.median(
                n / max(r, disk_s) for n, r in zip(nvme_steps, ram_steps, strict=True)
            ),
            3,
        ),
        "disk_read_GBps": round(read_bw / 1e9, 3),
        "disk_write_GBps": round(write_bw / 1e9, 3),
        "disk_bound_step_s": round(disk_s, 3),
    }


if __name__ == "__main__":
    main()
