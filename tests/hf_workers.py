"""Drivers of the Hugging Face import/export tests, module-level so spawned ranks (``dist_utils.run_world``) can
run them, and the small helpers the tests share.
"""

from __future__ import annotations

import os

import torch
from hf_reference import hf_model
from llama_reference import BETAS, EPS, LR, WD

import checkpoints
import zinf_fn as zf


def adamw():
    return zf.adamw(lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)


def fp32_config(placement: str = "none", nvme_path: str | None = None) -> zf.Config:
    return zf.Config(offload_params=placement, offload_optimizer=placement, nvme_path=nvme_path,
                     param_dtype=torch.float32)


def save_hf(family: str, directory, dtype: torch.dtype = torch.float32, max_shard_size="50GB"):
    """``hf_model(family)`` in ``dtype``, written by ``save_pretrained`` to ``directory``; returns the model."""
    hf = hf_model(family).to(dtype)
    hf.save_pretrained(directory, max_shard_size=max_shard_size)
    return hf


def file_bytes(directory) -> dict[str, bytes]:
    """Every file of a directory by name, as bytes."""
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def train_and_export_worker(rank: int, world: int, hf_dir: str, out_dir: str, batches: list) -> dict:
    """from_hf at this world size, to_hf before training (``out_dir/init``), 10 steps on this rank's rows of
    each batch, to_hf again (``out_dir/trained``); returns the losses and the files the first to_hf named."""
    _, state = checkpoints.from_hf(hf_dir, adamw(), fp32_config("cpu"))
    files = checkpoints.to_hf(state, os.path.join(out_dir, "init"), torch.float32, max_shard_size="20KB")
    losses = []
    for batch in batches:
        state, metrics = zf.train_step(state, {k: v.chunk(world)[rank] for k, v in batch.items()})
        losses.append(metrics["loss"])
    checkpoints.to_hf(state, os.path.join(out_dir, "trained"), torch.float32)
    return {"losses": losses, "files": files}
