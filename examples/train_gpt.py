"""Train a small byte-level GPT with zinf-fn: the project's default run.

    python examples/train_gpt.py                       # stdlib sources, ~1-2 minutes on 2 CPU cores
    python examples/train_gpt.py --offload cpu --steps 100
    python examples/train_gpt.py --offload nvme --nvme-path /mnt/nvme/run1
    torchrun --nproc-per-node 2 examples/train_gpt.py  # data parallel, each rank on its slice
    python examples/train_gpt.py --save-every 50       # checkpoints in runs/train_gpt/step_000050, ...
    python examples/train_gpt.py --resume runs/train_gpt   # continue from the newest one, at any world size
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data  # noqa: E402

import checkpoints  # noqa: E402
import zinf_fn as zf  # noqa: E402
from layers import gpt  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="a text file to train on (default: Python's standard-library sources)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (split over ranks)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global-norm clipping (0: off)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--offload", choices=["none", "cpu", "nvme"], default="none",
                   help="where parameters and optimizer state live")
    p.add_argument("--nvme-path", help="directory for --offload nvme")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", type=int, default=200, help="bytes to generate at the end (0: none)")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps, in the "
                   "background (0: never)")
    p.add_argument("--ckpt-dir", default="runs/train_gpt", help="where --save-every saves (keeps the newest 3)")
    p.add_argument("--resume", help="a checkpoint, or a directory of them (the newest), to continue from")
    return p.parse_args(argv)


def setup_distributed() -> tuple[int, int]:
    """Join the torchrun process group when launched by torchrun; a single process needs none."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def cosine_schedule(lr: float, warmup: int, steps: int):
    import math

    def schedule(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    return schedule


def no_decay_for_norms_and_biases(path: str) -> bool:
    return path.endswith(".w") and ".ln" not in path and "ln_f" not in path


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, world = setup_distributed()
    torch.manual_seed(args.seed)
    cfg = gpt.Config(vocab_size=256, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers,
                     seq_len=args.seq_len)
    config = zf.Config(offload_params=args.offload, offload_optimizer=args.offload, nvme_path=args.nvme_path,
                       grad_accum=args.grad_accum, clip_grad_norm=args.clip or None)
    opt = zf.adamw(lr=cosine_schedule(args.lr, args.warmup, args.steps), b1=0.9, b2=0.95,
                   weight_decay=args.weight_decay, mask=no_decay_for_norms_and_biases)
    train, held_out = data.split(data.load_corpus(args.data))
    if args.resume:
        path = checkpoints.latest(args.resume) or args.resume   # a directory of checkpoints, or one
        state = checkpoints.restore(path, gpt.model(cfg), opt, config)
    else:
        state = zf.init(gpt.model(cfg), opt, config, seed=args.seed)
    stream = data.batches(train, args.batch_size, args.seq_len, args.seed, rank, world)
    for _ in range(state.step):   # a resumed run continues the same data stream
        next(stream)
    eval_batch = next(data.batches(held_out, args.batch_size, args.seq_len, args.seed + 1, rank, world))
    first_eval = float(zf.eval_step(state, eval_batch))
    losses = train_loop(state_box := [state], stream, args, rank, world)
    state = state_box[0]
    last_eval = float(zf.eval_step(state, eval_batch))
    if rank == 0:
        print(f"held-out loss {first_eval:.3f} -> {last_eval:.3f} (nats/byte; ln 256 = 5.545 is chance)")
    if args.sample:
        params = zf.gather_params(state, "param")   # collective: every rank takes part
        if rank == 0:
            print_sample(params, cfg, train, args)
    return {"first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "eval_before": first_eval, "eval_after": last_eval}


def train_loop(state_box: list, stream, args, rank: int, world: int) -> list[float]:
    losses, tokens, saving = [], args.batch_size * args.seq_len, None
    first = state_box[0].step
    bar = tqdm(range(first, args.steps), disable=rank != 0, unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    for step in bar:
        state_box[0], metrics = zf.train_step(state_box[0], next(stream))
        losses.append(metrics["loss"])
        rate = tokens * (step + 1 - first) / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{rate:,.0f}", lr=f"{metrics['lr']:.1e}")
        if args.save_every and (step + 1) % args.save_every == 0:   # written while the next steps run
            path = os.path.join(args.ckpt_dir, f"step_{step + 1:06d}")
            saving = checkpoints.save_async(path, state_box[0], keep=3, overwrite=True)
    if saving is not None:
        saving.result()   # the last checkpoint is committed before the run ends
    return losses


def print_sample(params: dict, cfg: gpt.Config, corpus: torch.Tensor, args) -> None:
    prompt = corpus[:32].long()[None]   # (1, 32)
    gen = torch.Generator().manual_seed(args.seed)
    out = gpt.generate(params, cfg, prompt, args.sample, gen=gen, temperature=0.8)
    text = bytes(out[0].tolist()).decode("utf-8", errors="replace")
    print("---- sample ----\n" + text + "\n----------------")


if __name__ == "__main__":
    main()
