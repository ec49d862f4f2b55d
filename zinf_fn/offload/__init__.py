"""The infinity offload engine: tiers (device / cpu / nvme), the O_DIRECT file layer, I/O futures, the buffer
pool, activation offload."""

from .activations import OffloadedCheckpoints
from .buffers import BufferPool, aligned_empty, canonical_device
from .files import DirectFiles, FileIO
from .futures import done, failed
from .nvme import NvmeTier
from .tiers import NVME_ENGINES, PLACEMENTS, MemoryTier, Tier, make_tier

__all__ = ["NVME_ENGINES", "PLACEMENTS", "BufferPool", "DirectFiles", "FileIO", "MemoryTier", "NvmeTier",
           "OffloadedCheckpoints", "Tier", "aligned_empty", "canonical_device", "done", "failed", "make_tier"]
