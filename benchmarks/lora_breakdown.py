"""Where a LoRA step's time goes, with and without the shortcuts (``keep_activations``,
``reuse_blocks``).

The quick model of ``benchmarks/lora.py`` (base and adapters on NVMe, the adapters' optimizer states
in RAM), twice in one process: ``plain`` (every block recomputed and refetched) and ``shortcuts``,
alternating rounds of steps, each with a Chrome trace (``zf.Config(trace=)``). From the compute
thread's spans of every step after the first of each round: a step runs from one ``wait embed`` to
the next; the forward ends where the head's compute begins, the backward starts where it ends; a
phase's compute is its time less its waits.

    python benchmarks/lora_breakdown.py --dir /work/bench-x/lb

Last line: JSON {"metric": "lora_breakdown_ms", "plain": {...}, "shortcuts": {...}} (means in ms).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zinf_fn as zf  # noqa: E402
from layers import gpt, lora  # noqa: E402
from zinf_fn.state import view  # noqa: E402

PARTS = (
    "start wait",
    "forward compute",
    "forward waits",
    "head",
    "backward compute",
    "backward waits",
    "step",
)


def step_parts(spans: list[dict], a: int, b: int) -> dict:
    """One step's parts (microseconds) from the compute thread's spans between ``a`` and ``b``."""
    mine = [e for e in spans if a <= e["ts"] < b]
    head = next(e for e in mine if e["name"] == "forward head")
    h0, h1 = head["ts"], head["ts"] + head["dur"]
    waits = [e for e in mine if e["cat"] == "wait"]
    start = sum(
        e["dur"] for e in waits if e["name"] in ("wait embed", "wait blocks.0") and e["ts"] < h0
    )
    forward = sum(e["dur"] for e in waits if e["ts"] < h0) - start
    backward = sum(e["dur"] for e in waits if e["ts"] >= h1)
    return {
        "start wait": start,
        "forward compute": h0 - a - start - forward,
        "forward waits": forward,
        "head": h1 - h0,
        "backward compute": b - h1 - backward,
        "backward waits": backward,
        "step": b - a,
    }


def breakdown(trace: str, skip: set[int]) -> dict:
    """Mean parts (ms) over the steps of ``trace`` whose index is not in ``skip`` (each round's
    first)."""
    events = json.loads(Path(trace).read_text())
    main = {
        (e["pid"], e["tid"])
        for e in events
        if e.get("name") == "thread_name" and e["args"]["name"] == "MainThread"
    }
    spans = sorted(
        (e for e in events if e.get("ph") == "X" and (e["pid"], e["tid"]) in main),
        key=lambda e: e["ts"],
    )
    starts = [e["ts"] for e in spans if e["name"] == "wait embed"]
    steps = [
        step_parts(spans, a, b)
        for i, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True))
        if i not in skip
    ]
    return {k: round(sum(s[k] for s in steps) / len(steps) / 1000, 1) for k in PARTS}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--run", type=int, default=4, help="steps of a configuration per round (first not counted)"
    )
    parser.add_argument("--keep-activations", type=int, default=64 << 20)
    parser.add_argument("--reuse-blocks", type=int, default=1)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    cfg = gpt.Config(vocab_size=256, d_model=1024, n_heads=16, n_layers=4, seq_len=32)
    model = lora.apply(gpt.model(cfg), rank=8, alpha=16.0, targets=("attn.qkv",))
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    path = tempfile.mkdtemp(prefix="lora-breakdown-", dir=args.dir)
    shortcuts = {
        "plain": {},
        "shortcuts": dict(keep_activations=args.keep_activations, reuse_blocks=args.reuse_blocks),
    }
    try:
        states = {}
        for name, kw in shortcuts.items():
            Path(path, name).mkdir()
            config = zf.Config(
                offload_params="nvme",
                offload_optimizer="cpu",
                nvme_path=f"{path}/{name}",
                prefetch_depth=2,
                trace=f"{path}/{name}.json",
                **kw,
            )
            states[name] = zf.init(model, zf.adamw(lr=1e-4), config)
        gen = torch.Generator().manual_seed(0)
        for _ in range(args.rounds):
            for name in states:
                for _ in range(args.run):
                    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), generator=gen)
                    states[name], _ = zf.train_step(
                        states[name], {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
                    )
                view(states[name]).flush()
        for state in states.values():
            view(state).close()
        # step i runs from wait embed i to i + 1: left out, each round's first step and its last
        # (whose span holds the other configuration's round)
        skip = {r * args.run for r in range(args.rounds)} | {
            r * args.run - 1 for r in range(1, args.rounds + 1)
        }
        out = {name: breakdown(f"{path}/{name}.json", skip) for name in states}
        for name, parts in out.items():
            print(name, "  ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)
        print(json.dumps({"metric": "lora_breakdown_ms", **out, **shortcuts["shortcuts"]}))
    finally:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
