"""Checkpoint save / restore throughput against the raw disk, and how long save_async blocks
training.

    python benchmarks/checkpoint.py --quick [--dir DIR] [--compare-tensorstore]

Baselines, measured in the same run on the same directory and interleaved with the checkpoint runs
(the disk is shared and noisy, so every figure is the median of ``--repeats`` rounds; the ``*_best``
keys compare the best round of each side):

- raw write: one file of the checkpoint's size, O_DIRECT, aligned 1 MiB blocks from 4 threads, then
  fsync (the checkpoint's files are fsynced too);
- raw read: the same file, cold (posix_fadvise DONTNEED first), O_DIRECT, 1 MiB blocks, 4 threads,
  each into its reused 1 MiB buffer; reported beside it (not a ratio's baseline), the same reads
  into memory of the file's size, block b at its place (``raw_read_into_memory_gbps``: what a disk
  read into memory the size of the data, as a restore's, gets on this machine).

Checkpoint side, over the checkpoint's bytes: ``checkpoints.save`` wall time (until committed: every
file fsynced, renamed); ``checkpoints.restore`` (cold: DONTNEED on every file first), reported
twice: its read phase (opening the arrays and reading every slice into the state's memory: what the
format and the reader decide, ``restore_throughput_ratio``; that memory is fresh, so its first-touch
page faults fall in this phase, while the raw read reuses one buffer) and end to end (plus building
the empty state it fills: the layout and the allocation of every state array,
``restore_end_to_end_ratio``). The read phase is then timed once more, cold, into the restored
state's (now resident) memory (``restore_reread_ratio``): the reader's I/O alone, without
first-touch page faults. These are the default saves, checksummed (a crc32c per chunk, computed on
save and compared on restore); the same with ``checksums=False`` gives ``checksum_cost`` (save and
restore read time with checksums / without, paired by round; ``checksum_cost_save`` and
``checksum_cost_restore`` apart). Training: the same steps with no save, after ``save_async`` and
after ``save``; the time save_async blocks training is the call itself plus the time steps waited on
its write guard (the handle's stats), against the time ``save`` blocks. The extra time of the steps
running beside the background save (CPU contention, not blocking) is reported as
``async_slowdown_ratio``. With ``--compare-tensorstore`` every round also saves and restores through
tensorstore's zarr3 driver (the path taken without O_DIRECT), interleaved:
``save_tensorstore_ratio`` and ``restore_tensorstore_ratio``. The last line is JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoints  # noqa: E402
import checkpoints.manifest  # noqa: E402
import checkpoints.restore  # noqa: E402
import zinf_fn as zf  # noqa: E402
from checkpoints.arrays import TORCH_DTYPES  # noqa: E402
from layers import gpt  # noqa: E402
from zinf_fn.io import odirect  # noqa: E402

checkpoints_restore = sys.modules[
    "checkpoints.restore"
]  # the module (``checkpoints.restore`` is the function)

BLOCK = 1 << 20


def settle() -> None:
    """Start every timed phase from a quiet disk: earlier phases' dirty pages (and deletes)
    flushed."""
    os.sync()
    time.sleep(0.2)


def raw_write(path: str, nbytes: int, threads: int = 4) -> float:
    """Seconds to write ``nbytes`` with O_DIRECT in aligned 1 MiB blocks, fsync included."""
    buf = mmap.mmap(-1, BLOCK)
    buf.write(os.urandom(BLOCK))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    n = -(-nbytes // BLOCK)
    settle()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(
            ex.map(
                lambda i: [os.pwrite(fd, buf, b * BLOCK) for b in range(i, n, threads)],
                range(threads),
            )
        )
    os.fsync(fd)
    seconds = time.perf_counter() - t0
    os.close(fd)
    return seconds


def raw_read(path: str, threads: int = 4, into: mmap.mmap | None = None) -> float:
    """Seconds to read the file cold with O_DIRECT in 1 MiB blocks: each thread into its reused 1
    MiB buffer, or with ``into`` (page-aligned, the file's size rounded up to blocks) block b into
    its place there."""
    drop_cache(path)
    n = -(-os.path.getsize(path) // BLOCK)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    settle()

    def work(i):
        buf = mmap.mmap(-1, BLOCK) if into is None else None
        for b in range(i, n, threads):
            os.preadv(
                fd,
                [buf if into is None else memoryview(into)[b * BLOCK : (b + 1) * BLOCK]],
                b * BLOCK,
            )

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(work, range(threads)))
    seconds = time.perf_counter() - t0
    os.close(fd)
    return seconds


def drop_cache(root: str) -> None:
    """posix_fadvise(DONTNEED) on a file or on every file under a directory: the next read is
    cold."""
    paths = (
        [root]
        if os.path.isfile(root)
        else [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    )
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def fs_type(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            if os.path.abspath(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def make_state(args):
    cfg = gpt.Config(
        vocab_size=256, d_model=args.d_model, n_heads=8, n_layers=args.layers, seq_len=64
    )
    opt = zf.adamw(lr=1e-4)
    config = zf.Config(offload_params="cpu", offload_optimizer="cpu")
    return zf.init(gpt.model(cfg), opt, config), (gpt.model(cfg), opt, config), cfg


def batch(cfg, b: int = 4) -> dict:
    tokens = torch.randint(
        0, cfg.vocab_size, (b, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def steps(state, data, n: int):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        state, _ = zf.train_step(state, data)
        times.append(time.perf_counter() - t0)
    return state, times


def measure(args, root: str) -> dict:
    state, (model, opt, config), cfg = make_state(args)
    data = batch(cfg)
    state, _ = steps(state, data, 1)  # warm: first-step imports, buffers
    # threads, pools, first-use costs: a default (checksummed) save and restore, on each path
    for variant in (True, "ts") if args.compare_tensorstore else (True,):
        with tensorstore_path() if variant == "ts" else contextlib.nullcontext():
            timings = {"save": [], "save_ts": []}
            warm = _timed_save(state, os.path.join(root, "warm"), variant, timings)
            checkpoints.restore(warm, model, opt, config)
        shutil.rmtree(warm)
    r = {
        k: []
        for k in (
            "raw_w",
            "raw_r",
            "raw_r_mem",
            "save",
            "restore",
            "restore_io",
            "reread_io",
            "save_raw",
            "restore_io_raw",
            "save_ts",
            "restore_io_ts",
            "async_blocked",
            "async_steps",
            "sync_steps",
            "plain_steps",
            "async_guard",
            "async_call",
        )
    }
    raw = os.path.join(root, "raw.bin")
    nbytes = sum(
        e["shape"][0]
        * e["shape"][1]
        * TORCH_DTYPES[e["dtype"]].itemsize  # what a save writes: every array
        for e in checkpoints.manifest.build_manifest(state, "size", None)["arrays"]
    )
    memory = mmap.mmap(
        -1, -(-nbytes // BLOCK) * BLOCK
    )  # the raw read into memory of the data's size
    for i in range(
        args.repeats
    ):  # each round: a baseline right before the checkpoint run it is paired with
        r["raw_w"].append(raw_write(raw, nbytes))
        r["raw_r_mem"].append(
            raw_read(raw, into=memory)
        )  # (resident from the first round's read on)
        paths = {
            crc: _timed_save(state, os.path.join(root, f"ck{i}{crc}"), crc, r)
            for crc in (True, False)
        }
        if args.compare_tensorstore:
            with tensorstore_path():
                paths["ts"] = _timed_save(state, os.path.join(root, f"ck{i}ts"), "ts", r)
        r["raw_r"].append(raw_read(raw))
        for crc, path in paths.items():
            with tensorstore_path() if crc == "ts" else contextlib.nullcontext():
                _timed_restore(path, (model, opt, config), crc, r)
            shutil.rmtree(path)
        state = _training_rounds(state, data, root, i, args.steps, r)
    os.remove(raw)
    return {"bytes": nbytes, **r}


@contextlib.contextmanager
def tensorstore_path():
    """The slow twin: the O_DIRECT probes fail (as on a file system that refuses O_DIRECT), so
    chunks go through tensorstore's zarr3 driver."""
    probes = odirect.write_alignment, odirect.read_alignment
    odirect.write_alignment = odirect.read_alignment = lambda path: None
    try:
        yield
    finally:
        odirect.write_alignment, odirect.read_alignment = probes


# the default (checksums), checksums=False, the tensorstore path (checksums)
SUFFIX = {True: "", False: "_raw", "ts": "_ts"}


def _timed_save(state, path: str, variant, r: dict) -> str:
    settle()
    t0 = time.perf_counter()
    checkpoints.save(path, state, checksums=variant is not False)
    r["save" + SUFFIX[variant]].append(time.perf_counter() - t0)
    return path


def _timed_restore(path: str, target: tuple, variant, r: dict) -> None:
    drop_cache(path)
    settle()
    stats = {}
    t0 = time.perf_counter()
    state = checkpoints.restore(path, *target, stats=stats)
    if variant is True:
        r["restore"].append(time.perf_counter() - t0)
    r["restore_io" + SUFFIX[variant]].append(stats["open_s"] + stats["read_s"])
    if variant is True:  # the read phase again, cold, into the restored state's (resident) memory
        drop_cache(path)
        settle()
        t0 = time.perf_counter()
        checkpoints_restore.reread_(path, state)
        r["reread_io"].append(time.perf_counter() - t0)


def _training_rounds(state, data, root, i, n, r):
    """n steps with no save; save_async then n steps; save then n steps."""
    settle()
    state, t = steps(state, data, n)
    r["plain_steps"].append(sum(t))
    settle()
    handle = checkpoints.save_async(os.path.join(root, f"async{i}"), state)
    state, t = steps(state, data, n)
    handle.result()
    r["async_steps"].append(sum(t))
    r["async_call"].append(handle.stats["call_s"])
    r["async_guard"].append(handle.stats["guard_s"])
    r["async_blocked"].append(handle.stats["call_s"] + handle.stats["guard_s"])
    settle()
    t0 = time.perf_counter()
    checkpoints.save(os.path.join(root, f"sync{i}"), state)
    blocked = time.perf_counter() - t0
    state, t = steps(state, data, n)
    r["sync_steps"].append(blocked + sum(t))
    shutil.rmtree(os.path.join(root, f"async{i}"))
    shutil.rmtree(os.path.join(root, f"sync{i}"))
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="~360 MB of states, 5 rounds (default ~1.4 GB, 7)"
    )
    parser.add_argument(
        "--dir", default=None, help="directory on the disk to measure (default: next to the repo)"
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--compare-tensorstore",
        action="store_true",
        help="also save and restore through tensorstore's driver (the slow twin) in every round",
    )
    args = parser.parse_args()
    args.d_model, args.layers = (512, 8) if args.quick else (1024, 8)
    args.repeats = args.repeats or (5 if args.quick else 7)
    args.steps = 2
    base = args.dir or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(base, exist_ok=True)  # a --dir that does not exist yet is created
    root = tempfile.mkdtemp(prefix=".ckpt-bench-", dir=base)
    try:
        kind = fs_type(root)
        if kind in ("tmpfs", "ramfs"):
            raise SystemExit(f"{root} is on {kind}: measure a real disk (--dir)")
        r = measure(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(r, kind, args)


def paired(baseline: list, ours: list, digits: int = 3) -> float:
    """The median over rounds of baseline time / our time, each pair measured in the same round."""
    return round(statistics.median(b / o for b, o in zip(baseline, ours, strict=True)), digits)


def _sums(a: list, b: list) -> list:
    """Per round: a save's time plus its restore's."""
    return [x + y for x, y in zip(a, b, strict=True)]


def report(r: dict, kind: str, args) -> None:
    med = {k: statistics.median(v) for k, v in r.items() if isinstance(v, list) and v}
    gb = r["bytes"] / 1e9
    out = {
        "checkpoint_gb": round(gb, 3),
        "filesystem": kind,
        "repeats": args.repeats,
        "raw_write_gbps": round(gb / med["raw_w"], 3),
        "save_gbps": round(gb / med["save"], 3),
        "raw_read_gbps": round(gb / med["raw_r"], 3),
        "raw_read_into_memory_gbps": round(gb / med["raw_r_mem"], 3),
        "restore_read_gbps": round(gb / med["restore_io"], 3),
        "restore_end_to_end_gbps": round(gb / med["restore"], 3),
        "restore_reread_gbps": round(gb / med["reread_io"], 3),
        "save_no_checksums_gbps": round(gb / med["save_raw"], 3),
        "restore_read_no_checksums_gbps": round(gb / med["restore_io_raw"], 3),
        "save_s": round(med["save"], 3),
        "async_call_s": round(med["async_call"], 4),
        "async_guard_s": round(med["async_guard"], 4),
        "async_extra_step_s": round(med["async_steps"] - med["plain_steps"], 3),
        "sync_extra_step_s": round(med["sync_steps"] - med["plain_steps"], 3),
        "save_throughput_ratio": paired(r["raw_w"], r["save"]),
        "restore_throughput_ratio": paired(r["raw_r"], r["restore_io"]),
        "restore_end_to_end_ratio": paired(r["raw_r"], r["restore"]),
        "restore_reread_ratio": paired(r["raw_r"], r["reread_io"]),
        "checksum_cost": paired(
            _sums(r["save"], r["restore_io"]), _sums(r["save_raw"], r["restore_io_raw"])
        ),
        "checksum_cost_save": paired(r["save"], r["save_raw"]),
        "checksum_cost_restore": paired(r["restore_io"], r["restore_io_raw"]),
        **(
            {
                "save_tensorstore_ratio": paired(r["raw_w"], r["save_ts"]),
                "restore_tensorstore_ratio": paired(r["raw_r"], r["restore_io_ts"]),
            }
            if r["save_ts"]
            else {}
        ),
        "async_blocked_ratio": paired(r["async_blocked"], r["save"], 4),
        "async_slowdown_ratio": round((med["async_steps"] - med["plain_steps"]) / med["save"], 3),
        # best of the rounds on both sides: what each side reaches when the shared machine is quiet
        "save_throughput_ratio_best": round(min(r["raw_w"]) / min(r["save"]), 3),
        "restore_throughput_ratio_best": round(min(r["raw_r"]) / min(r["restore_io"]), 3),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    for k in ("save", "raw_w", "restore_io", "restore", "reread_io", "raw_r", "raw_r_mem"):
        print(f"{k:8s} rounds (s): {', '.join(f'{x:.3f}' for x in r[k])}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
