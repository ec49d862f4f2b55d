"""Which rows a state has, which of them this rank holds, and which elements of each it holds.

A *row* is one unit's flat buffer in its group's arrays: layer i of "blocks", the one row of "embed"
and "head", or one tile of a tiled weight (group "blocks:mlp.fc.w", row ``layer * n_tiles + t``, see
``zinf_fn.tiles``). Who holds what is the engine's ``Sharding``:

- "allgather": every rank holds a shard of every row, elements ``[r * S, (r + 1) * S)`` of the padded
  flat buffer, of which the checkpoint keeps the real ones (``< numel``);
- "broadcast": the owner of a unit holds all of its rows (and its tiles' rows) whole, ``[0, numel)``.

Either way a rank's tier row holds its elements from position 0, so element ``e`` of the checkpoint
row is ``buffer[e - lo]``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from zinf_fn.store import units


class Row(NamedTuple):
    group: str
    row: int
    unit: Any      # the zinf_fn Unit or TileUnit, for Sharding.holds


def rows_in_update_order(runtime) -> list[Row]:
    """Every row, in the order a step updates them (reverse scan: head, blocks L-1..0, embed)."""
    layout = runtime.tiles.layout
    out = []
    for unit in reversed(units(runtime.model.n_layers)):
        out += [Row(t.group, t.row, t) for t in reversed(layout.units([unit]))]
        out.append(Row(unit.group, unit.row, unit))
    return out


def held_rows(runtime) -> list[Row]:
    """The rows this rank holds (all of them in allgather mode, its units' in broadcast mode)."""
    return [r for r in rows_in_update_order(runtime) if runtime.sharding.holds(r.unit)]


def element_range(runtime, group: str) -> tuple[int, int]:
    """[lo, hi) of the real elements of ``group``'s rows that this rank's tier rows hold."""
    part = runtime.store.groups[group].part
    lo, hi = runtime.sharding.local_range(part)
    hi = min(hi, part.numel)
    return min(lo, hi), hi


def disk_name(group: str) -> str:
    """A group's directory: tile groups ("blocks:mlp.fc.w") keep to zarr's recommended name characters."""
    return group.replace(":", "--")
