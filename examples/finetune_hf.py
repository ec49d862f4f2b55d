"""Fine-tune a local Hugging Face checkpoint (Llama / Mistral / Qwen2) on your own data, with its own tokenizer.

    python examples/finetune_hf.py                      # a small random Llama and chat data made here, < 1 min
    python examples/finetune_hf.py --hf-dir ~/models/Llama-3.2-1B-Instruct --data train.jsonl --format chat \\
        --val val.jsonl --steps 1000 --pack --seq-len 1024 --placement nvme --nvme-path /mnt/nvme/ft
    python examples/finetune_hf.py ... --resume         # continue from the run's newest checkpoint
    python examples/finetune_hf.py ... --lora-rank 8 --lora-alpha 16 --lora-targets attn.q attn.v [--merge]
    torchrun --nproc-per-node 2 examples/finetune_hf.py ...   # data parallel: each rank takes B/N rows

Data (``zinf_data``; see docs/finetuning.md): ``--format chat`` (JSONL ``messages``, rendered by the
tokenizer's chat template: only the assistant's tokens are trained), ``prompt-response`` (the prompt is
masked) or ``text`` (plain text files or a JSONL text field); Parquet/Arrow files through ``datasets``.
Tokenized once into ``RUN/token_cache`` (memory-mapped; rebuilt when the data or tokenizer changes). The
loss is the mean over the global batch's target tokens (``zf.TokenLoss``). ``--pack`` puts several
examples in a row, each attending only to itself; otherwise each row is one example, padded.

The run directory (``--run-dir``, default ``runs/finetune_hf``) gets ``metrics.jsonl`` (train loss, lr,
grad norm per step; held-out loss and perplexity every ``--eval-every`` steps), ``curves.png``,
checkpoints ``ckpt/step_N`` (every ``--save-every`` steps, the newest ``--keep`` kept, with the data
position; ``--resume`` continues from the newest and sees exactly the batches an uninterrupted run
would) and the export ``hf/`` (``checkpoints.to_hf`` plus the tokenizer), from which transformers
answers one held-out prompt greedily at the end. Under ``torchrun`` every rank builds the same global
batch and takes its rows; rank 0 writes the metrics, the curves and the tokenizer.

LoRA (``--lora-rank R``, ``layers.lora`` through ``checkpoints.from_hf(transform=)``; docs/lora.md): only the
adapters of ``--lora-targets`` (default: the family's, ``attn.q attn.v``) train; the frozen base is stored as
its 16-bit copy only, on NVMe with ``--placement nvme`` (the adapters' optimizer states then in RAM), read
each step and never written. The run exports the adapter as PEFT writes it, ``adapter/``
(``checkpoints.to_peft``; ``peft.PeftModel.from_pretrained(base, RUN/adapter)`` loads it), and with
``--merge`` also the merged weights as ``hf/`` (``checkpoints.to_hf``, PEFT's ``merge_and_unload``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import finetune_tools as tools  # noqa: E402

import checkpoints  # noqa: E402
import zinf_data as zd  # noqa: E402
import zinf_fn as zf  # noqa: E402
from checkpoints.hf import FAMILIES, model_config  # noqa: E402
from checkpoints.hf_files import read_config  # noqa: E402
from layers import lora  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", help="a local HF model directory with its tokenizer (default: a small random Llama)")
    p.add_argument("--data", nargs="+", help="training files (.jsonl, .txt, .parquet, .arrow); needed with --hf-dir")
    p.add_argument("--format", choices=zd.FORMATS, default="chat")
    p.add_argument("--val", nargs="+", help="held-out files (default: --val-fraction of the training examples)")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--train-on-prompt", action="store_true", help="train on every token, prompts and markup too")
    p.add_argument("--pack", action="store_true", help="several examples per row (attention stays within each)")
    p.add_argument("--truncate", action="store_true", help="cut examples longer than --seq-len (default: refuse)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64, help="at most the model's max_position_embeddings")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=10, help="warmup steps, then a cosine to lr/10 at --steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="global-norm clipping (0: off)")
    p.add_argument("--placement", choices=["none", "cpu", "nvme"], default="nvme")
    p.add_argument("--nvme-path", help="directory for --placement nvme (default: a temporary one)")
    p.add_argument("--run-dir", default="runs/finetune_hf", help="metrics, curves, checkpoints, export")
    p.add_argument("--eval-every", type=int, default=20, help="held-out loss every N steps (0: only at the end)")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (0: never)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in RUN/ckpt")
    p.add_argument("--stop-at", type=int, default=0, help="stop after step N as an interruption would (no export)")
    p.add_argument("--export-dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank only (0: every weight)")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA's alpha: the update is scaled alpha / rank")
    p.add_argument("--lora-targets", nargs="+", help="block linears to adapt (default: the family's, attn.q attn.v)")
    p.add_argument("--merge", action="store_true", help="with --lora-rank: also export the merged weights as hf/")
    p.add_argument("--frozen-storage", choices=["bf16", "int8", "nf4"], default="bf16",
                   help="with --lora-rank: how the frozen base's block linears are stored (zf.Config.frozen_storage)")
    p.add_argument("--keep-activations", type=int, default=0,
                   help="bytes of saved activations kept from forward to backward (zf.Config.keep_activations)")
    p.add_argument("--reuse-blocks", type=int, default=0,
                   help="last blocks kept fetched into the backward (zf.Config.reuse_blocks)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_data(args, hf_dir: str, vocab_size: int):
    """(tokenizer, train batches, held-out batches, the data's identity kept in checkpoints)."""
    tok = zd.load_tokenizer(hf_dir, vocab_size)
    cache = os.path.join(args.run_dir, "token_cache")
    too_long = "truncate" if args.truncate else ("split" if args.format == "text" else "refuse")

    def prepared(files):
        data = zd.tokenized(files, args.format, tok, hf_dir, cache, train_on_prompt=args.train_on_prompt)
        return data, zd.spans(data, args.seq_len, too_long)

    train, spans = prepared(args.data)
    if args.val:
        val, val_spans = prepared(args.val)
    else:
        val, (spans, val_spans) = train, zd.held_out(spans, args.val_fraction, args.seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0

    def batches(data, s, shuffle, what):
        return zd.Batches(data, s, args.seq_len, args.batch_size, args.pack, pad, args.seed, shuffle, what)

    identity = {"train": os.path.basename(train.path), "val": os.path.basename(val.path), "seed": args.seed,
                "batch_size": args.batch_size, "seq_len": args.seq_len, "pack": args.pack,
                "lora": [args.lora_rank, args.lora_alpha, args.lora_targets] if args.lora_rank else None}
    val_what = f"held-out data ({'--val' if args.val else f'--val-fraction {args.val_fraction} of --data'})"
    return tok, batches(train, spans, True, "training data"), batches(val, val_spans, False, val_what), identity


def lora_of(args):
    """The LoRA transform of ``--lora-rank`` / ``--lora-alpha`` / ``--lora-targets``; None without LoRA."""
    if not args.lora_rank:
        return None
    targets = tuple(args.lora_targets) if args.lora_targets else None
    return lambda model: lora.apply(model, rank=args.lora_rank, alpha=args.lora_alpha, targets=targets)


def open_state(args, hf_dir: str, config: zf.Config, optimizer, identity: dict):
    """(model, state): from the HF weights, or with ``--resume`` from the newest checkpoint (same data)."""
    overrides, transform = {"token_loss": True}, lora_of(args)
    newest = checkpoints.latest(os.path.join(args.run_dir, "ckpt")) if args.resume else None
    if newest is None:
        if args.resume:
            print(f"--resume: no checkpoint in {args.run_dir}/ckpt; starting from {hf_dir}")
        return checkpoints.from_hf(hf_dir, optimizer, config, overrides=overrides, transform=transform)
    saved = checkpoints.read_manifest(newest)["extra"]
    if saved.get("data") != identity:
        raise ValueError(f"--resume: {newest} was trained on data {saved.get('data')}, this run has {identity}; "
                         "resume with the same data, seed, batch size, seq len, packing and LoRA settings")
    hf_config = saved["hf_config"]
    model = FAMILIES[hf_config["model_type"]].model(model_config(hf_config, newest, overrides))
    model = model if transform is None else transform(model)
    state = checkpoints.restore(newest, model, optimizer, config)
    print(f"resumed {newest} at step {state.step}")
    return model, state


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: a process group torchrun (or a test) set up, or (0, 1)."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def rows_of(batch: dict) -> dict:
    """This rank's rows of a global batch (every rank builds the same one)."""
    rank, world = rank_and_world()
    n = next(iter(batch.values())).shape[0] // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def evaluate(state, val: zd.Batches) -> dict:
    """Held-out loss over every held-out batch, weighted by their target tokens, and its perplexity."""
    total, count = 0.0, 0
    for i in range(val.per_epoch(0)):
        batch = val.batch(i)
        n = int((batch["targets"] != zd.IGNORE).sum())   # the global batch's: eval_step's mean is over all ranks
        if n:
            total += float(zf.eval_step(state, rows_of(batch))) * n
            count += n
    loss = total / max(count, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


def train(args, state, train_batches, val_batches, log, save) -> object:
    end = min(args.steps, args.stop_at or args.steps)
    bar = tqdm(range(state.step, end), unit="step", dynamic_ncols=True, disable=rank_and_world()[0] != 0)
    stream = train_batches.from_(state.step)
    if state.step == 0:   # the held-out loss before training: where the curve starts
        log.write({"step": 0, **evaluate(state, val_batches)})
    for step in bar:
        state, m = zf.train_step(state, rows_of(next(stream)))
        log.write({"step": step + 1, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"]})
        bar.set_postfix(loss=f"{m['loss']:.3f}")
        if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.steps:
            record = evaluate(state, val_batches)
            log.write({"step": step + 1, **record})
            bar.write(f"step {step + 1}: held-out loss {record['val_loss']:.4f} (ppl {record['val_ppl']:.2f})")
        if args.save_every and (step + 1) % args.save_every == 0:
            save(state, step + 1)
    return state


def finetune(args, hf_dir: str, nvme_path: str | None) -> dict:
    adapters_in_ram = args.lora_rank and args.placement == "nvme"   # LoRA: the base on NVMe, the adapters' states not
    config = zf.Config(offload_params=args.placement, offload_optimizer="cpu" if adapters_in_ram else args.placement,
                       nvme_path=nvme_path, clip_grad_norm=args.clip or None, grad_accum=args.grad_accum,
                       frozen_storage=args.frozen_storage, keep_activations=args.keep_activations,
                       reuse_blocks=args.reuse_blocks)
    optimizer = zf.adamw(lr=tools.warmup_cosine(args.lr, args.warmup, args.steps), b1=0.9, b2=0.95,
                         weight_decay=args.weight_decay)
    hf_config = read_config(hf_dir)
    cfg = model_config(hf_config, hf_dir)
    if args.seq_len > cfg.seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings {cfg.seq_len}")
    tok, train_batches, val_batches, identity = load_data(args, hf_dir, cfg.vocab_size)
    t0 = time.perf_counter()
    model, state = open_state(args, hf_dir, config, optimizer, identity)
    adapters = f", LoRA rank {args.lora_rank} on {model.config.targets}" if args.lora_rank else ""
    print(f"{lora.base_config(model.config).family}, {model.n_layers} layers{adapters}, ready in "
          f"{time.perf_counter() - t0:.1f} s")
    log = tools.MetricsLog(os.path.join(args.run_dir, "metrics.jsonl"), state.step, write=rank_and_world()[0] == 0)
    pending = []

    def save(state, step):   # written while the next steps run; the data position is the step
        path = os.path.join(args.run_dir, "ckpt", f"step_{step:06d}")
        pending[:] = [checkpoints.save_async(path, state, keep=args.keep, overwrite=True,
                                             extra={"hf_config": hf_config, "data": identity})]

    state = train(args, state, train_batches, val_batches, log, save)
    if pending:
        pending[0].result()   # sync: the last checkpoint is committed
    if state.step < args.steps:   # --stop-at: interrupted
        return {"stopped_at": state.step}
    return finish(args, state, tok, hf_config, log, val_batches)


def finish(args, state, tok, hf_config: dict, log, val_batches) -> dict:
    """Export with the tokenizer, plot the curves, and sample the exported model on a held-out prompt."""
    out, hf_dir = export(args, state, hf_config)   # collective
    curves = os.path.join(args.run_dir, "curves.png")
    if rank_and_world()[0] != 0:
        return {"out": out, "records": log.records}
    tok.save_pretrained(out)
    tools.plot_curves(log.records, curves, f"fine-tune ({args.format}, {args.steps} steps)")
    losses = [r["loss"] for r in log.records if "loss" in r]
    val = [r["val_loss"] for r in log.records if "val_loss" in r]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; held-out {val[0]:.3f} -> {val[-1]:.3f}; exported to {out}: "
          f"{', '.join(sorted(os.listdir(out)))}; curves {curves}")
    result = {"first_loss": losses[0], "last_loss": losses[-1], "val_losses": val, "out": out, "curves": curves,
              "records": log.records}
    if args.format == "chat":
        messages = prompt_of(val_batches, tok)
        adapter = out if args.lora_rank and not args.merge else None
        result["sample"] = tools.greedy_sample(hf_dir if adapter else out, messages, adapter=adapter)
        print(f"prompt: {messages[-1]['content']!r} -> greedy answer: {result['sample']!r}")
    return result


def export(args, state, hf_config: dict) -> tuple[str, str]:
    """(the export directory, the HF model to sample): ``hf/`` (``to_hf``: LoRA merged), or with LoRA and no
    ``--merge`` the PEFT adapter ``adapter/`` (``to_peft``) over the base it was imported from. Collective."""
    if args.lora_rank:
        adapter = os.path.join(args.run_dir, "adapter")
        checkpoints.to_peft(state, adapter, base_model_name_or_path=args.hf_dir)
        if not args.merge:
            return adapter, args.hf_dir
    out = os.path.join(args.run_dir, "hf")
    checkpoints.to_hf(state, out, args.export_dtype, hf_config=hf_config)   # LoRA: merged (merge_lora=True)
    return out, out


def prompt_of(val: zd.Batches, tok) -> list[dict]:
    """The first held-out conversation without its last assistant turn (re-read from its file)."""
    import json

    where = val.data.where(int(val.data.starts.searchsorted(val.spans[0, 0], side="right") - 1))
    with open(where.path) as f:
        row = json.loads(f.readlines()[where.line - 1])
    messages = row["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last]


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.run_dir, exist_ok=True)
    if args.hf_dir and not args.data:
        raise SystemExit("--data is needed with --hf-dir (the files to fine-tune on)")
    rank, world = rank_and_world()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must divide among {world} ranks")
    if not args.hf_dir and rank == 0:
        tools.demo_inputs(os.path.join(args.run_dir, "demo"), args.seed)
    if world > 1:
        dist.barrier()   # sync: rank 0's demo files are written
    hf_dir, data = (args.hf_dir, args.data) if args.hf_dir else tools.demo_inputs(
        os.path.join(args.run_dir, "demo"), args.seed)
    args.data, args.hf_dir = args.data or [data], hf_dir
    with tempfile.TemporaryDirectory(prefix="zinf-finetune-") as scratch:
        nvme_path = args.nvme_path
        if args.placement == "nvme" and nvme_path is None:
            nvme_path = os.path.join(scratch, "nvme")   # the engine keeps each rank's files apart (rank{r}/)
        if nvme_path:
            os.makedirs(nvme_path, exist_ok=True)
        return finetune(args, hf_dir, nvme_path)   # the temporary NVMe files go with scratch


if __name__ == "__main__":
    main()
