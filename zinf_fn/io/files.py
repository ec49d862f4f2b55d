"""The one O_DIRECT file layer, used by the NVMe tier and by checkpoints.

``FileIO`` is the I/O threads of one user (a tier, a save, a restore), each with its reused page-aligned
staging buffer; ``read_span_`` / ``write_whole_`` move a byte span through O_DIRECT straight from/to the
caller's memory where it is aligned, else through that staging buffer (the one staging scheme);
``odirect`` is the one alignment probe. ``checkpoints.chunkio`` builds its chunk files on these, and
``DirectFiles`` (below) the row files of the NVMe tier.

``DirectFiles``, the DeepNVMe-style I/O engine under the NVMe tier (``NvmeTier(engine="direct")``):
a pool of I/O threads reads and writes whole files with ``O_DIRECT`` straight from/to the caller's
buffer in blocks of ``BLOCK_BYTES`` (several in flight per file), bypassing the page cache, with no
intermediate copy; the threads block in ``preadv``/``pwrite``, which release the GIL. ``O_DIRECT``
needs a page-aligned buffer and a block-aligned length: ``BufferPool`` hands out page-aligned host
buffers, the sub-page tail of a file goes through a buffered descriptor, and an unaligned caller
buffer falls back to buffered I/O for the whole file (correct, slower).

The first write of a file creates it whole (a temporary file, ``posix_fallocate``d to its size,
renamed once written): running out of space raises there, before a byte is written, and leaves every
file written before readable. Later writes overwrite the allocated blocks in place: no metadata
changes, so no ENOSPC after the first write on a non-copy-on-write file system (ext4, xfs, tmpfs),
and no journal transaction per write (a create and a rename each commit one). A failed in-place
write (EIO) leaves that one file torn, no other.

``read``/``write`` return ``concurrent.futures.Future`` s whose ``result()`` raises ``OSError`` with
the caller's description of what was moved; the caller keeps the buffer alive and untouched until then.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..trace import NULL_TRACER, BusyClock
from . import odirect
from .buffers import aligned_empty
from .futures import Joined, done, failed, wrap

IO_THREADS = 8                 # blocking syscalls in flight per tier (the disk wants a deep queue)
BLOCK_BYTES = 8 << 20          # one O_DIRECT request; a 25 MB layer shard is ~4 requests in parallel
STAGE_BYTES = 4 << 20          # the staging window of one I/O thread (a multiple of every O_DIRECT alignment)
_TMP_IDS = itertools.count()


class FileIO:
    """The I/O threads of one user of the file layer (a tier, a save, a restore), each with its own reused
    page-aligned staging buffer: the one staging scheme, through which memory, offsets or lengths that
    O_DIRECT cannot take move with one memcpy (``read_span_``, ``write_whole_``)."""

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
        """One future for ``pieces`` (callables) run on the I/O threads; ``finish(first error or None)``
        runs once, last (``Joined``)."""
        joined = Joined(len(pieces), finish, describe)
        for piece in pieces:
            self.pool.submit(joined.run, piece)
        return joined.future

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def read_span_(io: FileIO, fd: int, offset: int, dest: torch.Tensor, align: int, stage: bool,
               window: int = STAGE_BYTES) -> None:
    """On an I/O thread: bytes ``[offset, offset + len(dest))`` of the O_DIRECT descriptor ``fd`` into
    ``dest`` (uint8): straight into it where address, offset and length are ``align``-ed and not ``stage``,
    else through the thread's staging buffer, ``window`` bytes at a time."""
    n = dest.numel()
    if not stage and odirect.is_aligned(align, dest.data_ptr(), offset, n):
        odirect.pread_full(fd, memoryview(dest.numpy()), offset)   # straight into the destination
        return
    first, end = odirect.align_down(offset, align), odirect.align_up(offset + n, align)
    for lo in range(first, end, window):   # staged, a bounded window at a time
        hi = min(end, lo + window)
        buf = io.staging(hi - lo)
        odirect.pread_full(fd, memoryview(buf.numpy()), lo)   # the file ends first where hi > size
        a, b = max(lo, offset), min(hi, offset + n)
        dest[a - offset : b - offset].copy_(buf[a - lo : b - lo])


def write_whole_(io: FileIO, fd: int, data: torch.Tensor, size: int, align: int, window: int = STAGE_BYTES) -> None:
    """On an I/O thread: ``data`` (uint8, zero-padded to ``size`` bytes) as the whole content of the new,
    empty file behind the O_DIRECT descriptor ``fd``: straight from ``data`` where it is aligned and
    whole, else through the thread's staging buffer; a size off the alignment is truncated back to."""
    if data.numel() == size and odirect.is_aligned(align, data.data_ptr(), size):
        odirect.pwrite_full(fd, memoryview(data.numpy()), 0)   # straight from the source
        return
    for lo in range(0, size, window):   # staged, a bounded window at a time
        hi = min(size, lo + window)
        buf = io.staging(odirect.align_up(hi - lo, align))
        n = max(0, min(hi, data.numel()) - lo)
        buf[:n].copy_(data[lo : lo + n])
        buf[n:].zero_()                                     # fill value past the last element
        odirect.pwrite_full(fd, memoryview(buf.numpy()), lo)
    if size % align:
        os.ftruncate(fd, size)                              # the aligned write's padding


