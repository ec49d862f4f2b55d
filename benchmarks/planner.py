"""How well the planner predicts, whether spilling pays, and whether auto_config chooses well.

Every measured configuration runs in a fresh child process: the RSS before ``zf.init`` is its
baseline, the peak (Linux VmHWM, reset through ``/proc/self/clear_refs`` just before ``zf.init``, as
in ``benchmarks/memory.py``) is taken after the steps, and the step time is the median of the steps
after a warm-up. The prediction of each config is ``zf.estimate`` (with the sample batch) and the
step-time model over ``zf.calibrate(--dir)`` and the model's own layers timed by the planner
(``plan.compute``), between the child's steps; predicted peak RSS = the child's baseline + the
estimate's peak host.

1. accuracy: none, cpu, nvme and a spilled placement on two GPT sizes: ``max_rss_error`` and
   ``max_time_error`` (|predicted - measured| / measured, the worst config), twice the steps of the
   other parts (with ``--quick`` the median of 7 steps, and of the 7 predictions made one before
   each).
2. spillover: a model whose states are 1.5x the host budget's room for states (the budget less a
   spilled run's working memory), params in RAM and the optimizer "auto" (RAM up to the budget, the
   rest on NVMe) against everything on NVMe: ``spill_over_nvme`` = spilled
   step time / all-NVMe step time (goal <= 0.7), with the bytes each moves per step.
3. auto_config on the 13.7M GPT (d_model 512, 4 layers, vocab 1024, seq 64, batch 4) with a host
   budget half-way between the all-in-RAM and the all-on-NVMe peaks (the first does not fit, the
   second does): its choice's step time over the best hand-set placement's, each the median of
   ``AUTO_ROUNDS`` interleaved runs.
4. the tiles (``tiles_choice``): auto_config given a factory of a 55M GPT's attention and MLP tile
   counts, states in RAM, under a host budget the untiled model does not fit (0.9x its predicted
   peak): the tiles and placement it chooses, their predicted and measured peak RSS
   (``tiles_rss_error``), and the untiled model's measured peak and step beside them
   (``--tiles-only``: this part alone).

    python benchmarks/planner.py --quick --dir DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

import zinf_fn as zf
from layers import gpt
from zinf_fn.planner.fit import problems
from zinf_fn.planner.machine import disk_bandwidth
from zinf_fn.planner.sizes import plan_config
from zinf_fn.planner.timing import peak_rss, predict
from zinf_fn.state import view

SMALL = dict(
    vocab_size=1024, d_model=512, n_heads=8, n_layers=4, seq_len=64
)  # 13.7M params, batch 4
LARGE = dict(vocab_size=1024, d_model=768, n_heads=12, n_layers=8, seq_len=64)  # 57M params
DISK_BYTES = 64 << 20  # the disk measured between a run's steps (``predicted_now``): ~0.1 s
AUTO_ROUNDS = 3  # interleaved rounds of the auto_config comparison
IO_BOUND = dict(
    vocab_size=1024, d_model=512, n_heads=8, n_layers=24, seq_len=16
)  # the spillover model: 76M params


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def sample_batch(cfg: gpt.Config, batch: int, seed: int = 0) -> dict:
    tokens = torch.randint(
        0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(seed)
    )
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def child(spec: dict) -> dict:
    """Run one config (in this fresh process): baseline and peak RSS, median step time, bytes moved.

    Each step waits for a line on stdin and prints its seconds when done: the parent runs the
    planner between two steps (``measure``), never while one runs."""
    cfg, config = gpt.Config(**spec["model"]), zf.Config(**spec["config"])
    batch = sample_batch(cfg, spec["batch"])
    baseline = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    state = zf.init(gpt.model(cfg), zf.adamw(lr=1e-4, weight_decay=0.1), config, seed=0)
    times, moved = [], 0
    for _ in range(spec["steps"]):
        sys.stdin.readline()  # sync: the parent's planner call is done
        t0 = time.perf_counter()
        state, metrics = zf.train_step(state, batch)
        times.append(time.perf_counter() - t0)
        moved = sum(
            v for k, v in metrics.items() if re.fullmatch(r"bytes_(read|written)\.[a-z+]+", k)
        )
        print(json.dumps({"step": times[-1]}), flush=True)
    view(state).close()
    return {
        "baseline": baseline,
        "peak": status_bytes("VmHWM"),
        "step_s": statistics.median(times[1:]),
        "steps_s": [round(t, 3) for t in times[1:]],
        "moved": moved,
        "config": state.config.describe(),
    }


def measure(
    model: dict,
    config: zf.Config,
    batch: int,
    steps: int,
    run_dir: str,
    between: Callable[[], float] | None = None,
) -> dict:
    """``child`` in a fresh interpreter; the NVMe files go to a fresh directory under ``run_dir``.

    ``between`` (a planner call) runs before every measured step (the first after the warm-up),
    while the child waits: its results are returned as ``"between"``, so a prediction and the
    measurement it is compared with see the same seconds of a shared machine's load (none runs after
    the last step: the child's teardown would share the cores with it)."""
    path = tempfile.mkdtemp(prefix="run-", dir=run_dir)
    fields = {
        k: v
        for k, v in dataclasses.asdict(dataclasses.replace(config, nvme_path=path)).items()
        if k not in ("param_dtype", "compute_dtype")
    }
    spec = {"model": model, "config": fields, "batch": batch, "steps": steps}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            results, lines = _drive(proc, steps, between)
        finally:
            proc.kill()
            shutil.rmtree(path, ignore_errors=True)
        if proc.returncode or not lines:
            err.seek(0)
            raise RuntimeError(
                f"child failed (exit code {proc.returncode}, {len(lines)} result lines) for "
                f"{spec}:\n{err.read()}"
            )
    return {**json.loads(lines[-1]), "between": results}


