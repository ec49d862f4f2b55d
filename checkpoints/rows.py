"""Which rows a state has, which of them this rank holds, and which elements of each it holds.

A *row* is one unit's flat buffer in its group's arrays: layer i of "blocks", the one row of "embed"
and "head", or one tile of a tiled weight (group "blocks:mlp.fc.w", row ``layer * n_tiles + t``, see
``zinf_fn.tiling.layout``). Who holds what is the engine's partition mode (``zinf_fn.state``):

- "allgather": every rank holds a shard of every row, elements ``[r * S, (r + 1) * S)`` of the padded
  flat buffer, of which the checkpoint keeps the real ones (``< numel``);
- "broadcast": the owner of a unit holds all of its rows (and its tiles' rows) whole, ``[0, numel)``.

Either way a rank's tier row holds its elements from position 0, so element ``e`` of the checkpoint
row is ``buffer[e - lo]``.
"""

from __future__ import annotations

from zinf_fn.state import Row, StateView

__all__ = ["Row", "disk_name", "element_range", "held_rows"]


def held_rows(v: StateView) -> list[Row]:
    """The rows this rank holds, in the order a step updates them (``StateView.rows``)."""
    return v.rows()


def element_range(v: StateView, group: str) -> tuple[int, int]:
    """[lo, hi) of the real elements of ``group``'s rows that this rank's tier rows hold."""
    return v.element_range(group)


def disk_name(group: str) -> str:
    """A group's directory: tile groups ("blocks:mlp.fc.w") keep to zarr's recommended name characters."""
    return group.replace(":", "--")
