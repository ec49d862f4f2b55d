"""Host optimizer throughput: the engine's AdamW update of one shard against torch's kernels and a
copy.

On ``--numel`` fp32 elements (32M: a 128 MB shard, far past every cache), all on the same four
buffers (param, grad, m, v; see ``shard_buffers``), each round times, in turn:

- ``engine``: ``zf.adamw(...).update`` of (grad, (m, v), master) with weight decay on half the
  shard, as the engine's updater calls it (the same gradient every round: the fused update only
  reads it), then the 16-bit copy written from the master (``engine_with_copy16``);
- ``torch_fused``: ``torch.optim.AdamW(fused=True)`` over the two halves (decay on one, none on the
  other: two param groups);
- ``torch_foreach``: the same with ``foreach=True``;
- ``copy``: ``dst.copy_(grad)`` (reads 4 bytes and writes 4 bytes per element);
- compressed moments (``optim.compressed.adamw_piece_``, weight decay on every element, its own
  moment buffers): ``int8`` (fp32 master), ``int8_remainder`` (bf16 copy + 16-bit remainder master,
  the copy written), ``bf16`` (fp32 master, bf16 moments with stochastic rounding);
- ``bitsandbytes_8bit``: bitsandbytes' CPU ``AdamW8bit`` step on the same param and grad buffers
  (decay on every element; its own 8-bit states). ``--no-compressed`` leaves these out.

The rounds alternate, each starting one variant later, so every variant sees the same machine.
AdamW touches 28 bytes per element (reads
param, grad, m and v; writes param, m and v), the 16-bit copy 2 more. Last line: JSON with
``vs_torch_fused`` (engine update throughput over fused; goal >= 1.0), ``vs_torch_foreach`` and
``vs_copy_bandwidth`` (the engine's bytes touched per second over the copy's; goal >= 0.9), and
``int8_vs_bitsandbytes`` (int8 update throughput over bitsandbytes' AdamW8bit; goal >= 1.0),
``int8_vs_torch_fused``, ``int8_remainder_vs_torch_fused`` and ``bf16_vs_torch_fused``
(goal >= 1.0), and each compressed variant's bytes touched per second over the copy's
(``int8_vs_copy_bandwidth``, ...; ``COMPRESSED_BYTES``; goal >= 0.7).

    python benchmarks/optimizer.py --quick
    python benchmarks/optimizer.py --clock cpu     # the process's CPU time: less moved by other
    jobs' load python benchmarks/optimizer.py --clock cpu --threads 1   # one core's cost per
    element

With ``--clock cpu`` each variant is timed by the CPU time of all the process's threads
(``time.process_time``) instead of the wall clock: on a machine shared with other jobs a variant's
wall time counts the time its threads wait for a core, which the CPU time does not (cache and memory
contention still count; a thread spinning at a parallel region's barrier for a descheduled sibling
does: ``--threads 1`` leaves that out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import zinf_fn as zf
from zinf_fn.optim import DecaySpans

HYPER = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
ADAMW_BYTES = 28  # per element: read param, grad, m, v; write param, m, v (fp32)


CLOCKS = {
    "wall": time.perf_counter,
    "cpu": time.process_time,
}  # --clock: cpu is every thread's CPU time


def shard_buffers(n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(param, grad, m, v): one flat fp32 buffer each, as a tier row is. Every variant updates these
    same buffers in turn: on this machine the fused kernel's speed on two equal-sized sets of
    buffers differed by up to 1.3x with where they were allocated, so variants on separate buffers
    measure the allocations, not the code."""
    return (
        torch.randn(n, generator=gen),
        torch.randn(n, generator=gen),
        torch.zeros(n),
        torch.zeros(n),
    )


