"""Memory-centric tiling: working memory of one large layer's step, and the largest layer a budget trains.

    python benchmarks/tiling.py --quick        # budget search for T = 1 and T = 16, JSON on the last line
    python benchmarks/tiling.py --memory       # working memory at a fixed hidden size for T = 1, 4, 16

A *probe* trains a one-layer model (a tiny embed and head around one transformer-style layer of hidden
size d) for one step with the engine in a fresh subprocess: params and optimizer states in CPU memory
("cpu" placement, bf16 parameter copy), compute in fp32, prefetch depth 1, world 1. Its *working
memory* is the peak RSS during the first step minus the RSS right after ``zf.init`` (the model states
are resident before the step; what the step adds is gathered/cast parameters, gradients in flight,
activations, and the pools that hold them). glibc is told to serve blocks >= 64 KiB with mmap
(``MALLOC_MMAP_THRESHOLD_``), so freed buffers leave the RSS and the peak is the real high-water mark.

The budget search ("trains under a fixed working-memory budget"): the largest d (a multiple of 64)
whose probe's working memory is <= the budget, found by doubling then bisection, separately for T = 1
and T = 16.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time

LAYERS = ("linear", "mlp", "block")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _model(layer: str, d: int, tiles: int):
    import torch

    from layers import gpt, linear, mlp
    from zinf_fn import tiling
    from zinf_fn.model import Model, Stage

    def block_init(gen, i):
        if layer == "linear":   # d -> d, tiles over output features
            return {"w": linear.init(gen, d, d, bias=False, tiles=tiles)}
        if layer == "mlp":      # d -> 4d -> d, tiles over the hidden features of both
            return mlp.init(gen, d, 4 * d, bias=False, tiles=tiles)
        cfg = gpt.Config(vocab_size=8, d_model=d, n_heads=d // 64, n_layers=1, seq_len=64,
                         bias=False, attn_tiles=tiles, mlp_tiles=tiles)
        return gpt.block_init(cfg, gen, i)

    def block_apply(p, x):
        if layer == "linear":
            return x + tiling.linear(x, p["w"]["w"])
        if layer == "mlp":
            return x + mlp.apply(p, x)
        cfg = gpt.Config(vocab_size=8, d_model=d, n_heads=d // 64, n_layers=1, seq_len=64, bias=False)
        return gpt.block_apply(cfg, p, x)

    return Model(embed=Stage(lambda gen: {"s": torch.ones(d)}, lambda p, b: b["x"] * p["s"]),
                 block=Stage(block_init, block_apply),
                 head=Stage(lambda gen: {"s": torch.ones(d)}, lambda p, x, b: ((x * p["s"]) ** 2).mean()),
                 n_layers=1)


class Prober:
    """Measures one-layer models in this process: the working memory and step time of each.

    A small warm-up model runs first, so lazy imports, kernels and thread pools are not counted; each
    model's states are freed before the next is built (glibc returns >= 64 KiB blocks to the OS, so
    the peak-RSS reset before each first step starts from what is really resident).
    """

    def __init__(self, layer: str, tokens: int):
        import torch

        import zinf_fn as zf

        self.zf, self.torch, self.layer, self.tokens = zf, torch, layer, tokens
        torch.set_num_threads(int(os.environ.get("PROBE_THREADS", "2")))
        self.config = zf.Config(offload_params="cpu", offload_optimizer="cpu", param_dtype=torch.bfloat16,
                                prefetch_depth=1)
        self.measure(128, 4, 1)   # warm-up

    def measure(self, d: int, tiles: int, steps: int) -> dict:
        """Working memory (peak RSS of the first step minus RSS after init) and step times at (d, T)."""
        zf, torch = self.zf, self.torch
        seq = 64 if self.layer == "block" else self.tokens
        batch = {"x": torch.randn(max(1, self.tokens // seq), seq, d, generator=torch.Generator().manual_seed(0))}
        t0 = time.perf_counter()
        state = zf.init(_model(self.layer, d, tiles), zf.sgd(lr=1e-3), self.config, seed=0)
        init_s = time.perf_counter() - t0
        gc.collect()
        base = _status_kib("VmRSS")
        _reset_peak_rss()
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            state, metrics = zf.train_step(state, batch)
            times.append(time.perf_counter() - t0)
            if i == 0:
                peak = _status_kib("VmHWM")
        state.runtime.close()
        del state
        gc.collect()
        return {"layer": self.layer, "d": d, "tiles": tiles, "tokens": self.tokens,
                "layer_params": d * d * {"linear": 1, "mlp": 8, "block": 12}[self.layer],
                "working_bytes": (peak - base) * 1024, "init_s": init_s, "first_step_s": times[0],
                "step_time_s": min(times[1:]) if steps > 1 else times[0], "loss": metrics["loss"]}

    def largest_hidden(self, tiles: int, budget: int, start: int) -> tuple[int, list]:
        """The largest d (multiple of 64) whose first step fits ``budget`` working bytes: doubling, then
        bisection to ~6% of the answer. Returns (d, every probe)."""
        probes = []

        def fits(d):
            probes.append(self.measure(d, tiles, 1))
            return probes[-1]["working_bytes"] <= budget

        lo, hi = 0, start
        while fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 64 * max(1, lo // 1024):
            mid = (lo + hi) // 2 // 64 * 64
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo, probes


def in_subprocess(mode: str, spec: list, timeout: float = 1800):
    """Run ``--<mode> <spec>`` of this script in a fresh process (its peak RSS its own); its JSON result."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), f"--{mode}", json.dumps(spec)], env=env,
                         capture_output=True, text=True, timeout=timeout, cwd=root)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_probe(layer: str, d: int, tiles: list[int], tokens: int = 64, steps: int = 1) -> list[dict]:
    """Working memory and step time of the one-layer model at hidden size d, for each T, in one subprocess."""
    return in_subprocess("probe", [layer, tokens, [[d, t, steps] for t in tiles]])


