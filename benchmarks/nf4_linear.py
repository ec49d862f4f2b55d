"""A frozen NF4 expert's products: the fused kernel over its codes against decode + ``F.linear``.

One expert of Qwen3-30B-A3B (gate_up 1536 x 2048, down 2048 x 768), its bf16 weights stored NF4
(``codebook.encode_leaf``). For each of a few rows (1 to 64: a 30B step at 32 tokens routes ~2 rows
to an expert) each round times, in turn:

- ``fused``: ``nf4_linear.CodedMatrix.linear`` then ``grad_input`` (forward and dx, what a frozen
  expert costs a step where its codes are lent, ``GroupPolicy.codes``), the same codes each time:
  in the cache;
- ``fused_cold``: the same over distinct copies of the codes (``COLD_BYTES`` of them), each once a
  round, as a step reads its experts: from DRAM, just fetched (the mean per copy);
  beyond ``nf4_linear.FUSED_ROWS`` (128) rows the op itself decodes W once and runs
  ``F.linear``;
- ``decode_linear``: the path it replaces, the codes decoded into an fp32 buffer
  (``codebook.decode_leaf_``, the fetcher's decode) then ``F.linear`` and ``g @ W``.

Then the whole expert as the step runs it (``expert``): ``tiling.expert_swiglu``'s one node, its
forward and backward to its input over held sources of the codes, in the cache (``swiglu``) and
over distinct copies (``swiglu_cold``). The rounds alternate the variants, and the best round
counts (a shared machine's load inflates a round, never shortens it). Last line: JSON with each
shape's milliseconds per row count and the speedup (``decode_linear / fused``).

    python benchmarks/nf4_linear.py --quick
    python benchmarks/nf4_linear.py --threads 1   # one core's cost, no barrier on a busy machine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from functools import partial

import torch
import torch.nn.functional as F

from zinf_fn import tiling
from zinf_fn.formats import codebook, nf4_linear
from zinf_fn.tiling.held import HeldTiles

SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}
ROWS = (1, 2, 4, 8, 16, 32, 64)
COLD_BYTES = 256 << 20  # distinct codes a cold round reads: more than the caches hold


def _expert(shape: tuple[int, int]) -> nf4_linear.CodedMatrix:
    """A (d_out, d_in) weight's bf16 values (init std 0.02) stored NF4."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).mul_(0.02)
    stored = codebook.encode_leaf("nf4", w.to(torch.bfloat16))
    return nf4_linear.CodedMatrix(stored, shape, torch.bfloat16)


def _copies(w: nf4_linear.CodedMatrix) -> list[nf4_linear.CodedMatrix]:
    """Distinct copies of ``w``'s codes, ``COLD_BYTES`` in all."""
    n = max(2, COLD_BYTES // w.stored.numel())
    return [dataclasses.replace(w, stored=w.stored.clone()) for _ in range(n)]


def _variants(w: nf4_linear.CodedMatrix, x: torch.Tensor, g: torch.Tensor) -> dict:
    """The ways of one forward and dx, each a function of no arguments giving the products it
    made (1, or the copies a cold round went over)."""
    dense = torch.empty(w.shape)
    copies = _copies(w)

    def fused():
        w.linear(x)
        w.grad_input(g)
        return 1

    def fused_cold():
        for copy in copies:
            copy.linear(x)
            copy.grad_input(g)
        return len(copies)

    def decode_linear():
        codebook.decode_leaf_("nf4", w.stored, dense, torch.bfloat16)
        F.linear(x, dense)
        g.mm(dense)
        return 1

    return {"fused": fused, "fused_cold": fused_cold, "decode_linear": decode_linear}


def _expert_variants(rows: int) -> dict:
    """One expert's ``tiling.expert_swiglu`` forward and backward to its rows, over held sources of
    its codes: the same expert each time, or each of distinct copies once."""
    gate_up, down = (
        dataclasses.replace(_expert(shape), shape=(1, *shape)) for shape in SHAPES.values()
    )
    experts = [(gate_up, down), *zip(_copies(gate_up), _copies(down), strict=False)]
    sources = [[HeldTiles(tiling.RowTiles((w,)), torch.zeros(0)) for w in e] for e in experts]
    x = torch.randn(rows, SHAPES["gate_up"][1], requires_grad=True)

    def over(chosen: list) -> int:
        for gate_up_source, down_source in chosen:
            tiling.expert_swiglu(x, gate_up_source, down_source, 0).sum().backward()
        return len(chosen)

    return {"swiglu": partial(over, sources[:1]), "swiglu_cold": partial(over, sources[1:])}


def time_best(variants: dict, rounds: int) -> dict[str, float]:
    """The best milliseconds per product of each variant over ``rounds`` alternating rounds."""
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for name, run in variants.items():
            t0 = time.perf_counter()
            n = run()
            best[name] = min(best[name], (time.perf_counter() - t0) / n)
    return {name: round(seconds * 1e3, 4) for name, seconds in best.items()}


def time_rows(w: nf4_linear.CodedMatrix, rows: int, rounds: int) -> dict[str, float]:
    """The best milliseconds of each way of one forward and dx of ``w`` on ``rows`` rows."""
    d_out, d_in = w.shape
    x, g = torch.randn(rows, d_in), torch.randn(rows, d_out)
    return time_best(_variants(w, x, g), rounds)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (the kernel's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 5 if args.quick else args.rounds
    out: dict = {"threads": torch.get_num_threads(), "rounds": rounds}
    for name, shape in SHAPES.items():
        w = _expert(shape)
        per_rows = {}
        for rows in ROWS:
            ms = time_rows(w, rows, rounds)
            ms["speedup"] = round(ms["decode_linear"] / ms["fused"], 2)
            per_rows[str(rows)] = ms
            print(f"{name} {shape} rows {rows}: {ms}", flush=True)
        out[name] = per_rows
    out["expert"] = {}
    for rows in ROWS[:3]:  # the rows a 30B step routes to an expert
        out["expert"][str(rows)] = ms = time_best(_expert_variants(rows), rounds)
        print(f"expert (gate_up, swiglu, down) rows {rows}: {ms}", flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
