"""``zf.calibrate``: this machine's speeds, measured in seconds and cached in a JSON file.

The disk is measured through the engine's own O_DIRECT file layer (``offload.files.DirectFiles``, the
NVMe tier's I/O threads), writing in-place row files as a step does; host copy bandwidth is a large
``Tensor.copy_``; FLOP/s is an fp32 matmul. The result is cached in ``<nvme_path>/zinf-calibration.json``
(delete the file to measure again); without an nvme_path, in ``~/.cache/zinf-fn/calibration.json``
with no disk figures.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import NamedTuple

import torch

from ..offload import odirect
from ..offload.buffers import aligned_empty
from ..offload.files import DirectFiles
from ..offload.nvme import IO_THREADS

CACHE_NAME = "zinf-calibration.json"
FILE_BYTES = 16 << 20   # one row file; FILES of them in flight at once, like a step's row reads


class Machine(NamedTuple):
    """Bandwidths in bytes per second, compute in FLOP/s (0.0 where not measured)."""

    disk_read_bps: float
    disk_write_bps: float
    copy_bps: float
    matmul_flops: float


def cache_path(nvme_path: str | None) -> str:
    """Where ``calibrate(nvme_path)`` keeps its result (a JSON file the user may delete)."""
    if nvme_path:
        return os.path.join(os.path.abspath(nvme_path), CACHE_NAME)
    return os.path.join(os.path.expanduser("~"), ".cache", "zinf-fn", "calibration.json")


def calibrate(nvme_path: str | None = None, refresh: bool = False, disk_bytes: int = 128 << 20) -> Machine:
    """This machine's disk read/write bandwidth under ``nvme_path``, host copy bandwidth and fp32 matmul
    FLOP/s; from the cache file (``cache_path``) unless it is missing or ``refresh``. Takes seconds."""
    path = cache_path(nvme_path)
    if not refresh and os.path.exists(path):
        with open(path) as f:
            return Machine(**json.load(f))
    read_bps, write_bps = _disk(nvme_path, disk_bytes) if nvme_path else (0.0, 0.0)
    machine = Machine(read_bps, write_bps, _copy_bps(), _matmul_flops())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(machine._asdict(), f, indent=1)
    return machine


def _disk(nvme_path: str, total: int) -> tuple[float, float]:
    """(read, write) bytes/s of ``total`` bytes in ``FILE_BYTES`` row files, overwritten in place then read."""
    root = tempfile.mkdtemp(prefix="zinf-calibrate-", dir=nvme_path)
    files = DirectFiles(IO_THREADS, "zinf-calibrate", odirect.write_alignment(root) is not None)
    n = max(1, total // FILE_BYTES)
    bufs = [aligned_empty(FILE_BYTES, torch.uint8).fill_(i) for i in range(n)]
    paths = [os.path.join(root, f"row{i}") for i in range(n)]
    label, what = ("write", "calibrate"), lambda: f"calibrating the disk under {nvme_path!r}"
    try:
        for p, b in zip(paths, bufs, strict=True):   # the first write creates the files (fallocate, rename)
            files.write(p, FILE_BYTES, b, what, label).result()   # sync: created
        t0 = time.perf_counter()
        for fut in [files.write(p, FILE_BYTES, b, what, label) for p, b in zip(paths, bufs, strict=True)]:
            fut.result()   # sync: every in-place write is done
        t1 = time.perf_counter()
        for fut in [files.read(p, FILE_BYTES, b, what, label) for p, b in zip(paths, bufs, strict=True)]:
            fut.result()   # sync: every read is done
        t2 = time.perf_counter()
    finally:
        files.close()
        shutil.rmtree(root, ignore_errors=True)
    return n * FILE_BYTES / max(t2 - t1, 1e-9), n * FILE_BYTES / max(t1 - t0, 1e-9)


def _copy_bps(numel: int = 32 << 20, repeats: int = 5) -> float:
    """Bytes/s of a host fp32 copy (read + write counted once each, as the engine's staging copies)."""
    src, dst = torch.ones(numel), torch.empty(numel)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return 2 * repeats * numel * 4 / max(time.perf_counter() - t0, 1e-9)


def _matmul_flops(n: int = 768, repeats: int = 6) -> float:
    """FLOP/s of an (n, n) @ (n, n) fp32 matmul on the CPU threads torch uses."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / max(time.perf_counter() - t0, 1e-9)
