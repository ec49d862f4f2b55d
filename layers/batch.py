"""Validation of token batches ``{"inputs": (B, T) int, "targets": (B, T) int}`` for language
models.

Optional leaves: ``"segments"`` (B, T) int, which example each position belongs to in a packed row
(a model that reads it attends only within an example, positions restarting at each); targets -100
are ignored by every loss (``count_targets`` counts the rest).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

BATCH_KEYS = ("inputs", "targets")
IGNORE = -100  # a target that no loss counts (a prompt, a pad, the chat template's markup)


def count_targets(batch) -> torch.Tensor:
    """The target tokens of ``batch`` (those != -100): a 0-d int64 tensor
    (``zf.Model.count_targets``)."""
    return (batch["targets"] != IGNORE).sum()


def check_tokens(name: str, tokens, seq_len: int | None) -> None:
    """Raise unless ``tokens`` is a 2-D integer tensor (B, T) with ``1 <= T <= seq_len`` (any T if
    None)."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(
            f"{name}: expected a torch.Tensor of token ids, got {type(tokens).__name__}"
        )
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(
            f"{name}: expected an integer tensor of token ids (e.g. torch.long), got dtype "
            f"{tokens.dtype}; "
            f"convert with {name}.long()"
        )
    if tokens.dim() != 2 or tokens.shape[1] == 0:
        raise ValueError(f"{name}: expected shape (B, T) with T >= 1, got {tuple(tokens.shape)}")
    if seq_len is not None and tokens.shape[1] > seq_len:
        raise ValueError(
            f"{name}: sequence length T={tokens.shape[1]} exceeds the model's seq_len={seq_len}; "
            f"crop to {name}[:, -{seq_len}:] or build the model with a larger seq_len"
        )


def check_batch(batch, seq_len: int) -> None:
    """Raise unless ``batch`` is ``{"inputs": (B, T), "targets": (B, T)}`` of integers with T <=
    seq_len."""
    if not isinstance(batch, Mapping):
        expected = "{'inputs': (B, T) long, 'targets': (B, T) long}"
        raise TypeError(f"batch: expected a dict {expected}, got {type(batch).__name__}")
    missing = [key for key in BATCH_KEYS if key not in batch]
    if missing:
        raise ValueError(
            f"batch: missing key(s) {missing}; expected {list(BATCH_KEYS)}, got {list(batch)}"
        )
    for key in BATCH_KEYS:
        check_tokens(f"batch['{key}']", batch[key], seq_len)
    for key in ("targets", "segments"):
        if key in batch and batch["inputs"].shape != batch[key].shape:
            raise ValueError(
                f"batch: expected batch['inputs'] and batch['{key}'] of the same shape (B, T), got "
                f"{tuple(batch['inputs'].shape)} and {tuple(batch[key].shape)}"
            )
    if "segments" in batch:
        check_tokens("batch['segments']", batch["segments"], seq_len)
