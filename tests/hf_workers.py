"""Drivers of the Hugging Face import/export tests, module-level so spawned ranks
(``dist_utils.run_world``) can run them, and the small helpers the tests share.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from hf_reference import engine_config, engine_weights, hf_model, hf_tensors, train_engine
from llama_reference import BETAS, EPS, LR, WD, reference_run

import checkpoints
import zinf_fn as zf

PARITY_FAMILIES = ["llama3", "qwen2"]  # a Llama with GQA (llama3 rope) and a Qwen2 (qkv bias)
SMALL_SHARDS = "20KB"  # the 12 KB embedding and lm_head, 4-8 KB layer tensors: 7 shards


def adamw():
    return zf.adamw(lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)


def fp32_config(placement: str = "none", nvme_path: str | None = None) -> zf.Config:
    return zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        nvme_path=nvme_path,
        param_dtype=torch.float32,
    )


def save_hf(family: str, directory, dtype: torch.dtype = torch.float32, max_shard_size="50GB"):
    """``hf_model(family)`` in ``dtype``, written by ``save_pretrained`` to ``directory``; returns
    the model."""
    hf = hf_model(family).to(dtype)
    hf.save_pretrained(directory, max_shard_size=max_shard_size)
    return hf


def file_bytes(directory) -> dict[str, bytes]:
    """Every file of a directory by name, as bytes."""
    return {
        name: open(os.path.join(directory, name), "rb").read()
        for name in sorted(os.listdir(directory))
    }


def train_and_export_worker(
    rank: int, world: int, hf_dir: str, out_dir: str, batches: list
) -> dict:
    """from_hf at this world size, to_hf before training (``out_dir/init``), 10 steps on this rank's
    rows of each batch, to_hf again (``out_dir/trained``); returns the losses and the files the
    first to_hf named."""
    _, state = checkpoints.from_hf(hf_dir, adamw(), fp32_config("cpu"))
    files = checkpoints.to_hf(
        state, os.path.join(out_dir, "init"), torch.float32, max_shard_size="20KB"
    )
    losses = []
    for batch in batches:
        state, metrics = zf.train_step(state, {k: v.chunk(world)[rank] for k, v in batch.items()})
        losses.append(metrics["loss"])
    checkpoints.to_hf(state, os.path.join(out_dir, "trained"), torch.float32)
    return {"losses": losses, "files": files}


def assert_world_two_trains_like_world_one(family: str, directory, split: int = 1) -> None:
    """``hf_model(family)`` imported, exported and trained at world 2 (``train_and_export_worker``
    under ``directory``) as at world 1: rank 0's export before training is world 1's, bitwise, and
    every rank returns its list of files; every rank's losses equal ``reference_run(family,
    split)``'s within 1e-6 relative and the trained export holds its weights within 1e-4
    (gradients averaged over the ranks in another order, as tests/partition/test_distributed.py
    measures). ``split`` 2: the reference splits each batch into the two ranks' halves (a loss
    that is not a mean over rows, as the router's aux loss)."""
    from dist_utils import run_world

    _, batches, ref_losses, ref_final = reference_run(family, split)
    save_hf(family, directory / "hf")
    _, state = checkpoints.from_hf(str(directory / "hf"), adamw(), fp32_config("cpu"))
    files = checkpoints.to_hf(state, str(directory / "w1"), torch.float32, max_shard_size="20KB")
    results = run_world(
        2, train_and_export_worker, str(directory / "hf"), str(directory / "w2"), batches
    )
    assert file_bytes(directory / "w2" / "init") == file_bytes(directory / "w1")  # rank 0 wrote
    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-6)
        assert result["files"] == files
    back = transformers.AutoModelForCausalLM.from_pretrained(str(directory / "w2" / "trained"))
    trained = engine_weights(
        {n: t.detach() for n, t in back.state_dict().items()}, engine_config(back)
    )
    for path, got in trained.items():
        assert (got - ref_final[path]).abs().max() <= 1e-4, path


def import_train_export(family: str, placement: str, directory, max_shard_size="50GB") -> tuple:
    """``family``'s tiny model saved by transformers, imported (``from_hf``, at ``placement``),
    trained on the reference run's batches and exported (``to_hf``, fp32), each step checked
    against transformers + ``torch.optim.AdamW(fused=True)``: the saved model is the reference's
    start, the losses within 1e-5 relative, every final weight within 1e-5, and from_pretrained
    reads back exactly the engine's fp32 masters. Returns ``(the saved HF model, losses, final
    weights by key path)`` for the caller's own checks."""
    initial, batches, ref_losses, ref_final = reference_run(family)
    hf = save_hf(family, directory / "hf", max_shard_size=max_shard_size)
    assert all(torch.equal(t, initial[n]) for n, t in hf.state_dict().items())  # the start
    nvme = str(directory) if placement == "nvme" else None
    _, state = checkpoints.from_hf(str(directory / "hf"), adamw(), fp32_config(placement, nvme))
    state, losses, final = train_engine(state, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for path, want in ref_final.items():
        assert (final[path] - want).abs().max() <= 1e-5, path
    checkpoints.to_hf(state, str(directory / "out"), torch.float32)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(directory / "out"))
    for path, got in hf_tensors(back).items():
        assert torch.equal(got, final[path]), path
    return hf, losses, final