def _drive(
    proc: subprocess.Popen, steps: int, between: Callable[[], float] | None
) -> tuple[list, list[str]]:
    """Step the child ``steps`` times (``between()`` before every step after the first); then (the
    results of ``between``, the lines the child printed after its steps: the last is its result).

    Everything is read through ``proc.stdout``'s own buffer: ``readline`` may already hold the
    result line (printed right after the last step's), which ``communicate``, reading the pipe
    beneath it, would miss."""
    results = []
    for i in range(steps):
        if between is not None and i >= 1:
            results.append(between())
        proc.stdin.write("\n")
        proc.stdin.flush()
        if not proc.stdout.readline():  # sync: the step is done (or the child died)
            break
    proc.stdin.close()
    rest = proc.stdout.read()  # sync: the child closed its stdout (it exited)
    proc.wait(timeout=1800)
    return results, rest.strip().splitlines()


def predicted(
    model: dict, config: zf.Config, batch: int, machine, timed: bool = True
) -> tuple[int, float | None, int, zf.Config]:
    """(peak host bytes, step seconds, bytes moved per step, the resolved config) the planner
    predicts; ``timed``: the model's layers timed now (``plan.compute``), else no step seconds
    (None)."""
    cfg = gpt.Config(**model)
    planned = plan_config(gpt.model(cfg), zf.adamw(), config, sample_batch(cfg, batch), timed=timed)
    est = planned.estimate
    step = predict(est, planned.work, machine).step if timed else None
    return peak_rss(est, machine), step, sum(est.moved.values()), est.config


def predicted_now(model: dict, config: zf.Config, batch: int, machine, run_dir: str) -> float:
    """The predicted step seconds with the model's layers timed and the disk under ``run_dir``
    measured now (``calibrate``'s other figures as they are)."""
    read, write = disk_bandwidth(run_dir, DISK_BYTES)
    return predicted(
        model, config, batch, machine._replace(disk_read_bps=read, disk_write_bps=write)
    )[1]


