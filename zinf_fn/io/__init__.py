"""Generic I/O below everything: the O_DIRECT file layer and its alignment probe, I/O futures,
aligned host buffers (huge pages, the mmap threshold) and the buffer pool. The engine's tiers and
checkpoints/ both build on it; it knows nothing of units, tiers or steps."""

from .buffers import BufferPool, aligned_empty, canonical_device
from .direct_files import DirectFiles
from .files import FileIO
from .futures import done, failed

__all__ = [
    "BufferPool",
    "DirectFiles",
    "FileIO",
    "aligned_empty",
    "canonical_device",
    "done",
    "failed",
]
