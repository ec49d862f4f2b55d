"""A unit's weights and the rows they are stored in: its group's row, its frozen row, its tiles'
rows.

A unit's tree is stored over several rows: its stage's group holds its leaves, with a zero-size
*anchor* in place of each tiled weight (whose tiles are rows of the weight's tile group,
``tiling.layout``) and of each frozen leaf stored apart (in its stage's "<stage>:frozen" group,
``zinf_fn.formats.frozen``). These functions are the one place that maps between a unit's weights by
key path and those rows, for the state interface (``zinf_fn.state``: ``gather_params``,
``StateView.gather_unit`` / ``load_unit_`` / ``leaf_shapes``) and so for checkpoints' imports and
exports. ``v`` is a ``StateView`` (its ``gather_row`` is this module's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..optim.remainder import join
from ..tiling.layout import assemble
from ..tree import LeafSpec, unflatten
from .units import key


def gather_row(store, sharding, kind: str, unit) -> torch.Tensor:
    """``unit``'s row of ``kind`` gathered over ranks: flat fp32 on the CPU, padding cut
    (``StateView.gather_row``; a per-block scale row: the blocks holding the real elements,
    ``RowKinds.unit_numel``). Collective. The "master" of a frozen group is its param row; of a
    remainder master, the param and remainder rows joined (``optim.remainder``); "remainder" comes
    back as its int16 bits, int8 codes as their uint8."""
    if kind == "master" and unit.group in store.row_kinds.frozen:
        kind = "param"
    if kind == "master" and store.row_kinds.remainder:
        return join(
            _gather_bits(store, sharding, "param", unit),
            _gather_bits(store, sharding, "remainder", unit),
        )
    bits = _gather_bits(store, sharding, kind, unit)
    return bits if bits.dtype in (torch.int16, torch.uint8) else bits.to(torch.float32)


def row_values(v, kind: str, unit) -> torch.Tensor:
    """``v.gather_row(kind, unit)``; of a quantized frozen row (``Config.frozen_storage``), not its
    bytes but the values they hold, dequantized (fp32, the leaves of ``FrozenCodes.values_spec``).
    Collective."""
    row = v.gather_row(kind, unit)
    codes = v.frozen.codes
    spec = codes.values_spec(unit.group)
    return row if spec is None else codes.decode_row_(unit.group, row, torch.empty(spec.numel))


def _gather_bits(store, sharding, kind: str, unit) -> torch.Tensor:
    """``unit``'s row of ``kind`` gathered over ranks, in its dtype on the CPU, padding cut.
    Collective."""
    tier, part, dtype = (
        store.tier_of(kind),
        store.group_of(unit).part,
        store.row_kinds.dtype_of(kind, unit.group),
    )
    n = store.row_kinds.row_numel(kind, unit.group)
    # gloo moves no int16: the same bytes as bf16
    wire = torch.bfloat16 if dtype == torch.int16 else dtype
    shard = None
    if sharding.holds(unit):
        shard = torch.empty(n, dtype=dtype, device=tier.device)
        tier.read_(key(unit.group, kind), unit.row, shard).result()  # sync: shard read
    # the rows gathered: every rank's (allgather), or one
    ranks = part.padded_numel // part.shard_numel
    full = torch.empty(n * ranks, dtype=dtype, device=tier.device)
    # sync: every part in
    sharding.gather_(full.view(wire), None if shard is None else shard.view(wire), unit)
    return full[: store.row_kinds.unit_numel(kind, unit.group)].to("cpu").clone()


def stored_leaves(v, unit) -> list[tuple[Any, LeafSpec]]:
    """(row unit, leaf spec) of every untiled weight of ``unit``: its group's leaves but the
    anchors, then its frozen row's (``zinf_fn.formats.frozen``), each at its offset in that row."""
    companion = v.frozen.companion(unit)
    anchors = {leaf.path for leaf in v.tiles.leaves.get(unit.group, ())}
    # real shapes, quantized or not
    frozen = () if companion is None else v.frozen.splits[unit.group].spec.leaves
    anchors |= {leaf.path for leaf in frozen}
    out = [(unit, leaf) for leaf in v.groups[unit.group].spec.leaves if leaf.path not in anchors]
    return out + [(companion, leaf) for leaf in frozen]