def accuracy(run_dir: str, machine, steps: int) -> tuple[list, float, float, float]:
    """Predicted vs measured peak RSS and step time for none / cpu / nvme / spilled on two sizes.

    The planner times the model's own layers (``plan.compute``), so a prediction follows the
    machine's speed at that moment, which on a shared machine swings within seconds: each config is
    predicted between the measured steps of its run (``measure``'s ``between``; the planner and a
    fresh disk measurement, never the run's figures) and the prediction compared is the median of
    those. ``time_error_first`` is the error of the first of them alone, made before any measured
    step."""
    rows = []
    for name, model, batch in (("small", SMALL, 4), ("large", LARGE, 2)):
        for placement in ("none", "cpu", "nvme", "spilled"):
            config = _placement(placement, model, batch, run_dir)
            peak = predicted(model, config, batch, machine, timed=False)[0]
            got = measure(
                model,
                config,
                batch,
                steps,
                run_dir,
                between=functools.partial(predicted_now, model, config, batch, machine, run_dir),
            )
            step, first, rss = (
                statistics.median(got["between"]),
                got["between"][0],
                got["peak"] - got["baseline"],
            )
            rows.append(
                {
                    "model": name,
                    "placement": placement,
                    "rss_pred_mib": round((got["baseline"] + peak) / 2**20),
                    "rss_mib": round(got["peak"] / 2**20),
                    "rss_error": abs(got["baseline"] + peak - got["peak"]) / got["peak"],
                    "engine_rss_pred_mib": round(peak / 2**20),
                    "engine_rss_mib": round(rss / 2**20),
                    "step_pred_s": round(step, 3),
                    "step_preds_s": [round(t, 3) for t in got["between"]],
                    "steps_s": got["steps_s"],
                    "step_s": round(got["step_s"], 3),
                    "time_error": abs(step - got["step_s"]) / got["step_s"],
                    "time_error_first": abs(first - got["step_s"]) / got["step_s"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return (
        rows,
        max(r["rss_error"] for r in rows),
        max(r["time_error"] for r in rows),
        max(r["time_error_first"] for r in rows),
    )


def _placement(name: str, model: dict, batch: int, run_dir: str) -> zf.Config:
    if name in ("none", "cpu", "nvme"):
        return zf.Config(offload_params=name, offload_optimizer=name, nvme_path=run_dir)
    return zf.Config(
        offload_params="cpu",
        offload_optimizer="cpu",
        spill_optimizer=f"{model['n_layers'] // 2}:nvme",
        nvme_path=run_dir,
    )


def spillover(run_dir: str, machine, steps: int) -> dict:
    """Spilled (params in RAM, optimizer RAM-then-NVMe) vs all on NVMe, the host budget room for 2/3
    of the states: states / 1.5 + the working memory of a spilled run."""
    cfg = gpt.Config(**IO_BOUND)
    nvme = zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=run_dir)
    states = sum(zf.estimate(gpt.model(cfg), zf.adamw(), zf.Config()).states.values())
    split = zf.estimate(
        gpt.model(cfg),
        zf.adamw(),
        zf.Config(
            offload_params="cpu",
            offload_optimizer="cpu",
            spill_optimizer="1:nvme",
            nvme_path=run_dir,
        ),
    )
    budget = int(states / 1.5) + sum(split.working.values())
    spilled = zf.Config(
        offload_params="cpu", offload_optimizer="auto", host_memory_budget=budget, nvme_path=run_dir
    )
    a, b = measure(IO_BOUND, spilled, 1, steps, run_dir), measure(IO_BOUND, nvme, 1, steps, run_dir)
    return {
        "spill_over_nvme": round(a["step_s"] / b["step_s"], 3),
        "spill_states_bytes": states,
        "spill_host_budget": budget,
        "spilled_config": {
            k: a["config"][k] for k in ("offload_params", "offload_optimizer", "spill_optimizer")
        },
        "spilled_step_s": round(a["step_s"], 3),
        "nvme_step_s": round(b["step_s"], 3),
        "spilled_bytes_moved": a["moved"],
        "nvme_bytes_moved": b["moved"],
    }


def auto_choice(run_dir: str, machine, steps: int) -> dict:
    """auto_config's choice on the 13.7M GPT vs the best hand-set placement that fits the same
    budget."""
    cfg, batch = gpt.Config(**SMALL), sample_batch(gpt.Config(**SMALL), 4)
    in_ram = zf.estimate(gpt.model(cfg), zf.adamw(), zf.Config(), batch).host_peak
    on_disk = zf.estimate(
        gpt.model(cfg),
        zf.adamw(),
        zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=run_dir),
        batch,
    ).host_peak
    budget = (in_ram + on_disk) // 2  # all in RAM does not fit, all on NVMe does
    chosen = zf.auto_config(
        gpt.model(cfg),
        zf.adamw(),
        nvme_path=run_dir,
        host_memory_budget=budget,
        batch=batch,
        machine=machine,
    )
    configs = {}
    for p, o in (
        ("cpu", "nvme"),
        ("nvme", "nvme"),
        ("none", "nvme"),
        ("nvme", "cpu"),
        ("cpu", "cpu"),
    ):
        config = zf.Config(
            offload_params=p, offload_optimizer=o, nvme_path=run_dir, host_memory_budget=budget
        )
        if not problems(zf.estimate(gpt.model(cfg), zf.adamw(), config, batch)):
            configs[f"{p}/{o}"] = config
    # Interleaved rounds, each placement's median over them: the best of single noisy runs is biased
    # low (two names of one placement, nvme/none and nvme/cpu on CPU compute, stepped 0.30-0.38 s a
    # minute apart).
    runs: dict[str, list[float]] = {name: [] for name in [*configs, "auto"]}
    for _ in range(AUTO_ROUNDS):
        for name, config in [*configs.items(), ("auto", chosen)]:
            runs[name].append(measure(SMALL, config, 4, steps, run_dir)["step_s"])
    hand = {name: statistics.median(runs[name]) for name in configs}
    auto_s = statistics.median(runs["auto"])
    best = min(hand.values())
    return {
        "auto_choice": f"{chosen.offload_params}/{chosen.offload_optimizer}"
        + (f">{chosen.spill_optimizer}" if chosen.spill_optimizer else ""),
        "auto_step_s": round(auto_s, 3),
        "hand_step_s": {k: round(v, 3) for k, v in hand.items()},
        "auto_over_best": round(auto_s / best, 3),
        "auto_host_budget": budget,
    }


TILED = dict(
    vocab_size=1024, d_model=1024, n_heads=8, n_layers=4, seq_len=64
)  # 55M params, batch 2
TILE_COUNTS = (1, 2, 4, 8)


def tiled_factory(attn_tiles: int, mlp_tiles: int):
    return gpt.model(gpt.Config(**TILED, attn_tiles=attn_tiles, mlp_tiles=mlp_tiles))


def tiles_choice(run_dir: str, machine, steps: int) -> dict:
    """auto_config given a factory of tile counts, states in RAM (no nvme_path: tiles are the one
    way to fit), under a host budget 0.9x the untiled model's predicted peak: the choice, its
    predicted and measured peak RSS (a child run), and the untiled model's measured peak at the
    chosen placement beside the budget."""
    cfg = gpt.Config(**TILED)
    batch = sample_batch(cfg, 2)
    untiled = zf.estimate(
        gpt.model(cfg), zf.adamw(), zf.Config(offload_params="cpu", offload_optimizer="cpu"), batch
    ).host_peak  # on CPU compute "none" is host memory too: the same peak
    budget = int(0.9 * untiled)
    choice = zf.auto_config(
        tiled_factory,
        zf.adamw(),
        host_memory_budget=budget,
        batch=batch,
        machine=machine,
        tile_counts=TILE_COUNTS,
    )
    model = {**TILED, **choice.tiles}
    peak = predicted(model, choice.config, 2, machine, timed=False)[0]
    got = measure(model, choice.config, 2, steps, run_dir)
    plain = measure(
        TILED, dataclasses.replace(choice.config, host_memory_budget=None), 2, steps, run_dir
    )
    return {
        "tiles_choice": choice.tiles,
        "tiles_config": {
            k: got["config"][k] for k in ("offload_params", "offload_optimizer", "spill_optimizer")
        },
        "tiles_host_budget_mib": round(budget / 2**20),
        "tiles_untiled_pred_peak_mib": round(untiled / 2**20),
        "tiles_rss_pred_mib": round((got["baseline"] + peak) / 2**20),
        "tiles_rss_mib": round(got["peak"] / 2**20),
        "tiles_rss_error": round(abs(got["baseline"] + peak - got["peak"]) / got["peak"], 3),
        "tiles_engine_rss_pred_mib": round(peak / 2**20),
        "tiles_engine_rss_mib": round((got["peak"] - got["baseline"]) / 2**20),
        "tiles_untiled_engine_rss_mib": round((plain["peak"] - plain["baseline"]) / 2**20),
        "tiles_step_s": round(got["step_s"], 3),
        "tiles_untiled_step_s": round(plain["step_s"], 3),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="4 steps per config (1 warm-up)")
    p.add_argument(
        "--dir", default=None, help="where the NVMe files and the calibration go (created)"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--tiles-only",
        action="store_true",
        help="only the tiles auto_config chooses (tiles_choice)",
    )
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    steps = 4 if args.quick else 8
    parent = args.dir or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="zinf-planner-", dir=parent)
    try:
        machine = zf.calibrate(run_dir)
        print(json.dumps({"machine": machine._asdict()}), flush=True)
        tiles = tiles_choice(run_dir, machine, steps)
        print(json.dumps(tiles), flush=True)
        if args.tiles_only:
            return
        rows, rss_error, time_error, first_error = accuracy(run_dir, machine, 2 * steps)
        spill = spillover(run_dir, machine, steps)
        auto = auto_choice(run_dir, machine, steps)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(
        json.dumps(
            {
                "metric": "planner",
                "max_rss_error": round(rss_error, 3),
                "max_time_error": round(time_error, 3),
                "max_time_error_first": round(first_error, 3),
                **spill,
                **auto,
                **tiles,
                "configs": len(rows),
            }
        )
    )


if __name__ == "__main__":
    main()
