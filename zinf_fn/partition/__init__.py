"""Bandwidth-centric partitioning: shard math, the allgather and broadcast modes, comm, the
fingerprint."""

from .comm import CollectiveError, Comm, DistComm, LocalComm, current_comm
from .fingerprint import check_agreement, fingerprint
from .sharding import AllgatherSharding, BroadcastSharding, Sharding, make_sharding
from .shards import Partition, owner_of, partition

__all__ = [
    "AllgatherSharding",
    "BroadcastSharding",
    "CollectiveError",
    "Comm",
    "DistComm",
    "LocalComm",
    "Partition",
    "Sharding",
    "check_agreement",
    "current_comm",
    "fingerprint",
    "make_sharding",
    "owner_of",
    "partition",
]
