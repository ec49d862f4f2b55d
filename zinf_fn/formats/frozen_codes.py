"""How frozen param rows are stored: their 16-bit values, or codes (``Config.frozen_storage``).

Where the storage quantizes ("int8", "nf4"), a frozen group's 2-D leaves (and stacked 3-D ones: a
block's experts) are stored as block-wise codes (``formats.codebook``) and its other leaves as their
16-bit values' bytes, each leaf at a 4-byte aligned offset of a uint8 row (``quantized_layout``):
the row of a stage's frozen group ("blocks:frozen", ``formats.frozen``) and of a frozen tile group
of the blocks. ``FrozenCodes`` knows which groups are coded and answers every question about their
rows: the byte layout, the leaves' values they hold, their encoding and decoding. Which leaves are
frozen, and where they go, is ``formats.frozen.FrozenLeaves``'s (which holds one, ``codes``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from ..layout.units import BLOCKS
from ..tree import FlatSpec, LeafSpec
from .codebook import FROZEN_BLOCK, QUANTIZED, Decode, decode_row_, encode_leaf, leaf_nbytes


class Coded(NamedTuple):
    """A param row stored as codes: its leaves (real shapes, ``spec``), the byte layout of the row
    (``stored``, uint8 leaves) and each leaf's code ("nf4" / "int8", or "": its 16-bit values'
    bytes)."""

    spec: FlatSpec
    stored: FlatSpec
    codes: tuple[str, ...]


def quantized_layout(
    spec: FlatSpec, storage: str, itemsize: int, stage: str
) -> tuple[FlatSpec, tuple[str, ...]]:
    """(the byte layout of a frozen group's row, each leaf's code) where ``storage`` quantizes its
    2-D leaves (and stacked 3-D ones: a block's experts): each leaf at a 4-byte aligned offset (its
    fp32 scales, or its 16-bit values, are viewed in place)."""
    leaves, codes, offset = [], [], 0
    for leaf in spec.leaves:
        code = storage if len(leaf.shape) >= 2 else ""  # a matrix, or a stack of them (experts)
        if code and leaf.numel % FROZEN_BLOCK:
            raise ValueError(
                f"Config.frozen_storage={storage!r}: frozen weight {stage}.{leaf.path} of shape "
                f"{leaf.shape} has {leaf.numel} elements, not a multiple of the block "
                f"of {FROZEN_BLOCK}; "
                "pass frozen_storage='bf16', or give the weight a size that 64 "
                "divides"
            )
        nbytes = leaf_nbytes(code, leaf.numel) if code else leaf.numel * itemsize
        leaves.append(LeafSpec(leaf.path, (nbytes,), offset, nbytes))
        codes.append(code)
        offset += -(-nbytes // 4) * 4
    return FlatSpec(spec.treedef, tuple(leaves), offset), tuple(codes)


class FrozenCodes:
    """Which frozen groups are stored as codes, and how their rows are laid out, written and read;
    filled by the layout step (``code_``, ``code_tiles_``) before the groups exist."""

    def __init__(self, storage: str = "bf16", param_dtype: torch.dtype = torch.bfloat16):
        """``storage``: ``Config.frozen_storage`` ("bf16", or "int8" / "nf4": a frozen group's 2-D
        and 3-D leaves as codes); ``param_dtype``: the 16-bit dtype its other leaves are stored in
        and its values are rounded to."""
        self.storage = storage
        self.param_dtype = param_dtype
        # group -> how its param row is stored as codes (a frozen group's, a frozen tile group's)
        self._coded: dict[str, Coded] = {}

    def code_(self, group: str, spec: FlatSpec, stage: str) -> Coded:
        """Store ``group``'s row, whose leaves ``spec`` gives (of ``stage``), as codes; returns how
        (``quantized_layout``)."""
        stored, codes = quantized_layout(spec, self.storage, self.param_dtype.itemsize, stage)
        self._coded[group] = Coded(spec, stored, codes)
        return self._coded[group]

    def code_tiles_(self, leaves: Iterable, param_only: Callable[[str], bool]) -> None:
        """Frozen tiled leaves of the blocks (``TiledLeaf`` s whose groups are ``param_only``)
        whose tiles are matrices or stacks of them (streamed experts' (1, out, in)) are stored as
        codes where the storage quantizes, as the frozen group's leaves are."""
        if self.storage not in QUANTIZED:
            return
        for leaf in leaves:
            if leaf.stage == BLOCKS and param_only(leaf.group) and len(leaf.shapes[0]) >= 2:
                self.code_(leaf.group, leaf.spec(), leaf.stage)

    def row_spec(self, group: str, spec: FlatSpec) -> FlatSpec:
        """The layout of ``group``'s param row, whose leaves ``spec`` gives: its bytes where it is
        stored as codes (``code_tiles_``), else ``spec``."""
        return self._coded[group].stored if group in self._coded else spec

    def quantized(self, group: str) -> bool:
        """Whether ``group`` is a frozen group (or a frozen tile group) stored quantized
        (``Config.frozen_storage``): a uint8 param row."""
        return group in self._coded

    def values_spec(self, group: str) -> FlatSpec | None:
        """The leaves (real shapes) a quantized frozen group's byte row holds; None for any other
        group."""
        return self._coded[group].spec if self.quantized(group) else None

    def values_numel(self, group: str, padded: int) -> int:
        """Elements of the flat row of values that fills a row of ``group`` (``Runtime.load_row_``):
        ``padded`` (its padded row), or a quantized frozen group's leaves' elements (quantized as
        the row is written)."""
        spec = self.values_spec(group)
        return padded if spec is None else spec.numel

    def stored_row(
        self, group: str, flat: torch.Tensor, local: tuple[int, int], padded: int, cast_
    ) -> torch.Tensor:
        """This rank's param row (elements ``local`` = ``[start, end)`` of its padded row) of frozen
        ``group`` from ``flat`` (``Runtime.load_row_``'s): its ``param_dtype`` copy (``cast_(out,
        x)`` rounds it), or the bytes of the codes of a quantized row, whose ``flat`` holds its
        leaves' values (``values_numel``)."""
        start, end = local
        values = flat[: self.values_spec(group).numel] if self.quantized(group) else flat[start:end]
        param = torch.empty(values.numel(), dtype=self.param_dtype)
        cast_(param, values)
        return self.encode_row(group, param, padded)[start:end] if self.quantized(group) else param

    def shard_elements(self, group: str, part) -> int:
        """Parameters in this rank's shard of a row of ``group`` (``part`` its partition):
        ``shard_numel``, or a quantized frozen row's share of its leaves' elements (its shard's
        bytes of the padded row's)."""
        spec = self.values_spec(group)
        return (
            part.shard_numel if spec is None else spec.numel * part.shard_numel // part.padded_numel
        )

    def encode_row(self, group: str, values: torch.Tensor, numel: int) -> torch.Tensor:
        """The uint8 (``numel``,) row of quantized frozen ``group`` (padding zero) holding its
        leaves' 16-bit ``values`` (``values_spec``'s flat row, in ``param_dtype``): codes and
        scales, or the values' bytes."""
        split = self._coded[group]
        row = torch.zeros(numel, dtype=torch.uint8)
        for leaf, stored, code in zip(
            split.spec.leaves, split.stored.leaves, split.codes, strict=True
        ):
            x = values[leaf.offset : leaf.offset + leaf.numel]
            row[stored.offset : stored.offset + stored.numel] = (
                encode_leaf(code, x) if code else x.view(torch.uint8)
            )
        return row

    def decode(self, group: str) -> Decode | None:
        """How a quantized frozen group's row is decoded (``codebook.decode_row_``); else None."""
        if not self.quantized(group):
            return None
        coded = self._coded[group]
        return Decode(self.storage, coded.spec, coded.stored, coded.codes, self.param_dtype)

    def decode_row_(self, group: str, row: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``values_spec``'s numel, any dtype and device; written, returned) filled with
        the values the uint8 ``row`` of quantized frozen ``group`` holds (``encode_row``'s):
        ``codebook.decode_row_``."""
        return decode_row_(self.decode(group), row, out)
