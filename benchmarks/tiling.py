"""Memory-centric tiling: working memory of one large layer's step, and the largest layer a budget
trains.

    python benchmarks/tiling.py --quick        # budget search for T = 1 and T = 16, JSON on the
    last line python benchmarks/tiling.py                # the same budget, T = 64 searched too
    python benchmarks/tiling.py --memory       # working memory at a fixed hidden size for T = 1, 4,
    16 python benchmarks/tiling.py --check --device cuda   # tiled GPT == untiled GPT on a device
    (bf16 compute) python benchmarks/tiling.py --breakdown    # where a step's time goes at d 2048,
    512 tokens, T = 1, 4, 16

``--device cuda`` runs every probe with compute on the GPU (parameters and optimizer still in CPU
memory) and measures working memory as ``torch.cuda.max_memory_allocated`` during the first step
minus ``torch.cuda.memory_allocated`` after init.

A *probe* trains a one-layer model (a tiny embed and head around one transformer-style layer of
hidden size d) for one step with the engine in a fresh subprocess: params and optimizer states in
CPU memory ("cpu" placement, bf16 parameter copy), compute in fp32, prefetch depth 1, world 1. Its
*working memory* is the peak RSS during the first step minus the RSS right after ``zf.init`` less
the staging pool ``zf.init`` makes (the model states are resident before the step; what the step
adds is gathered/cast parameters, gradients in flight, activations, and the pools that hold them).
glibc is told to serve blocks >= 64 KiB with mmap (``MALLOC_MMAP_THRESHOLD_``), so freed buffers
leave the RSS and the peak is the real high-water mark.

The budget search ("trains under a fixed working-memory budget"): the largest d (a multiple of 64)
whose probe's working memory is <= the budget, found by doubling then bisection, separately for T =
1 and T = 16.
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
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere: the packages are not installed
    sys.path.insert(0, ROOT)


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _model(layer: str, d: int, tiles: int):
    import torch

    from layers import gpt, linear, mlp
    from zinf_fn import tiling
    from zinf_fn.model import Model, Stage

    def block_init(gen, i):
        if layer == "linear":  # d -> d, tiles over output features
            return {"w": linear.init(gen, d, d, bias=False, tiles=tiles)}
        if layer == "mlp":  # d -> 4d -> d, tiles over the hidden features of both
            return mlp.init(gen, d, 4 * d, bias=False, tiles=tiles)
        cfg = gpt.Config(
            vocab_size=8,
            d_model=d,
            n_heads=d // 64,
            n_layers=1,
            seq_len=64,
            bias=False,
            attn_tiles=tiles,
            mlp_tiles=tiles,
        )
        return gpt.block_init(cfg, gen, i)

    def block_apply(p, x):
        if layer == "linear":
            return x + tiling.linear(x, p["w"]["w"])
        if layer == "mlp":
            return x + mlp.apply(p, x)
        cfg = gpt.Config(
            vocab_size=8, d_model=d, n_heads=d // 64, n_layers=1, seq_len=64, bias=False
        )
        return gpt.block_apply(cfg, p, x)

    return Model(
        embed=Stage(lambda gen: {"s": torch.ones(d)}, lambda p, b: b["x"] * p["s"]),
        block=Stage(block_init, block_apply),
        head=Stage(lambda gen: {"s": torch.ones(d)}, lambda p, x, b: ((x * p["s"]) ** 2).mean()),
        n_layers=1,
    )


class Prober:
    """Measures one-layer models in this process: the working memory and step time of each.

    A small warm-up model runs first, so lazy imports, kernels and thread pools are not counted;
    each model's states are freed before the next is built (glibc returns >= 64 KiB blocks to the
    OS, so the peak-RSS reset before each first step starts from what is really resident).
    """

    def __init__(self, layer: str, tokens: int, device: str = "cpu"):
        import torch

        import zinf_fn as zf
        from zinf_fn.state import view

        self.zf, self.torch, self.layer, self.tokens = zf, torch, layer, tokens
        self.view = view  # the state interface: a state is closed through it
        self.cuda = device.startswith("cuda")
        if not self.cuda:
            torch.set_num_threads(int(os.environ.get("PROBE_THREADS", "2")))
        self.config = zf.Config(
            offload_params="cpu",
            offload_optimizer="cpu",
            param_dtype=torch.bfloat16,
            prefetch_depth=1,
            device=device,
        )
        self.measure(128, 4, 1)  # warm-up

    def measure(self, d: int, tiles: int, steps: int) -> dict:
        """Working memory (peak RSS of the first step minus the model states: RSS after init less
        the staging pool, made at init) and step times at (d, T)."""
        zf, torch = self.zf, self.torch
        seq = 64 if self.layer == "block" else self.tokens
        batch = {
            "x": torch.randn(
                max(1, self.tokens // seq), seq, d, generator=torch.Generator().manual_seed(0)
            )
        }
        t0 = time.perf_counter()
        state = zf.init(_model(self.layer, d, tiles), zf.sgd(lr=1e-3), self.config, seed=0)
        init_s = time.perf_counter() - t0
        gc.collect()
        # the staging pool is working memory the engine makes at init (the parts' demands): not
        # model states
        base = self._base() - (0 if self.cuda else self.view(state).counters().pool_bytes)
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            state, metrics = zf.train_step(state, batch)
            if self.cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if i == 0:
                peak = self._peak()
        self.view(state).close()
        del state
        gc.collect()
        return {
            "layer": self.layer,
            "d": d,
            "tiles": tiles,
            "tokens": self.tokens,
            "layer_params": d * d * {"linear": 1, "mlp": 8, "block": 12}[self.layer],
            "working_bytes": peak - base,
            "init_s": init_s,
            "first_step_s": times[0],
            "step_time_s": min(times[1:]) if steps > 1 else times[0],
            "loss": metrics["loss"],
        }

    def step_times(self, d: int, tiles: list[int], steps: int) -> dict[int, float]:
        """Best step time of each T at hidden size d, the models' steps interleaved (a shared,
        loaded machine changes speed over seconds; interleaving gives every T the same
        conditions)."""
        zf, torch = self.zf, self.torch
        seq = 64 if self.layer == "block" else self.tokens
        batch = {
            "x": torch.randn(
                max(1, self.tokens // seq), seq, d, generator=torch.Generator().manual_seed(0)
            )
        }
        states = {
            t: zf.init(_model(self.layer, d, t), zf.sgd(lr=1e-3), self.config, seed=0)
            for t in tiles
        }
        best = {t: float("inf") for t in tiles}
        for i in range(steps + 1):
            for t in tiles:
                t0 = time.perf_counter()
                states[t], _ = zf.train_step(states[t], batch)
                if self.cuda:
                    torch.cuda.synchronize()
                if i:  # the first step of each warms its pool
                    best[t] = min(best[t], time.perf_counter() - t0)
        for state in states.values():
            self.view(state).close()
        return best

    def _base(self) -> int:
        """Bytes resident now, after resetting the peak counter."""
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            return self.torch.cuda.memory_allocated()
        base = status_kib("VmRSS") * 1024
        reset_peak_rss()
        return base

    def _peak(self) -> int:
        return self.torch.cuda.max_memory_allocated() if self.cuda else status_kib("VmHWM") * 1024

    def largest_hidden(self, tiles: int, budget: int, start: int) -> tuple[int, list]:
        """The largest d (multiple of 64) whose first step fits ``budget`` working bytes: doubling,
        then bisection to ~6% of the answer. Returns (d, every probe)."""
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


def in_subprocess(mode: str, spec: list, timeout: float = 1800, script: str = __file__):
    """Run ``--<mode> <spec>`` of ``script`` (this one by default) in a fresh process (its peak RSS
    its own); its JSON result."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, os.path.abspath(script), f"--{mode}", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{mode} {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_probe(
    layer: str, d: int, tiles: list[int], tokens: int = 64, steps: int = 1, device: str = "cpu"
):
    """Working memory and step time of the one-layer model at hidden size d, for each T, in one
    subprocess."""
    return in_subprocess("probe", [layer, tokens, device, [[d, t, steps] for t in tiles]])


