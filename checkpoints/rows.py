"""Which rows a state has, which of them this rank holds, and which elements of each it holds.

A *row* is one unit's flat buffer in its group's arrays: layer i of "blocks", the one row of "embed"
and "head", or one tile of a tiled weight (group "blocks:mlp.fc.w", row ``layer * n_tiles + t``, see
``zinf_fn.tiling.layout``). Who holds what is the engine's partition mode (``zinf_fn.state``):

- "allgather": every rank holds a shard of every row, elements ``[r * S, (r + 1) * S)`` of the
  padded flat buffer, of which the checkpoint keeps the real ones (``< numel``);
- "broadcast": the owner of a unit holds all of its rows (and its tiles' rows) whole, ``[0,
  numel)``.

Either way a rank's tier row holds its elements from position 0, so element ``e`` of the checkpoint
row is ``buffer[e - lo]``. A kind that stores one element per block of ``per`` (int8 moments'
scales, ``per_element``) holds blocks ``[lo / per, ceil(hi / per))`` the same way (shards are whole
blocks).
"""

from __future__ import annotations

from typing import NamedTuple

from zinf_fn.state import Row, StateView

__all__ = [
    "ReadWindow",
    "Row",
    "columns",
    "disk_name",
    "element_range",
    "held_rows",
    "kind_range",
    "per_element",
    "read_window",
]


def held_rows(v: StateView) -> list[Row]:
    """The rows this rank holds, in the order a step updates them (``StateView.rows``)."""
    return v.rows()


def element_range(v: StateView, group: str) -> tuple[int, int]:
    """[lo, hi) of the real elements of ``group``'s rows that this rank's tier rows hold."""
    return v.element_range(group)


def per_element(stored, kind: str, group: str) -> int:
    """Elements of the group's flat row per stored element of ``kind`` (1, or a block for int8
    scales); ``stored``: a ``zinf_fn.state.StoredRows``."""
    return stored.groups[group].part.shard_numel // stored.row_numel(kind, group)


def kind_range(v: StateView, stored, group: str, kind: str) -> tuple[int, int]:
    """[lo, hi) of the real stored elements of ``kind`` in ``group`` this rank holds
    (``element_range`` scaled by ``per_element``: whole blocks, the last one cut by the row's end);
    empty where it holds none."""
    return columns(read_window(v, group), per_element(stored, kind, group))


class ReadWindow(NamedTuple):
    """What a restore reads of one slot of a row on this rank: elements ``[start, start + numel)``
    of the unit's padded row into buffers (``numel // per`` elements for a kind of one stored
    element per ``per``), of which ``[start, end)`` are real, and ``keep``: the state's shard of
    them (``[lo, lo + shard)``)."""

    start: int
    end: int
    numel: int
    keep: slice


def read_window(v: StateView, group: str, block: int = 1) -> ReadWindow:
    """The window of ``group``'s rows this rank reads: its shard, from its first real element
    rounded down to ``block``, the elements its sources decode together (int8 moments' 256; 1: the
    shard itself). A shard that starts inside a block (an fp32 state's, from an int8 checkpoint) so
    decodes whole blocks."""
    lo, hi = v.element_range(group)
    shard = v.shard_numel(group)
    start = lo - lo % block
    numel = -(-(lo + shard - start) // block) * block
    return ReadWindow(start, hi if hi > lo else start, numel, slice(lo - start, lo - start + shard))


def columns(window: ReadWindow, per: int) -> tuple[int, int]:
    """[lo, hi) of the stored elements of a kind of ``per`` elements per stored one
    (``per_element``) that ``window`` reads: whole blocks, the last one cut by the row's end; empty
    where it holds no real element (never the block of another rank's elements: each chunk file has
    one writer)."""
    if window.end <= window.start:
        return 0, 0
    return window.start // per, -(-window.end // per)


def disk_name(group: str) -> str:
    """A group's directory: tile groups ("blocks:mlp.fc.w") keep to zarr's recommended name
    characters."""
    return group.replace(":", "--")
