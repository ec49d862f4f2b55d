"""Where the fused NF4 products stop paying: the fused kernels against the twin, by rows.

For each weight shape and row count, one forward (``x @ W^T``) and one backward (``g @ W``) of a
bf16 weight stored NF4, in the CPU time of the process (``time.process_time``: the kernels' and
BLAS's threads counted alike), per product pair:

- ``fused``: ``nf4_linear.run``, the C kernels on the codes, whatever the rows;
- ``decoded``: the op's twin, ``CodedMatrix.linear`` / ``grad_input`` with ``FUSED_ROWS`` 0: W
  decoded into the thread's reused buffer, then ``F.linear`` / ``mm`` (a decode per product).

Each over distinct copies of the codes (``COLD_BYTES``: a step's weights come from DRAM), the two
alternating, the best of ``--rounds``. ``nf4_linear.FUSED_ROWS`` is set where ``decoded`` starts
to win. The default shapes are Qwen3-30B-A3B's: an expert's gate_up and down, attention's q and o.

    python benchmarks/nf4_rows.py --quick
    python benchmarks/nf4_rows.py --rows 32 --shape q=4096x2048 --shape o=2048x4096
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from zinf_fn.formats import codebook, nf4_kernels, nf4_linear

SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768), "q": (4096, 2048), "o": (2048, 4096)}
ROWS = (1, 8, 32, 64, 128, 192, 256, 512)
COLD_BYTES = 24 << 20


def _copies(shape: tuple[int, int]) -> list[nf4_linear.CodedMatrix]:
    """Distinct copies of a (d_out, d_in) weight's NF4 codes (init std 0.02), ``COLD_BYTES`` of
    them, at least 2."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).mul_(0.02)
    stored = codebook.encode_leaf("nf4", w.to(torch.bfloat16))
    n = max(2, COLD_BYTES // stored.numel())
    return [nf4_linear.CodedMatrix(stored.clone(), shape, torch.bfloat16) for _ in range(n)]


def time_pair(copies: list[nf4_linear.CodedMatrix], rows: int, rounds: int) -> dict[str, float]:
    """CPU ms of a forward and a backward product on ``rows`` rows, fused and decoded."""
    lib = nf4_kernels.library()
    d_out, d_in = copies[0].shape
    x, g = torch.randn(rows, d_in), torch.randn(rows, d_out)

    def fused():
        for w in copies:
            nf4_linear.run(lib, x, w, forward=True)
            nf4_linear.run(lib, g, w, forward=False)

    def decoded():
        for w in copies:
            w.linear(x)
            w.grad_input(g)

    best = {"fused": float("inf"), "decoded": float("inf")}
    fused_rows = nf4_linear.FUSED_ROWS
    nf4_linear.FUSED_ROWS = 0  # the op runs its twin at every row count
    try:
        for _ in range(rounds):
            for name, run in (("fused", fused), ("decoded", decoded)):
                t0 = time.process_time()
                run()
                best[name] = min(best[name], time.process_time() - t0)
    finally:
        nf4_linear.FUSED_ROWS = fused_rows
    return {name: round(s / len(copies) * 1e3, 3) for name, s in best.items()}


def _shape(text: str) -> tuple[str, tuple[int, int]]:
    name, _, dims = text.partition("=")
    d_out, _, d_in = dims.partition("x")
    return name, (int(d_out), int(d_in))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--shape", action="append", type=_shape, help="NAME=OUTxIN, repeated")
    args = parser.parse_args(argv)
    if nf4_kernels.library() is None:
        raise SystemExit("nf4_rows: the NF4 kernels could not be built (no C compiler?)")
    rounds = 3 if args.quick else args.rounds
    shapes = dict(args.shape) if args.shape else SHAPES
    out: dict = {"rounds": rounds, "fused_rows": nf4_linear.FUSED_ROWS}
    for name, shape in shapes.items():
        copies = _copies(shape)
        out[name] = {}
        for rows in args.rows:
            ms = time_pair(copies, rows, rounds)
            ms["decoded_over_fused"] = round(ms["decoded"] / ms["fused"], 2)
            out[name][str(rows)] = ms
            print(f"{name} {shape} rows {rows}: {ms}", flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
