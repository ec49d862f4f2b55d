"""Checksummed chunk files (zarr v3's ``crc32c`` codec): the crc32c computed beside the write of a
chunk's bytes, and verified inside the read, while each window of them is in the cache.

A checksummed chunk file is the chunk's bytes, then their crc32c as a little-endian uint32
(``arrays.CRC32C_BYTES``). The checksum costs CPU (the ``crc32c`` package: the CPU's crc
instruction, ~10 GB/s a core, with the GIL released), never a pass over memory or a disk request of
its own where the disk is the limit:

- a save writes a chunk as two pieces on the I/O threads at once (``SealedWrite``): its bytes
  (O_DIRECT where aligned, ``files.write_span``) and their crc32c; the one that ends last writes the
  4 bytes after the data (the page cache, with the data's sub-block tail) and registers the file for
  the save's sync. The crc hides behind the disk, the last chunk's too.
- a restore reads a chunk file whole, data and crc32c in one pass of the thread's staging windows
  (``files.read_windows``): each window's data bytes are added to the crc32c while cache-resident
  and copied where the caller wants them (any part of the chunk); the stored crc32c comes from the
  last window, not a read of its own.
"""

from __future__ import annotations

import errno
import struct
import threading

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
    """One checksummed chunk file written by two pieces that run at once on I/O threads:
    ``write`` (the file created, ``data`` written) and ``checksum`` (its crc32c); the last to end
    writes the crc32c after the data and calls ``written(path)`` (the save's sync makes it durable).
    A piece's error is raised by that piece; the file is closed either way."""

    def __init__(self, path: str, data: torch.Tensor, chunk_bytes: int, align: int, written):
        self.path, self.data, self.chunk_bytes, self.align = path, data, chunk_bytes, align
        self.written = written
        self.fds: tuple[int | None, int] | None = None
        self.data_written = False
        self.tail: torch.Tensor | None = None   # the crc32c's bytes, once computed
        self._left = 2
        self._lock = threading.Lock()

    def pieces(self) -> list:
        """The two pieces, the write first (the disk's queue fills before the CPU work)."""
        return [self.write, self.checksum]

    def write(self) -> None:
        self._piece(self._write_data)

    def checksum(self) -> None:
        self._piece(self._compute)

    def _write_data(self) -> None:
        self.fds = files.create(self.path, self.chunk_bytes + CRC32C_BYTES, direct=True)
        files.write_span(self.fds, 0, self.data, self.align)
        self.data_written = True

    def _compute(self) -> None:
        self.tail = crc32c_tail(self.data, self.chunk_bytes)

    def _piece(self, work) -> None:
        try:
            work()
        finally:
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                self._seal()

    def _seal(self) -> None:
        """Both pieces ended: the crc32c after the data (where both succeeded), the file closed."""
        try:
            if self.data_written and self.tail is not None:
                files.write_span(self.fds, self.chunk_bytes, self.tail, self.align)
                self.written(self.path)
        finally:
            if self.fds is not None:
                files.close_pair(self.fds)


class CheckedRead:
    """The crc32c of one chunk file's data, computed window by window as ``files.read_windows``
    hands them, with the bytes ``[first, first + len(dest))`` of the data copied into ``dest`` and
    the stored crc32c kept from the bytes after the data."""

    def __init__(self, chunk_bytes: int, first: int, dest: torch.Tensor):
        self.chunk_bytes, self.first, self.dest = chunk_bytes, first, dest
        self.crc = 0
        self.stored = bytearray(CRC32C_BYTES)

    def read(self, io: files.FileIO, fd: int, align: int, path: str,
             window: int = files.STAGE_BYTES) -> None:
        """On an I/O thread: the whole file behind ``fd`` read (``window`` bytes at a time) and
        checked; ValueError naming ``path`` where its crc32c differs, OSError where it ends
        early."""
        end = self.chunk_bytes + CRC32C_BYTES
        got = files.read_windows(io, fd, 0, end, align, self.sink, window)
        if got < end:
            raise OSError(errno.EIO, f"chunk file {path!r}: unexpected end at byte {got}")
        (stored,) = struct.unpack("<I", self.stored)
        if self.crc != stored:
            raise ValueError(f"chunk file {path!r}: crc32c {self.crc:#010x}, the file stores "
                             f"{stored:#010x}: its bytes changed after they were written")

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
