"""What disk traffic alone costs a training step on this machine: a RAM step timed with and without
another process moving bytes to and from the same disk at the rate the NVMe step moves them.

    python benchmarks/io_interference.py [--rate 1.4] [--dir DIR]
    python benchmarks/io_interference.py --moe qwen3-30b-a3b --dir DIR [--layers N] [--rate 1.0]

No state of the trained model is on disk here: the helper process (this script with ``--helper``)
writes a preallocated file whole once (so that every later read reaches the disk: an extent never
written reads back as zeros without one), then moves ``--rate`` GB/s over it with O_DIRECT from 8
threads whenever a flag file exists: 8 MiB blocks, half read and half written, or with ``--moe``
2 MiB reads only (what the 30B's NVMe step does: it reads its NF4 experts, ~1.6 and ~0.8 MB a
tile, and writes nothing of the base). What the helper moved is its ``/proc/PID/io`` bytes.

The default trainer is the RAM configuration of ``benchmarks/overlap.py --quick``, in rounds of 3
steps without and 3 with the traffic (5 rounds), whose default rate is about what its NVMe
configuration moves (1.53 GB per step of ~1.1 s). With ``--moe`` it is the 30B steps of
``examples/train_larger_than_ram.py --moe PRESET --lora-rank 8 --frozen-storage nf4
--base-in-ram`` (``--layers`` of them; the whole base in RAM: ~18 GiB at 48 layers), one step a
phase, the phases' order alternating by round, every step on the same batch, so that every step
computes the same experts and one timing of them alone (``moe_alone.active_experts_seconds``, as
the example's ``roofline_ratio`` divides by) serves them all: the step over it quiet and with the
traffic is the floor the NVMe step's ``roofline_ratio`` has on this machine, whatever streams its
bytes. The default rate is about what that step reads: 7.5 GB in ~7.7 s.

The ratio is the median over rounds of (step with traffic / step without). Last line JSON:
``{"metric": "ram_step_ratio_with_disk_traffic", ...}`` with the helper's CPU seconds and GB moved
per second of traffic (and with ``--moe`` the two roofline ratios).
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import overlap  # noqa: E402

import zinf_fn as zf  # noqa: E402
from layers import gpt  # noqa: E402

THREADS = 8
# (block bytes, share of blocks read, file bytes) of the helper's traffic: the default's, --moe's
MIXED = (8 << 20, 0.5, 1 << 30)
READS = (2 << 20, 1.0, 4 << 30)


def helper(path: str, flag: str, rate: float, moe: bool) -> None:
    """Write ``path`` whole, then move ``rate`` bytes/s over it while ``flag`` exists, forever
    (the trainer kills this process); ``flag + ".ready"`` appears once the file is written."""
    block, read_share, file_bytes = READS if moe else MIXED
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.posix_fallocate(fd, 0, file_bytes)
    fill = mmap.mmap(-1, block)
    fill.write(os.urandom(block))
    for offset in range(0, file_bytes, block):  # every extent written: its reads reach the disk
        os.pwrite(fd, fill, offset)
    Path(flag + ".ready").touch()
    per_block = block / (rate / THREADS)  # seconds per block per thread at the target rate
    reads_of = round(1 / (1 - read_share)) if read_share < 1 else 0  # one write in this many

    def work(i: int) -> None:
        buf = mmap.mmap(-1, block)
        k = i
        while True:
            if not os.path.exists(flag):
                time.sleep(0.01)
                continue
            t0 = time.perf_counter()
            offset = (k % (file_bytes // block)) * block
            writes = reads_of and k % reads_of == 0
            os.pwrite(fd, buf, offset) if writes else os.preadv(fd, [buf], offset)
            k += THREADS
            time.sleep(max(0.0, per_block - (time.perf_counter() - t0)))

    for i in range(THREADS):
        threading.Thread(target=work, args=(i + 1,), daemon=True).start()
    threading.Event().wait()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bytes_moved(pid: int) -> int:
    """Bytes process ``pid`` has read from and written to storage (``/proc/PID/io``)."""
    with open(f"/proc/{pid}/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]) + int(fields["write_bytes"])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="GB/s the helper moves (default 1.4, half read, half written; with --moe 1.0, read)",
    )
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="directory on the disk to load (created)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="default: 5; with --moe 3")
    parser.add_argument(
        "--moe",
        choices=("qwen3-30b-a3b", "tiny"),
        default=None,
        help="the trainer: the 30B steps with the base in RAM (train_larger_than_ram.py --moe)",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="with --moe: its layers (default: the preset's)"
    )
    parser.add_argument("--helper", nargs=2, metavar=("FILE", "FLAG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layers is not None and args.moe is None:
        parser.error("--layers: only with --moe")
    args.rate = args.rate or (1.0 if args.moe else 1.4)
    args.rounds = args.rounds or (3 if args.moe else 5)
    return args


class Trainer:
    """The RAM configuration of ``overlap.py --quick``, warmed up: ``steps(n)`` runs n steps,
    returns seconds."""

    per_phase = 3  # steps a phase of a round

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

    def close(self) -> dict:
        zf.close(self.state)
        return {}


class MoeTrainer:
    """The ``--moe`` steps with the base in RAM (``examples/moe_run.py``'s model and config, the
    example's collector frozen), warmed up, each on the same batch: ``steps(n)``; ``close`` times
    the last step's experts alone."""

    per_phase = 1

    def __init__(self, preset: str, layers: int | None, run_dir: str):
        sys.path.insert(0, str(ROOT / "examples"))
        import moe_run
        import train_larger_than_ram

        from zinf_cli import corpus

        argv = ["--moe", preset, "--lora-rank", "8", "--frozen-storage", "nf4", "--base-in-ram"]
        argv += ["--path", run_dir] + ([] if layers is None else ["--layers", str(layers)])
        self.args, self.run = train_larger_than_ram.parse_args(argv), moe_run
        self.cfg = moe_run.model_config(self.args)
        model, config = (
            moe_run.make_model(self.args, self.cfg),
            moe_run.engine_config(self.args, run_dir),
        )
        self.state = zf.init(model, zf.adamw(lr=1e-4, weight_decay=0.0), config, seed=0)
        text = corpus.load_corpus(None)
        self.batch = next(corpus.batches(text, self.args.batch, self.args.seq, seed=0))
        self.rows: list[int] = []
        self.steps(1)  # warm-up
        gc.collect()
        gc.freeze()  # as the example's steps run (``moe_run.train_frozen``)

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.rows.clear()
            with self.run.expert_rows(self.rows):
                self.state, self.metrics = zf.train_step(self.state, self.batch)
        return time.perf_counter() - t0

    def close(self) -> dict:
        """The state closed, then the experts of a step timed alone (as the example's
        ``roofline_ratio`` divides by), with the last step's loss."""
        zf.close(self.state)
        gc.unfreeze()
        routed = int(self.metrics.get("experts_routed", 0))
        rows = self.rows if len(self.rows) == routed else []
        compute, _, _ = self.run.alone_seconds(self.args, self.cfg, routed, rows)
        return {"experts_alone_s": compute, "loss": float(self.metrics["loss"])}


def rounds(trainer, proc: subprocess.Popen, flag: str, n: int) -> tuple[dict, float, int, float]:
    """``n`` rounds of ``trainer.per_phase`` quiet steps and as many with the helper's traffic
    (``flag`` present), quiet first in the even rounds where a phase is one step: (seconds per step
    by phase, one value a round; the helper's CPU seconds and bytes moved; the seconds of
    traffic)."""
    times: dict[str, list[float]] = {"quiet": [], "traffic": []}
    helper_cpu, moved, traffic_s, steps = 0.0, 0, 0.0, trainer.per_phase
    while not os.path.exists(flag + ".ready"):  # the helper has written its file
        if proc.poll() is not None:
            raise RuntimeError(f"the traffic helper exited with {proc.returncode}")
        time.sleep(0.1)
    for r in range(n):
        order = ("traffic", "quiet") if steps == 1 and r % 2 else ("quiet", "traffic")
        for phase in order:
            if phase == "quiet":
                times["quiet"].append(trainer.steps(steps) / steps)
                continue
            Path(flag).touch()
            time.sleep(0.3)
            c0, b0 = cpu_seconds(proc.pid), bytes_moved(proc.pid)
            seconds = trainer.steps(steps)
            times["traffic"].append(seconds / steps)
            helper_cpu += cpu_seconds(proc.pid) - c0
            moved += bytes_moved(proc.pid) - b0
            traffic_s += seconds
            os.remove(flag)
            time.sleep(0.3)
    return times, helper_cpu, moved, traffic_s


def main() -> None:
    args = parse_args()
    if args.helper:
        return helper(*args.helper, args.rate * 1e9, args.moe is not None)
    overlap.keep_freed_memory()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    path, flag = (
        os.path.join(args.dir, f"io-interference-{os.getpid()}.bin"),
        f"{args.dir}/io-interference-{os.getpid()}.on",
    )
    run_dir = os.path.join(args.dir, f"io-interference-run-{os.getpid()}")
    try:
        trainer = Trainer() if args.moe is None else MoeTrainer(args.moe, args.layers, run_dir)
        print(json.dumps(traffic_beside(args, trainer, path, flag)))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def traffic_beside(args, trainer, path: str, flag: str) -> dict:
    """``trainer``'s rounds with the helper process started beside it (removed after, with its
    file and flags), then the trainer closed: the run's JSON (``result``)."""
    helper_args = ["--rate", str(args.rate), "--helper", path, flag]
    proc = subprocess.Popen(
        [sys.executable, __file__, *helper_args, *(["--moe", args.moe] if args.moe else [])]
    )
    try:
        times, helper_cpu, moved, traffic_s = rounds(trainer, proc, flag, args.rounds)
    finally:
        proc.kill()
        proc.wait()
        for leftover in (path, flag, flag + ".ready"):
            if os.path.exists(leftover):
                os.remove(leftover)
    return result(args, times, helper_cpu, moved, traffic_s, trainer.close())


def result(args, times: dict, helper_cpu: float, moved: int, traffic_s: float, extra: dict) -> dict:
    """The run's JSON: the median of the rounds' ratios, the phases' medians, the helper's cost
    and rate; with ``--moe`` the steps over their experts alone, quiet and with the traffic."""
    ratio = statistics.median(t / q for t, q in zip(times["traffic"], times["quiet"], strict=True))
    quiet, traffic = statistics.median(times["quiet"]), statistics.median(times["traffic"])
    out = {
        "metric": "ram_step_ratio_with_disk_traffic",
        "value": round(ratio, 3),
        "rate_gbps": args.rate,
        "moved_gbps": round(moved / traffic_s / 1e9, 3),
        "quiet_step_s": round(quiet, 3),
        "traffic_step_s": round(traffic, 3),
        "helper_cpu_s_per_s": round(helper_cpu / traffic_s, 3),
        "rounds": args.rounds,
    }
    if "experts_alone_s" in extra:
        alone = extra["experts_alone_s"]
        out |= {
            "moe": args.moe,
            "layers": args.layers,
            "quiet_steps_s": [round(t, 3) for t in times["quiet"]],
            "traffic_steps_s": [round(t, 3) for t in times["traffic"]],
            "experts_alone_s": round(alone, 3),
            "roofline_ratio_quiet": round(quiet / alone, 3),
            "roofline_ratio_with_traffic": round(traffic / alone, 3),
            "loss": round(extra["loss"], 4),
        }
    return out


if __name__ == "__main__":
    main()
