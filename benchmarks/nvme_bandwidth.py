"""Raw disk bandwidth vs the NVMe tier's, measured in one run on the same directory.

raw   one file, O_DIRECT, page-aligned 1 MiB blocks, 8 requests in flight (threads), sequential.
tier  ``NvmeTier`` moving layer shards the way training does: per layer, the bf16 param row and the
      fp32 master, m and v rows (a d_model-1024 GPT block: 25 MB + 3 x 50 MB), written together as
      the optimizer's write-behind does and read ``depth`` layers ahead as the read-ahead does.

Honest timing: every write phase ends with fsync of every file it wrote, inside the timer; before
every read phase the files are fsynced and evicted from the page cache (posix_fadvise DONTNEED), so
neither side is served from memory (O_DIRECT bypasses the cache anyway). Both sides first write
their files once (the allocation, timed and reported as ``first_write``) and then overwrite them in
place (``write``): training overwrites rows allocated at init, so the steady state is the overwrite.
Raw and tier alternate, round by round, so the disk's drift over time hits both.

    python benchmarks/nvme_bandwidth.py --quick            # 2 GiB per pass, 4 rounds
    python benchmarks/nvme_bandwidth.py --gib 8 --rounds 3

Last line: JSON with raw and tier GB/s and ``read_ratio`` / ``write_ratio`` (tier / raw).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zinf_fn.io.buffers import aligned_empty  # noqa: E402
from zinf_fn.offload.nvme import NvmeTier  # noqa: E402

BLOCK = 1 << 20
D_MODEL = 1024
LAYER_NUMEL = 12 * D_MODEL * D_MODEL + 13 * D_MODEL  # one GPT block's parameters
KINDS = (
    ("param", torch.bfloat16),
    ("master", torch.float32),
    ("opt.0", torch.float32),
    ("opt.1", torch.float32),
)


def evict(paths) -> None:
    """fsync and drop from the page cache: the next read comes from the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_all(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Raw:
    """Sequential O_DIRECT I/O on one file, ``threads`` aligned 1 MiB requests in flight."""

    def __init__(self, directory: str, nbytes: int, threads: int = 8):
        self.path, self.nbytes, self.threads = os.path.join(directory, "raw.bin"), nbytes, threads
        self.buffers = [mmap.mmap(-1, BLOCK) for _ in range(threads)]  # page-aligned
        for b in self.buffers:
            b.write(os.urandom(BLOCK))

    def write(self) -> float:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.threads) as ex:
            list(
                ex.map(
                    lambda i: os.pwrite(fd, self.buffers[i % self.threads], i * BLOCK),
                    range(self.nbytes // BLOCK),
                )
            )
        os.fsync(fd)
        seconds = time.perf_counter() - t0
        os.close(fd)
        return seconds

    def read(self) -> float:
        evict([self.path])
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.threads) as ex:
            list(
                ex.map(
                    lambda i: os.preadv(fd, [self.buffers[i % self.threads]], i * BLOCK),
                    range(self.nbytes // BLOCK),
                )
            )
        seconds = time.perf_counter() - t0
        os.close(fd)
        return seconds


class Tier:
    """Layer shards through ``NvmeTier``: the four state rows of a layer together, ``depth`` layers
    in flight."""

    def __init__(self, directory: str, nbytes: int, engine: str, depth: int = 2):
        per_layer = sum(LAYER_NUMEL * dtype.itemsize for _, dtype in KINDS)
        self.layers = max(1, nbytes // per_layer)
        self.nbytes = self.layers * per_layer
        self.depth = depth
        self.tier = NvmeTier(directory, "rank0/bench", engine=engine)
        for kind, dtype in KINDS:
            self.tier.allocate(f"blocks/{kind}", self.layers, LAYER_NUMEL, dtype)
        self.slots = [
            {kind: aligned_empty(LAYER_NUMEL, dtype) for kind, dtype in KINDS}
            for _ in range(depth + 1)
        ]
        for slot in self.slots:
            for buf in slot.values():
                buf.view(torch.uint8).random_()

    def files(self) -> list[str]:
        return [self.tier.row_path(f"blocks/{k}", r) for k, _ in KINDS for r in range(self.layers)]

    def _run(self, op) -> float:
        inflight = []
        t0 = time.perf_counter()
        for layer in range(self.layers):
            slot = self.slots[layer % len(self.slots)]
            if len(inflight) > self.depth:
                for f in inflight.pop(0):
                    f.result()
            inflight.append([op(f"blocks/{k}", layer, slot[k]) for k, _ in KINDS])
        for group in inflight:
            for f in group:
                f.result()
        return time.perf_counter() - t0

    def write(self) -> float:
        t0 = time.perf_counter()
        self._run(self.tier.write_)
        fsync_all(self.files())
        return time.perf_counter() - t0

    def read(self) -> float:
        evict(self.files())
        return self._run(self.tier.read_)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 GiB per pass, 4 rounds")
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="a directory on the disk to measure (created)"
    )
    parser.add_argument("--engine", default="direct", choices=("direct", "tensorstore"))
    args = parser.parse_args()
    gib, rounds = (2.0, 4) if args.quick else (args.gib, args.rounds)
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="nvme-bw-", dir=args.dir)
    try:
        nbytes = int(gib * (1 << 30)) // BLOCK * BLOCK
        raw, tier = Raw(work, nbytes), Tier(work, nbytes, args.engine)
        sides = {"raw": raw, "tier": tier}
        seconds = {(s, p): 0.0 for s in sides for p in ("first_write", "write", "read")}
        for name, side in sides.items():
            seconds[(name, "first_write")] = side.write()
        for r in range(rounds):
            order = list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]
            for phase in ("write", "read"):
                for name, side in order:
                    seconds[(name, phase)] += getattr(side, phase)()
        result = {
            "metric": "nvme_bandwidth",
            "dir": args.dir,
            "engine": args.engine,
            "raw_gib": raw.nbytes / 2**30,
            "tier_gib": tier.nbytes / 2**30,
            "rounds": rounds,
        }
        for name, side in sides.items():
            for phase, n in (("first_write", 1), ("write", rounds), ("read", rounds)):
                result[f"{name}_{phase}_GBps"] = round(
                    side.nbytes * n / seconds[(name, phase)] / 1e9, 3
                )
        for phase in ("read", "write", "first_write"):
            result[f"{phase}_ratio"] = round(
                result[f"tier_{phase}_GBps"] / result[f"raw_{phase}_GBps"], 3
            )
        tier.tier.close()
        for key, value in result.items():
            print(f"{key:24s} {value}")
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
