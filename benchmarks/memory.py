"""Host memory of an all-NVMe run: model-state bytes on disk over the RSS the engine adds at its
peak.

An 8-layer ``d_model`` 2048 GPT (about 400M parameters; ``--quick``: 4 layers of 1024) with
parameters and optimizer on NVMe under ``--dir`` is initialised and trained for 3 steps. The peak
RSS (Linux VmHWM, reset to the current RSS just before ``zf.init`` through
``/proc/self/clear_refs``) is taken after init and after the steps; the baseline is the RSS before
``zf.init`` (torch, the interpreter, the batch). Last line: JSON with ``states_over_peak_rss`` =
state bytes on disk / (peak RSS - baseline) (goal >= 8), the same for init alone, and the bytes
moved per parameter per step.

With ``--tiles T`` attention and the MLP are tiled T ways (``gpt.Config(attn_tiles=T,
mlp_tiles=T)``): each tile's weights are a unit of their own, so the layer-sized working memory
shrinks about T-fold. The untiled model's steps then run too (in a child process, after this run)
and the JSON gives them beside the tiled ones (``untiled_step_s``, ``tiled_over_untiled_step``:
medians of the steps after the first).

    python benchmarks/memory.py --quick [--dir DIR] [--tiles T]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import zinf_fn as zf
from layers import gpt
from zinf_fn.state import view

MIB = 1 << 20


def status_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="4 layers of d_model 1024")
    p.add_argument(
        "--dir", default=None, help="where the NVMe tier's files go (created; default: a temp dir)"
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--tiles",
        type=int,
        default=1,
        help="tile attention and the MLP this many ways (memory-centric tiling: each tile is a "
        "unit); > 1 also times the untiled model's steps, in a child process after this run",
    )
    p.add_argument(
        "--no-baseline", action="store_true", help=argparse.SUPPRESS
    )  # the child: no child of its own
    return p.parse_args(argv)


def measure(args) -> dict:
    """Init and ``args.steps`` steps of the all-NVMe GPT in this process: RSS, disk bytes, step
    seconds."""
    d, layers = (1024, 4) if args.quick else (2048, 8)
    cfg = gpt.Config(
        vocab_size=256,
        d_model=d,
        n_heads=d // 128,
        n_layers=layers,
        seq_len=128,
        attn_tiles=args.tiles,
        mlp_tiles=args.tiles,
    )
    parent = args.dir or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    run = tempfile.mkdtemp(prefix="zinf-memory-", dir=parent)
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=gen)
        for _ in range(args.steps)
    ]
    config = zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=run)
    out = {"d": d, "layers": layers, "baseline": status_bytes("VmRSS"), "step_s": [], "moved": []}
    try:
        reset_peak()
        t0 = time.perf_counter()
        state = zf.init(gpt.model(cfg), zf.adamw(lr=1e-4, weight_decay=0.1), config, seed=0)
        out.update(
            init_s=time.perf_counter() - t0, init_peak=status_bytes("VmHWM"), on_disk=du(run)
        )
        for tokens in batches:
            t0 = time.perf_counter()
            state, m = zf.train_step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
            out["step_s"].append(round(time.perf_counter() - t0, 2))
            out["moved"].append(m["bytes_read.nvme"] + m["bytes_written.nvme"])
        out["peak"] = status_bytes("VmHWM")
        out["params"] = sum(t.numel() for t in _leaves(zf.gather_params(state, "param")))
        view(state).close()
    finally:
        shutil.rmtree(run, ignore_errors=True)
    return out


def untiled_steps(args) -> list[float]:
    """The untiled model's step seconds: this script with ``--tiles 1`` in a fresh process (its RSS
    its own)."""
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--tiles",
        "1",
        "--steps",
        str(args.steps),
        "--no-baseline",
    ]
    argv += (["--quick"] if args.quick else []) + (["--dir", args.dir] if args.dir else [])
    root = os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))
    )  # this checkout's packages in the child too
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
    }
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])["step_s"]


def main() -> None:
    args = parse_args()
    r = measure(args)
    on_disk, peak, init_peak, baseline = r["on_disk"], r["peak"], r["init_peak"], r["baseline"]
    print(
        f"GPT d_model {r['d']}, {r['layers']} layers, {r['params'] / 1e6:.0f}M params; states on "
        "disk "
        f"{on_disk / MIB:.0f} MiB; RSS before init {baseline / MIB:.0f} MiB, peak after init "
        f"{init_peak / MIB:.0f}"
        f" MiB, after {args.steps} steps {peak / MIB:.0f} MiB; steps {r['step_s']} s",
        flush=True,
    )
    result = {
        "metric": "states_over_peak_rss",
        "states_over_peak_rss": round(on_disk / max(1, peak - baseline), 2),
        "init_states_over_peak_rss": round(on_disk / max(1, init_peak - baseline), 2),
        "state_bytes_on_disk": on_disk,
        "peak_rss_added_bytes": peak - baseline,
        "init_peak_rss_added_bytes": init_peak - baseline,
        "init_s": round(r["init_s"], 1),
        "step_s": r["step_s"],
        "bytes_per_param": round(r["moved"][-1] / r["params"], 2),
        "params": r["params"],
        "tiles": args.tiles,
    }
    if (
        args.tiles > 1 and not args.no_baseline
    ):  # the steps after the first (the warm-up), median of each
        untiled = untiled_steps(args)
        result.update(
            untiled_step_s=untiled,
            tiled_over_untiled_step=round(
                statistics.median(r["step_s"][1:] or r["step_s"])
                / statistics.median(untiled[1:] or untiled),
                3,
            ),
        )
    print(json.dumps(result))


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree)


if __name__ == "__main__":
    main()
