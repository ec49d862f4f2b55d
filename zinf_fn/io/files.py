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

``DirectFiles``, the DeepNVMe-style I/O engine under the NVMe tier (``NvmeTier(engine="direct")``),
reads and writes whole row files (or spans of them) on its ``FileIO``'s threads, in pieces of
at most ``BLOCK_BYTES`` (``odirect.pieces``; several in flight per file), straight from/to the
caller's buffer, bypassing the page cache, with no intermediate copy; the threads block in
``preadv``/``pwrite``, which release the GIL. ``BufferPool`` hands out page-aligned host buffers,
so only a row's sub-page tail takes the fallback. Each file's descriptors are opened once and
reused by every request (``io.handles``).

The first write of a row file creates it whole (``create`` on a temporary name, renamed once
written): running out of space raises there and leaves every file written before readable. Later
writes overwrite the allocated blocks in place: no block allocation, so no ENOSPC after the first
write on a non-copy-on-write file system (ext4, xfs, tmpfs), and no journal transaction for a create
or a rename. A failed in-place write (EIO) leaves that one file torn, no other.

``read``/``write`` return ``concurrent.futures.Future`` s whose ``result()`` raises ``OSError`` with
the caller's description of what was moved; the caller keeps the buffer alive and untouched until
then. """

from __future__ import annotations

import errno
import functools
import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..observe.trace import NULL_TRACER, BusyClock
from . import odirect
from .buffers import aligned_empty
from .futures import Joined, done, failed, wrap
from .handles import Handle, OpenFiles

IO_THREADS = 8  # blocking syscalls in flight per tier (the disk wants a deep queue)
# the largest O_DIRECT request: a transfer is cut into the fewest pieces of at most this size, of
# one length (``odirect.pieces``), so a d-1024 block's 50 MB fp32 row is 4 requests of 12.6 MB,
# one per thread, finishing together (8 MiB blocks made it 6 of 8 MiB and a 52 KiB seventh: 7
# hand-offs, wake-ups and completions a row, each a slice of compute's two cores, BENCHMARKS.md)
BLOCK_BYTES = 16 << 20
# The staging window of one I/O thread (a multiple of every O_DIRECT alignment): small, so that
# every thread's window stays in the CPU's cache, where a read lands fastest
# (``checkpoints.chunkio.STAGE_READS``; 4 MiB windows lost that in issue 22's measurements,
# BENCHMARKS.md).
STAGE_BYTES = 1 << 20
_TMP_IDS = itertools.count()


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
        got = odirect.pread_full(fd, _mem(dest[lo:hi]), offset + lo)
        if got < hi - lo:
            raise OSError(errno.EIO, f"unexpected end of file at byte {offset + lo + got}")


def write_span(
    fds: tuple[int | None, int], offset: int, src: torch.Tensor, align: int = odirect.ALIGN
) -> None:
    """On an I/O thread: ``src`` (uint8) at byte ``offset`` of the file behind ``fds``
    (``open_pair`` / ``create``): O_DIRECT where it can, the rest buffered (see the module's
    docstring)."""
    for fd, lo, hi in _by_descriptor(fds, offset, src, align):
        _pwrite_full(fd, _mem(src[lo:hi]), offset + lo)


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


def _mem(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t`` (uint8), shared."""
    return memoryview(t.numpy()) if t.numel() else memoryview(b"")


