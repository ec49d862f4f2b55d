"""Render one training step of a ``zf.Config(trace=...)`` Chrome trace as a Gantt chart (PNG).

One row per thread (compute, prefetch, update, the NVMe tiers' I/O threads), one bar per span,
coloured by kind: compute, gather, update, read, write, and the compute thread's waits.

    python benchmarks/plot_trace.py trace.json step.png            # the last complete step
    python benchmarks/plot_trace.py trace.json step.png --step 1

Steps are told apart by their first span, "forward embed" on the compute thread.
"""

from __future__ import annotations

import argparse
import json

COLOURS = {
    "compute": "#4c72b0",
    "gather": "#8172b2",
    "update": "#55a868",
    "read": "#dd8452",
    "write": "#c44e52",
    "wait": "#000000",
}


def step_window(spans: list[dict], step: int | None) -> tuple[float, float, int]:
    starts = sorted(e["ts"] for e in spans if e["name"] == "forward embed")
    if not starts:
        raise SystemExit("no 'forward embed' span: is this a zinf_fn training trace?")
    index = len(starts) - 1 if step is None else step
    if not 0 <= index < len(starts):
        raise SystemExit(f"--step {step}: the trace holds steps 0..{len(starts) - 1}")
    end = starts[index + 1] if index + 1 < len(starts) else max(e["ts"] + e["dur"] for e in spans)
    return starts[index], end, index


def thread_order(name: str) -> tuple:
    for rank, prefix in enumerate(("MainThread", "zinf-fetch", "zinf-update", "zinf-nvme")):
        if name.startswith(prefix):
            return (rank, name)
    return (9, name)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace")
    parser.add_argument("out")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--title", default=None)
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = json.load(open(args.trace))
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = [e for e in events if e.get("ph") == "X"]
    t0, t1, index = step_window(spans, args.step)
    inside = [e for e in spans if e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    threads = sorted({e["tid"] for e in inside}, key=lambda t: thread_order(names.get(t, str(t))))
    row = {tid: i for i, tid in enumerate(threads)}
    fig, ax = plt.subplots(figsize=(14, 0.32 * len(threads) + 1.6), dpi=90)
    for cat, colour in COLOURS.items():
        bars = [
            ((max(e["ts"], t0) - t0) / 1e6, min(e["dur"], t1 - e["ts"]) / 1e6, row[e["tid"]])
            for e in inside
            if e["cat"] == cat
        ]
        for tid in threads:
            mine = [(x, w) for x, w, r in bars if r == row[tid]]
            if mine:
                height = 0.45 if cat == "wait" else 0.8
                ax.broken_barh(
                    mine, (row[tid] - height / 2, height), facecolors=colour, linewidth=0
                )
    ax.set_yticks(range(len(threads)))
    ax.set_yticklabels(
        [names.get(t, str(t)).replace("MainThread", "compute (main)") for t in threads], fontsize=7
    )
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the step")
    ax.set_xlim(0, (t1 - t0) / 1e6)
    ax.set_title(args.title or f"{args.trace}: step {index} ({(t1 - t0) / 1e6:.1f} s)", fontsize=9)
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in COLOURS.items()],
        loc="upper right",
        fontsize=7,
        ncol=6,
    )
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}: step {index}, {len(inside)} spans on {len(threads)} threads")


if __name__ == "__main__":
    main()
