"""Checksummed chunk files (zarr v3's ``crc32c`` codec): the crc32c computed beside the write of a
chunk's bytes, and verified inside the read, while each window of them is in the cache.

A checksummed chunk file is the chunk's bytes, then their crc32c as a little-endian uint32
(``arrays.CRC32C_BYTES``). The checksum costs CPU (the ``crc32c`` package: the CPU's crc
instruction, ~10 GB/s a core, with the GIL released), never a pass over memory or a disk request of
its own where the disk is the limit:

- a save computes a chunk's crc32c on threads of its own (``ChunkIO.crc_pool``) while an I/O
  thread writes its bytes (O_DIRECT where aligned, ``files.write_span``), then writes the 4 bytes
  after the data (the page cache, with the data's sub-block tail; ``SealedWrite``). The crc hides
  behind the disk, the last chunk's too, and never holds an I/O thread from the disk.
- a restore reads a chunk file whole, data and crc32c in one pass of the thread's staging windows
  (``files.read_windows``): each window's data bytes are added to the crc32c while cache-resident
  and copied where the caller wants them (any part of the chunk); the stored crc32c comes from the
  last window, not a read of its own.
"""

from __future__ import annotations

import errno
import struct
from concurrent.futures import Executor

import crc32c
import torch

from zinf_fn.io import files

from .arrays import CRC32C_BYTES


def crc32c_tail(data: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """The 4 bytes stored after a chunk whose data is ``data`` (uint8, at most ``chunk_bytes``):
    the little-endian crc32c of the whole chunk, the zeros past ``data`` included."""
    crc = crc32c.crc32c(data.numpy())
    pad = chunk_bytes - data.numel()
    crc = crc32c.crc32c(bytes(pad), crc) if pad else crc
    return torch.frombuffer(bytearray(struct.pack("<I", crc)), dtype=torch.uint8)


class SealedWrite:
    """One checksummed chunk file: its crc32c computed on ``crc_pool`` (threads of their own,
    started here) while ``write`` (on an I/O thread) creates the file and writes ``data``, then
    waits for the crc32c (done by then: it runs several times faster than the disk) and writes it
    after the data. The I/O threads only write, so the disk's queue stays full however slow the
    CPU is; an error of either side is raised by ``write``, the file closed either way."""

    def __init__(
        self, path: str, data: torch.Tensor, chunk_bytes: int, align: int, crc_pool: Executor
    ):
        self.path = path
        self.data = data
        self.chunk_bytes = chunk_bytes
        self.align = align
        self.tail = crc_pool.submit(crc32c_tail, data, chunk_bytes)  # the crc32c's 4 bytes

    def write(self) -> None:
        """On an I/O thread: the file created, the data written, then its crc32c after it."""
        fds = files.create(self.path, self.chunk_bytes + CRC32C_BYTES, direct=True)
        try:
            files.write_span(fds, 0, self.data, self.align)
            files.write_span(fds, self.chunk_bytes, self.tail.result(), self.align)  # sync
        finally:
            files.close_pair(fds)


class CheckedRead:
    """The crc32c of one chunk file's data, computed window by window as ``files.read_windows``
    hands them, with the bytes ``[first, first + len(dest))`` of the data copied into ``dest`` and
    the stored crc32c kept from the bytes after the data."""

    def __init__(self, chunk_bytes: int, first: int, dest: torch.Tensor):
        self.chunk_bytes = chunk_bytes
        self.first = first  # the data's byte at dest[0]
        self.dest = dest
        self.crc = 0
        self.stored = bytearray(CRC32C_BYTES)

    def read(
        self, io: files.FileIO, fd: int, align: int, path: str, window: int = files.STAGE_BYTES
    ) -> None:
        """On an I/O thread: the whole file behind ``fd`` read (``window`` bytes at a time) and
        checked; ValueError naming ``path`` where its crc32c differs, OSError where it ends
        early."""
        end = self.chunk_bytes + CRC32C_BYTES
        got = files.read_windows(io, fd, 0, end, align, self.sink, window)
        if got < end:
            raise OSError(errno.EIO, f"chunk file {path!r}: unexpected end at byte {got}")
        (stored,) = struct.unpack("<I", self.stored)
        if self.crc != stored:
            raise ValueError(
                f"chunk file {path!r}: crc32c {self.crc:#010x}, the file stores "
                f"{stored:#010x}: its bytes changed after they were written"
            )

    def sink(self, lo: int, part: torch.Tensor) -> None:
        """File bytes ``[lo, lo + len(part))``: data to the crc32c (and to ``dest`` where it
        wants them), the crc32c's bytes kept."""
        hi = lo + part.numel()
        data_end = min(hi, self.chunk_bytes)
        if data_end > lo:
            data = part[: data_end - lo]
            self.crc = crc32c.crc32c(data.numpy(), self.crc)
            a, b = max(lo, self.first), min(data_end, self.first + self.dest.numel())
            if b > a:
                self.dest[a - self.first : b - self.first].copy_(part[a - lo : b - lo])
        crc_start = max(lo, self.chunk_bytes)
        if hi > crc_start:
            where = slice(crc_start - self.chunk_bytes, hi - self.chunk_bytes)
            self.stored[where] = part[crc_start - lo :].numpy().tobytes()
