"""The host heap: large temporaries are mapped and unmapped, not kept in malloc's arenas.

glibc serves an allocation below its mmap threshold from the heap, and raises that threshold (up to
32 MiB) each time a mapped block is freed. A step's temporaries (the vjp's leaf gradients, a tile's
gradient, activations) are then carved out of arenas whose free holes are never given back: on an
8-layer d_model 2048 GPT with attention and MLP tiled 4 ways, everything on NVMe, the peak RSS the
engine added was 1244 MiB with the sliding threshold and 562 MiB with a fixed 1 MiB one
(BENCHMARKS.md, issue 13). ``Config.host_mmap_threshold`` fixes the threshold (glibc's ``mallopt``,
which also stops the sliding); 0 leaves malloc as it is. The setting is process-wide, like malloc.
"""

from __future__ import annotations

import ctypes
import platform

M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter (malloc.h)

_applied: int | None = None


def fix_mmap_threshold(nbytes: int) -> bool:
    """Serve host allocations of at least ``nbytes`` by their own mapping (freed back to the OS at once);
    True where it took effect (glibc), False elsewhere or for 0. Applied once per value per process."""
    global _applied
    if not nbytes or platform.libc_ver()[0] != "glibc":
        return False
    if nbytes == _applied:
        return True
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    if libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(nbytes)) != 1:
        return False
    _applied = nbytes
    return True
