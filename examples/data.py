"""Byte-level training data: a text file, or by default Python's own standard-library sources.

Every machine that runs this project has the standard library, so the default run needs no download.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_corpus(max_bytes: int = 8_000_000) -> bytes:
    """The concatenated sources of the standard library (sorted, so every run reads the same bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(chunks)[:max_bytes]


def load_corpus(path: str | None) -> torch.Tensor:
    """The corpus as a uint8 tensor of bytes; ``path`` None: the standard-library sources."""
    data = Path(path).read_bytes() if path else stdlib_corpus()
    if len(data) < 1024:
        raise ValueError(f"corpus {path or 'stdlib'} has {len(data)} bytes; need at least 1024")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split(corpus: torch.Tensor, holdout: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    cut = int(len(corpus) * (1 - holdout))
    return corpus[:cut], corpus[cut:]


def batches(corpus: torch.Tensor, batch_size: int, seq_len: int, seed: int, rank: int = 0, world_size: int = 1):
    """Endless random windows ``{"inputs": (B, T), "targets": (B, T)}`` (targets shifted by one byte).

    Every rank draws the same global batch of ``batch_size`` windows and keeps its own slice of rows,
    so any world size trains on the same data.
    """
    if batch_size % world_size:
        raise ValueError(f"batch size {batch_size} must divide by the world size {world_size}")
    gen = torch.Generator().manual_seed(seed)
    per_rank = batch_size // world_size
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, len(corpus) - seq_len - 1, (batch_size,), generator=gen)
        windows = corpus[starts[:, None] + offsets].long()   # (B, T + 1)
        mine = windows[rank * per_rank : (rank + 1) * per_rank]
        yield {"inputs": mine[:, :-1], "targets": mine[:, 1:]}
