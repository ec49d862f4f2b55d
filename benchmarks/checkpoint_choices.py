"""The two measured choices of the checkpoint I/O path, each against its alternative, in one run.

    python benchmarks/checkpoint_choices.py [--dir DIR] [--rounds N]

- staged reads: ``restore`` with ``chunkio.STAGE_READS`` on (each read lands in its I/O thread's
  reused ``chunkio.STAGE_BYTES`` (1 MiB) window and is copied into the state: the chosen path)
  against off (read straight into the state's fresh memory where it is aligned: the choice of
  f1a8ada), at the default request size (``staged_read_speedup``); against staging through 4 MiB
  windows (``small_window_speedup``); requests of ``chunkio.READ_PIECE_BYTES`` (16 MiB) against 1
  MiB ones, both chosen otherwise (``piece_read_speedup``); and the chosen reads against the reads
  before issue 22 (1 MiB requests staged through 4 MiB windows: ``vs_staged_1mib_reads``). Cold
  reads (posix_fadvise DONTNEED first), timing the read phase (open + read, as
  ``benchmarks/checkpoint.py`` does).
- syncfs: ``save`` with one ``syncfs(2)`` per sync point against an fsync of every file and
  directory (``commit.syncfs`` made to report "not available"), whole saves until committed.

The same model as ``benchmarks/checkpoint.py --quick`` (~360 MB of states). The two sides alternate
within each round (which goes first alternates too); each figure is the median over rounds of the
paired time ratio alternative / chosen (> 1: the choice is faster). The last line is JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkpoint import drop_cache, make_state, settle  # noqa: E402

import checkpoints  # noqa: E402
import checkpoints.commit  # noqa: E402
from checkpoints import chunkio  # noqa: E402


@contextlib.contextmanager
def reads(staged: bool, piece: int, window: int):
    saved = chunkio.STAGE_READS, chunkio.READ_PIECE_BYTES, chunkio.STAGE_BYTES
    chunkio.STAGE_READS, chunkio.READ_PIECE_BYTES, chunkio.STAGE_BYTES = staged, piece, window
    try:
        yield
    finally:
        chunkio.STAGE_READS, chunkio.READ_PIECE_BYTES, chunkio.STAGE_BYTES = saved


@contextlib.contextmanager
def use_syncfs(on: bool):
    saved = checkpoints.commit.syncfs
    if not on:  # commit.sync_tree looks it up in its module; chunkio imported it by name
        checkpoints.commit.syncfs = lambda path: False
        chunkio.syncfs = checkpoints.commit.syncfs
    try:
        yield
    finally:
        checkpoints.commit.syncfs = chunkio.syncfs = saved


def timed_restore(path: str, target: tuple) -> float:
    drop_cache(path)
    settle()
    stats: dict = {}
    checkpoints.restore(path, *target, stats=stats)
    return stats["open_s"] + stats["read_s"]


def timed_save(state, path: str) -> float:
    settle()
    t0 = time.perf_counter()
    checkpoints.save(path, state)
    seconds = time.perf_counter() - t0
    shutil.rmtree(path)
    return seconds


def paired(alternative: list, chosen: list) -> float:
    return round(statistics.median(a / c for a, c in zip(alternative, chosen, strict=True)), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", default=None, help="directory on the disk to measure (default: next to the repo)"
    )
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    args.d_model, args.layers = 512, 8
    base = args.dir or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(base, exist_ok=True)  # a --dir that does not exist yet is created
    root = tempfile.mkdtemp(prefix=".ckpt-choices-", dir=base)
    try:
        state, target, _ = make_state(args)
        path = checkpoints.save(os.path.join(root, "ck"), state)
        nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        checkpoints.restore(path, *target)  # warm: threads, imports
        piece, window = chunkio.READ_PIECE_BYTES, chunkio.STAGE_BYTES
        sides = {
            "chosen": (chunkio.STAGE_READS, piece, window),
            "direct": (False, piece, window),
            "window_4mib": (True, piece, 4 << 20),
            "piece_1mib": (chunkio.STAGE_READS, 1 << 20, window),
            "staged_1mib": (True, 1 << 20, 4 << 20),
        }
        t = {k: [] for k in (*sides, "syncfs", "fsync")}
        for i in range(args.rounds):
            for name in list(sides)[:: 1 if i % 2 else -1]:
                with reads(*sides[name]):
                    t[name].append(timed_restore(path, target))
            for name, on in [("syncfs", True), ("fsync", False)][:: 1 if i % 2 else -1]:
                with use_syncfs(on):
                    t[name].append(timed_save(state, os.path.join(root, f"s{i}{name}")))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: round(statistics.median(v), 4) for k, v in t.items()}
    print(
        json.dumps(
            {
                "staged_read_speedup": paired(t["direct"], t["chosen"]),
                "small_window_speedup": paired(t["window_4mib"], t["chosen"]),
                "piece_read_speedup": paired(t["piece_1mib"], t["chosen"]),
                "vs_staged_1mib_reads": paired(t["staged_1mib"], t["chosen"]),
                "syncfs_save_speedup": paired(t["fsync"], t["syncfs"]),
                **{f"{k}_s": v for k, v in med.items()},
                "rounds": args.rounds,
                "checkpoint_bytes": nbytes,
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
