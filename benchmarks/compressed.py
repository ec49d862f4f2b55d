"""Compressed optimizer states where the disk sets the step: NVMe step with remainder + int8 over
fp32 states.

Two copies of the same GPT (``overlap.py --quick``'s: d_model 1024, 4 layers) train with every state
on NVMe on the same batches of few tokens (1 x 32 by default), so the step is the disk's time to
move the states, not compute's:

    fp32        bf16 params, fp32 master, fp32 m and v: 28 bytes a parameter a step
    compressed  the same with ``Config(master="remainder")`` and ``zf.adamw(moments="int8")``: ~14
    bytes

In rounds alternating in one process (the machine's drift hits both alike), each configuration runs
``--run`` consecutive steps, all but the first timed (``overlap.run_rounds``: each timed step starts
with its predecessor's writes in flight, the steady state of training). ``compressed_over_fp32`` is
the median over rounds of (compressed step / fp32 step) within a round (goal <= 0.6; the byte ratio,
printed as ``bytes_ratio``, is ~0.5). ``disk_bound_share`` is each step's disk time at the disk's
speed measured in this run (``overlap.disk_bandwidth``) over its step time: near 1 where the disk
sets the step.

    python benchmarks/compressed.py --quick --dir DIR     # 3 rounds of 3 steps (6 timed per
    configuration) python benchmarks/compressed.py --quick --busy --dir DIR   # the same beside a
    process keeping a core busy python benchmarks/compressed.py --quick --cpu-table --dir DIR   #
    where each step's CPU goes

``--cpu-table`` (``cpu_table``): the same steps, timed the same way, with each thread's CPU clock
read around them and the engine's phases wrapped in place: CPU seconds a step per thread role
(compute, fetch, disk reads and writes, update workers, their OpenMP helpers) and per phase of the
update workers (kernel, remainder join and split, the 16-bit copy, the write-behind, the pool), each
configuration side by side; the readable table goes to stderr, and the JSON line gets its
"cpu_table".

Last line: JSON {"metric": "compressed_over_fp32", "value": ..., "bytes_per_param_fp32": ...,
"bytes_per_param_compressed": ..., "bytes_ratio": ..., ...}.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu_table  # noqa: E402
import overlap  # noqa: E402

import zinf_fn as zf  # noqa: E402
from layers import gpt  # noqa: E402
from zinf_fn.state import view  # noqa: E402

FORMATS = {
    "fp32": ({}, "fp32"),
    "compressed": ({"master": "remainder"}, "int8"),
}  # Config fields, moments


def make_states(cfg: gpt.Config, path: str, depth: int) -> dict:
    """The two configurations, every state on NVMe under ``path``."""
    states = {}
    for name, (fields, moments) in FORMATS.items():
        Path(path, name).mkdir()
        config = zf.Config(
            offload_params="nvme",
            offload_optimizer="nvme",
            nvme_path=f"{path}/{name}",
            prefetch_depth=depth,
            host_mmap_threshold=0,
            **fields,
        )
        states[name] = zf.init(gpt.model(cfg), zf.adamw(lr=1e-4, moments=moments), config)
    return states


def busy_core() -> subprocess.Popen:
    """A process that keeps one core busy for as long as it lives (the caller kills it)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def figures(times: dict, io: dict, read_bw: float, write_bw: float) -> dict:
    """The JSON keys: the ratio of step times within rounds, each step's bytes and its disk-bound
    share (``io``: ``overlap.run_rounds``' counters per step; reads served from memory did not reach
    the disk)."""
    out = {
        "metric": "compressed_over_fp32",
        "value": round(
            statistics.median(
                c / f for c, f in zip(times["compressed"], times["fp32"], strict=True)
            ),
            3,
        ),
    }
    for name in times:
        read, written = (
            statistics.median(x[4] - x[3] for x in io[name]),
            statistics.median(x[5] for x in io[name]),
        )
        step = statistics.median(times[name])
        out.update(
            {
                f"{name}_step_s": round(step, 3),
                f"bytes_per_param_{name}": round(io[name][-1][6], 3),
                f"disk_bound_share_{name}": round((read / read_bw + written / write_bw) / step, 3),
            }
        )
    out["bytes_ratio"] = round(out["bytes_per_param_compressed"] / out["bytes_per_param_fp32"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds of 3 steps")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--run",
        type=int,
        default=3,
        help="consecutive steps a round (>= 2); all but the first timed",
    )
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="directory for the NVMe tiers (created)"
    )
    parser.add_argument(
        "--busy",
        action="store_true",
        help="keep one core busy with a competing process, as a data loader would",
    )
    parser.add_argument(
        "--cpu-table",
        action="store_true",
        help="CPU seconds a step per thread and per update phase (stderr, and the JSON)",
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.run = 3, 3
    if args.run < 2:
        parser.error(f"--run must be >= 2 (the first step of a round is not timed), got {args.run}")
    overlap.keep_freed_memory()
    cfg = overlap.model_config(args)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    path = tempfile.mkdtemp(prefix="compressed-", dir=args.dir)
    competitor = busy_core() if args.busy else None
    phases = cpu_table.install() if args.cpu_table else None
    try:
        states = make_states(cfg, path, args.depth)
        if phases is not None:
            batch = functools.partial(overlap.next_batch, cfg, args)
            rows = cpu_table.report(states, batch, args.rounds, args.run, phases)
        times, io = overlap.run_rounds(states, cfg, args)
        for state in states.values():
            view(state).close()
        step_bytes = statistics.median(x[4] - x[3] + x[5] for x in io["fp32"])
        read_bw, write_bw = overlap.disk_bandwidth(
            path, int(step_bytes)
        )  # about one fp32 step's bytes
        print(f"disk: read {read_bw / 1e9:.2f} GB/s, write {write_bw / 1e9:.2f} GB/s")
        print(
            json.dumps(
                {
                    **figures(times, io, read_bw, write_bw),
                    "tokens_per_step": args.batch * args.seq,
                    "d_model": args.d_model,
                    "n_layers": args.layers,
                    "rounds": args.rounds,
                    "steps_per_round": args.run,
                    "busy": args.busy,
                    **({"cpu_table": rows} if phases is not None else {}),
                }
            )
        )
    finally:
        if competitor is not None:
            competitor.kill()
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
