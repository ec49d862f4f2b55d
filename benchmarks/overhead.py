"""Engine overhead: step time of zinf-fn (placement none) over plain PyTorch doing the same
arithmetic.

The reference recomputes each block in backward (torch.utils.checkpoint, non-reentrant), as the
engine does; a second ratio is against the reference without recompute. Runs alternate in one
process after warm-up, so both see the same machine state. Last line: JSON.

    python benchmarks/overhead.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from reference import RefGPT, load_tree, make_batches  # noqa: E402

import zinf_fn as zf  # noqa: E402
from layers import gpt  # noqa: E402


def reference_step(model, opt, batch, recompute: bool) -> float:
    opt.zero_grad(set_to_none=True)
    x = model.embed(batch["inputs"])
    for block in model.block_modules():
        x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
    loss = model.head_loss(x, batch["targets"])
    loss.backward()
    opt.step()
    return float(loss.detach())


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer steps (under a minute here)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    args = p.parse_args()
    rounds = 3 if args.quick else 8
    cfg = gpt.Config(
        vocab_size=256, d_model=args.d_model, n_heads=8, n_layers=args.layers, seq_len=args.seq_len
    )
    opt_kw = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    state = zf.init(
        gpt.model(cfg), zf.adamw(**opt_kw), zf.Config(param_dtype=torch.float32), seed=0
    )
    ref = load_tree(RefGPT(cfg), zf.gather_params(state))
    ref_opt = torch.optim.AdamW(
        ref.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True
    )  # the kernel the engine runs: the same arithmetic
    data = make_batches(cfg, 2 * rounds + 2, args.batch_size, seed=0)
    box = [state]

    def engine_step(batch):
        box[0], _ = zf.train_step(box[0], batch)

    engine_step(data[0])  # warm-up: allocations, thread start
    reference_step(ref, ref_opt, data[0], True)
    reference_step(ref, ref_opt, data[0], False)
    times = {"engine": [], "recompute": [], "plain": []}
    for r in range(rounds):
        batch = data[1 + r]
        times["engine"].append(timed(lambda b=batch: engine_step(b)))
        times["recompute"].append(timed(lambda b=batch: reference_step(ref, ref_opt, b, True)))
        times["plain"].append(timed(lambda b=batch: reference_step(ref, ref_opt, b, False)))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"config: d_model {args.d_model}, {args.layers} layers, seq {args.seq_len}, batch "
        f"{args.batch_size}, "
        f"fp32 on {torch.get_num_threads()} threads, {rounds} alternating rounds (median)"
    )
    for k, v in med.items():
        print(f"  {k:10s} {v * 1000:8.1f} ms/step   all: {[round(t * 1000) for t in times[k]]}")
    ratio = round(med["engine"] / med["recompute"], 3)
    print(
        json.dumps(
            {
                "metric": "step_time_ratio_engine_over_torch",
                "value": ratio,
                "vs_no_recompute": round(med["engine"] / med["plain"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
