"""The ``zinf-fn finetune`` command's overhead: a step of its loop (the batch, the step, the
record with tokens/s and peak RSS, ``metrics.jsonl``, progress, the signal check) over the same step
through the Python API (``zf.train_step`` on the same ``zinf_data`` batch), on the demo's Llama in
RAM.

Segments of each alternate in one process after a warm-up step (API, CLI, CLI, API in each
round), on one state (both continue it), so both see the same machine and the same threads. Last
line: JSON (``ratio``: the median over rounds of CLI / API time, the goal <= 1.02; on a loaded
machine it swings both ways, so ``*_outside_step_ms`` also gives each loop's time per step outside
``zf.train_step``: the batch, and for the CLI its record, log line and signal check).

    python benchmarks/finetune_overhead.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import zinf_fn as zf  # noqa: E402
from checkpoints.hf import model_config  # noqa: E402
from checkpoints.hf_files import read_config  # noqa: E402
from zinf_cli import finetune, tools  # noqa: E402
from zinf_cli.engine import engine_config, optimizer_of  # noqa: E402
from zinf_cli.finetune_data import load_data  # noqa: E402
from zinf_cli.loop import rows_of  # noqa: E402
from zinf_cli.trackers import MetricsLog, Trackers  # noqa: E402


def setup(run_dir: str):
    """(args, state after one warm-up step, data, log): the demo's run in RAM, evaluating never."""
    args = finetune.parse_args(
        [
            f"run_dir={run_dir}",
            "placement=none",
            "steps=1000000",
            "eval_every=0",
            "save_every=0",
            "log_every=1000000",
        ]
    )
    args.hf_dir, demo_data = tools.demo_inputs(os.path.join(run_dir, "demo"), args.seed)
    args.data = [demo_data]
    vocab = model_config(read_config(args.hf_dir), args.hf_dir).vocab_size
    data = load_data(args, args.hf_dir, vocab)
    _, state = finetune.open_state(
        args, args.hf_dir, engine_config(args, None), optimizer_of(args), data
    )
    state, _ = zf.train_step(state, rows_of(data.train.batch(0)))  # warm-up; no eval at step 0 now
    log = Trackers(MetricsLog(os.path.join(run_dir, "metrics.jsonl"), state.step), [])
    return args, state, data, log


def api_segment(state, data, n: int):
    """(state, seconds, seconds inside ``zf.train_step``) of ``n`` steps through the Python API."""
    inside = 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        batch = rows_of(data.train.batch(state.step))
        t1 = time.perf_counter()
        state, _ = zf.train_step(state, batch)
        inside += time.perf_counter() - t1
    return state, time.perf_counter() - t0, inside


def cli_segment(args, state, data, log, n: int):
    """(state, seconds, seconds inside ``zf.train_step``) of ``n`` steps of the command's loop
    (``finetune.train``; its records time each step as ``tokens / tokens_per_s``)."""
    args.stop_at = state.step + n
    first = len(log.records)
    t0 = time.perf_counter()
    state = finetune.train(args, state, data, log, save=None)
    seconds = time.perf_counter() - t0
    # step s trained batch s - 1, of its own length (pad_to_multiple_of)
    inside = sum(
        data.train.batch(r["step"] - 1)["targets"].numel() / r["tokens_per_s"]
        for r in log.records[first:]
        if "tokens_per_s" in r
    )
    return state, seconds, inside


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps per segment")
    p.add_argument("--quick", action="store_true", help="2 rounds of 3 steps: checks that it runs")
    args_ = p.parse_args(argv)
    rounds, steps = (2, 3) if args_.quick else (args_.rounds, args_.steps)
    with tempfile.TemporaryDirectory(prefix="zinf-overhead-") as run_dir:
        args, state, data, log = setup(run_dir)
        api, cli, api_outside, cli_outside = [], [], [], []
        for _ in range(rounds):  # API, CLI, CLI, API: a drift of the machine cancels in a round
            state, first, first_in = api_segment(state, data, steps)
            state, second, second_in = cli_segment(args, state, data, log, steps)
            state, third, third_in = cli_segment(args, state, data, log, steps)
            state, fourth, fourth_in = api_segment(state, data, steps)
            api.append(first + fourth)
            cli.append(second + third)
            api_outside.append(first + fourth - first_in - fourth_in)
            cli_outside.append(second + third - second_in - third_in)
        zf.close(state)
    result = {
        "benchmark": "finetune_overhead",
        "rounds": rounds,
        "steps_per_segment": steps,
        "api_step_s": statistics.median(api) / (2 * steps),
        "cli_step_s": statistics.median(cli) / (2 * steps),
        "ratio": statistics.median(c / a for c, a in zip(cli, api, strict=True)),
        "api_outside_step_ms": 1e3 * statistics.median(api_outside) / (2 * steps),
        "cli_outside_step_ms": 1e3 * statistics.median(cli_outside) / (2 * steps),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
