"""The one O_DIRECT file layer, used by the NVMe tier and by checkpoints.

``FileIO`` is the I/O threads of one user (a tier, a save, a restore), each with its reused
page-aligned staging buffer (``read_windows``: a file's bytes in order, each window handed on while
it is in the cache; ``read_staged_`` copies them into memory: checkpoints read every chunk through
it, and a checksummed chunk's crc32c is computed from the windows). Three functions move bytes, and
both users build on them:

``create``      the one way a file is made (an NVMe row file, a checkpoint chunk file): created
                empty, then allocated whole (``posix_fallocate``: running out of space raises there,
                before a byte is written, and the allocated bytes read as zeros).
``read_span_``  a byte span of a file into memory, ``write_span`` memory into a byte span: the
``write_span``  part whose address, offset and length O_DIRECT takes moves straight through the
                O_DIRECT descriptor, the rest (the sub-block tail, or all of it where the memory or
                the offset is off the alignment) through a buffered descriptor of the same file: the
                one fallback for unaligned data. It is the page cache rather than a staging copy
                because a write cannot stage a partial block: O_DIRECT would rewrite the whole block
                (racing a neighbouring span's write of it) or extend the file past its size; and a
                read of a tail the page cache holds dirty would force it to the disk first.

The NVMe tier's I/O engine over these is ``io.direct_files.DirectFiles``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from . import odirect
from .buffers import aligned_empty
from .futures import Joined

IO_THREADS = 8  # blocking syscalls in flight per tier (the disk wants a deep queue)
# The staging window of one I/O thread (a multiple of every O_DIRECT alignment): small, so that
# every thread's window stays in the CPU's cache, where a read lands fastest
# (``checkpoints.chunkio.STAGE_READS``; 4 MiB windows lost that in issue 22's measurements,
# BENCHMARKS.md).
STAGE_BYTES = 1 << 20


class FileIO:
    """The I/O threads of one user of the file layer (a tier, a save, a restore), each with its own
    reused page-aligned staging buffer (``read_staged_``)."""

    def __init__(self, threads: int, name: str):
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._local = threading.local()

    def staging(self, nbytes: int) -> torch.Tensor:
        """This thread's staging buffer, at least ``nbytes`` long (uint8, page-aligned)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.buf = aligned_empty(odirect.align_up(nbytes), torch.uint8)
        return buf[:nbytes]

    def run(self, pieces: list, finish, describe=None) -> Future:
        """One future for ``pieces`` (callables) run on the I/O threads; ``finish(first error or
        None)`` runs once, last (``Joined``)."""
        joined = Joined(len(pieces), finish, describe)
        for piece in pieces:
            self.pool.submit(joined.run, piece)
        return joined.future

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def create(path: str, size: int, direct: bool) -> tuple[int | None, int]:
    """The one way a file is made: ``path`` created empty (or emptied), ``size`` bytes allocated
    (ENOSPC raises here, before a byte is written; they read as zeros); returns ``open_pair``'s
    descriptors (both closed again where it raises)."""
    buffered = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if size:
            # on the buffered descriptor: glibc may emulate it by writes
            os.posix_fallocate(buffered, 0, size)
    except OSError:
        os.close(buffered)
        raise
    return _with_direct(path, os.O_WRONLY, direct, buffered)


def open_pair(
    path: str, flags: int, direct: bool, nofollow: bool = False
) -> tuple[int | None, int]:
    """(an O_DIRECT descriptor, None where ``direct`` is False or the file system refuses it, a
    buffered descriptor) of the existing file ``path``; ``nofollow``: never through a symlink
    (ELOOP)."""
    flags |= os.O_NOFOLLOW if nofollow else 0
    return _with_direct(path, flags, direct, os.open(path, flags))


def _with_direct(path: str, flags: int, direct: bool, buffered: int) -> tuple[int | None, int]:
    if not direct:
        return None, buffered
    try:
        return os.open(path, flags | os.O_DIRECT), buffered
    except OSError:
        return None, buffered


def close_pair(fds: tuple[int | None, int]) -> None:
    """Close ``open_pair``'s (or ``create``'s) descriptors."""
    _close(*fds)


