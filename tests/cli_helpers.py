"""Running the ``zinf-fn`` command in a child process, as a user runs it (``python -m zinf_cli``:
the console script is the same ``zinf_cli.main:main``), and building a tiny HF Llama directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_GPT = ("d_model=32", "layers=2", "heads=2", "seq_len=32", "batch_size=4", "sample=0")


def zinf_fn(*args: str, cwd=None, timeout: float = 600, env=None) -> subprocess.CompletedProcess:
    """``zinf-fn ARGS`` in a child process (this checkout first on its path, ``env`` added to the
    environment); its output kept."""
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "zinf_cli", *args],
        cwd=cwd,
        env=env,
        timeout=timeout,
        capture_output=True,
        text=True,
    )


def zinf_fn_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """``zinf-fn ARGS`` in this process (``zinf_cli.main``, what the child runs), its output taken
    from ``capsys``: for a step of a test that is no test of the process (no start-up paid)."""
    from zinf_cli import main

    capsys.readouterr()  # what was printed before is not this command's
    status = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["zinf-fn", *args], status, out, err)


def start(*args: str, cwd=None) -> subprocess.Popen:
    """``zinf-fn ARGS`` started in a child process (its output to a pipe)."""
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "zinf_cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def metrics(run_dir, keys=("step", "loss", "lr", "grad_norm", "val_loss")) -> list[dict]:
    """``run_dir/metrics.jsonl``, the records' training keys only (the others time the run)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k in keys} for line in f]


def tiny_llama(directory) -> str:
    """A random 2-layer Llama saved by transformers into ``directory`` (never downloaded)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(directory))
    return str(directory)


def wandb_history(run_dir) -> list[dict]:
    """The history rows (``run.log`` calls: ``_step`` and the logged keys) of the offline W&B run
    under ``run_dir/wandb``, read from its ``.wandb`` file: W&B's record log, LevelDB's log format
    (a 7-byte file header, then 32 KiB blocks of records, each a 7-byte header: CRC, length, type
    FULL/FIRST/MIDDLE/LAST) of ``wandb_internal_pb2.Record`` messages."""
    import glob

    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(str(run_dir), "wandb", "offline-run-*", "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    block = 32768
    pos = 7  # past the file header (":W&B", a magic, a version)
    parts = b""
    rows = []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "history":
                history = record.history
                row = {
                    "/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in history.item
                }
                rows.append({"_step": history.step.num, **row})
    return rows
