"""The public state interface: what checkpoints/, tests and users reach of a ``TrainState``'s
engine, through ``view(state)`` (``zinf_fn.state.front``: ``StateView`` and its table of names)."""

from ..formats.frozen import FrozenUnit, frozen_group, is_frozen_group
from ..layout.build import init_unit
from ..layout.units import BLOCKS, EMBED, HEAD, Unit, key, stage_rows, unit_name, units
from ..observe.counters import Counters
from ..optim.stored import (
    Formats,
    RowFormat,
    StoredRows,
    Where,
    check_values,
    parse_formats,
    row_format,
)
from ..tiling.layout import TileLayout, TileUnit
from ..train import TrainState, empty_state
from .front import StateView, gather_params, gather_row, view
from .held import Row

__all__ = [
    "BLOCKS",
    "EMBED",
    "HEAD",
    "Counters",
    "Formats",
    "FrozenUnit",
    "Row",
    "RowFormat",
    "StateView",
    "StoredRows",
    "TileLayout",
    "TileUnit",
    "TrainState",
    "Unit",
    "Where",
    "check_values",
    "empty_state",
    "frozen_group",
    "gather_params",
    "gather_row",
    "init_unit",
    "is_frozen_group",
    "key",
    "parse_formats",
    "row_format",
    "stage_rows",
    "unit_name",
    "units",
    "view",
]
