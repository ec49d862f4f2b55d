"""The open descriptors of the files one ``io.direct_files.DirectFiles`` moves, opened once per
file.

A row file is read and written many times a step (the forward's read, the backward's, the update's
pieces): opening it per request (two ``open`` calls, a ``stat``, two ``close`` calls, each a
syscall and some Python) costs ~0.2 ms a request on the caller's thread. ``OpenFiles`` keeps, per
file, its descriptor pair (``files.open_pair``: O_DIRECT where the file system takes it, and the
buffered one for the unaligned tail), opened read-write on first use and checked once against the
size its user expects; later requests use the pair as it is, with no syscall. A pair in use by
requests in flight is never closed under them: ``acquire`` counts a user, ``release`` ends it, and a
pair dropped meanwhile (``forget``, or evicted to stay under ``capacity`` files) is closed when its
last user ends. A file replaced on disk (a first write's rename, an array allocated afresh) must be
``forget``-ten first: its old pair would still read the old inode.
"""

from __future__ import annotations

import os
import resource
import threading
from collections import OrderedDict

# files whose descriptors stay open at once (two each) where the process may open few descriptors:
# far below the usual limit of 1024, and more than the rows one step of a layer-streamed model
# touches often
LEAST_CAPACITY = 256
# the users of ``OpenFiles`` a process may hold at once (the param, optimizer and activation
# tiers, a checkpoint's), each keeping at most its share of the descriptor limit open, less
# ``SPARE`` descriptors for everything else the process opens
USERS = 4
SPARE = 1024


def capacity() -> int:
    """Files one ``OpenFiles`` keeps open: its share (``USERS``) of the process's descriptor limit
    (``RLIMIT_NOFILE``) less ``SPARE``, two descriptors a file, at least ``LEAST_CAPACITY``. A
    streamed mixture of experts reads a file per expert and leaf (12,288 at 48 layers of 128
    experts), many every step: below the files a step touches, an LRU reopens most of them on every
    read (two ``open`` calls, a ``stat`` and two ``close`` calls on the caller's thread), the
    step's sweep evicting each file before its next use."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return LEAST_CAPACITY * USERS
    return max(LEAST_CAPACITY, (soft - SPARE) // (2 * USERS))


CAPACITY = capacity()


class Handle:
    """One file's descriptor pair (``files.open_pair``'s ``(direct or None, buffered)``), its size
    in bytes, and the requests using it."""

    def __init__(self, fds: tuple[int | None, int], size: int):
        self.fds = fds
        self.size = size
        self.users = 0
        self.dropped = False  # forgotten or evicted: closed by its last user


class OpenFiles:
    """Descriptor pairs of files opened once and reused (the module docstring); thread-safe."""

    def __init__(self, opener, capacity: int = CAPACITY):
        """``opener(path)``: the descriptor pair of the existing file ``path``, read-write
        (``files.open_pair``); FileNotFoundError where there is none."""
        self._opener = opener
        self._capacity = capacity
        self._open: OrderedDict[str, Handle] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def acquire(self, path: str) -> Handle | None:
        """``path``'s pair, one more user counted (``release`` it once its requests ended); None
        where the file does not exist (nothing is kept open for it)."""
        with self._lock:
            handle = self._open.get(path)
            if handle is not None:
                self._open.move_to_end(path)
                handle.users += 1
                return handle
        try:
            fds = self._opener(path)
        except FileNotFoundError:
            return None
        try:
            handle = Handle(fds, os.fstat(fds[1]).st_size)
        except OSError:
            _close_pair(fds)
            raise
        handle.users = 1
        with self._lock:
            raced = self._open.get(path)
            if raced is not None:  # another thread opened it meanwhile: use theirs
                raced.users += 1
                _close_pair(fds)
                return raced
            self._open[path] = handle
            self._evict()
        return handle

    def release(self, handle: Handle) -> None:
        """One user of ``handle`` ended; the pair closes here if it was dropped meanwhile."""
        with self._lock:
            handle.users -= 1
            last = handle.dropped and handle.users == 0
        if last:
            _close_pair(handle.fds)

    def forget(self, path: str | None = None, under: str | None = None) -> None:
        """Drop the pair of ``path``, or of every file under the directory ``under`` (every file
        where both are None): a later ``acquire`` opens the file again."""
        with self._lock:
            names = [
                p
                for p in self._open
                if (path is None or p == path)
                and (under is None or p.startswith(os.path.join(under, "")))
            ]
            handles = [self._open.pop(p) for p in names]
            idle = [h for h in handles if _drop(h)]
        for handle in idle:
            _close_pair(handle.fds)

    def close(self) -> None:
        """Close every pair (no request in flight: the I/O threads ended)."""
        self.forget()

    def _evict(self) -> None:
        """Drop the least recently used pairs beyond ``capacity`` (under the lock)."""
        while len(self._open) > self._capacity:
            _, handle = self._open.popitem(last=False)
            if _drop(handle):
                _close_pair(handle.fds)


def _drop(handle: Handle) -> bool:
    """Mark ``handle`` dropped; whether it has no user (the caller closes it then)."""
    handle.dropped = True
    return handle.users == 0


def _close_pair(fds: tuple[int | None, int]) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)
