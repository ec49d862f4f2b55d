"""Which elements of this rank's shard take weight decay: spans per unit, cached per group and
pattern.

The optimizer's ``weight_decay_mask`` is a predicate on key paths (``"blocks.3.attn.qkv.w"``); the
fused kernels take runs of elements instead (``DecaySpans``). A unit's spans depend only on its
group's flat layout, this rank's range of it and which of its leaves the predicate accepts, so units
of one group with the same pattern share them.
"""

from __future__ import annotations

import threading

from ..layout.units import Unit
from ..partition.sharding import Sharding
from ..store import Store
from ..tree import FlatSpec
from .optimizers import DecaySpans


def decay_spans(
    spec: FlatSpec, prefix: str, part_range: tuple[int, int], predicate
) -> DecaySpans | None:
    """The ranges of this rank's shard (``part_range`` of the padded flat buffer) that take weight
    decay: the leaves whose key path ``predicate`` accepts, merged where they touch. None: decay
    everything."""
    if predicate is None:
        return None
    start, end = part_range
    spans: list[tuple[int, int]] = []
    for leaf in spec.leaves:
        lo, hi = max(leaf.offset, start), min(leaf.offset + leaf.numel, end)
        if lo < hi and predicate(f"{prefix}{leaf.path}"):
            if spans and spans[-1][1] == lo - start:
                spans[-1] = (spans[-1][0], hi - start)
            else:
                spans.append((lo - start, hi - start))
    return DecaySpans(tuple(spans), end - start)


class DecayCache:
    """``of(unit)``: the decayed spans of this rank's shard of ``unit`` under ``mask`` (None: decay
    everything), computed once per group and decay pattern. Thread-safe (the update workers share
    it)."""

    def __init__(self, store: Store, sharding: Sharding, mask):
        self.store, self.sharding, self.mask = store, sharding, mask
        self._spans: dict[tuple, DecaySpans | None] = {}
        self._lock = threading.Lock()

    def of(self, unit: Unit) -> DecaySpans | None:
        if self.mask is None:
            return None
        group = self.store.group_of(unit)
        prefix = f"{unit.name}."
        signature = tuple(self.mask(prefix + leaf.path) for leaf in group.spec.leaves)
        cache_key = (unit.group, signature)
        with self._lock:
            if cache_key not in self._spans:
                part_range = self.sharding.local_range(group.part)
                self._spans[cache_key] = decay_spans(group.spec, prefix, part_range, self.mask)
            return self._spans[cache_key]

    def row_offset(self, unit: Unit) -> int:
        """Where this rank's shard of ``unit`` starts in the unit's padded flat row (its element
        index there)."""
        return self.sharding.local_range(self.store.group_of(unit).part)[0]
