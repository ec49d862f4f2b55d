"""Fine-tune a local Hugging Face checkpoint (Llama / Mistral / Qwen2) with zinf-fn, and export it back.

    python examples/finetune_hf.py                                   # a small random Llama, in well under a minute
    python examples/finetune_hf.py --hf-dir ~/models/Llama-3.2-1B --placement nvme --nvme-path /mnt/nvme/ft \\
        --data corpus.txt --steps 1000 --save-every 100 --out runs/finetune_hf/hf
    python examples/finetune_hf.py --hf-dir DIR --tokens train.bin   # nanoGPT-style uint16 token ids

Params and optimizer state live on NVMe (``--placement nvme``; ``--nvme-path`` defaults to a temporary
directory) or in CPU memory (``--placement cpu``). Checkpoints are taken in the background every
``--save-every`` steps (the newest ``--keep`` are kept) and carry the model's config.json in their
manifest, so ``python -m checkpoints hf export CKPT OUT`` turns any of them into an HF directory. At the
end the weights are written with ``checkpoints.to_hf`` to ``--out``, which
``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Data: bytes of a text file (default: Python's standard-library sources), each byte a token id, or a
token file (``--tokens``). Byte ids are a stand-in for a real tokenizer: fine for a smoke run or a
byte-level model; bring the model's own tokens (``--tokens``) for a real fine-tune.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data  # noqa: E402

import checkpoints  # noqa: E402
import zinf_fn as zf  # noqa: E402
from checkpoints.hf_files import read_config  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", help="a local HF model directory (default: build a small random Llama)")
    p.add_argument("--data", help="a text file to train on, as bytes (default: the standard-library sources)")
    p.add_argument("--tokens", help="a flat uint16 token file instead of --data (nanoGPT's train.bin)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64, help="at most the model's max_position_embeddings")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="global-norm clipping (0: off)")
    p.add_argument("--placement", choices=["none", "cpu", "nvme"], default="nvme",
                   help="where params and optimizer state live")
    p.add_argument("--nvme-path", help="directory for --placement nvme (default: a temporary one)")
    p.add_argument("--save-every", type=int, default=20, help="async checkpoint every N steps (0: never)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    p.add_argument("--ckpt-dir", default="runs/finetune_hf", help="where checkpoints go")
    p.add_argument("--out", help="HF directory to export to at the end (default: CKPT_DIR/hf)")
    p.add_argument("--export-dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def random_llama(directory: str, seed: int) -> str:
    """A small random LlamaForCausalLM (byte vocabulary, GQA) written by ``save_pretrained`` to ``directory``."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def training_data(args, vocab_size: int):
    corpus = data.load_tokens(args.tokens) if args.tokens else data.load_corpus(args.data)
    if not args.tokens and vocab_size < 256:
        raise ValueError(f"byte-level data needs a vocabulary of >= 256 ids, the model has {vocab_size}; "
                         "pass --tokens with the model's own token ids")
    return data.batches(corpus, args.batch_size, args.seq_len, args.seed)


def finetune(args, hf_dir: str, nvme_path: str | None) -> dict:
    config = zf.Config(offload_params=args.placement, offload_optimizer=args.placement, nvme_path=nvme_path,
                       clip_grad_norm=args.clip or None)
    optimizer = zf.adamw(lr=args.lr, b1=0.9, b2=0.95, weight_decay=args.weight_decay)
    t0 = time.perf_counter()
    model, state = checkpoints.from_hf(hf_dir, optimizer, config)
    print(f"loaded {hf_dir} ({model.config.family}, {model.n_layers} layers) in {time.perf_counter() - t0:.1f} s")
    if args.seq_len > model.config.seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings {model.config.seq_len}")
    stream = training_data(args, model.config.vocab_size)
    hf_config = read_config(hf_dir)   # kept in each checkpoint and in the export (token ids, architectures)
    losses, saving = [], None
    bar = tqdm(range(args.steps), unit="step", dynamic_ncols=True)
    for step in bar:
        state, metrics = zf.train_step(state, next(stream))
        losses.append(metrics["loss"])
        bar.set_postfix(loss=f"{metrics['loss']:.3f}")
        if args.save_every and (step + 1) % args.save_every == 0:   # written while the next steps run
            path = os.path.join(args.ckpt_dir, f"step_{step + 1:06d}")
            saving = checkpoints.save_async(path, state, keep=args.keep, overwrite=True,
                                            extra={"hf_config": hf_config})
    if saving is not None:
        saving.result()   # sync: the last checkpoint is committed
    out = args.out or os.path.join(args.ckpt_dir, "hf")
    files = checkpoints.to_hf(state, out, args.export_dtype, hf_config=hf_config)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; exported to {out}: {', '.join(files)}")
    return {"first_loss": losses[0], "last_loss": losses[-1], "out": out}


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zinf-finetune-") as scratch:
        hf_dir = args.hf_dir or random_llama(os.path.join(scratch, "random-llama"), args.seed)
        nvme_path = args.nvme_path
        if args.placement == "nvme" and nvme_path is None:
            nvme_path = os.path.join(scratch, "nvme")
        if nvme_path:
            os.makedirs(nvme_path, exist_ok=True)
        return finetune(args, hf_dir, nvme_path)   # the temporary model and NVMe files go with scratch


if __name__ == "__main__":
    main()
