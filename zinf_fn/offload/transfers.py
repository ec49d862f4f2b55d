"""What travels between a tier and the buffers of a stream: named, never a bare tuple.

``Transfer`` is one tier read or write in flight: the buffer it fills or empties, the future of the
I/O (None where nothing is in flight: a memory row used as its own view, a copy that completed) and
whether the buffer came from the pool (and goes back there once the transfer completed). ``Write``
is a write to issue: which row of which tier, from which buffer, starting at which element of the row.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import NamedTuple

import torch

from .tiers import Tier


class Transfer(NamedTuple):
    """A read or write in flight: ``buf`` is not reused before ``future`` completed; ``pooled``: it then
    goes back to the pool."""

    buf: torch.Tensor
    future: Future | None
    pooled: bool

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


class Write(NamedTuple):
    """A row write to issue: elements ``[start, start + buf.numel())`` of row ``row`` of ``tier``'s array
    ``key`` from ``buf`` (``pooled``: given back to the pool once written)."""

    tier: Tier
    key: str
    row: int
    buf: torch.Tensor
    pooled: bool
    start: int = 0
