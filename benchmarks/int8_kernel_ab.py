"""The int8 AdamW kernel of several checkouts against torch's fused AdamW, paired in one process.

``optimizer.py --quick`` times each variant in its own median, and one run swings by +-10 % on a
shared machine; a change to the C kernel (``optim.native_source``) is better judged here. Each
``--tree NAME=DIR`` names a checkout: its kernel source (``native_source.SOURCE`` as that checkout
writes it, read in a subprocess with DIR on the path, with the tables it reads) is built by
``native.build`` and its ``adamw_int8`` called directly on the same 32M-element gradient, the fp32
master (``optimizer.shard_buffers``, shared with torch's variant) and its own int8 moments:
``int8`` (fp32 master) and ``int8_remainder`` (the remainder master: bf16 copy + 16-bit
remainder). The rounds alternate, each starting one variant later; every call is timed by the
wall clock and by the process's CPU time (``time.process_time``: every thread's) at once.

Per variant: the median of each clock, and the median over rounds of torch's time in that round
over the variant's (``vs_torch_fused``: the paired ratio, >= 1.0 where the kernel is as fast as
torch's fused fp32 AdamW). Last line: JSON with those ratios.

    python benchmarks/int8_kernel_ab.py --tree main=/work/main --tree new=. --rounds 9
    python benchmarks/int8_kernel_ab.py --tree new=. --threads 1    # one core's cost
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import optimizer
import torch

from zinf_fn.native import FLAGS, build, ptr
from zinf_fn.optim import compressed, formats

KINDS = ("int8", "int8_remainder")


def tree_kernel(tree: str) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(kernel source, code tables, nearest-code and encode tables) of the checkout at ``tree``:
    its ``native_source.SOURCE`` and ``compressed.native_tables()``, read with the checkout as the
    working directory (``python -c`` puts that first on the path), since a kernel reads the tables
    its own checkout lays out."""
    root = Path(tree).resolve()
    env = {**os.environ, "PYTHONPATH": str(root)}
    with tempfile.TemporaryDirectory() as tmp:
        tables = Path(tmp, "tables.pt")
        code = (
            "import sys, torch; from zinf_fn.optim.native_source import SOURCE; "
            "from zinf_fn.optim import compressed; "
            f"torch.save(compressed.native_tables(), {str(tables)!r}); sys.stdout.write(SOURCE)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
        )
        if out.returncode:
            raise ValueError(f"--tree {tree}: could not read its kernel source:\n{out.stderr}")
        codes, luts = torch.load(tables)
    return out.stdout, codes, luts


def kernel(source: str) -> ctypes.CDLL:
    """``adamw_int8`` built from ``source`` with the package's flags."""
    lib = build("zinf_adamw", source, FLAGS)
    if lib is None:
        raise ValueError("the kernel source did not build with the system C compiler")
    lib.adamw_int8.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 13, ctypes.c_int]
    lib.adamw_int8.restype = None
    return lib


def int8_update(lib: ctypes.CDLL, tables: tuple, buffers: tuple[torch.Tensor, ...], kind: str):
    """A closure: one ``adamw_int8`` step of ``lib`` (reading its checkout's ``tables``) over the
    shard, with its own moments (and its own remainder master for ``int8_remainder``), weight decay
    on every element."""
    master, grad, _, _ = buffers
    n = master.numel()
    if kind == "int8_remainder":
        master = compressed.init_master(formats.MasterFormat("remainder"), master)
    moments = compressed.init_moments(formats.MomentsFormat("int8"), n)
    codes, luts = tables
    h = optimizer.HYPER
    hyper = compressed.AdamWHyper(h["b1"], h["b2"], h["eps"], h["weight_decay"])
    step = [0]

    def update():
        s = compressed.step_scalars(hyper, step[0], h["lr"])
        step[0] += 1
        lib.adamw_int8(
            n,
            ptr(grad),
            *compressed._master_ptrs(master, None),
            *(ptr(t) for t in moments),
            ptr(codes),
            ptr(luts),
            ptr(s),
            None,
            torch.get_num_threads(),
        )

    return update


def paired_ratio(base: list[float], times: list[float]) -> float:
    """The median over rounds of base's time over the variant's in the same round."""
    return statistics.median(b / t for b, t in zip(base, times, strict=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", action="append", required=True, help="NAME=DIR of a checkout")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--numel", type=int, default=32 << 20)
    p.add_argument("--threads", type=int, default=None, help="torch's and the kernels' threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    buffers = optimizer.shard_buffers(args.numel, torch.Generator().manual_seed(0))
    variants = {"torch_fused": optimizer.torch_variant(buffers, fused=True)}
    for tree in args.tree:
        name, _, path = tree.partition("=")
        if not path:
            raise ValueError(f"--tree takes NAME=DIR (e.g. main=/work/main), got {tree!r}")
        source, *tables = tree_kernel(path)
        lib = kernel(source)
        for kind in KINDS:
            variants[f"{name}:{kind}"] = int8_update(lib, tables, buffers, kind)
    times = optimizer.timed_rounds(variants, args.rounds, optimizer.CLOCKS)
    fused = times["torch_fused"]
    print(f"{args.numel} elements, {torch.get_num_threads()} threads, {args.rounds} rounds")
    ratios = {}
    for k, t in times.items():
        ratio = {c: paired_ratio(fused[c], t[c]) for c in t}
        ratios[k] = {c: round(v, 3) for c, v in ratio.items()}
        print(
            f"  {k:28s} cpu {statistics.median(t['cpu']) * 1e3:7.1f} ms"
            f"  wall {statistics.median(t['wall']) * 1e3:7.1f} ms"
            f"   vs torch_fused: cpu {ratio['cpu']:.3f}  wall {ratio['wall']:.3f}"
        )
    print(json.dumps({"metric": "int8_kernel_vs_torch_fused", "paired_ratios": ratios}))


if __name__ == "__main__":
    main()
