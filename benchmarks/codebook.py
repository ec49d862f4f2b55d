"""A frozen weight's codes (``zinf_fn.formats.codebook``): encode and decode of one expert-sized
tile by the C kernels against their torch twins and bitsandbytes' CPU functions, in one run.

    python benchmarks/codebook.py [--rows 1536 --cols 2048 --repeat 5 --clock cpu|wall]

Each figure is the best of ``--repeat`` (the machine is shared), per element in ns:

    encode_ns_<impl>, decode_ns_<impl>   impl: native (the C kernels), torch (the twins,
                                         ``native=False``), bnb (bitsandbytes quantize_4bit /
                                         dequantize_4bit, NF4 only)
    encode_speedup, decode_speedup       torch's time / native's (NF4)

Decode writes the fp32 values the fetch hands to compute (``codebook.decode_leaf_``; the twins
decode to bfloat16 and cast). ``--clock cpu`` counts the process's CPU time (every thread's), so
the figures hold on a loaded machine. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zinf_fn.formats import codebook  # noqa: E402


def best(fn, repeat: int, clock) -> float:
    """The shortest of ``repeat`` timed calls of ``fn`` (one untimed call first)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def timings(kind: str, w: torch.Tensor, repeat: int, clock) -> dict[str, float]:
    """ns per element of encode and decode of ``w`` as ``kind``, native and torch."""
    n, shape = w.numel(), tuple(w.shape)
    stored = codebook.encode_leaf(kind, w)
    out = torch.empty(n)
    out_ = {
        "encode_native": best(lambda: codebook.encode_leaf(kind, w), repeat, clock),
        "encode_torch": best(lambda: codebook.encode_leaf(kind, w, native=False), repeat, clock),
        "decode_native": best(
            lambda: codebook.decode_leaf_(kind, stored, out, torch.bfloat16), repeat, clock
        ),
        "decode_torch": best(
            lambda: out.copy_(
                codebook.decode_leaf(kind, stored, shape, torch.bfloat16, native=False).view(-1)
            ),
            repeat,
            clock,
        ),
    }
    return {f"{key}_ns": round(t / n * 1e9, 3) for key, t in out_.items()}


def bnb_timings(w: torch.Tensor, repeat: int, clock) -> dict[str, float]:
    """ns per element of bitsandbytes' NF4 quantize_4bit and dequantize_4bit (+ the fp32 cast)."""
    import bitsandbytes.functional as bnb

    packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    encode = best(
        lambda: bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False),
        repeat,
        clock,
    )
    decode = best(lambda: bnb.dequantize_4bit(packed, state).float(), repeat, clock)
    return {
        "encode_bnb_ns": round(encode / w.numel() * 1e9, 3),
        "decode_bnb_ns": round(decode / w.numel() * 1e9, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1536)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = p.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(args.rows, args.cols, generator=gen) * 0.02).to(torch.bfloat16)
    nf4 = timings("nf4", w, args.repeat, clock)
    int8 = timings("int8", w, args.repeat, clock)
    out = {"clock": args.clock, "shape": [args.rows, args.cols], "threads": torch.get_num_threads()}
    out.update({f"nf4_{k}": v for k, v in nf4.items()})
    out.update({f"int8_{k}": v for k, v in int8.items()})
    out.update({f"nf4_{k}": v for k, v in bnb_timings(w, args.repeat, clock).items()})
    out["encode_speedup"] = round(nf4["encode_torch_ns"] / nf4["encode_native_ns"], 2)
    out["decode_speedup"] = round(nf4["decode_torch_ns"] / nf4["decode_native_ns"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