def leaf_shapes(v, unit) -> dict[str, tuple[int, ...]]:
    """Key path in ``unit``'s tree -> shape of every weight of it (a tiled weight whole)."""
    out = {leaf.path: tuple(leaf.shape) for _, leaf in stored_leaves(v, unit)}
    out.update({leaf.path: tuple(leaf.full_shape()) for leaf in v.tiles.leaves.get(unit.group, ())})
    return out


def gather_unit(v, kind: str, unit) -> dict[str, torch.Tensor]:
    """Key path -> ``unit``'s weight of ``kind`` gathered over ranks, fp32 on the CPU: a tiled
    weight whole (its tiles joined), a frozen leaf from its frozen row (dequantized, where
    quantized). Collective: every rank calls it for the unit."""
    rows: dict = {}
    out = {}
    for row_unit, leaf in stored_leaves(v, unit):
        if row_unit not in rows:
            rows[row_unit] = row_values(v, kind, row_unit)
        out[leaf.path] = rows[row_unit][leaf.offset : leaf.offset + leaf.numel].view(leaf.shape)
    layout = v.tiles
    for leaf in layout.leaves.get(unit.group, ()):
        tiles = [
            row_values(v, kind, layout.tile_unit(leaf, unit, t))[: leaf.numel(t)].view(
                leaf.shapes[t]
            )
            for t in range(leaf.n_tiles)
        ]
        out[leaf.path] = torch.cat(tiles, dim=leaf.axis)
    return out


def gather_tree(v, kind: str, unit) -> Any:
    """``unit``'s whole tree of ``kind`` gathered over ranks (fp32, CPU): its frozen leaves back in
    place, each tiled weight the ``RowTiles`` / ``ColTiles`` node its init returned. Collective."""
    rest = unflatten(v.gather_row(kind, unit), v.groups[unit.group].spec)
    companion = v.frozen.companion(unit)
    if companion is not None:
        frozen = unflatten(row_values(v, kind, companion), v.frozen.splits[unit.group].spec)
        rest = v.frozen.assemble(unit, rest, frozen)
    return assemble(v.tiles, unit, rest, lambda tile: row_values(v, kind, tile))


def load_unit_(v, unit, source: Callable[[str], torch.Tensor]) -> None:
    """Every row of ``unit`` from ``source(path)``, the whole weight at each key path (any dtype):
    its group's and frozen row as flat fp32 rows, a tiled weight cut as the model cuts it, one tile
    per row at its front. Each row is written as ``zf.init`` writes it (``StateView.load_row_``:
    master, fresh optimizer state, copy; a quantized frozen row: the codes of its 16-bit values)."""
    rows: dict = {}
    for row_unit, leaf in stored_leaves(v, unit):
        if row_unit not in rows:
            padded = v.groups[row_unit.group].part.padded_numel
            rows[row_unit] = torch.zeros(
                v.frozen.codes.values_numel(row_unit.group, padded), dtype=torch.float32
            )
        rows[row_unit][leaf.offset : leaf.offset + leaf.numel].copy_(source(leaf.path).reshape(-1))
    rows.setdefault(unit, torch.zeros(v.groups[unit.group].part.padded_numel, dtype=torch.float32))
    for row_unit, flat in rows.items():
        v.load_row_(row_unit, flat)
    layout = v.tiles
    for leaf in layout.leaves.get(unit.group, ()):
        pieces = torch.split(source(leaf.path), [s[leaf.axis] for s in leaf.shapes], dim=leaf.axis)
        for t, piece in enumerate(pieces):
            row = torch.zeros(v.groups[leaf.group].part.padded_numel, dtype=torch.float32)
            row[: piece.numel()].copy_(piece.reshape(-1))
            v.load_row_(layout.tile_unit(leaf, unit, t), row)