def read_span_(
    fds: tuple[int | None, int], offset: int, dest: torch.Tensor, align: int = odirect.ALIGN
) -> None:
    """On an I/O thread: bytes ``[offset, offset + len(dest))`` of the file behind ``fds``
    (``open_pair``) into ``dest`` (uint8): O_DIRECT where it can, the rest buffered (see the
    module's docstring)."""
    for fd, lo, hi in _by_descriptor(fds, offset, dest, align):
        got = odirect.pread_full(fd, _mem(span(dest, lo, hi)), offset + lo)
        if got < hi - lo:
            raise OSError(errno.EIO, f"unexpected end of file at byte {offset + lo + got}")


def write_span(
    fds: tuple[int | None, int], offset: int, src: torch.Tensor, align: int = odirect.ALIGN
) -> None:
    """On an I/O thread: ``src`` (uint8) at byte ``offset`` of the file behind ``fds``
    (``open_pair`` / ``create``): O_DIRECT where it can, the rest buffered (see the module's
    docstring)."""
    for fd, lo, hi in _by_descriptor(fds, offset, src, align):
        _pwrite_full(fd, _mem(span(src, lo, hi)), offset + lo)


def _by_descriptor(
    fds: tuple[int | None, int], offset: int, data: torch.Tensor, align: int
) -> list[tuple[int, int, int]]:
    """(descriptor, lo, hi) for the bytes of ``data`` at ``offset``: the aligned head O_DIRECT, the
    rest buffered."""
    direct, buffered = fds
    n = data.numel()
    cut = (
        odirect.align_down(n, align)
        if direct is not None and odirect.is_aligned(align, data.data_ptr(), offset)
        else 0
    )
    return [(fd, lo, hi) for fd, lo, hi in ((direct, 0, cut), (buffered, cut, n)) if hi > lo]


def read_staged_(
    io: FileIO, fd: int, offset: int, dest: torch.Tensor, align: int, window: int = STAGE_BYTES
) -> None:
    """On an I/O thread: bytes ``[offset, offset + len(dest))`` of the O_DIRECT descriptor ``fd``
    into ``dest`` (uint8) through the thread's staging buffer, ``window`` bytes at a time (any
    alignment of ``dest``, ``offset`` and length: O_DIRECT reads the whole ``align``-ed blocks
    around them); OSError where the file ends first."""

    def copy(lo: int, part: torch.Tensor) -> None:
        dest[lo - offset : lo - offset + part.numel()].copy_(part)

    copied = read_windows(io, fd, offset, offset + dest.numel(), align, copy, window)
    if copied < dest.numel():
        raise OSError(errno.EIO, f"unexpected end of file at byte {offset + copied}")


def read_windows(
    io: FileIO, fd: int, lo: int, hi: int, align: int, sink, window: int = STAGE_BYTES
) -> int:
    """On an I/O thread: bytes ``[lo, hi)`` of the file behind ``fd`` (O_DIRECT or buffered) read
    in order through the thread's staging buffer, ``window`` bytes at a time (from the
    ``align``-ed block around ``lo``), each handed to ``sink(file offset, bytes)`` while it is in
    the cache (a view of the buffer, valid during the call). Returns the bytes handed: fewer than
    ``hi - lo`` where the file ends first."""
    first, end = odirect.align_down(lo, align), odirect.align_up(hi, align)
    handed = 0
    for start in range(first, end, window):
        stop = min(end, start + window)
        buf = io.staging(stop - start)
        got = odirect.pread_full(fd, _mem(buf), start)  # the file ends first where stop > size
        a, b = max(start, lo), min(start + got, hi)
        if b > a:
            sink(a, buf[a - start : b - start])
            handed += b - a
    return handed


def span(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``t[lo:hi]`` of a 1-D tensor, ``t`` itself where that is all of it: a transfer's one piece
    (most are) makes no new view on the I/O threads, where each tensor call lets go of the
    interpreter's lock and waits to take it back while the compute threads run Python."""
    return t if lo == 0 and hi == t.numel() else t[lo:hi]


def _mem(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t`` (uint8), shared: a ctypes array over its
    memory, not ``t.numpy()``, a tensor call that lets go of the interpreter's lock (``span``).
    Valid while ``t`` lives: the request that passes it holds it."""
    n = t.numel()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())) if n else memoryview(b"")


_pwrite_full = odirect.pwrite_full  # a module attribute: tests inject write errors here


def _close(*fds) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)
