"""``zinf-fn train``: pretrain a GPT (``layers.gpt``) from scratch, byte-level on a text file (by
default Python's standard-library sources: no download) or on a token file.

    zinf-fn train                                      # ~1-2 minutes on 2 CPU cores
    zinf-fn train --config gpt_pretrain.yaml steps=100 placement=cpu
    zinf-fn train --placement nvme --nvme-path /mnt/nvme/run1
    zinf-fn train --save-every 50                      # runs/train_gpt/step_000050, ...
    zinf-fn train --resume runs/train_gpt              # continue from the newest, at any world size
    torchrun --nproc-per-node 2 -m zinf_cli train      # data parallel, each rank on its slice

Every option is one name in a recipe file, as ``key=value`` and as ``--key`` (docs/cli.md).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

import checkpoints
import zinf_fn as zf
from layers import gpt

from . import corpus, recipe
from .engine import check_fit, engine_config, needs_disk, optimizer_of
from .loop import (
    Progress,
    StopSignal,
    flops_per_token,
    rank_and_world,
    timed_step,
    torchrun_world,
)
from .pretrain_options import OPTIONS
from .trackers import MetricsLog, Trackers, open_trackers

PROG = "zinf-fn train"


def model_of(args):
    """The GPT of the recipe's sizes (token-mean loss: the same as the plain mean where nothing is
    masked, as here)."""
    cfg = gpt.Config(
        vocab_size=args.vocab_size,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        seq_len=args.seq_len,
        mlp_tiles=args.mlp_tiles,
        head_tiles=args.head_tiles,
    )
    return gpt.model(cfg)


def load_data(args):
    """(train, held-out) corpora: a token file's memmap, or the bytes of a text file or stdlib."""
    if args.tokens:
        return corpus.split(corpus.load_tokens(args.tokens, args.token_dtype))
    if args.vocab_size < 256:
        raise ValueError(
            f"vocab_size {args.vocab_size}: a byte-level corpus needs 256; pass "
            "tokens= for a token file"
        )
    return corpus.split(corpus.load_corpus(args.data))


def open_state(args, model, optimizer, config):
    """A new state (``zf.init``) or, with ``resume``, the newest checkpoint there."""
    if not args.resume:
        return zf.init(model, optimizer, config, seed=args.seed)
    path = checkpoints.latest(args.resume) or args.resume  # a directory of checkpoints, or one
    saved = (checkpoints.read_manifest(path)["extra"] or {}).get("recipe", {})
    changes = recipe.training_changes(saved, args, OPTIONS)
    if saved and changes:
        raise ValueError(f"--resume: {path} was trained with another recipe: {'; '.join(changes)}")
    return checkpoints.restore(path, model, optimizer, config)


def train(args, state, stream, log: Trackers, rank: int):
    """Steps from ``state.step`` to ``steps`` (or a signal), saving every ``save_every``."""
    progress = Progress(state.step, args.steps, args.log_every, rank == 0)
    pending = []
    extra = {"family": "layers.gpt", "recipe": recipe.as_dict(args, OPTIONS)}

    def save(step: int) -> None:  # written while the next steps run
        path = os.path.join(args.run_dir, f"step_{step:06d}")
        pending[:] = [
            checkpoints.save_async(path, state, keep=args.keep, overwrite=True, extra=extra)
        ]

    flops = flops_per_token(state)
    with StopSignal() as stop:
        while state.step < args.steps:
            state, record = timed_step(state, next(stream), state.step, flops)
            log.write(record)
            progress.step(record)
            saved = args.save_every and record["step"] % args.save_every == 0
            if saved:
                save(record["step"])
            if record["step"] < args.steps and stop.requested():
                progress.write(f"stopping after step {record['step']}: a signal asked to stop")
                if args.save_every and not saved:
                    save(record["step"])
                break
    progress.close()
    if pending:
        pending[0].result()  # sync: the last checkpoint is committed before the run ends
    return state


def run(args, nvme_path: str | None) -> dict:
    """Train, evaluate on a held-out batch before and after, and sample."""
    rank, world = rank_and_world()
    torch.manual_seed(args.seed)
    optimizer = optimizer_of(args)
    model = model_of(args)
    config = engine_config(args, nvme_path)
    train_data, held_out = load_data(args)
    stream = corpus.batches(train_data, args.batch_size, args.seq_len, args.seed, rank, world)
    first = next(corpus.batches(train_data, args.batch_size, args.seq_len, args.seed, rank, world))
    check_fit(args, model, optimizer, config, first, nvme_path, show=rank == 0)
    state = open_state(args, model, optimizer, config)
    for _ in range(state.step):  # a resumed run continues the same data stream
        next(stream)
    eval_batch = next(
        corpus.batches(held_out, args.batch_size, args.seq_len, args.seed + 1, rank, world)
    )
    first_eval = float(zf.eval_step(state, eval_batch))
    if rank == 0:
        recipe.write(os.path.join(args.run_dir, "recipe.yaml"), args, OPTIONS)
    log = Trackers(
        MetricsLog(os.path.join(args.run_dir, "metrics.jsonl"), state.step, rank == 0),
        open_trackers(args.report_to, args.run_dir) if rank == 0 else [],
    )
    try:
        state = train(args, state, stream, log, rank)
    finally:
        log.close()
    last_eval = float(zf.eval_step(state, eval_batch))
    if rank == 0:
        print(
            f"held-out loss {first_eval:.3f} -> {last_eval:.3f} (nats/token; "
            f"ln {args.vocab_size} = {torch.tensor(float(args.vocab_size)).log():.3f} is chance)"
        )
    if args.sample and not args.tokens:
        params = zf.gather_params(state, "param")  # collective: every rank takes part
        if rank == 0:
            print_sample(params, model.config, train_data, args)
    zf.close(state)  # the engine's threads stopped, its files closed
    losses = [r["loss"] for r in log.records if "loss" in r]
    return {
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "eval_before": first_eval,
        "eval_after": last_eval,
        "step": state.step,
    }


def print_sample(params: dict, cfg: gpt.Config, corpus_: torch.Tensor, args) -> None:
    """``sample`` bytes generated after the corpus' first 32 (temperature 0.8, seeded)."""
    prompt = corpus_[:32].long()[None]  # (1, 32)
    gen = torch.Generator().manual_seed(args.seed)
    out = gpt.generate(params, cfg, prompt, args.sample, gen=gen, temperature=0.8)
    text = bytes(out[0].tolist()).decode("utf-8", errors="replace")
    print("---- sample ----\n" + text + "\n----------------")


def main(argv=None) -> dict:
    """Run ``zinf-fn train`` with ``argv`` (default: the command line); the run's result."""
    args = recipe.resolve(PROG, __doc__, OPTIONS, sys.argv[1:] if argv is None else argv)
    os.makedirs(args.run_dir, exist_ok=True)
    with torchrun_world(), tempfile.TemporaryDirectory(prefix="zinf-train-") as scratch:
        nvme_path = args.nvme_path
        if nvme_path is None and needs_disk(args):
            nvme_path = os.path.join(scratch, "nvme")
        return run(args, nvme_path)
