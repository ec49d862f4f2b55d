"""The host heap: large temporaries are mapped and unmapped, not kept in malloc's arenas.

glibc serves an allocation below its mmap threshold from the heap, and raises that threshold (up to
32 MiB) each time a mapped block is freed. A step's temporaries (the vjp's leaf gradients, a tile's
gradient, activations) are then carved out of arenas whose free holes are never given back, and the
process's peak RSS grows by them (BENCHMARKS.md, issue 13). ``Config.host_mmap_threshold`` fixes the
threshold (glibc's ``mallopt``, which also stops the sliding); 0 leaves malloc as it is.
The setting is process-wide, like malloc.

``advise_huge``: the engine's large host buffers (``io.buffers.aligned_empty``) ask for transparent
huge pages (``madvise(MADV_HUGEPAGE)``, Linux): their first touch faults 2 MiB at a time, and the
kernel pins them for an O_DIRECT request a huge page at a time instead of 4 KiB at a time (an
all-NVMe step's kernel time, BENCHMARKS.md). Where the kernel's THP mode is ``never`` the advice
changes nothing.
"""

from __future__ import annotations

import ctypes
import platform
import sys

from .sync import libc_function

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)

_applied: int | None = None


def fix_mmap_threshold(nbytes: int) -> bool:
    """Serve host allocations of at least ``nbytes`` by their own mapping (freed back to the OS at
    once); True where it took effect (glibc), False elsewhere or for 0. Applied once per value per
    process."""
    global _applied
    if not nbytes or platform.libc_ver()[0] != "glibc":
        return False
    if nbytes == _applied:
        return True
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    if mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(nbytes)) != 1:
        return False
    _applied = nbytes
    return True


def advise_huge(address: int, nbytes: int) -> bool:
    """Advise transparent huge pages for ``[address, address + nbytes)`` (``HUGE_PAGE``-aligned, a
    multiple of it); True where the kernel took the advice."""
    madvise = libc_function("madvise") if sys.platform == "linux" else None
    if madvise is None or nbytes <= 0:
        return False
    return (
        madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), ctypes.c_int(MADV_HUGEPAGE)) == 0
    )
