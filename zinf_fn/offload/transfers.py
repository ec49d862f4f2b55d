"""What travels between a tier and the buffers of a stream: named, never a bare tuple.

``Transfer`` is one tier read or write in flight: the buffer it fills or empties, the future of the
I/O (None where nothing is in flight: a memory row used as its own view, a copy that completed) and
whether the buffer came from the pool (and goes back there once the transfer completed). ``Write``
is a write to issue: which row of which tier, from which buffer, starting at which element of the
row. ``CastRead`` is a read's future that casts a row being read (a master) into the buffer (its
16-bit copy).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import NamedTuple

import torch

from .tiers import Tier


class Transfer(NamedTuple):
    """A read or write in flight: ``buf`` is not reused before ``future`` completed; ``pooled``: it
    then goes back to the pool."""

    buf: torch.Tensor
    future: Future | None
    pooled: bool

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


class Write(NamedTuple):
    """A row write to issue: elements ``[start, start + buf.numel())`` of row ``row`` of ``tier``'s
    array ``key`` from ``buf`` (``pooled``: given back to the pool once written)."""

    tier: Tier
    key: str
    row: int
    buf: torch.Tensor
    pooled: bool
    start: int = 0


class CastRead:
    """The read of a shard cast from a master row being read: ``result()`` waits for the master's
    read, then casts it into ``out`` (once, on the caller's thread: the fetch thread) by
    ``cast(out, master)`` (default ``out.copy_(master)``: fp32 -> param_dtype)."""

    def __init__(self, out: torch.Tensor, master: torch.Tensor, read: Future, cast=None):
        self._out, self._master, self._read = out, master, read
        self._cast_fn = cast
        self._cast = False

    def result(self) -> None:
        self._read.result()  # sync: the master row is in memory
        if not self._cast:
            if self._cast_fn is None:
                # fp32 -> param_dtype: what the update wrote as the 16-bit copy
                self._out.copy_(self._master)
            else:
                self._cast_fn(self._out, self._master)
            self._cast = True