def check(device: str) -> dict:
    """A small GPT with tiled attention, MLP and head against the untiled one, 3 steps on
    ``device``.

    ok: losses agree to 1e-5 relative in fp32 compute (2e-2 in bf16, whose products round
    differently per tile shape), parameters to 2 * lr * steps, the most a sign flip of a gradient
    element can move an Adam parameter (see tests/tiling/test_tiling_engine.py for why a few
    elements move at all).
    """
    import optree
    import torch

    import zinf_fn as zf
    from layers import gpt
    from zinf_fn import tiling

    cfg = gpt.Config(vocab_size=256, d_model=256, n_heads=4, n_layers=2, seq_len=64)
    tiled_cfg = gpt.Config(**{**cfg.__dict__, "attn_tiles": 4, "mlp_tiles": 7, "head_tiles": 16})
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (8, 65), generator=gen) for _ in range(3)]
    out = {}
    for compute in (
        (torch.bfloat16, torch.float32) if device.startswith("cuda") else (torch.float32,)
    ):
        config = zf.Config(
            offload_params="cpu", offload_optimizer="cpu", device=device, compute_dtype=compute
        )
        runs = []
        for c in (cfg, tiled_cfg):
            state = zf.init(gpt.model(c), zf.adamw(lr=1e-3), config)
            losses = []
            for tokens in data:
                state, metrics = zf.train_step(
                    state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
                )
                losses.append(metrics["loss"])
            full = optree.tree_map(tiling.untile, zf.gather_params(state), is_leaf=tiling.is_tiled)
            runs.append((losses, optree.tree_leaves(full)))
        loss_rel = max(abs(a - b) / abs(a) for a, b in zip(runs[0][0], runs[1][0], strict=True))
        param = max(float((a - b).abs().max()) for a, b in zip(runs[0][1], runs[1][1], strict=True))
        limit = 1e-5 if compute == torch.float32 else 2e-2
        out[str(compute).removeprefix("torch.")] = {
            "ok": loss_rel <= limit and param <= 2 * 1e-3 * len(data),
            "loss_rel_diff": loss_rel,
            "max_param_diff": param,
            "losses_tiled": runs[1][0],
        }
    return out


