"""LoRA with the base on NVMe: the bytes a step moves, and its step time against a full fine-tune's.

Three copies of the same GPT train on the same batches, in rounds alternating in one process (the
machine's drift hits both alike), with few tokens per step so that the disk, not compute, sets the
step:

    lora   ``layers.lora`` adapters (rank ``--rank`` on ``--targets``): the frozen base on NVMe as
    its bf16
           copy only (``zinf_fn.formats.frozen``: read in forward and in backward's recompute, never
           written), the adapters' rows on NVMe too and their optimizer states in RAM; with
           ``zf.Config(keep_activations= --keep-activations, reuse_blocks=--reuse-blocks)``
           (docs/lora.md: no recompute, the last block reused)
    lora_plain  the same without those two (every block recomputed and fetched again in backward):
    the
           before of the shortcuts, ``lora_plain_over_full``, in the same rounds
    lora_in_ram the lora configuration with the base in RAM (``offload_params="cpu"``): the same
    step with no
           disk at all, the floor its compute sets on this machine (``lora_in_ram_over_full``)
    full   every parameter trains: params and optimizer on NVMe (28 bytes/param a step)

``bytes_per_param_lora`` = the bytes the lora configuration's step reads and writes through its
tiers (``state_bytes_moved``) / the base's parameters (goal <= 4.2: 2 + 2 for the bf16 base, plus
the adapters'). ``lora_over_full`` = median over rounds of (lora step / full step) within the round
(goal <= 0.2). Each round runs ``--run`` steps of each configuration, the steps after the first
timed (a step returns with its last writes in flight, as in training), then flushes untimed.

    python benchmarks/lora.py --quick --dir /work/bench-x/lora   # d_model 1024, 4 layers, 32 tokens
    a step

Without ``--quick`` it also runs the 2.2B-parameter model of ``examples/train_larger_than_ram.py``
(one child process each, so ``ru_maxrss`` is the run's own): the LoRA fine-tune with the base on
NVMe (``lora_peak_rss_gib``, goal <= 1.5, and its steps) and the full fine-tune (``--big-full``,
default on; ~31 GB of disk) for ``big_lora_over_full``, the ratio of their median steps after the
first.

Last line: JSON {"metric": "lora_over_full", "value": ..., "bytes_per_param_lora": ..., ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zinf_fn as zf  # noqa: E402
from layers import gpt, lora  # noqa: E402
from zinf_fn.state import view  # noqa: E402

GIB = 1 << 30


def make_states(cfg: gpt.Config, path: str, args) -> dict:
    """The configurations, each with its own NVMe directory under ``path``: lora (with
    ``--keep-activations`` and ``--reuse-blocks``), lora_plain (without them: every block recomputed
    and refetched) and full."""
    lm = lora.apply(
        gpt.model(cfg), rank=args.rank, alpha=2.0 * args.rank, targets=tuple(args.targets)
    )
    base = dict(offload_params="nvme", offload_optimizer="cpu", prefetch_depth=args.depth)
    configs = {
        "lora": (
            lm,
            zf.Config(
                **base,
                nvme_path=f"{path}/lora",
                keep_activations=args.keep_activations,
                reuse_blocks=args.reuse_blocks,
            ),
        ),
        "lora_plain": (lm, zf.Config(**base, nvme_path=f"{path}/lora_plain")),
        "lora_in_ram": (
            lm,
            zf.Config(
                offload_params="cpu",
                offload_optimizer="cpu",
                prefetch_depth=args.depth,
                keep_activations=args.keep_activations,
                reuse_blocks=args.reuse_blocks,
            ),
        ),
        "full": (
            gpt.model(cfg),
            zf.Config(
                offload_params="nvme",
                offload_optimizer="nvme",
                nvme_path=f"{path}/full",
                prefetch_depth=args.depth,
            ),
        ),  # the baseline: as it always ran
    }
    for name in configs:
        Path(path, name).mkdir()
    return {
        name: zf.init(model, zf.adamw(lr=1e-4), config) for name, (model, config) in configs.items()
    }


def base_params(state) -> int:
    """Parameters of the frozen base: every element of the groups that hold frozen leaves only."""
    v = view(state)
    return sum(g.spec.numel * g.rows for name, g in v.groups.items() if v.is_frozen(name))


def timed_run(state, data: list) -> tuple:
    """(state, seconds per step of the steps after the first, bytes moved per step): the first step
    leaves its writes in flight for the timed ones, and the last step's are flushed after the clock
    stopped."""
    state, _ = zf.train_step(state, data[0])
    moved = 0
    t0 = time.perf_counter()
    for batch in data[1:]:
        state, metrics = zf.train_step(state, batch)
        moved += metrics["state_bytes_moved"]
    seconds = (time.perf_counter() - t0) / (len(data) - 1)
    view(
        state
    ).flush()  # sync: this configuration's last writes end before the other configuration runs
    return state, seconds, moved / (len(data) - 1)


def interleaved(cfg: gpt.Config, args, path: str) -> dict:
    """The quick model's configurations in alternating rounds: the ratios, the bytes, the step
    times."""
    states = make_states(cfg, path, args)
    base = base_params(states["lora"])
    gen = torch.Generator().manual_seed(0)

    def batch():
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    for name in states:  # warm-up: every buffer made, every code path run once
        states[name], _ = zf.train_step(states[name], batch())
        view(states[name]).flush()
    times, moved = {n: [] for n in states}, {n: [] for n in states}
    for r in range(args.rounds):
        data = [batch() for _ in range(args.run)]
        for name in states:
            states[name], seconds, nbytes = timed_run(states[name], data)
            times[name].append(seconds)
            moved[name].append(nbytes)
        print(
            f"round {r}: " + "  ".join(f"{n} {times[n][-1]:.3f}s/step" for n in states), flush=True
        )
    for state in states.values():
        view(state).close()
    ratio = statistics.median(a / b for a, b in zip(times["lora"], times["full"], strict=True))
    plain, in_ram = (
        statistics.median(a / b for a, b in zip(times[n], times["full"], strict=True))
        for n in ("lora_plain", "lora_in_ram")
    )
    return {
        "metric": "lora_over_full",
        "value": round(ratio, 3),
        "lora_plain_over_full": round(plain, 3),
        "lora_in_ram_over_full": round(in_ram, 3),
        "lora_in_ram_step_s": round(statistics.median(times["lora_in_ram"]), 3),
        "lora_plain_step_s": round(statistics.median(times["lora_plain"]), 3),
        "bytes_per_param_lora_plain": round(statistics.median(moved["lora_plain"]) / base, 3),
        "bytes_per_param_lora": round(statistics.median(moved["lora"]) / base, 3),
        "bytes_per_param_full": round(statistics.median(moved["full"]) / base, 3),
        "lora_step_s": round(statistics.median(times["lora"]), 3),
        "full_step_s": round(statistics.median(times["full"]), 3),
        "base_params": base,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "tokens_per_step": args.batch * args.seq,
        "keep_activations": args.keep_activations,
        "reuse_blocks": args.reuse_blocks,
        "rank": args.rank,
        "targets": args.targets,
        "rounds": args.rounds,
        "steps_per_round": args.run,
    }


def big_run(args, path: str, rank: int) -> dict:
    """``examples/train_larger_than_ram.py`` in a child process (its own peak RSS), LoRA where
    ``rank``: its JSON line."""
    command = [
        sys.executable,
        str(ROOT / "examples" / "train_larger_than_ram.py"),
        "--path",
        path,
        "--steps",
        str(args.big_steps),
    ]
    if rank:
        command += ["--lora-rank", str(rank), "--lora-targets", *args.targets]
    print("running", " ".join(command), flush=True)
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    print(done.stdout, file=sys.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def big(args, path: str) -> dict:
    """The 2.2B model: the LoRA run's peak RSS and steps, and (``--big-full``) the full run's
    steps."""
    lora_run = big_run(args, path, args.rank)
    out = {
        "lora_peak_rss_gib": round(lora_run["peak_rss_bytes"] / GIB, 3),
        "big_lora_steps_s": lora_run["seconds_per_step"],
        "big_lora_init_s": lora_run["init_s"],
        "big_lora_bytes_per_param": lora_run["bytes_per_param"],
        "big_params": lora_run["params"],
    }
    if args.big_full:
        full = big_run(args, path, 0)
        lora_s, full_s = (
            statistics.median(run["seconds_per_step"][1:]) for run in (lora_run, full)
        )
        out.update(
            big_full_steps_s=full["seconds_per_step"],
            big_full_init_s=full["init_s"],
            big_full_peak_rss_gib=round(full["peak_rss_bytes"] / GIB, 3),
            big_lora_over_full=round(lora_s / full_s, 3),
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="the interleaved small model only (no 2.2B runs)"
    )
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--run", type=int, default=3, help="steps of a configuration per round (first untimed)"
    )
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument(
        "--keep-activations",
        type=int,
        default=64 << 20,
        help="Config.keep_activations of the LoRA configuration (bytes; 0: every block recomputed)",
    )
    parser.add_argument(
        "--reuse-blocks",
        type=int,
        default=1,
        help="Config.reuse_blocks of the LoRA configuration (last blocks kept into the backward)",
    )
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument(
        "--targets", nargs="+", default=["attn.qkv"], help="the adapted block linears"
    )
    parser.add_argument(
        "--big-steps", type=int, default=3, help="steps of each 2.2B run (without --quick)"
    )
    parser.add_argument(
        "--big-full",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the 2.2B full fine-tune (~31 GB of disk) for big_lora_over_full",
    )
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="directory for the NVMe tiers (created)"
    )
    args = parser.parse_args()
    if args.run < 2:
        parser.error(f"--run must be >= 2 (the first step of a round is not timed), got {args.run}")
    cfg = gpt.Config(
        vocab_size=256,
        d_model=args.d_model,
        n_heads=max(1, args.d_model // 64),
        n_layers=args.layers,
        seq_len=args.seq,
    )
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    path = tempfile.mkdtemp(prefix="lora-", dir=args.dir)
    try:
        result = interleaved(cfg, args, path)
        if not args.quick:
            result.update(big(args, path))
        print(json.dumps(result))
    finally:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
