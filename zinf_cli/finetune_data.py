"""The data of ``zinf-fn finetune``: the model's tokenizer, tokenized files, training and held-out
batches (``zinf_data``), and the data's identity a checkpoint keeps."""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import zinf_data as zd


class FinetuneData(NamedTuple):
    """The tokenizer, the training and held-out batches, and the data's identity: the token caches'
    names (they change when the files or the tokenizer do) and the LoRA settings."""

    tokenizer: object
    train: zd.Batches
    val: zd.Batches
    identity: dict


def load_data(args, hf_dir: str, vocab_size: int) -> FinetuneData:
    """Tokenize ``args.data`` (and ``args.val``) once into ``run_dir/token_cache``; cut batches."""
    tok = zd.load_tokenizer(hf_dir, vocab_size)
    cache = os.path.join(args.run_dir, "token_cache")
    too_long = "truncate" if args.truncate else ("split" if args.format == "text" else "refuse")

    def prepared(files):
        data = zd.tokenized(
            files,
            args.format,
            tok,
            hf_dir,
            cache,
            train_on_prompt=args.train_on_prompt,
            verify=not args.no_verify,
        )
        return data, zd.spans(data, args.seq_len, too_long)

    train, spans = prepared(args.data)
    if args.val:
        val, val_spans = prepared(args.val)
    else:
        val = train
        spans, val_spans = zd.held_out(spans, args.val_fraction, args.seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0

    def batches(data, s, shuffle, what):
        return zd.Batches(
            data,
            s,
            args.seq_len,
            args.batch_size,
            args.pack,
            pad,
            args.seed,
            shuffle,
            what,
            args.pad_to_multiple_of,
        )

    # "lora": [rank, alpha, targets], where ``zinf-fn convert hf export`` reads a LoRA run's alpha
    lora = [args.lora_rank, args.lora_alpha, args.lora_targets] if args.lora_rank else None
    identity = {
        "train": os.path.basename(train.path),
        "val": os.path.basename(val.path),
        "lora": lora,
    }
    source = "val" if args.val else f"val_fraction {args.val_fraction} of data"
    val_what = f"held-out data ({source})"
    return FinetuneData(
        tok,
        batches(train, spans, True, "training data"),
        batches(val, val_spans, False, val_what),
        identity,
    )


def prompt_of(val: zd.Batches) -> list[dict]:
    """The first held-out conversation without its last assistant turn (re-read from its file)."""
    first = int(val.data.starts.searchsorted(val.spans[0, 0], side="right") - 1)
    where = val.data.where(first)
    with open(where.path) as f:
        row = json.loads(f.readlines()[where.line - 1])
    messages = row["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last]
