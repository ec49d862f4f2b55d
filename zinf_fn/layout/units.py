"""The unit vocabulary: the names every part of the engine shares, defined once.

A step walks *units* in scan order: unit 0 is the embedding, units 1..L the blocks, unit L+1 the
head (``head_index``). Each unit belongs to a *group* (``EMBED``, ``BLOCKS``, ``HEAD``: "embed",
"blocks", "head") whose arrays hold one row per unit; an array is named ``key(group, kind)``, e.g.
"blocks/param". This module imports nothing of the engine: the store, the tiers and the planner all
build on it.
"""

from __future__ import annotations

from typing import NamedTuple

EMBED, BLOCKS, HEAD = "embed", "blocks", "head"  # the three stages, and the names of their groups
# a stage's group holds its units' rows; any other group, rows a stage's unit adds
STAGES = (EMBED, BLOCKS, HEAD)


def unit_name(stage: str, layer: int) -> str:
    """The name of a unit and the key-path prefix of its leaves: "embed", "blocks.3", "head"."""
    return f"{BLOCKS}.{layer}" if stage == BLOCKS else stage


def stage_rows(stage: str, n_layers: int) -> int:
    """Rows of a stage's group: one per layer for the blocks, one for the embedding and the head."""
    return n_layers if stage == BLOCKS else 1


def stage_of(group: str) -> str:
    """The stage a group's rows belong to: "blocks" of "blocks", "blocks:frozen" and a tile group
    "blocks:mlp.fc.w" (a group's name is its stage's, then ":" and what it holds of it)."""
    return group.split(":")[0]


def unit_of_row(group: str, row: int, rows: int, n_layers: int) -> int:
    """The scan-order index of the unit that row ``row`` of ``group`` (``rows`` rows) belongs to.

    A stage's group has ``stage_rows`` rows; a tile group "<stage>:<path>"
    (``zinf_fn.tiling.layout``) has ``tiles`` rows per layer, row = layer * tiles + t.
    """
    stage = stage_of(group)
    layer = row // max(1, rows // stage_rows(stage, n_layers))
    return {EMBED: 0, HEAD: head_index(n_layers)}.get(stage, layer + 1)


def head_index(n_layers: int) -> int:
    """The scan-order index of the head unit: after the embedding (0) and the ``n_layers``
    blocks."""
    return n_layers + 1


class Unit(NamedTuple):
    index: int  # position in scan order: 0 embed, 1..L blocks, L+1 head
    group: str
    row: int

    @property
    def name(self) -> str:
        return unit_name(self.group, self.row)


def units(n_layers: int) -> list[Unit]:
    return [
        Unit(0, EMBED, 0),
        *(Unit(i + 1, BLOCKS, i) for i in range(n_layers)),
        Unit(head_index(n_layers), HEAD, 0),
    ]


def key(group: str, kind: str) -> str:
    return f"{group}/{kind}"


def reused(unit: Unit, n_layers: int, reuse: int) -> bool:
    """Whether ``unit`` (a block, or a row of one: its frozen row, ``unit.index`` in scan order) is
    one of the forward's last ``reuse`` blocks, which the backward uses as the forward fetched it
    instead of refetching (``Config.reuse_blocks``: the fetch plan, the scan and the planner ask
    this)."""
    return stage_of(unit.group) == BLOCKS and unit.index > n_layers - reuse
