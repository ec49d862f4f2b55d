"""Training data: byte-level (a text file, or by default Python's own standard-library sources), or
a token file.

Every machine that runs this project has the standard library, so the default run needs no download.
A token file is nanoGPT's ``train.bin`` convention: a flat binary array of uint16 (vocabularies up
to 65536) or uint32 token ids, native byte order, no header; it is memory-mapped, never read whole.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch

TOKEN_DTYPES = ("uint16", "uint32")


def stdlib_corpus(max_bytes: int = 8_000_000) -> bytes:
    """The concatenated sources of the standard library (sorted: every run reads the same bytes)."""
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


def load_tokens(path: str, dtype: str = "uint16") -> np.memmap:
    """The token file at ``path``, a read-only (N,) ``np.memmap`` of ``dtype`` (uint16, uint32)."""
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token file {path}: dtype must be one of {TOKEN_DTYPES}, got {dtype!r}")
    size, itemsize = Path(path).stat().st_size, np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(f"token file {path}: {size} bytes is not a whole number of {dtype} ids "
                         f"({itemsize} bytes each); is it a "
                         f"{'uint32' if dtype == 'uint16' else 'uint16'} file?")
    if size // itemsize < 1024:
        raise ValueError(f"token file {path} has {size // itemsize} tokens; need at least 1024")
    return np.memmap(path, dtype=dtype, mode="r")


def split(corpus, holdout: float = 0.05) -> tuple:
    """The first ``1 - holdout`` of ``corpus`` and the rest, as views (a memmap stays a memmap)."""
    cut = int(len(corpus) * (1 - holdout))
    return corpus[:cut], corpus[cut:]


def batches(corpus, batch_size: int, seq_len: int, seed: int, rank: int = 0, world_size: int = 1):
    """Endless random windows ``{"inputs": (B, T), "targets": (B, T)}`` (targets shifted by one).

    Every rank draws the same global batch of ``batch_size`` windows and keeps its own slice of
    rows, so any world size trains on the same data. ``corpus`` is a 1-D uint8 tensor
    (``load_corpus``) or a token ``np.memmap`` (``load_tokens``); only the windows drawn are read
    from a memmap.
    """
    if batch_size % world_size:
        raise ValueError(f"batch size {batch_size} must divide by the world size {world_size}")
    gen = torch.Generator().manual_seed(seed)
    per_rank = batch_size // world_size
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, len(corpus) - seq_len - 1, (batch_size,), generator=gen)
        windows = _windows(corpus, starts[:, None] + offsets)   # (B, T + 1) long
        mine = windows[rank * per_rank : (rank + 1) * per_rank]
        yield {"inputs": mine[:, :-1], "targets": mine[:, 1:]}


def _windows(corpus, index: torch.Tensor) -> torch.Tensor:
    """``corpus[index]`` as a long tensor; a memmap is gathered by numpy (torch indexes no uint16 or
    uint32)."""
    if isinstance(corpus, np.ndarray):
        return torch.from_numpy(corpus[index.numpy()].astype(np.int64))
    return corpus[index].long()
