"""O_DIRECT file I/O primitives: the probes, aligned windows, and full reads and writes of one
range.

``O_DIRECT`` moves bytes between the disk and the caller's memory with no page cache and no copy,
but needs the memory address, the file offset and the length aligned to the device's logical block
size: 512 bytes on most disks, up to ``ALIGN`` (4096) on others. ``write_alignment`` and
``read_alignment`` find the smallest of the two that works on a file system by trying it, or None
where ``O_DIRECT`` is refused (tmpfs on older kernels: EINVAL at open); callers then use buffered
I/O.
"""

from __future__ import annotations

import errno
import mmap
import os
import uuid

ALIGN = 4096  # the largest O_DIRECT alignment in use; buffers aligned to it suit every disk
CANDIDATES = (512, ALIGN)


def write_alignment(directory: str) -> int | None:
    """The O_DIRECT alignment for new files in the existing, writable ``directory`` (None:
    refused)."""
    if not hasattr(os, "O_DIRECT"):
        return None
    probe = os.path.join(directory, f".odirect-probe-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return None
    try:
        return _first_working(lambda mem, offset: os.pwrite(fd, mem, offset))
    finally:
        os.close(fd)
        os.unlink(probe)


def read_alignment(path: str) -> int | None:
    """The O_DIRECT alignment for reading the existing file ``path`` (None: refused)."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size < 2 * ALIGN:
            return ALIGN  # too short to try a smaller offset inside the file: the safe choice
        return _first_working(lambda mem, offset: os.preadv(fd, [mem], offset))
    finally:
        os.close(fd)


def _first_working(io) -> int | None:
    """The smallest candidate alignment at which ``io(mem, offset)`` of that many bytes succeeds."""
    buf = mmap.mmap(-1, 2 * ALIGN)  # page-aligned
    for align in CANDIDATES:
        try:
            # address, offset and length all ``align``
            io(memoryview(buf)[align : 2 * align], align)
            return align
        except OSError:
            continue
    return None


def align_down(n: int, align: int = ALIGN) -> int:
    return n - n % align


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def is_aligned(align: int, *values: int) -> bool:
    """True when every value (addresses, offsets, lengths) is a multiple of ``align``."""
    return all(v % align == 0 for v in values)


def pieces(nbytes: int, block: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` byte spans covering ``nbytes`` in the fewest requests of at most ``block``
    bytes, of one length rounded up to ``ALIGN`` (each piece starts aligned: it moves by O_DIRECT
    wherever the whole transfer does), the last one shorter; one empty piece for 0 bytes (so a
    transfer of nothing still runs, and its future resolves)."""
    count = max(1, -(-nbytes // block))
    size = max(ALIGN, align_up(-(-nbytes // count)))
    return [(lo, min(lo + size, nbytes)) for lo in range(0, nbytes, size)] or [(0, 0)]


def pread_full(fd: int, mem: memoryview, offset: int) -> int:
    """Read into ``mem`` from ``offset`` until it is full or the file ends; returns the bytes
    read."""
    done = 0
    while done < len(mem):
        n = os.preadv(fd, [mem[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def pwrite_full(fd: int, mem: memoryview, offset: int) -> None:
    """Write all of ``mem`` at ``offset``."""
    done = 0
    while done < len(mem):
        n = os.pwrite(fd, mem[done:], offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"write made no progress at byte {offset + done}")
        done += n
