"""``zf.calibrate``: this machine's speeds, measured in seconds and cached in a JSON file.

The disk is measured through the engine's own O_DIRECT file layer (``io.direct_files.DirectFiles``,
the NVMe tier's I/O threads), writing in-place row files as a step does; host copy bandwidth is a
large ``Tensor.copy_``; FLOP/s is an fp32 matmul. The result is cached in
``<nvme_path>/zinf-calibration.json`` (delete the file to measure again); without an nvme_path, in
``~/.cache/zinf-fn/calibration.json`` with no disk figures.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config import Config
from ..io import odirect
from ..io.buffers import aligned_empty
from ..io.direct_files import DirectFiles
from ..model import Model, Stage
from ..offload.nvme import IO_THREADS
from .compute import engine_threads

CACHE_NAME = "zinf-calibration.json"
FILE_BYTES = 16 << 20  # one row file; FILES of them in flight at once, like a step's row reads


class Machine(NamedTuple):
    """Bandwidths in bytes per second, compute in FLOP/s (0.0 where not measured); and what a step
    costs beyond the model (``_probe``): seconds per fetched unit and the resident bytes the runtime
    adds."""

    disk_read_bps: float
    disk_write_bps: float
    copy_bps: float
    matmul_flops: float
    unit_overhead_s: float = 0.0
    runtime_rss_bytes: float = 0.0
    disk_exposed: float = 1.0  # the share of a step's disk time not hidden behind its compute


def cache_path(nvme_path: str | None) -> str:
    """Where ``calibrate(nvme_path)`` keeps its result (a JSON file the user may delete)."""
    if nvme_path:
        return os.path.join(os.path.abspath(nvme_path), CACHE_NAME)
    return os.path.join(os.path.expanduser("~"), ".cache", "zinf-fn", "calibration.json")


def calibrate(
    nvme_path: str | None = None,
    refresh: bool = False,
    disk_bytes: int = 128 << 20,
    probe: bool = True,
) -> Machine:
    """This machine's disk read/write bandwidth under ``nvme_path``, host copy bandwidth and fp32
    matmul FLOP/s; from the cache file (``cache_path``) unless it is missing or ``refresh``. Takes
    seconds. ``probe=False``, where no cache file is: the bandwidths and FLOP/s only (a second or
    two), without the engine's probe runs (``unit_overhead_s``, ``runtime_rss_bytes`` and
    ``disk_exposed`` keep their defaults), and not cached."""
    path = cache_path(nvme_path)
    if not refresh and os.path.exists(path):
        with open(path) as f:
            return Machine(**json.load(f))
    if nvme_path:
        # as zf.init would: the run's directory may not exist yet
        os.makedirs(nvme_path, exist_ok=True)
    read_bps, write_bps = disk_bandwidth(nvme_path, disk_bytes) if nvme_path else (0.0, 0.0)
    machine = Machine(read_bps, write_bps, _copy_bps(), _matmul_flops())
    if not probe:
        return machine
    machine = machine._replace(**_probe(nvme_path, machine))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(machine._asdict(), f, indent=1)
    return machine


def disk_bandwidth(nvme_path: str, total: int = 128 << 20) -> tuple[float, float]:
    """(read, write) bytes/s under ``nvme_path`` of ``total`` bytes in ``FILE_BYTES`` row files,
    overwritten in place then read, through the NVMe tier's own file layer; a fraction of a second
    at the default size. ``calibrate`` caches it; the probe runs and benchmarks measure it again
    where the disk is shared."""
    root = tempfile.mkdtemp(prefix="zinf-calibrate-", dir=nvme_path)
    files = DirectFiles(IO_THREADS, "zinf-calibrate", odirect.write_alignment(root) is not None)
    n = max(1, total // FILE_BYTES)
    bufs = [aligned_empty(FILE_BYTES, torch.uint8).fill_(i) for i in range(n)]
    paths = [os.path.join(root, f"row{i}") for i in range(n)]
    label, what = ("write", "calibrate"), lambda: f"calibrating the disk under {nvme_path!r}"
    try:
        # the first write creates the files (fallocate, rename)
        for p, b in zip(paths, bufs, strict=True):
            files.write(p, FILE_BYTES, b, what, label).result()  # sync: created
        t0 = time.perf_counter()
        for fut in [
            files.write(p, FILE_BYTES, b, what, label) for p, b in zip(paths, bufs, strict=True)
        ]:
            fut.result()  # sync: every in-place write is done
        t1 = time.perf_counter()
        for fut in [
            files.read(p, FILE_BYTES, b, what, label) for p, b in zip(paths, bufs, strict=True)
        ]:
            fut.result()  # sync: every read is done
        t2 = time.perf_counter()
    finally:
        files.close()
        shutil.rmtree(root, ignore_errors=True)
    return n * FILE_BYTES / max(t2 - t1, 1e-9), n * FILE_BYTES / max(t1 - t0, 1e-9)


def _copy_bps(numel: int = 32 << 20, repeats: int = 5) -> float:
    """Bytes/s of a host fp32 copy (read + write counted once each, as the engine's staging
    copies)."""
    src, dst = torch.ones(numel), torch.empty(numel)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return 2 * repeats * numel * 4 / max(time.perf_counter() - t0, 1e-9)


def _matmul_flops(n: int = 1024, repeats: int = 3, trials: int = 5) -> float:
    """FLOP/s of an (n, n) @ (n, n) fp32 matmul on the CPU threads torch uses: the median of
    ``trials`` (what a step sees on a loaded machine, rather than its best moment)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds = []
    with engine_threads():  # the threads a step's matmuls run beside (``plan.compute``)
        a @ b
        for _ in range(trials):
            t0 = time.perf_counter()
            for _ in range(repeats):
                a @ b
            seconds.append(time.perf_counter() - t0)
    return 2 * n**3 * repeats / max(sorted(seconds)[trials // 2], 1e-9)


PROBE_WIDTH, PROBE_LAYERS, PROBE_VOCAB, PROBE_SEQ = 256, 6, 512, 64


class ProbeSteps(NamedTuple):
    """The steps of one probe run: ``warm`` untimed (the first a warm-up; the peak RSS is theirs),
    then ``timed``, each after the planner's prediction."""

    warm: int
    timed: int


PROBE_STEPS = {
    "memory": ProbeSteps(warm=6, timed=6),
    # NVMe: a step's disk share is a small difference of two noisy times
    "nvme": ProbeSteps(warm=6, timed=10),
}


def probe_model() -> Model:
    """A small pre-norm transformer (embedding, ``PROBE_LAYERS`` blocks of attention and a GELU MLP,
    a cross-entropy head): the kernels a language model's step runs, at a size where a step's time
    and memory beyond the planner's model are mostly the engine's and torch's own."""
    d = PROBE_WIDTH

    def w(gen, *shape):
        return torch.randn(*shape, generator=gen) * shape[0] ** -0.5

    def block_init(gen, i):
        return {
            "qkv": w(gen, d, 3 * d),
            "o": w(gen, d, d),
            "up": w(gen, d, 4 * d),
            "down": w(gen, 4 * d, d),
        }

    def block(p, x):  # x: (B, T, d)
        q, k, v = (
            t.unflatten(-1, (4, d // 4)).transpose(1, 2)
            for t in F.layer_norm(x, (d,)).matmul(p["qkv"]).chunk(3, -1)
        )  # (B, heads, T, d / heads)
        x = (
            x
            + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
            @ p["o"]
        )
        return x + F.gelu(F.layer_norm(x, (d,)) @ p["up"]) @ p["down"]

    def head(p, x, b):
        return F.cross_entropy((F.layer_norm(x, (d,)) @ p["w"]).flatten(0, 1), b["y"].flatten())

    return Model(
        Stage(lambda g: {"e": w(g, PROBE_VOCAB, d)}, lambda p, b: p["e"][b["x"]]),
        Stage(block_init, block),
        Stage(lambda g: {"w": w(g, d, PROBE_VOCAB)}, head),
        PROBE_LAYERS,
    )


def probe_batch() -> dict:
    tokens = torch.randint(
        0, PROBE_VOCAB, (4, PROBE_SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def _probe(nvme_path: str | None, machine: Machine) -> dict:
    """Run the probe model in fresh interpreters (``python -m zinf_fn.planner.probe``), in memory
    and (with a disk) on NVMe, each for its ``PROBE_STEPS``: the seconds per fetched unit beyond the
    model, the share of the disk time a step does not hide, and the resident bytes the runtime adds
    (the larger of the two runs)."""
    import subprocess
    import sys

    def run(placement: str, machine: Machine) -> dict:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "zinf_fn.planner.probe",
                placement,
                nvme_path or "",
                json.dumps(machine),
                json.dumps(PROBE_STEPS[placement]),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    memory = run("memory", machine)
    if not nvme_path:
        return {
            "unit_overhead_s": memory["unit_overhead_s"],
            "runtime_rss_bytes": memory["runtime_rss_bytes"],
        }
    disk = run("nvme", machine._replace(unit_overhead_s=memory["unit_overhead_s"]))
    return {
        "unit_overhead_s": memory["unit_overhead_s"],
        "disk_exposed": disk["disk_exposed"],
        "runtime_rss_bytes": max(memory["runtime_rss_bytes"], disk["runtime_rss_bytes"]),
    }


def probe_config(placement: str, nvme_path: str | None) -> Config:
    """The probe's placement: "memory" (every state in memory) or "nvme" (every state on NVMe)."""
    if placement == "nvme":
        return Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=nvme_path)
    return Config()
