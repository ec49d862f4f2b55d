"""The options of ``zinf-fn train``: the data, the GPT's sizes, and the optimizer and engine options
``zinf-fn finetune`` has (one name each), with pretraining's defaults."""

from __future__ import annotations

from .corpus import TOKEN_DTYPES
from .finetune_options import ENGINE, OPTIMIZER
from .recipe import Option, with_defaults

DATA = (
    Option("data", str, None, "a text file to train on, byte-level (default: Python's standard-"
           "library sources)", path=True),
    Option("tokens", str, None, "a token file instead (nanoGPT's flat train.bin); needs "
           "vocab_size", path=True),
    Option("token_dtype", str, "uint16", "the token file's ids", TOKEN_DTYPES),
    Option("seq_len", int, 128, "tokens per row"),
    Option("seed", int, 0, "initialisation and the data order"),
)
MODEL = (
    Option("vocab_size", int, 256, "the vocabulary (256: bytes)"),
    Option("d_model", int, 128, "the GPT's width"),
    Option("layers", int, 4, "the GPT's blocks"),
    Option("heads", int, 4, "attention heads"),
)
RUN = (
    Option("run_dir", str, "runs/train_gpt", "checkpoints step_N, metrics.jsonl, the recipe",
           training=False, aliases=("--ckpt-dir",), path=True),
    Option("save_every", int, 0, "save a checkpoint every N steps in the background (0: never)",
           training=False),
    Option("keep", int, 3, "checkpoints to keep", training=False),
    Option("resume", str, None, "a checkpoint, or a directory of them (the newest), to resume",
           training=False, path=True),
    Option("sample", int, 200, "bytes to generate at the end (0: none)", training=False),
    Option("report_to", list, None, "trackers beside metrics.jsonl: tensorboard, wandb, mlflow",
           training=False),
    Option("log_every", int, 10, "without a terminal: one log line every N steps", training=False),
)
OPTIONS = DATA + MODEL + with_defaults(
    OPTIMIZER, steps=300, batch_size=16, lr=3e-3, warmup=30, weight_decay=0.1) + with_defaults(
    ENGINE, placement="none") + RUN
