"""Checkpoints with states on a CUDA device: one short run, one JSON line per check.

    python benchmarks/checkpoint_gpu_check.py [--dir DIR]     # needs a CUDA device (falls back to
    CPU)

Checks (each prints {"check": name, "ok": bool, ...}):
  deterministic        two uninterrupted runs on the device agree bitwise (else resume cannot be
  checked) resume_<placement>   5 steps straight == 3 steps, save, restore, 2 steps: losses and
  every state row async_<placement>    save_async with a one-row staging budget, 3 steps at once:
  the checkpoint holds
                       the rows of the call, bitwise (device rows copied to host before they change)
  device_to_host       a checkpoint of device-resident states restored on placement cpu: rows
  bitwise
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoints  # noqa: E402
import zinf_fn as zf  # noqa: E402
from layers import gpt  # noqa: E402
from zinf_fn.state import view  # noqa: E402

CFG = gpt.Config(vocab_size=256, d_model=256, n_heads=4, n_layers=4, seq_len=128)


def report(name: str, ok: bool, **info) -> None:
    print(json.dumps({"check": name, "ok": bool(ok), **info}), flush=True)


def batches(n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len + 1), generator=gen)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def config(placement: str, nvme_dir: str) -> zf.Config:
    return zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        nvme_path=nvme_dir if placement == "nvme" else None,
    )


def opt():
    return zf.adamw(lr=1e-3, weight_decay=0.1)


def train(state, data):
    losses = []
    for batch in data:
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
    return state, losses


def rows(state) -> dict[str, torch.Tensor]:
    """Host copies of every saved state row."""
    v = view(state)
    out = {}
    for gname, group in v.groups.items():
        for kind in v.kinds():  # param, master, opt.<i>
            for row in range(group.rows):
                buf = torch.empty(v.shard_numel(gname), dtype=v.dtype(kind), device=v.device(kind))
                v.read_(kind, gname, row, buf).result()  # sync: read
                out[f"{gname}/{kind}/{row}"] = buf.cpu()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def differing(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def check_resume(root: str, placement: str, nvme: str) -> None:
    data = batches(5)
    straight, want = train(zf.init(gpt.model(CFG), opt(), config(placement, nvme + "/a")), data)
    half, first = train(zf.init(gpt.model(CFG), opt(), config(placement, nvme + "/b")), data[:3])
    path = checkpoints.save(os.path.join(root, f"resume_{placement}"), half)
    back = checkpoints.restore(path, gpt.model(CFG), opt(), config(placement, nvme + "/c"))
    back, rest = train(back, data[3:])
    bad = differing(rows(back), rows(straight))
    report(
        f"resume_{placement}",
        first + rest == want and not bad,
        losses_equal=first + rest == want,
        rows_differing=bad[:5],
        device=str(view(half).device("master")),
    )


def check_async(root: str, placement: str, nvme: str) -> None:
    state, _ = train(zf.init(gpt.model(CFG), opt(), config(placement, nvme + "/d")), batches(3))
    at_save = rows(state)
    handle = checkpoints.save_async(
        os.path.join(root, f"async_{placement}"), state, staging_bytes=1
    )
    state, _ = train(state, batches(6)[3:])
    handle.result()
    back = checkpoints.restore(handle.path, gpt.model(CFG), opt(), config(placement, nvme + "/e"))
    bad = differing(rows(back), at_save)
    changed = differing(rows(state), at_save)
    report(
        f"async_{placement}",
        not bad and bool(changed),
        rows_differing=bad[:5],
        rows_changed_by_later_steps=len(changed),
        guard_copies=handle.stats["guard_copies"],
        guard_s=round(handle.stats["guard_s"], 4),
    )


def check_device_to_host(root: str) -> None:
    state, _ = train(zf.init(gpt.model(CFG), opt(), config("none", "")), batches(2))
    path = checkpoints.save(os.path.join(root, "d2h"), state)
    back = checkpoints.restore(path, gpt.model(CFG), opt(), config("cpu", ""))
    bad = differing(rows(back), rows(state))
    report("device_to_host", not bad, rows_differing=bad[:5])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)  # a --dir that does not exist yet is created
    root = tempfile.mkdtemp(prefix="zinf-ckpt-gpu-", dir=args.dir)
    try:
        report(
            "cuda_available",
            torch.cuda.is_available(),
            device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        )
        data = batches(3)
        a = train(zf.init(gpt.model(CFG), opt(), config("none", "")), data)[1]
        b = train(zf.init(gpt.model(CFG), opt(), config("none", "")), data)[1]
        report("deterministic", a == b, losses=a)
        for placement in ("none", "cpu", "nvme"):
            nvme = os.path.join(root, f"nvme_{placement}")
            for sub in "abcde":
                os.makedirs(os.path.join(nvme, sub))
            check_resume(root, placement, nvme)
            check_async(root, placement, nvme)
        check_device_to_host(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