def time_ratios(args, d: int, tokens: int, name: str) -> dict[str, float]:
    """``{name: T=16 / T=1 step time}``; at d = 2048 also T = 4 (``step_time_ratio_tiled4_...``),
    all from one subprocess with the models' steps interleaved."""
    tiles = [1, 4, 16] if d == 2048 else [1, 16]
    best = in_subprocess("time", [args.layer, tokens, args.device, d, tiles, 4])
    shown = ", ".join(f"T={t} {best[str(t)]:.3f} s" for t in tiles[1:])
    print(
        f"step time at d={d}, {tokens} tokens: untiled {best['1']:.3f} s, {shown} (best of 4, "
        "interleaved)",
        flush=True,
    )
    out = {name: best["16"] / best["1"]}
    if "4" in best:
        out[name.replace("step_time_ratio_tiled", "step_time_ratio_tiled4", 1)] = (
            best["4"] / best["1"]
        )
    return out


def breakdown(
    layer: str, d: int, tokens: int, tiles: list[int], steps: int, device: str = "cpu"
) -> dict:
    """Where a step's time goes, per T: the best step time, and per step the Chrome trace's spans
    (``zf.Config(trace=)``) summed by category and thread (compute thread vs. the fetch / update
    workers) and the engine's counters. Steps of the models interleaved, as
    ``Prober.step_times``."""
    import tempfile
    import threading

    import torch

    import zinf_fn as zf
    from zinf_fn.state import view

    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("PROBE_THREADS", "2")))
    batch = {
        "x": torch.randn(max(1, tokens // 64), 64, d, generator=torch.Generator().manual_seed(0))
    }
    folder, out, states, best, metrics = tempfile.mkdtemp(), {}, {}, {}, {}
    for t in tiles:
        config = zf.Config(
            offload_params="cpu",
            offload_optimizer="cpu",
            param_dtype=torch.bfloat16,
            prefetch_depth=1,
            device=device,
            trace=os.path.join(folder, f"t{t}.json"),
        )
        states[t], best[t] = (
            zf.init(_model(layer, d, t), zf.sgd(lr=1e-3), config, seed=0),
            float("inf"),
        )
    for i in range(steps + 1):
        for t in tiles:
            t0 = time.perf_counter()
            states[t], metrics[t] = zf.train_step(states[t], batch)
            best[t] = min(best[t], time.perf_counter() - t0) if i else best[t]
    for t in tiles:
        view(states[t]).close()
        spans: dict[str, float] = {}
        with open(os.path.join(folder, f"t{t}.json")) as f:
            for e in (e for e in json.load(f) if e.get("ph") == "X"):  # complete spans
                who = "compute thread" if e["tid"] == threading.main_thread().ident else "workers"
                spans[f"{e['cat']} ({who})"] = spans.get(f"{e['cat']} ({who})", 0.0) + e[
                    "dur"
                ] / 1e3 / (steps + 1)
        shown = (
            "fetches",
            "fetch_casts",
        )  # rows fetched, and the calls that cast them (a run of tiles: one)
        counters = {
            k: v for k, v in metrics[t].items() if k.startswith("tile_fetches") or k in shown
        }
        out[t] = {
            "step_s": best[t],
            "ms_per_step": {k: round(v, 1) for k, v in sorted(spans.items())},
            **counters,
        }
    return out


def _show(r: dict, budget: int | None = None) -> str:
    fit = "" if budget is None else (" fits" if r["working_bytes"] <= budget else " over")
    return f"  T={r['tiles']:2d} d={r['d']:6d}: working {r['working_bytes'] / 2**20:8.1f} MiB{fit}"


def budget_search_and_times(args) -> dict:
    """The default run: the largest hidden under the budget for T = 1 and 16 (and 64 unless
    --quick), then the step time ratios; the JSON line's fields."""
    budget = int((args.budget_mib or 96) * 2**20)
    print(
        f"layer={args.layer} tokens={args.tokens} budget={budget / 2**20:.0f} MiB of working "
        "memory",
        flush=True,
    )
    hidden = {}
    for tiles in (1, 16) if args.quick else (1, 16, 64):
        start = 512 if tiles == 1 else 2 * hidden[max(hidden)]
        found = in_subprocess(
            "search", [args.layer, args.tokens, args.device, tiles, budget, start]
        )
        hidden[tiles] = found["hidden"]
        print("\n".join(_show(r, budget) for r in found["probes"]), flush=True)
    ratios = {}
    for d, tokens, name in (
        (hidden[1], args.tokens, "step_time_ratio_tiled"),
        (hidden[1], 8 * args.tokens, f"step_time_ratio_tiled_{8 * args.tokens}_tokens"),
        (2048, 8 * args.tokens, f"step_time_ratio_tiled_d2048_{8 * args.tokens}_tokens"),
    ):
        ratios.update(time_ratios(args, d, tokens, name))
    extra = (
        {} if 64 not in hidden else {"hidden_t64": hidden[64], "ratio_t64": hidden[64] / hidden[1]}
    )
    return {
        "layer": args.layer,
        "device": args.device,
        "budget_bytes": budget,
        "tokens": args.tokens,
        "hidden_t1": hidden[1],
        "hidden_t16": hidden[16],
        "ratio": hidden[16] / hidden[1],
        **extra,
        **ratios,
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for child in ("--probe", "--search", "--time"):  # the modes of the subprocesses (JSON specs)
        ap.add_argument(child, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="small budget: a few minutes on 2 cores")
    ap.add_argument(
        "--memory", action="store_true", help="working memory at fixed d for T = 1, 4, 16"
    )
    ap.add_argument("--layer", choices=LAYERS, default="block")
    ap.add_argument("--budget-mib", type=float, default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--check", action="store_true", help="tiled vs untiled GPT on --device, 3 steps"
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="where a step's time goes at d 2048, 8 x --tokens tokens, T = 1, 4, 16 "
        "(Chrome trace spans)",
    )
    return ap


def child(args) -> dict | list | None:
    """A subprocess's own result (``--probe``, ``--search``, ``--time``), or None when this is not
    one."""
    if args.probe:
        layer, tokens, device, points = json.loads(args.probe)
        prober = Prober(layer, tokens, device)
        return [prober.measure(*p) for p in points]
    if args.search:
        layer, tokens, device, tiles, budget, start = json.loads(args.search)
        hidden, probes = Prober(layer, tokens, device).largest_hidden(tiles, budget, start)
        return {"hidden": hidden, "probes": probes}
    if args.time:
        layer, tokens, device, d, tiles, steps = json.loads(args.time)
        return Prober(layer, tokens, device).step_times(d, tiles, steps)
    return None


def memory(args) -> dict:
    """``--memory``: the working memory at d 2048 for T = 1, 4, 16, one probe each."""
    rows = run_probe(args.layer, 2048, [1, 4, 16], args.tokens, device=args.device)
    print("\n".join(_show(r) for r in rows))
    return {
        "layer": args.layer,
        "d": 2048,
        **{f"working_t{r['tiles']}": r["working_bytes"] for r in rows},
    }


def main() -> None:
    args = parser().parse_args()
    result = child(args)
    if result is not None:
        print(json.dumps(result))
    elif args.check:
        print(json.dumps({"device": args.device, **check(args.device)}))
    elif args.breakdown:
        print(
            json.dumps(
                breakdown(args.layer, 2048, 8 * args.tokens, [1, 4, 16], 3, args.device), indent=1
            )
        )
    elif args.memory:
        print(json.dumps(memory(args)))
    else:
        print(json.dumps(budget_search_and_times(args)))


if __name__ == "__main__":
    main()
