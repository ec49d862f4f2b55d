"""One GPT block's forward + backward, the ways the engine has done it and the way the reference
does.

    vjp        forward under no_grad, then recompute + pull back with torch.func.vjp
    pull_back  forward under no_grad, then recompute + pull back with plain autograd
    (scan.pull_back) tape       forward recorded without activations (tape.Tape), pull back later:
    the recompute stops early ref_es     the nn.Module twin under torch.utils.checkpoint
    (non-reentrant), early stop on (torch's default) ref_no_es  the same with early stop off

Variants alternate, min and 25th percentile over the rounds. Last line: JSON.

    python benchmarks/block_backward.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import optree
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from reference import RefGPT, load_tree  # noqa: E402

import zinf_fn as zf  # noqa: E402
from layers import gpt  # noqa: E402
from zinf_fn.scan import block_record, block_vjp  # noqa: E402
from zinf_fn.tree import flat_spec  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    return p.parse_args()


def variants(args: argparse.Namespace) -> dict[str, Callable[[], object]]:
    """One block's forward + backward, each way (see the module), on one input and cotangent."""
    cfg = gpt.Config(
        vocab_size=256, d_model=args.d_model, n_heads=8, n_layers=1, seq_len=args.seq_len
    )
    model = gpt.model(cfg)
    full = zf.gather_params(
        zf.init(model, zf.adamw(), zf.Config(param_dtype=torch.float32), seed=0)
    )
    params = full["blocks"][0]
    spec, leaves = flat_spec(params), optree.tree_leaves(params)

    def unflatten(ls):
        return optree.tree_unflatten(spec.treedef, list(ls))

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch_size, args.seq_len, args.d_model, generator=gen)
    dy = torch.randn(x.shape, generator=gen)

    def from_scratch(pull):
        with torch.no_grad():
            model.block.apply(params, x)
        return pull()

    def vjp():
        _, fn = torch.func.vjp(
            lambda p_leaves, xi: model.block.apply(unflatten(p_leaves), xi), list(leaves), x
        )
        return fn(dy)

    def tape():
        _, (t,) = block_record(model.block.apply, params, [x], "block", check=False)
        return t.pull_back([leaves, [x]], (dy,))

    ref = load_tree(RefGPT(cfg), full).block_modules()[0]

    def reference(early_stop: bool):
        xi = x.detach().requires_grad_()
        with set_checkpoint_early_stop(early_stop):
            checkpoint(ref, xi, use_reentrant=False).backward(dy)

    return {
        "vjp": lambda: from_scratch(vjp),
        "pull_back": lambda: from_scratch(
            lambda: block_vjp(model.block.apply, leaves, unflatten, x, (dy,))
        ),
        "tape": tape,
        "ref_es": lambda: reference(True),
        "ref_no_es": lambda: reference(False),
    }


def timed(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, dict[str, float]]:
    """Each of ``fns`` once to warm up, then ``rounds`` alternating rounds: min and 25th percentile,
    in ms."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    out = {}
    for k, ts in times.items():
        ts.sort()
        out[k] = {"min_ms": round(ts[0] * 1e3, 1), "p25_ms": round(ts[len(ts) // 4] * 1e3, 1)}
    return out


def main() -> None:
    args = parse_args()
    out = timed(variants(args), args.rounds)
    for k, row in out.items():
        print(f"{k:10s} min {row['min_ms']:7.1f} ms   p25 {row['p25_ms']:7.1f} ms")
    print(
        json.dumps(
            {
                "metric": "block_forward_backward_ms",
                "d_model": args.d_model,
                "tokens": args.batch_size * args.seq_len,
                "threads": torch.get_num_threads(),
                **out,
            }
        )
    )


if __name__ == "__main__":
    main()