class DirectFiles:
    """Whole-file reads and writes on ``threads`` I/O threads (a ``FileIO``); traced by ``tracer``, timed
    by ``clock`` (the runtime's I/O busy clock, shared by every tier; a clock of its own when None)."""

    def __init__(self, threads: int, name: str, direct: bool, tracer=NULL_TRACER, clock: BusyClock | None = None):
        self.direct = direct           # whether the file system takes O_DIRECT (tmpfs may not)
        self._io = FileIO(threads, name)
        self._create_lock = threading.Lock()
        self.tracer = tracer
        self.clock = clock or BusyClock()

    def close(self) -> None:
        self._io.close()

    def read(self, path: str, nbytes: int, out: torch.Tensor, describe, label: tuple[str, str],
             offset: int = 0) -> Future:
        """Fill ``out`` from bytes ``[offset, offset + out's bytes)`` of the ``nbytes``-byte file at ``path``
        (the whole file by default); a missing file reads as zeros."""
        mem = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        if not os.path.exists(path):   # never written: zarr's fill value
            out.zero_()
            return done()
        direct, buffered = self._open_pair(path, os.O_RDONLY, out, offset)
        size = os.fstat(buffered).st_size
        if size != nbytes:   # a row file of another layout (an earlier run's): refuse it, never read it short
            _close(direct, buffered)
            return failed(OSError(errno.EIO, f"{describe()}: the row file has {size} bytes, expected {nbytes}; it was "
                                             "left by a run with another layout (remove it, or use a new nvme_path)"))

        def finish(error):
            _close(direct, buffered)

        return self._run_pieces(label, offset, mem, (direct, buffered), _pread_full, finish, describe)

    def write(self, path: str, nbytes: int, src: torch.Tensor, describe, label: tuple[str, str],
              offset: int = 0) -> Future:
        """Write ``src`` at byte ``offset`` of the ``nbytes``-byte file at ``path``, in place; the first write of
        a file creates it whole (the rest zeros), then renames. Writes of disjoint spans may run at once."""
        mem = memoryview(src.view(torch.uint8).numpy()) if src.numel() else memoryview(b"")
        whole = offset == 0 and len(mem) == nbytes
        direct = buffered = target = None
        try:
            if not whole and _size(path) != nbytes:
                self._create_zeroed(path, nbytes)   # a span of a file never written whole
            in_place = _size(path) == nbytes
            target = path if in_place else f"{path}.tmp-{os.getpid()}-{next(_TMP_IDS)}"
            if in_place:
                direct, buffered = self._open_pair(path, os.O_WRONLY, src, offset)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                direct, buffered = self._open_pair(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, src)
                if nbytes:
                    os.posix_fallocate(buffered, 0, nbytes)   # ENOSPC here, before any byte is written
        except OSError as e:
            _close(direct, buffered)
            if target is not None and target != path:
                _unlink_quietly(target)
            return failed(wrap(e, describe()))

        def finish(error):
            _close(direct, buffered)
            if in_place:
                return
            if error is None:
                os.replace(target, path)   # a new file appears whole or not at all
            else:
                _unlink_quietly(target)

        return self._run_pieces(label, offset, mem, (direct, buffered), _pwrite_full, finish, describe)

    def _create_zeroed(self, path: str, nbytes: int) -> None:
        """Create the missing file ``path`` whole, reading as zeros: allocated (``posix_fallocate``: ENOSPC here),
        no byte written, renamed into place; once, whichever of several span writes comes first."""
        with self._create_lock:
            if _size(path) == nbytes:
                return
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}-{next(_TMP_IDS)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if nbytes:
                    os.posix_fallocate(fd, 0, nbytes)
            except OSError:
                os.close(fd)
                _unlink_quietly(tmp)
                raise
            os.close(fd)
            os.replace(tmp, path)

    def _run_pieces(self, label, offset, mem, fds, op, finish, describe) -> Future:
        """Split ``mem`` (bytes ``offset..`` of the file) into aligned O_DIRECT blocks plus a buffered tail; run
        them on the I/O threads."""
        direct, buffered = fds
        nbytes = len(mem)
        aligned = (nbytes // odirect.ALIGN) * odirect.ALIGN if direct is not None else 0
        pieces = [(direct, lo, min(lo + BLOCK_BYTES, aligned)) for lo in range(0, aligned, BLOCK_BYTES)]
        if aligned < nbytes or not pieces:
            pieces.append((buffered, aligned, nbytes))
        return self._io.run([lambda fd=fd, lo=lo, hi=hi: self._timed(label, op, fd, mem[lo:hi], offset + lo)
                             for fd, lo, hi in pieces], finish, describe)

    def _timed(self, label, op, fd, mem, offset) -> None:
        """One request, on an I/O thread: traced, and counted by the busy clock."""
        self.clock.enter()
        try:
            with self.tracer.span(*label, bytes=len(mem)):
                op(fd, mem, offset)
        finally:
            self.clock.exit()

    def _open_pair(self, path: str, flags: int, buf: torch.Tensor, offset: int = 0) -> tuple[int | None, int]:
        """(O_DIRECT descriptor or None, buffered descriptor) for ``path``; None where ``buf`` or the byte
        ``offset`` is off the O_DIRECT alignment (the span then moves buffered)."""
        buffered = os.open(path, flags, 0o644)
        if not self.direct or buf.data_ptr() % odirect.ALIGN or offset % odirect.ALIGN:
            return None, buffered
        try:
            return os.open(path, (flags & ~os.O_TRUNC) | os.O_DIRECT, 0o644), buffered
        except OSError:
            return None, buffered


def _pread_full(fd: int, mem: memoryview, offset: int) -> None:
    got = odirect.pread_full(fd, mem, offset)
    if got < len(mem):
        raise OSError(errno.EIO, f"unexpected end of file at byte {offset + got}")


_pwrite_full = odirect.pwrite_full   # a module attribute: tests inject write errors here


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1


def _close(*fds) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