def engine_variant(buffers: tuple[torch.Tensor, ...]):
    """(update, update + 16-bit copy) closures over one shard, its moments and a gradient."""
    opt = zf.adamw(**HYPER)
    master, grad, m, v = buffers
    n = master.numel()
    param16 = torch.empty(n, dtype=torch.bfloat16)
    decay = DecaySpans(
        ((0, n // 2),), n
    )  # decay on the first half, as the torch variants' two groups
    step = [0]

    def update():
        opt.update(grad, (m, v), master, step[0], decay)  # in place
        step[0] += 1

    def with_copy():
        update()
        param16.copy_(master)

    return update, with_copy


def torch_variant(buffers: tuple[torch.Tensor, ...], **impl):
    """torch.optim.AdamW's step over the two halves of the same buffers (two param groups: decay on
    the first half), its state set to views of them before the first step."""
    param, grad, m, v = buffers
    n = param.numel()
    cuts = [(0, n // 2), (n // 2, n)]
    halves = [
        torch.nn.Parameter(param[lo:hi]) for lo, hi in cuts
    ]  # views: the buffer is the parameter
    groups = [
        {"params": [halves[0]], "weight_decay": HYPER["weight_decay"]},
        {"params": [halves[1]], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups, lr=HYPER["lr"], betas=(HYPER["b1"], HYPER["b2"]), eps=HYPER["eps"], **impl
    )
    for p, (lo, hi) in zip(halves, cuts, strict=True):
        p.grad = grad[lo:hi]
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": m[lo:hi], "exp_avg_sq": v[lo:hi]}
    return opt.step


def compressed_variants(buffers: tuple[torch.Tensor, ...]) -> dict:
    """The compressed-moment updates and bitsandbytes' AdamW8bit on the shard's param and grad
    buffers."""
    from zinf_fn.optim import compressed, formats

    master, grad, _, _ = buffers
    n = master.numel()
    hyper = compressed.AdamWHyper(HYPER["b1"], HYPER["b2"], HYPER["eps"], HYPER["weight_decay"])
    remainder = compressed.init_master(formats.MasterFormat("remainder"), master)
    moments = {k: compressed.init_moments(formats.MomentsFormat(k), n) for k in ("int8", "bf16")}
    int8_rem = compressed.init_moments(formats.MomentsFormat("int8"), n)
    step = [0]

    def piece(m, mom):
        def update():
            compressed.adamw_piece_(grad, m, mom, hyper, step[0], HYPER["lr"], unit_seed=1)
            step[0] += 1

        return update

    out = {
        "int8": piece(master, moments["int8"]),
        "int8_remainder": piece(remainder, int8_rem),
        "bf16": piece(master, moments["bf16"]),
    }
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        print(f"bitsandbytes: not measured ({e})")
        return out
    param = torch.nn.Parameter(master)  # a view: the buffer is the parameter
    param.grad = grad
    opt = bnb.optim.AdamW8bit(
        [param],
        lr=HYPER["lr"],
        betas=(HYPER["b1"], HYPER["b2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
    )
    out["bitsandbytes_8bit"] = opt.step
    return out


# bytes per element a compressed update touches: the int8 codes (1 + 1 read and written) and a scale
# per 256 elements for each moment; the gradient read; the fp32 master (4 read, 4 written) or the
# bf16 copy and 16-bit remainder of the remainder master (2 + 2 read and written), so 16 for both
# int8 variants; bf16 moments read and write 2 + 2 beside the fp32 master: 20
COMPRESSED_BYTES = {"int8": 16 + 16 / 256, "int8_remainder": 16 + 16 / 256, "bf16": 20}


def compressed_figures(med: dict, copy_gbs: float, n: int) -> dict:
    """The JSON keys of the compressed variants: throughput ratios of the same run, over torch's
    fused AdamW and (bytes touched per second, ``COMPRESSED_BYTES``) over the copy."""
    out = {}
    for k in ("int8", "int8_remainder", "bf16"):
        if k in med:
            out[f"{k}_vs_torch_fused"] = round(med["torch_fused"] / med[k], 3)
            gbs = COMPRESSED_BYTES[k] * n / med[k] / 1e9
            out[f"{k}_vs_copy_bandwidth"] = round(gbs / copy_gbs, 3)
    if "bitsandbytes_8bit" in med:
        out["int8_vs_bitsandbytes"] = round(med["bitsandbytes_8bit"] / med["int8"], 3)
    return out


def timed_rounds(variants: dict, rounds: int, clocks: dict) -> dict[str, dict[str, list[float]]]:
    """Each variant's time on each of ``clocks`` (name: clock) in each of ``rounds`` rounds, after
    a warm-up round (first touches, kernel selection); each round starts one variant later, so
    every variant sees the same machine."""
    times = {k: {c: [] for c in clocks} for k in variants}
    names = list(variants)
    for r in range(rounds + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = {c: clock() for c, clock in clocks.items()}
            variants[name]()
            if r:
                for c, clock in clocks.items():
                    times[name][c].append(clock() - start[c])
    return times


def alternating_rounds(variants: dict, rounds: int, clock) -> dict[str, list[float]]:
    """``timed_rounds`` on the one ``clock``: each variant's time in each round."""
    times = timed_rounds(variants, rounds, {"clock": clock})
    return {k: t["clock"] for k, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer rounds (about 20 s here)")
    p.add_argument("--numel", type=int, default=32 << 20)
    p.add_argument(
        "--no-compressed", action="store_true", help="leave out the compressed-moment variants"
    )
    p.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall", help="what times a variant (see above)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's and the kernels' threads (default: torch's)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 5 if args.quick else 15
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    buffers = shard_buffers(n, gen)
    update, with_copy = engine_variant(buffers)
    src, dst = buffers[1], torch.empty(n)  # the copy reads the gradient buffer
    variants = {
        "engine": update,
        "engine_with_copy16": with_copy,
        "torch_fused": torch_variant(buffers, fused=True),
        "torch_foreach": torch_variant(buffers, foreach=True),
        "copy": lambda: dst.copy_(src),
    }
    if not args.no_compressed:
        variants.update(compressed_variants(buffers))
    times = alternating_rounds(variants, rounds, CLOCKS[args.clock])
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: n / v / 1e6 for k, v in med.items()}  # M elements / s
    copy_gbs = 8 * n / med["copy"] / 1e9
    print(
        f"{n} fp32 elements, {torch.get_num_threads()} threads, {rounds} alternating rounds "
        "(median, "
        f"{args.clock} clock)"
    )
    for k in variants:
        print(
            f"  {k:20s} {med[k] * 1000:8.2f} ms   {rate[k]:8.0f} M elem/s   all: "
            f"{[round(t * 1000, 1) for t in times[k]]}"
        )
    engine_gbs = ADAMW_BYTES * n / med["engine"] / 1e9
    print(
        json.dumps(
            {
                "metric": "host_adamw_throughput",
                "vs_torch_fused": round(med["torch_fused"] / med["engine"], 3),
                "vs_torch_foreach": round(med["torch_foreach"] / med["engine"], 3),
                "vs_copy_bandwidth": round(engine_gbs / copy_gbs, 3),
                "with_copy16_vs_torch_fused": round(
                    med["torch_fused"] / med["engine_with_copy16"], 3
                ),
                "engine_m_params_s": round(rate["engine"]),
                "torch_fused_m_params_s": round(rate["torch_fused"]),
                "copy_gb_s": round(copy_gbs, 2),
                "engine_gb_s": round(engine_gbs, 2),
                **compressed_figures(med, copy_gbs, n),
            }
        )
    )


if __name__ == "__main__":
    main()