def _show(r: dict, budget: int | None = None) -> str:
    fit = "" if budget is None else (" fits" if r["working_bytes"] <= budget else " over")
    return f"  T={r['tiles']:2d} d={r['d']:6d}: working {r['working_bytes'] / 2**20:8.1f} MiB{fit}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--search", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="small budget: a few minutes on 2 cores")
    ap.add_argument("--memory", action="store_true", help="working memory at fixed d for T = 1, 4, 16")
    ap.add_argument("--layer", choices=LAYERS, default="block")
    ap.add_argument("--budget-mib", type=float, default=None)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if args.probe:
        layer, tokens, points = json.loads(args.probe)
        prober = Prober(layer, tokens)
        print(json.dumps([prober.measure(*p) for p in points]))
        return
    if args.search:
        layer, tokens, tiles, budget, start = json.loads(args.search)
        hidden, probes = Prober(layer, tokens).largest_hidden(tiles, budget, start)
        print(json.dumps({"hidden": hidden, "probes": probes}))
        return
    if args.memory:
        d = 2048
        rows = run_probe(args.layer, d, [1, 4, 16], args.tokens)
        print("\n".join(_show(r) for r in rows))
        print(json.dumps({"layer": args.layer, "d": d, **{f"working_t{r['tiles']}": r["working_bytes"] for r in rows}}))
        return
    budget = int((args.budget_mib or (96 if args.quick else 256)) * 2**20)
    print(f"layer={args.layer} tokens={args.tokens} budget={budget / 2**20:.0f} MiB of working memory", flush=True)
    hidden = {}
    for tiles, start in ((1, 512), (16, None)):
        found = in_subprocess("search", [args.layer, args.tokens, tiles, budget, start or 2 * hidden[1]])
        hidden[tiles] = found["hidden"]
        print("\n".join(_show(r, budget) for r in found["probes"]), flush=True)
    times = {}
    for tokens in (args.tokens, 8 * args.tokens):   # step time at d = hidden_t1, where both fit
        t1, t16 = run_probe(args.layer, hidden[1], [1, 16], tokens, steps=4)
        times[tokens] = t16["step_time_s"] / t1["step_time_s"]
        print(f"step time at d={hidden[1]}, {tokens} tokens: untiled {t1['step_time_s']:.3f} s, "
              f"T=16 {t16['step_time_s']:.3f} s", flush=True)
    print(json.dumps({"layer": args.layer, "budget_bytes": budget, "tokens": args.tokens, "hidden_t1": hidden[1],
                      "hidden_t16": hidden[16], "ratio": hidden[16] / hidden[1],
                      "step_time_ratio_tiled": times[args.tokens],
                      f"step_time_ratio_tiled_{8 * args.tokens}_tokens": times[8 * args.tokens]}))


if __name__ == "__main__":
    main()
