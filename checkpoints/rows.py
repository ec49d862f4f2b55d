"""Which rows a state has, which of them this rank holds, and which elements of each it holds.

A *row* is one unit's flat buffer in its group's arrays: layer i of "blocks", the one row of "embed"
and "head", or one tile of a tiled weight (group "blocks:mlp.fc.w", row ``layer * n_tiles + t``, see
``zinf_fn.tiling.layout``). Who holds what is the engine's partition mode (``zinf_fn.state``):

- "allgather": every rank holds a shard of every row, elements ``[r * S, (r + 1) * S)`` of the padded
  flat buffer, of which the checkpoint keeps the real ones (``< numel``);
- "broadcast": the owner of a unit holds all of its rows (and its tiles' rows) whole, ``[0, numel)``.

Either way a rank's tier row holds its elements from position 0, so element ``e`` of the checkpoint
row is ``buffer[e - lo]``. A kind that stores one element per block of ``per`` (int8 moments' scales,
``per_element``) holds blocks ``[lo / per, ceil(hi / per))`` the same way (shards are whole blocks).
"""

from __future__ import annotations

from zinf_fn.state import Row, StateView

__all__ = ["Row", "disk_name", "element_range", "held_rows", "kind_range", "per_element"]


def held_rows(v: StateView) -> list[Row]:
    """The rows this rank holds, in the order a step updates them (``StateView.rows``)."""
    return v.rows()


def element_range(v: StateView, group: str) -> tuple[int, int]:
    """[lo, hi) of the real elements of ``group``'s rows that this rank's tier rows hold."""
    return v.element_range(group)


def per_element(stored, kind: str, group: str) -> int:
    """Elements of the group's flat row per stored element of ``kind`` (1, or a block for int8 scales);
    ``stored``: a ``zinf_fn.state.StoredRows``."""
    return stored.groups[group].part.shard_numel // stored.row_numel(kind, group)


def kind_range(v: StateView, stored, group: str, kind: str) -> tuple[int, int]:
    """[lo, hi) of the real stored elements of ``kind`` in ``group`` this rank holds (``element_range``
    scaled by ``per_element``: whole blocks, the last one cut by the row's end); empty where it holds none."""
    lo, hi = v.element_range(group)
    if lo >= hi:
        return 0, 0
    per = per_element(stored, kind, group)
    return lo // per, -(-hi // per)


def disk_name(group: str) -> str:
    """A group's directory: tile groups ("blocks:mlp.fc.w") keep to zarr's recommended name characters."""
    return group.replace(":", "--")
