"""Pure index math of bandwidth-centric partitioning: pad a flat buffer, split it into N equal
shards.

Rank r owns elements ``[r * shard_numel, (r + 1) * shard_numel)`` of *every* layer's padded flat
buffer, so a layer is rebuilt by one allgather in which every rank's link carries 1/N of the bytes.
"""

from __future__ import annotations

from typing import NamedTuple


class Partition(NamedTuple):
    numel: int  # real elements of the flat buffer
    world_size: int
    shard_numel: int  # elements each rank owns (the last shards may hold padding)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard in the padded flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def real_range(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the real (unpadded) elements of rank's shard, in flat-buffer coordinates.

        Real elements always come first in a shard, so ``lo == start``; ``hi - lo`` is their count
        (0 for a rank whose shard is all padding, which happens when numel < world_size *
        shard_numel).
        """
        start, end = self.shard_range(rank)
        return start, max(start, min(end, self.numel))


def partition(numel: int, world_size: int, align: int = 1) -> Partition:
    """Split ``numel`` elements into ``world_size`` equal shards, each a multiple of ``align``
    elements."""
    if numel < 0 or world_size < 1 or align < 1:
        raise ValueError(
            f"partition needs numel >= 0, world_size >= 1, align >= 1; got {numel}, {world_size}, "
            f"{align}"
        )
    per_rank = -(-numel // world_size)
    shard = -(-per_rank // align) * align
    return Partition(numel, world_size, max(shard, align))


def owner_of(layer: int, world_size: int) -> int:
    """Owner of a whole layer in the broadcast (ZeRO-Offload-style) baseline: round-robin."""
    return layer % world_size
