"""The 30B mixture-of-experts step with the side thread (``tiling.two_at_once``: a layer's frozen
experts two at once, a big lent linear's forward in two halves of its rows) against the same step
with every product on the compute thread, in one run.

``examples/train_larger_than_ram.py --moe qwen3-30b-a3b --lora-rank 8 --frozen-storage nf4``'s
model and engine config, ``--layers`` deep (8 by default: a 2 GB store under ``--dir``), 32 tokens a
step of the example's text. After a first step, each round takes the next batch and steps it once
each way (the order alternating by round, so each way as often follows the other on the same batch);
"one" is ``two_at_once.each`` with no job handed to the side thread (a lent linear's two halves
and a frozen head's two lanes then both on the compute thread). ``--against torch-threads``: "one"
keeps the side thread and runs torch on the compute thread at torch's threads, as before the step
set one beside it (``two_at_once.torch_on_one_thread`` doing nothing). Printed per step: the wall
time, the engine's waits, and every thread's CPU seconds and seconds waiting for a core
(``/proc/self/task/*/schedstat``), by thread name.

    python benchmarks/side_thread.py --dir DIR              # ~3 min on 2 cores
    python benchmarks/side_thread.py --dir DIR --layers 48  # the whole model: ~7 min
    python benchmarks/side_thread.py --dir DIR --against torch-threads

Last line: JSON {"metric": "two_over_one", "value": median step with the side thread / without}
(``--against torch-threads``: with torch on one thread beside it / without).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import moe_run  # noqa: E402
import train_larger_than_ram  # noqa: E402

import zinf_fn as zf  # noqa: E402
from zinf_cli import corpus  # noqa: E402
from zinf_fn.tiling import two_at_once  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def threads_now() -> dict[str, tuple[float, float]]:
    """Each live thread's (CPU seconds, seconds waiting for a core), by name (numbered names of one
    pool summed; threads Python did not start as "native")."""
    names = {t.native_id: t.name.rstrip("0123456789").rstrip("_") for t in threading.enumerate()}
    out: dict[str, tuple[float, float]] = collections.defaultdict(lambda: (0.0, 0.0))
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            sched = open(f"/proc/self/task/{tid}/schedstat").read().split()
        except OSError:  # the thread ended
            continue
        name = names.get(int(tid), "native")
        cpu, queued = out[name]
        out[name] = (cpu + (int(stat[11]) + int(stat[12])) / TICK, queued + int(sched[1]) / 1e9)
    return dict(out)


def _one_at_a_time(each):
    def run(jobs, fetch, compute, release, side_ok):
        return each(jobs, fetch, compute, release, lambda j, held: False)

    return run


@contextlib.contextmanager
def _torch_as_it_is(on: bool):
    yield


class Ways:
    """The two ways a step runs: "two" as the engine runs it, "one" without the side thread
    (``against`` "side") or without torch on one thread beside it ("torch-threads")."""

    def __init__(self, against: str):
        self.against = against
        self.each, self.alone = two_at_once.each, two_at_once.torch_on_one_thread

    def set(self, mode: str) -> None:
        other = mode == "one"
        side_off = other and self.against == "side"
        two_at_once.each = _one_at_a_time(self.each) if side_off else self.each
        torch_off = other and self.against == "torch-threads"
        two_at_once.torch_on_one_thread = _torch_as_it_is if torch_off else self.alone

    def restore(self) -> None:
        self.set("two")


def step(state, batch, mode: str, ways: Ways) -> tuple:
    """One step ``mode`` ("one" or "two"): (state, its record)."""
    ways.set(mode)
    before, start = threads_now(), time.perf_counter()
    state, metrics = zf.train_step(state, batch)
    wall, after = time.perf_counter() - start, threads_now()
    cpu = {k: round(v[0] - before.get(k, (0, 0))[0], 2) for k, v in after.items()}
    queued = {k: round(v[1] - before.get(k, (0, 0))[1], 2) for k, v in after.items()}
    waits = {k: round(float(v), 2) for k, v in metrics.items() if k.endswith("wait_s")}
    record = {"mode": mode, "step_s": round(wall, 3), **waits, "cpu_s": cpu, "runqueue_s": queued}
    return state, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="the store's directory (made, then removed)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--against",
        choices=("side", "torch-threads"),
        default="side",
        help="what the other way lacks: the side thread, or torch on one thread beside it",
    )
    args = parser.parse_args()
    path = Path(args.dir) / "side_thread"
    (path / "run").mkdir(parents=True, exist_ok=True)
    example = train_larger_than_ram.parse_args(
        ["--moe", "qwen3-30b-a3b", "--lora-rank", "8", "--frozen-storage", "nf4"]
        + ["--layers", str(args.layers), "--path", str(path)]
    )
    cfg = moe_run.model_config(example)
    model = moe_run.make_model(example, cfg)
    config = moe_run.engine_config(example, str(path / "run"))
    ways = Ways(args.against)
    try:
        state = zf.init(model, zf.adamw(lr=1e-4, weight_decay=0.0), config, seed=0)
        batches = corpus.batches(corpus.load_corpus(None), 1, 32, seed=0)
        state, _ = zf.train_step(state, next(batches))
        steps: dict[str, list[float]] = {"one": [], "two": []}
        for r in range(args.rounds):
            batch = next(batches)
            for mode in ("one", "two") if r % 2 == 0 else ("two", "one"):
                state, record = step(state, batch, mode, ways)
                steps[mode].append(record["step_s"])
                print(json.dumps(record), flush=True)
        zf.close(state)
    finally:
        ways.restore()
        shutil.rmtree(path, ignore_errors=True)
    one, two = statistics.median(steps["one"]), statistics.median(steps["two"])
    print(
        json.dumps(
            {
                "metric": "two_over_one",
                "value": round(two / one, 3),
                "layers": args.layers,
                "against": args.against,
                "step_s_one": round(one, 3),
                "step_s_two": round(two, 3),
                "rounds": args.rounds,
            }
        )
    )


if __name__ == "__main__":
    main()
