"""Host memory of an all-NVMe run: model-state bytes on disk over the RSS the engine adds at its peak.

An 8-layer ``d_model`` 2048 GPT (about 400M parameters; ``--quick``: 4 layers of 1024) with parameters
and optimizer on NVMe under ``--dir`` is initialised and trained for 3 steps. The peak RSS (Linux VmHWM,
reset to the current RSS just before ``zf.init`` through ``/proc/self/clear_refs``) is taken after
init and after the steps; the baseline is the RSS before ``zf.init`` (torch, the interpreter, the batch).
Last line: JSON with ``states_over_peak_rss`` = state bytes on disk / (peak RSS - baseline) (goal >= 8),
the same for init alone, and the bytes moved per parameter per step.

With ``--tiles T`` attention and the MLP are tiled T ways (``gpt.Config(attn_tiles=T, mlp_tiles=T)``):
each tile's weights are a unit of their own, so the layer-sized working memory shrinks about T-fold.

    python benchmarks/memory.py --quick [--dir DIR] [--tiles T]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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
        f.write("5")   # VmHWM := VmRSS


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="4 layers of d_model 1024")
    p.add_argument("--dir", default=None, help="where the NVMe tier's files go (created; default: a temp dir)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tiles", type=int, default=1,
                   help="tile attention and the MLP this many ways (memory-centric tiling: each tile is a unit)")
    args = p.parse_args()
    d, layers = (1024, 4) if args.quick else (2048, 8)
    cfg = gpt.Config(vocab_size=256, d_model=d, n_heads=d // 128, n_layers=layers, seq_len=128,
                     attn_tiles=args.tiles, mlp_tiles=args.tiles)
    parent = args.dir or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    run = tempfile.mkdtemp(prefix="zinf-memory-", dir=parent)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=gen) for _ in range(args.steps)]
    config = zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=run)
    try:
        baseline = status_bytes("VmRSS")
        reset_peak()
        t0 = time.perf_counter()
        state = zf.init(gpt.model(cfg), zf.adamw(lr=1e-4, weight_decay=0.1), config, seed=0)
        init_s, init_peak = time.perf_counter() - t0, status_bytes("VmHWM")
        on_disk = du(run)
        moved, params, step_s = [], 0, []
        for tokens in batches:
            t0 = time.perf_counter()
            state, m = zf.train_step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
            step_s.append(round(time.perf_counter() - t0, 2))
            moved.append(m["bytes_read.nvme"] + m["bytes_written.nvme"])
        peak = status_bytes("VmHWM")
        params = sum(t.numel() for t in _leaves(zf.gather_params(state, "param")))
        view(state).close()
    finally:
        shutil.rmtree(run, ignore_errors=True)
    print(f"GPT d_model {d}, {layers} layers, {params / 1e6:.0f}M params; states on disk {on_disk / MIB:.0f} MiB; "
          f"RSS before init {baseline / MIB:.0f} MiB, peak after init {init_peak / MIB:.0f} MiB, after "
          f"{args.steps} steps {peak / MIB:.0f} MiB; steps {step_s} s")
    print(json.dumps({
        "metric": "states_over_peak_rss", "states_over_peak_rss": round(on_disk / max(1, peak - baseline), 2),
        "init_states_over_peak_rss": round(on_disk / max(1, init_peak - baseline), 2),
        "state_bytes_on_disk": on_disk, "peak_rss_added_bytes": peak - baseline,
        "init_peak_rss_added_bytes": init_peak - baseline, "init_s": round(init_s, 1), "step_s": step_s,
        "bytes_per_param": round(moved[-1] / params, 2), "params": params, "tiles": args.tiles,
    }))


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree)


if __name__ == "__main__":
    main()
