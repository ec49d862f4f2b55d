"""The infinity offload engine: tiers (device / cpu / nvme), the O_DIRECT file layer, the buffer pool,
activation offload."""

from .activations import OffloadedCheckpoints
from .buffers import BufferPool, aligned_empty, canonical_device
from .nvme import NvmeTier
from .tiers import PLACEMENTS, MemoryTier, Tier, make_tier

__all__ = ["PLACEMENTS", "BufferPool", "MemoryTier", "NvmeTier", "OffloadedCheckpoints", "Tier", "aligned_empty",
           "canonical_device", "make_tier"]