class DirectFiles:
    """Whole-file reads and writes on ``threads`` I/O threads (a ``FileIO``); traced by ``tracer``,
    timed by ``clock`` (the runtime's I/O busy clock, shared by every tier; a clock of its own when
    None)."""

    def __init__(
        self,
        threads: int,
        name: str,
        direct: bool,
        tracer=NULL_TRACER,
        clock: BusyClock | None = None,
    ):
        self.direct = direct  # whether the file system takes O_DIRECT (tmpfs may not)
        # reads and writes on threads of their own: reads run in the order issued, at most half the
        # threads at once, so the unit a step needs first arrives first at the disk's speed (a later
        # unit's reads would share it), and a burst of writes never holds a read back
        self._reads = FileIO(max(1, threads // 2), f"{name}-read")
        self._writes = FileIO(max(1, threads - threads // 2), f"{name}-write")
        self._create_lock = threading.Lock()
        # each file's descriptors, opened once, read-write (``io.handles``)
        self._handles = OpenFiles(functools.partial(open_pair, flags=os.O_RDWR, direct=direct))
        self.tracer = tracer
        self.clock = clock or BusyClock()

    def close(self) -> None:
        self._reads.close()
        self._writes.close()
        self._handles.close()  # no request in flight: the I/O threads ended

    def read(
        self,
        path: str,
        nbytes: int,
        out: torch.Tensor,
        describe,
        label: tuple[str, str],
        offset: int = 0,
    ) -> Future:
        """Fill ``out`` from bytes ``[offset, offset + out's bytes)`` of the ``nbytes``-byte file at
        ``path`` (the whole file by default); a missing file reads as zeros."""
        handle = self._handles.acquire(path)
        if handle is None:  # never written: zarr's fill value
            out.zero_()
            return done()
        # a row file of another layout (an earlier run's): refuse it, never read it short
        if handle.size != nbytes:
            self._handles.release(handle)
            return failed(
                OSError(
                    errno.EIO,
                    f"{describe()}: the row file has {handle.size} bytes, expected {nbytes}; it "
                    "was left by a run with another layout (remove it, or use a new nvme_path)",
                )
            )
        return self._run_pieces(
            self._reads,
            label,
            offset,
            _as_bytes(out),
            handle.fds,
            read_span_,
            lambda error: self._handles.release(handle),
            describe,
        )

    def write(
        self,
        path: str,
        nbytes: int,
        src: torch.Tensor,
        describe,
        label: tuple[str, str],
        offset: int = 0,
    ) -> Future:
        """Write ``src`` at byte ``offset`` of the ``nbytes``-byte file at ``path``, in place; the
        first write of a file creates it whole (the rest zeros), then renames. Writes of disjoint
        spans may run at once."""
        data = _as_bytes(src)
        target = None
        try:
            handle = self._in_place(path, nbytes, whole=offset == 0 and data.numel() == nbytes)
            if handle is None:
                target = _temporary(path)
                fds = create(target, nbytes, self.direct)
        except OSError as e:
            if target is not None:
                _unlink_quietly(target)
            return failed(wrap(e, describe()))

        def finish(error):
            if handle is not None:
                self._handles.release(handle)
                return
            _close(*fds)
            if error is None:
                os.replace(target, path)  # a new file appears whole or not at all
                self._handles.forget(path)  # a pair open on the file replaced reads the old one
            else:
                _unlink_quietly(target)

        return self._run_pieces(
            self._writes,
            label,
            offset,
            data,
            fds if handle is None else handle.fds,
            write_span,
            finish,
            describe,
        )

    def _in_place(self, path: str, nbytes: int, whole: bool) -> Handle | None:
        """The open pair of the ``nbytes``-byte file ``path`` to write in place (``release`` it
        once written), or None where the write is ``whole`` and the file is missing or of another
        size (it is then created: ``write``); a span of such a file creates it first
        (``_create_zeroed``)."""
        handle = self._handles.acquire(path)
        if handle is not None and handle.size != nbytes:
            self._handles.release(handle)
            handle = None
        if handle is None and not whole:
            self._create_zeroed(path, nbytes)  # a span of a file never written whole
            handle = self._handles.acquire(path)
        return handle

    def _create_zeroed(self, path: str, nbytes: int) -> None:
        """Create the missing file ``path`` whole, reading as zeros: allocated (``create``: ENOSPC
        here), no byte written, renamed into place; once, whichever of several span writes comes
        first."""
        with self._create_lock:
            if _size(path) == nbytes:
                return
            tmp = _temporary(path)
            _close(*create(tmp, nbytes, direct=False))
            os.replace(tmp, path)
            self._handles.forget(path)

    def forget(self, under: str) -> None:
        """The files under the directory ``under`` may be replaced or removed by another hand (an
        array allocated afresh): their open descriptors are closed (once no request uses them)."""
        self._handles.forget(under=under)

    def _run_pieces(self, io: FileIO, label, offset, data, fds, op, finish, describe) -> Future:
        """Split ``data`` (bytes ``offset..`` of the file) into ``odirect.pieces``; run ``op``
        (``read_span_`` or ``write_span``) on each on the I/O threads."""
        return io.run(
            [
                lambda lo=lo, hi=hi: self._timed(label, op, fds, offset + lo, data[lo:hi])
                for lo, hi in odirect.pieces(data.numel(), BLOCK_BYTES)
            ],
            finish,
            describe,
        )

    def _timed(self, label, op, fds, offset, data) -> None:
        """One request, on an I/O thread: traced, and counted by the busy clock."""
        self.clock.enter()
        try:
            with self.tracer.span(*label, bytes=data.numel()):
                op(fds, offset, data)
        finally:
            self.clock.exit()


_pwrite_full = odirect.pwrite_full  # a module attribute: tests inject write errors here



def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The contiguous CPU tensor ``t``'s bytes, a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _temporary(path: str) -> str:
    """A fresh name beside ``path`` (its directory made) for a file renamed to ``path`` once
    whole."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return f"{path}.tmp-{os.getpid()}-{next(_TMP_IDS)}"


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
