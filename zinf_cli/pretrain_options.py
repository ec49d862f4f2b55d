"""The options of ``zinf-fn train``: the data, the GPT's sizes, and the optimizer, engine and run
options ``zinf-fn finetune`` has (one name each), with pretraining's defaults."""

from __future__ import annotations

from .corpus import TOKEN_DTYPES
from .finetune_options import ENGINE, OPTIMIZER, RUN
from .recipe import Option, with_defaults

DATA = (
    Option(
        "data",
        str,
        None,
        "a text file to train on, byte-level (default: Python's standard-library sources)",
        path=True,
    ),
    Option(
        "tokens",
        str,
        None,
        "a token file instead (nanoGPT's flat train.bin); needs vocab_size",
        path=True,
    ),
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
PRETRAIN_RUN = (
    Option(
        "resume",
        str,
        None,
        "a checkpoint, or a directory of them (the newest), to resume",
        training=False,
        path=True,
    ),
    Option("sample", int, 200, "bytes to generate at the end (0: none)", training=False),
)
OPTIONS = (
    DATA
    + MODEL
    + with_defaults(OPTIMIZER, steps=300, batch_size=16, lr=3e-3, warmup=30, weight_decay=0.1)
    + with_defaults(ENGINE, placement="none")
    + with_defaults(RUN, run_dir="runs/train_gpt", save_every=0, keep=3)
    + PRETRAIN_RUN
)
