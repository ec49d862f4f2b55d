"""The infinity offload engine: tiers (device / cpu / nvme), spillover, kept rows, activation
offload.

The generic I/O below it (the O_DIRECT file layer, I/O futures, aligned buffers and the buffer pool)
is ``zinf_fn.io``."""

from .activations import OffloadedCheckpoints
from .nvme import NvmeTier
from .protocol import NVME_ENGINES, PLACEMENTS, Tier
from .tiers import MemoryTier, make_tier

__all__ = [
    "NVME_ENGINES",
    "PLACEMENTS",
    "MemoryTier",
    "NvmeTier",
    "OffloadedCheckpoints",
    "Tier",
    "make_tier",
]
