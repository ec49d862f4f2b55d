"""What rows a state has: its groups, their kinds, dtypes and sizes, the tiles, the frozen leaves
and the ties (``RowShapes``, one part of ``zinf_fn.state.StateView``)."""

from __future__ import annotations

import dataclasses

import torch

from ..formats.frozen import FrozenLeaves
from ..layout.build import layout
from ..optim.stored import Formats, StoredRows, parse_formats
from ..runtime import Runtime
from ..store import Group, Store
from ..tiling.layout import TileLayout
from ..train import TrainState


class RowShapes:
    """The part of ``StateView`` that says what rows the state has, and how each is stored: nothing
    here reads or writes a row. It reads the state's model, optimizer and config (``state``), its
    store, and its runtime's tile layout and frozen leaves."""

    state: TrainState
    _runtime: Runtime
    _store: Store

    @property
    def groups(self) -> dict[str, Group]:
        return self._store.groups

    @property
    def param_dtype(self) -> torch.dtype:
        return self._store.row_kinds.param_dtype

    @property
    def n_opt_leaves(self) -> int:
        return self._store.row_kinds.n_opt_leaves

    @property
    def n_layers(self) -> int:
        return self.state.model.n_layers

    @property
    def tiles(self) -> TileLayout:
        return self._runtime.tiles.layout

    @property
    def frozen(self) -> FrozenLeaves:
        """The frozen leaves (``zinf_fn.formats.frozen``): ``companion(unit)``, the unit's row in
        its stage's frozen group ("blocks:frozen") or None; ``split_tree`` / ``assemble`` between a
        whole tree and its rows."""
        return self._runtime.frozen

    def is_frozen(self, group: str) -> bool:
        """Whether ``group`` holds only frozen leaves: a "param" row only (``kinds(group=)``),
        written once at init and never after; its "master" (``gather_row``) is that row upcast."""
        return group in self._store.row_kinds.frozen

    @property
    def ties(self) -> tuple:
        """The model's ``zf.Tie`` s: the head reads these embed leaves; they have rows in "embed"
        only."""
        return self.state.model.ties

    def kinds(self, grads: bool = False, group: str | None = None) -> list[str]:
        """"param", "master" (or "remainder"), "opt.<i>" (and "grad" with ``grads``, when the state
        has grad arrays). With ``group``: the kinds of that group's rows (``RowKinds.kinds_of``: a
        compressed format may store a kind in more rows, e.g. int8 codes "opt.<i>" and scales
        "opt.<i>.absmax")."""
        if group is not None:
            return self._store.row_kinds.kinds_of(group, None if grads else False)
        return ["param", *self._store.row_kinds.opt_kinds(None if grads else False)]

    def row_numel(self, kind: str, group: str) -> int:
        """Elements of one of this rank's rows of ``kind`` in ``group`` (``shard_numel`` for every
        kind but a per-block one, such as int8 moments' "opt.<i>.absmax")."""
        return self._store.row_kinds.row_numel(kind, group)

    def span(self, kind: str, lo: int, hi: int) -> tuple[int, int]:
        """The elements of a row of ``kind`` that hold elements ``[lo, hi)`` of this rank's shard
        (``RowKinds.span``: ``(lo, hi)``, or the blocks ``(lo // 256, hi // 256)`` of a per-block
        scale row)."""
        return self._store.row_kinds.span(kind, lo, hi)

    def dtype(self, kind: str, group: str | None = None) -> torch.dtype:
        """The dtype of ``kind``'s rows of ``group``: ``param_dtype`` for "param", int16 for
        "remainder", bf16 or uint8 (int8 codes) for the optimizer leaves of a group with compressed
        moments (``adamw(moments="bf16" | "int8")``), else fp32 (the int8 scale rows
        "opt.<i>.absmax" too)."""
        return self._store.row_kinds.dtype_of(kind, group)

    def shard_numel(self, group: str) -> int:
        """Elements of one of this rank's rows of ``group`` (padding included)."""
        return self._store.groups[group].part.shard_numel

    def stored_as(
        self, formats: Formats | None = None, param_dtype: torch.dtype | None = None
    ) -> StoredRows:
        """This state's rows, or a layout build's in ``formats`` (one layer per group initialised;
        ValueError)."""
        own = StoredRows(
            self._store, self.state.optimizer.moments, self.state.config.resolved_param_rounding()
        )
        if formats is None or (formats == own.formats and param_dtype == self.param_dtype):
            return own
        master, moments = parse_formats(formats.master, formats.moments)
        state, rounding = self.state, formats.param_rounding
        opt = state.optimizer._replace(
            moments=moments, compress=lambda name, numel: name in formats.compressed
        )
        config = dataclasses.replace(
            state.config, master=master.kind, param_dtype=param_dtype, param_rounding=rounding
        )
        return StoredRows(layout(state.model, opt, config).store, moments, rounding)
