"""Whole row files (or spans of them) read and written on I/O threads over the file layer
(``io.files``): ``DirectFiles``, the DeepNVMe-style I/O engine under the NVMe tier
(``NvmeTier(engine="direct")``).

It moves them on its ``FileIO``'s threads, in pieces of at most ``BLOCK_BYTES``
(``odirect.pieces``; several in flight per file), straight from/to the caller's buffer, bypassing
the page cache, with no intermediate copy; the threads block in ``preadv``/``pwrite``, which release
the GIL. ``BufferPool`` hands out page-aligned host buffers, so only a row's sub-page tail takes the
fallback. Each file's descriptors are opened once and reused by every request (``io.handles``).

The first write of a row file creates it whole (``create`` on a temporary name, renamed once
written): running out of space raises there and leaves every file written before readable. Later
writes overwrite the allocated blocks in place: no block allocation, so no ENOSPC after the first
write on a non-copy-on-write file system (ext4, xfs, tmpfs), and no journal transaction for a create
or a rename. A failed in-place write (EIO) leaves that one file torn, no other.

``read``/``write`` return ``concurrent.futures.Future`` s whose ``result()`` raises ``OSError`` with
the caller's description of what was moved; the caller keeps the buffer alive and untouched until
then."""

from __future__ import annotations

import errno
import functools
import itertools
import os
import threading
from concurrent.futures import Future

import torch

from ..observe.trace import NULL_TRACER, BusyClock

# through the module: the file layer's functions are called as ``files.create`` etc., the one place
# a file is made or opened (what a test records)
from . import files, odirect
from .futures import done, failed, wrap
from .handles import Handle, OpenFiles

# the largest O_DIRECT request: a transfer is cut into the fewest pieces of at most this size, of
# one length (``odirect.pieces``), so a d-1024 block's 50 MB fp32 row is one request.
# why 64 MiB, not 16: the disk's queue does not need a request per thread: one large O_DIRECT
# ``preadv``/``pwrite`` submits all its block requests (4 MiB each here) before it sleeps, so the
# device sees them in flight together. What each request costs is the CPU's: an I/O thread woken
# to start it and again when it ends, and a completion to join, each a slice taken from compute's
# two cores (a sgemm thread preempted, its twin spinning until it is back). 16 MiB made that row 4
# requests of 12.6 MB on 4 threads (and a bf16 row 2): the read threads' wake-ups a step of
# ``overlap.py --quick`` fell from 182 to 163, their CPU from 18.5 to 17.3 ms (issue 36).
BLOCK_BYTES = 64 << 20
_TMP_IDS = itertools.count()


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
        self._reads = files.FileIO(max(1, threads // 2), f"{name}-read")
        self._writes = files.FileIO(max(1, threads - threads // 2), f"{name}-write")
        self._create_lock = threading.Lock()
        # each file's descriptors, opened once, read-write (``io.handles``)
        self._handles = OpenFiles(
            functools.partial(files.open_pair, flags=os.O_RDWR, direct=direct)
        )
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
            files.read_span_,
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
                fds = files.create(target, nbytes, self.direct)
        except OSError as e:
            if target is not None:
                _unlink_quietly(target)
            return failed(wrap(e, describe()))

        def finish(error):
            if handle is not None:
                self._handles.release(handle)
                return
            files.close_pair(fds)
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
            files.write_span,
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
            files.close_pair(files.create(tmp, nbytes, direct=False))
            os.replace(tmp, path)
            self._handles.forget(path)

    def forget(self, under: str) -> None:
        """The files under the directory ``under`` may be replaced or removed by another hand (an
        array allocated afresh): their open descriptors are closed (once no request uses them)."""
        self._handles.forget(under=under)

    def _run_pieces(
        self, io: files.FileIO, label, offset, data, fds, op, finish, describe
    ) -> Future:
        """Split ``data`` (bytes ``offset..`` of the file) into ``odirect.pieces``; run ``op``
        (``read_span_`` or ``write_span``) on each on the I/O threads."""
        return io.run(
            [
                lambda lo=lo, hi=hi: self._timed(
                    label, op, fds, offset + lo, files.span(data, lo, hi)
                )
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


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The contiguous CPU tensor ``t``'s bytes, a flat uint8 view (``t`` itself where it is one: a
    row of codes; ``files.span``)."""
    if t.dtype == torch.uint8 and t.dim() == 1:
        return t
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


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
