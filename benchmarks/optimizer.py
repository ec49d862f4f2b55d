"""Host optimizer throughput: the engine's AdamW update of one shard against torch's kernels and a copy.

On ``--numel`` fp32 elements (32M: a 128 MB shard, far past every cache) each round times, in turn:

- ``engine``: ``zf.adamw(...).update`` of (grad, (m, v), master) with a decay mask over half the shard,
  as the engine's updater calls it (its input gradient is a fresh copy each time: the update may use
  it as scratch), then the 16-bit copy written from the master (``engine_with_copy16``);
- ``torch_fused``: ``torch.optim.AdamW(fused=True)`` on the same sizes (decay on one half, none on the
  other: two param groups);
- ``torch_foreach``: the same with ``foreach=True``;
- ``copy``: ``dst.copy_(src)`` of the shard (reads 4 bytes and writes 4 bytes per element).

The rounds alternate so every variant sees the same machine. AdamW touches 28 bytes per element (reads
param, grad, m and v; writes param, m and v), the 16-bit copy 2 more. Last line: JSON with
``vs_torch_fused`` (engine update throughput over fused; goal >= 1.0), ``vs_torch_foreach`` and
``vs_copy_bandwidth`` (the engine's bytes touched per second over the copy's; goal >= 0.9).

    python benchmarks/optimizer.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import zinf_fn as zf

HYPER = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
ADAMW_BYTES = 28   # per element: read param, grad, m, v; write param, m, v (fp32)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def engine_variant(n: int, gen: torch.Generator):
    """(update, update + 16-bit copy) closures over one shard, its moments and a reused gradient."""
    opt = zf.adamw(**HYPER)
    master = torch.randn(n, generator=gen)
    state = opt.init(master)
    grad_src, grad = torch.randn(n, generator=gen), torch.empty(n)
    param16 = torch.empty(n, dtype=torch.bfloat16)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[: n // 2] = True
    step = [0]

    def update():
        nonlocal master, state
        master, state = opt.update(grad, state, master, step[0], decay_mask=mask)
        step[0] += 1

    def refill():
        grad.copy_(grad_src)   # outside the timing: the update consumes its gradient

    def with_copy():
        update()
        param16.copy_(master)

    return update, with_copy, refill


def torch_variant(n: int, gen: torch.Generator, **impl):
    halves = [torch.nn.Parameter(torch.randn(size, generator=gen)) for size in (n // 2, n - n // 2)]
    for p in halves:
        p.grad = torch.randn(p.shape, generator=gen)
    groups = [{"params": [halves[0]], "weight_decay": HYPER["weight_decay"]},
              {"params": [halves[1]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=HYPER["lr"], betas=(HYPER["b1"], HYPER["b2"]), eps=HYPER["eps"], **impl)
    return opt.step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer rounds (about 20 s here)")
    p.add_argument("--numel", type=int, default=32 << 20)
    args = p.parse_args()
    rounds = 5 if args.quick else 15
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    update, with_copy, refill = engine_variant(n, gen)
    src, dst = torch.randn(n, generator=gen), torch.empty(n)
    variants = {"engine": update, "engine_with_copy16": with_copy,
                "torch_fused": torch_variant(n, gen, fused=True), "torch_foreach": torch_variant(n, gen, foreach=True),
                "copy": lambda: dst.copy_(src)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds + 1):   # round 0 warms up: first touches, kernel selection
        for name, fn in variants.items():
            refill()
            t = timed(fn)
            if r:
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: n / v / 1e6 for k, v in med.items()}   # M elements / s
    copy_gbs = 8 * n / med["copy"] / 1e9
    print(f"{n} fp32 elements, {torch.get_num_threads()} threads, {rounds} alternating rounds (median)")
    for k in variants:
        print(f"  {k:20s} {med[k] * 1000:8.2f} ms   {rate[k]:8.0f} M elem/s   all: "
              f"{[round(t * 1000, 1) for t in times[k]]}")
    engine_gbs = ADAMW_BYTES * n / med["engine"] / 1e9
    print(json.dumps({
        "metric": "host_adamw_throughput", "vs_torch_fused": round(med["torch_fused"] / med["engine"], 3),
        "vs_torch_foreach": round(med["torch_foreach"] / med["engine"], 3),
        "vs_copy_bandwidth": round(engine_gbs / copy_gbs, 3),
        "with_copy16_vs_torch_fused": round(med["torch_fused"] / med["engine_with_copy16"], 3),
        "engine_m_params_s": round(rate["engine"]), "torch_fused_m_params_s": round(rate["torch_fused"]),
        "copy_gb_s": round(copy_gbs, 2), "engine_gb_s": round(engine_gbs, 2),
    }))


if __name__ == "__main__":
    main()
