"""Durability: a file or directory fsynced, many at once, or a whole file system with one syncfs(2).

A write is durable once its data and the directory entry naming its file are on the disk.
``fsync_path`` makes one file or directory durable; ``fsync_all`` many at once (concurrent fsyncs
share the file system's journal commits); ``syncfs`` everything written to one file system so far,
in one journal commit instead of one per file and directory, where the OS has it.
"""

from __future__ import annotations

import ctypes
import functools
import os
from concurrent.futures import ThreadPoolExecutor

# fsyncs in flight where the caller lends no threads: each one waits on the disk
FSYNC_THREADS = 16


def fsync_path(path: str) -> None:
    """``path`` (a file or a directory) durable on return."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(paths: list[str], pool: ThreadPoolExecutor | None = None) -> None:
    """fsync ``paths`` in parallel (on ``pool``, or on ``FSYNC_THREADS`` new threads): durable on
    return."""
    own = ThreadPoolExecutor(FSYNC_THREADS) if pool is None else None
    try:
        list((pool or own).map(fsync_path, paths))  # sync: concurrent fsyncs share journal commits
    finally:
        if own is not None:
            own.shutdown()


def syncfs(path: str) -> bool:
    """syncfs(2) on the file system holding ``path``: everything written to it so far is durable on
    return (data, metadata, directory entries), in one journal commit instead of one per file and
    directory. It also flushes other processes' dirty data on that file system. False where the OS
    has no syncfs (nothing was synced)."""
    fn = libc_function("syncfs")
    if fn is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if fn(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(
                code, f"syncfs of the file system under {path!r} failed: {os.strerror(code)}"
            )
    finally:
        os.close(fd)
    return True


@functools.cache
def libc_function(name: str):
    """The C library's function ``name`` (errno kept for ``ctypes.get_errno``), or None where it
    lacks it."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
