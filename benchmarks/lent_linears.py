"""A LoRA step over a frozen NF4 base whose linears are lent to the fused kernels as their codes
(``zf.Model.takes_lent``), against the same step over the fetcher's decoded weights
(``takes_lent=None``), in one run.

A dense llama block of Qwen3-30B-A3B's attention (hidden 2048, 32 query and 4 key-value heads of
128) with a gated MLP (``--d-ff``), LoRA rank 8 on q and v, the base stored NF4 in RAM, the
adapters' optimizer in RAM; at each token count of ``--rows`` (batch 1) both states step
alternately, a warm-up step each first:

    step_s_<rows>_lent, step_s_<rows>_decoded     median seconds a step
    cpu_s_<rows>_lent, cpu_s_<rows>_decoded       median CPU seconds a step of the process (every
                                                  thread: the compute thread's and the fetcher's)
    lent_over_decoded_<rows>                      step_s lent / decoded
    fetched_layers_bytes_lent / _decoded          the planner's "fetched layers" working memory
                                                  (``zf.estimate``): the decoded buffers in flight

    python benchmarks/lent_linears.py --quick   # 4 layers, 32 and 512 tokens; ~2 min on 2 cores

Last line: JSON {"metric": "lent_over_decoded_32", "value": ..., ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zinf_fn as zf  # noqa: E402
from layers import llama, lora  # noqa: E402


def model(args, lent: bool) -> zf.Model:
    cfg = llama.Config(
        vocab_size=4096,
        d_model=2048,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        d_ff=args.d_ff,
        n_layers=args.layers,
        seq_len=max(args.rows),
    )
    m = lora.apply(llama.model(cfg), rank=8, alpha=16, targets=("attn.q", "attn.v"))
    return m if lent else m._replace(takes_lent=None)


def config() -> zf.Config:
    return zf.Config(offload_params="cpu", offload_optimizer="cpu", frozen_storage="nf4")


def batch(rows: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4096, (1, rows + 1), generator=gen)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def timed_step(state, b: dict):
    """(state, wall seconds, process CPU seconds) of one step."""
    wall, cpu = time.perf_counter(), time.process_time()
    state, _ = zf.train_step(state, b)
    return state, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, 3 steps each")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-ff", type=int, default=6144)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 512])
    args = parser.parse_args()
    if args.quick:
        args.layers, args.steps = 4, 3
    out: dict = {}
    for name, lent in (("lent", True), ("decoded", False)):
        working = zf.estimate(model(args, lent), zf.adamw(), config()).working
        out[f"fetched_layers_bytes_{name}"] = working["fetched layers"]
    states = {name: zf.init(model(args, name == "lent"), zf.adamw(), config(), seed=0)
              for name in ("lent", "decoded")}
    for rows in args.rows:
        times: dict = {name: ([], []) for name in states}
        for k in range(args.steps + 1):  # the first a warm-up
            for name in states:
                states[name], wall, cpu = timed_step(states[name], batch(rows, k))
                if k:
                    times[name][0].append(wall)
                    times[name][1].append(cpu)
        for name, (walls, cpus) in times.items():
            out[f"step_s_{rows}_{name}"] = round(statistics.median(walls), 4)
            out[f"cpu_s_{rows}_{name}"] = round(statistics.median(cpus), 4)
        ratio = out[f"step_s_{rows}_lent"] / out[f"step_s_{rows}_decoded"]
        out[f"lent_over_decoded_{rows}"] = round(ratio, 4)
    for state in states.values():
        zf.close(state)
    first = args.rows[0]
    print(json.dumps({"metric": f"lent_over_decoded_{first}",
                      "value": out[f"lent_over_decoded_{first}"], **out}))


if __name__ == "__main__":
    main()
