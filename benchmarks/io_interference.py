"""What disk traffic alone costs a training step on this machine: the RAM configuration of
``benchmarks/overlap.py --quick`` timed with and without another process moving bytes to and from
the same disk at the rate the NVMe configuration moves them.

    python benchmarks/io_interference.py [--rate 1.4] [--dir DIR]

No state of the trained model is on disk here: the helper process (this script with ``--helper``)
reads and writes 8 MiB blocks (half each) of a 1 GiB preallocated file with O_DIRECT from 8 threads,
throttled to ``--rate`` GB/s, whenever a flag file exists. The trainer alternates phases of 3 steps
without and with the traffic, 5 rounds; the ratio is the median over rounds of (step with traffic /
step without). The default rate is about what the NVMe configuration of ``overlap.py --quick``
moves: 1.53 GB per step of ~1.1 s. Last line JSON: ``{"metric": "ram_step_ratio_with_disk_traffic",
...}`` with the helper's CPU seconds per second of traffic.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import overlap  # noqa: E402

import zinf_fn as zf  # noqa: E402
from layers import gpt  # noqa: E402

BLOCK = 8 << 20
THREADS = 8
FILE_BYTES = 1 << 30


def helper(path: str, flag: str, rate: float) -> None:
    """Move ``rate`` bytes/s while ``flag`` exists, forever (the trainer kills this process)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.posix_fallocate(fd, 0, FILE_BYTES)
    per_block = BLOCK / (rate / THREADS)  # seconds per block per thread at the target rate

    def work(i: int) -> None:
        buf = mmap.mmap(-1, BLOCK)
        k = i
        while True:
            if not os.path.exists(flag):
                time.sleep(0.01)
                continue
            t0 = time.perf_counter()
            offset = (k % (FILE_BYTES // BLOCK)) * BLOCK
            os.preadv(fd, [buf], offset) if k % 2 else os.pwrite(fd, buf, offset)
            k += THREADS
            time.sleep(max(0.0, per_block - (time.perf_counter() - t0)))

    for i in range(THREADS):
        threading.Thread(target=work, args=(i,), daemon=True).start()
    threading.Event().wait()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rate", type=float, default=1.4, help="GB/s the helper moves (half read, half written)"
    )
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="directory on the disk to load (created)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--helper", nargs=2, metavar=("FILE", "FLAG"), help=argparse.SUPPRESS)
    return parser.parse_args()


class Trainer:
    """The RAM configuration of ``overlap.py --quick``, warmed up: ``steps(n)`` runs n steps,
    returns seconds."""

    def __init__(self):
        self.cfg = gpt.Config(vocab_size=256, d_model=1024, n_heads=16, n_layers=4, seq_len=128)
        self.shape, self.gen = (
            argparse.Namespace(batch=4, seq=128),
            torch.Generator().manual_seed(0),
        )
        self.state = zf.init(gpt.model(self.cfg), zf.adamw(lr=1e-4), zf.Config(prefetch_depth=2))
        self.steps(1)  # warm-up

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.state, _ = zf.train_step(
                self.state, overlap.next_batch(self.cfg, self.shape, self.gen)
            )
        return time.perf_counter() - t0


def rounds(
    trainer: Trainer, proc: subprocess.Popen, flag: str, n: int
) -> tuple[dict, float, float]:
    """``n`` rounds of 3 quiet steps then 3 with the helper's traffic (``flag`` present): (seconds
    per step by phase, one value a round; the helper's CPU seconds; the seconds of traffic)."""
    times, helper_cpu, traffic_s = {"quiet": [], "traffic": []}, 0.0, 0.0
    time.sleep(1.0)  # the helper has allocated its file
    for _ in range(n):
        times["quiet"].append(trainer.steps(3) / 3)
        time.sleep(0.3)
        Path(flag).touch()
        time.sleep(0.3)
        c0 = cpu_seconds(proc.pid)
        seconds = trainer.steps(3)
        times["traffic"].append(seconds / 3)
        helper_cpu += cpu_seconds(proc.pid) - c0
        traffic_s += seconds
        os.remove(flag)
        time.sleep(0.3)
    return times, helper_cpu, traffic_s


def main() -> None:
    args = parse_args()
    if args.helper:
        return helper(*args.helper, args.rate * 1e9)
    overlap.keep_freed_memory()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    path, flag = (
        os.path.join(args.dir, f"io-interference-{os.getpid()}.bin"),
        f"{args.dir}/io-interference.on",
    )
    trainer = Trainer()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--rate", str(args.rate), "--helper", path, flag]
    )
    try:
        times, helper_cpu, traffic_s = rounds(trainer, proc, flag, args.rounds)
    finally:
        proc.kill()
        proc.wait()
        for leftover in (path, flag):
            if os.path.exists(leftover):
                os.remove(leftover)
    ratio = statistics.median(t / q for t, q in zip(times["traffic"], times["quiet"], strict=True))
    print(
        json.dumps(
            {
                "metric": "ram_step_ratio_with_disk_traffic",
                "value": round(ratio, 3),
                "rate_gbps": args.rate,
                "quiet_step_s": round(statistics.median(times["quiet"]), 3),
                "traffic_step_s": round(statistics.median(times["traffic"]), 3),
                "helper_cpu_s_per_s": round(helper_cpu / traffic_s, 3),
                "rounds": args.rounds,
            }
        )
    )


if __name__ == "__main__":
    main()
