"""A frozen NF4 expert's products: the fused kernel over its codes against decode + ``F.linear``.

One expert of Qwen3-30B-A3B (gate_up 1536 x 2048, down 2048 x 768), its bf16 weights stored NF4
(``codebook.encode_leaf``). For each of a few rows (1, 2, 4, 8, 16: a 30B step routes ~2 rows to
an expert) each round times, in turn:

- ``fused``: ``nf4_linear.CodedMatrix.linear`` then ``grad_input`` (forward and dx, what a frozen
  expert costs a step where its codes are lent, ``GroupPolicy.codes``);
- ``decode_linear``: the path it replaces, the codes decoded into an fp32 buffer
  (``codebook.decode_leaf_``, the fetcher's decode) then ``F.linear`` and ``g @ W``.

The rounds alternate the two, and the best round counts (a shared machine's load inflates a
round, never shortens it). Last line: JSON with each shape's milliseconds per row count and the
speedup (``decode_linear / fused``).

    python benchmarks/nf4_linear.py --quick
    python benchmarks/nf4_linear.py --threads 1   # one core's cost, no barrier on a busy machine
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from zinf_fn.formats import codebook, nf4_linear

SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}
ROWS = (1, 2, 4, 8, 16)


def _expert(shape: tuple[int, int]) -> nf4_linear.CodedMatrix:
    """A (d_out, d_in) weight's bf16 values (init std 0.02) stored NF4."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).mul_(0.02)
    stored = codebook.encode_leaf("nf4", w.to(torch.bfloat16))
    return nf4_linear.CodedMatrix(stored, shape, torch.bfloat16)


def _variants(w: nf4_linear.CodedMatrix, x: torch.Tensor, g: torch.Tensor) -> dict:
    """The two ways of one forward and dx, each a function of no arguments."""
    dense = torch.empty(w.shape)

    def fused():
        w.linear(x)
        w.grad_input(g)

    def decode_linear():
        codebook.decode_leaf_("nf4", w.stored, dense, torch.bfloat16)
        F.linear(x, dense)
        g.mm(dense)

    return {"fused": fused, "decode_linear": decode_linear}


def time_rows(w: nf4_linear.CodedMatrix, rows: int, rounds: int) -> dict[str, float]:
    """The best milliseconds of each variant over ``rounds`` alternating rounds."""
    d_out, d_in = w.shape
    x, g = torch.randn(rows, d_in), torch.randn(rows, d_out)
    variants = _variants(w, x, g)
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for name, run in variants.items():
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: round(seconds * 1e3, 4) for name, seconds in best.items()}


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
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
