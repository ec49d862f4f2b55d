"""A group's rows as stored, to and from fp32: the one codec a restore into another format converts
with.

A group's rows hold *slots*, each one logical fp32 vector stored in one or more rows (``slot_of``)::

    "master"   the fp32 master: the "master" row (MasterFormat "fp32"), or the "param" and
               "remainder" rows (MasterFormat "remainder": the bf16 copy is the master's high half,
               ``optim.remainder``)
    "param"    the 16-bit copy of an fp32 master (a derived row: the cast of the master)
    "opt.<i>"  optimizer leaf i: its "opt.<i>" row in fp32 or bf16, or int8 codes "opt.<i>" and
               per-block fp32 scales "opt.<i>.absmax" (leaf 0, Adam's m, on the signed map; leaf 1,
               v, the unsigned)

``decode`` turns a slot's rows into fp32 exactly as the engine reads them (join; the bf16 upcast;
the int8 dequantization), ``encode`` writes fp32 into a slot as the engine's own write does:

    master     split (remainder), or the fp32 row itself
    param      the engine's cast of the master (``masters.cast16_``: ties away where ``ties_away``,
               else torch's round to nearest even)
    bf16       stochastic rounding (``kernels.to_bf16_stochastic``) keyed by (unit seed, step,
               element index of the unit's padded row): the noise the engine's write at that step
               would add; leaf 0 takes the m half of the hash, leaf 1 the v half, as
               ``compressed.adamw_piece_`` does
    int8       the engine's codec of a leaf's rows (``compressed.encode_leaf`` / ``decode_leaf``:
               what its init writes, the update kernels' twins bitwise; quantize and dequantize on
               blocks of ``formats.BLOCK``, m on the signed map, v on the unsigned; the rows
               ``layout.kinds.leaf_rows``)

Rows are this rank's (a shard, padding included); ``zero_value`` is the stored value of 0.0 in a
row, what padding holds (the code of 0 for int8 codes, zero bits otherwise). ``check_values`` is the
one rule about stored values a reader must hold untrusted rows to: an int8 scale is finite and >= 0.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..layout.kinds import SCALES, leaf_rows
from ..partition.shards import partition
from ..store import Store
from . import kernels
from .compressed import decode_leaf, encode_leaf
from .formats import BLOCK, MasterFormat, MomentsFormat, describe, from_description
from .masters import cast16_, join_, split_master_


class Where(NamedTuple):
    """Where a row sits, for bf16 stochastic rounding: the unit's seed (``unit.index``, as the
    engine keys its writes), the step whose write rounds, the row's first element in the unit's
    padded row."""

    unit_seed: int
    step: int
    element_offset: int


class RowFormat(NamedTuple):
    """How one group's rows are stored: its master ("fp32", "remainder", or "none": a group that
    stores its param row only), its optimizer leaves' format (fp32 where the group is not
    compressed), the 16-bit copy's dtype and whether the copy of an fp32 master rounds ties away."""

    master: str
    moments: MomentsFormat
    param_dtype: torch.dtype
    ties_away: bool

    def slot_of(self, kind: str) -> str:
        """The slot a stored kind belongs to (see the module docstring)."""
        if kind in ("master", "remainder") or (kind == "param" and self.master == "remainder"):
            return "master"
        return ".".join(kind.split(".")[:2]) if kind.startswith("opt.") else kind

    def decode(self, slot: str, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The fp32 vector of ``slot`` from its stored ``rows`` (kind -> tensor, read only). The
        "master" slot of a group without a master (``master`` "none") is its param row upcast."""
        if slot == "master":
            if self.master == "remainder":
                return join_(torch.empty(rows["param"].numel()), rows["param"], rows["remainder"])
            return rows["master" if self.master == "fp32" else "param"].float()
        kind = self.moments.kind
        return decode_leaf(
            kind, _leaf(slot), tuple(rows[k] for k in leaf_rows(slot, kind == "int8"))
        )

    def encode(self, slot: str, x: torch.Tensor, where: Where) -> dict[str, torch.Tensor]:
        """The stored rows (kind -> new tensor) of fp32 ``x`` (read only) in ``slot``, as the engine
        writes them."""
        if slot == "param":
            copy = torch.empty(x.numel(), dtype=self.param_dtype)
            cast16_(copy, x, self.ties_away)
            return {"param": copy}
        if slot == "master" and self.master == "remainder":
            param, remainder = (
                torch.empty(x.numel(), dtype=torch.bfloat16),
                torch.empty(x.numel(), dtype=torch.int16),
            )
            split_master_(x.contiguous(), param, remainder)
            return {"param": param, "remainder": remainder}
        if slot == "master" or self.moments.kind == "fp32":
            return {slot: x.clone()}
        if self.moments.kind == "bf16":
            counter = torch.tensor(
                [where.element_offset, kernels.rounding_key(where.unit_seed, where.step)]
            )
            noise = kernels.rounding_noise(x.numel(), counter)[_leaf(slot)]
            return {slot: kernels.to_bf16_stochastic(x, noise)}
        return dict(zip(leaf_rows(slot, True), encode_leaf("int8", _leaf(slot), x), strict=True))

    def zero_value(self, kind: str) -> int:
        """The stored value of 0.0 in a row of ``kind``: what its padding holds (as the engine's
        zero moments)."""
        if kind.startswith("opt.") and self.moments.kind == "int8" and not kind.endswith(SCALES):
            return _int8_zero_codes(self.moments)[_leaf(self.slot_of(kind))]
        return 0


class Formats(NamedTuple):
    """How a state's rows are stored, as plain data (what a checkpoint manifest records): the
    master's and the moments' formats (``formats.describe``), the groups whose optimizer leaves take
    the moments' format (the others keep fp32), and how the 16-bit copy of an fp32 master rounds
    (``Config.resolved_param_rounding``)."""

    master: dict
    moments: dict
    compressed: tuple[str, ...]
    param_rounding: str

    @classmethod
    def of(
        cls, master: MasterFormat, moments: MomentsFormat, compressed, param_rounding: str
    ) -> Formats:
        """The formats as JSON reads them back (lists, not tuples), so a manifest's compare
        equal."""

        def plain(fmt):
            return {k: list(v) if isinstance(v, tuple) else v for k, v in describe(fmt).items()}

        return cls(plain(master), plain(moments), tuple(sorted(compressed)), param_rounding)

    @classmethod
    def fp32(cls, param_rounding: str = "nearest_even") -> Formats:
        """fp32 masters and moments: what a format-version-1 checkpoint stores."""
        return cls.of(MasterFormat(), MomentsFormat(), (), param_rounding)


def parse_formats(master: dict, moments: dict) -> tuple[MasterFormat, MomentsFormat]:
    """The formats two descriptions name, each naming every field of its format; ValueError naming
    which one is of an unknown format, field or version (``formats.from_description``), lacks a
    field, or is of the wrong class."""
    out = []
    for field, desc, cls in (("master", master, MasterFormat), ("moments", moments, MomentsFormat)):
        try:
            fmt = from_description(desc)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{field}: {e}") from None
        if not isinstance(fmt, cls):
            raise ValueError(
                f"{field}: expected a {cls.__name__} description, got {desc.get('format')!r}"
            )
        missing = sorted(set(describe(fmt)) - set(desc))
        if missing:
            raise ValueError(
                f"{field}: expected every field of {cls.__name__}, got none for {missing}"
            )
        out.append(fmt)
    return out[0], out[1]


class StoredRows:
    """The rows a store keeps, by group: their kinds, dtypes, sizes and formats (a state's own
    store, or a layout build's in another format: ``zinf_fn.state.StateView.stored_as``)."""

    def __init__(self, store: Store, moments: MomentsFormat, param_rounding: str):
        self._store, self._moments, self._rounding = store, moments, param_rounding
        self.groups = store.groups

    def kinds(self, group: str) -> list[str]:
        """The kinds of ``group``'s rows, gradients aside (``RowKinds.kinds_of``)."""
        return self._store.row_kinds.kinds_of(group, False)

    def dtype(self, kind: str, group: str) -> torch.dtype:
        return self._store.row_kinds.dtype_of(kind, group)

    def row_numel(self, kind: str, group: str) -> int:
        return self._store.row_kinds.row_numel(kind, group)

    def unit_numel(self, kind: str, group: str) -> int:
        """Elements of a whole unit's row of ``kind`` over every rank, padding cut
        (``RowKinds.unit_numel``: the group's ``numel``, or the blocks holding them for int8
        scales): a checkpoint array's columns."""
        return self._store.row_kinds.unit_numel(kind, group)

    def shard_numel(self, group: str, world_size: int) -> int:
        """Elements of each rank's row of ``group`` (padding included) in a world of ``world_size``
        ranks in "allgather" mode (1: a "broadcast" owner's whole row), cut as the engine cuts it: a
        multiple of ``RowKinds.shard_align`` (whole int8 blocks), so a reader knows the shards any
        writer wrote."""
        numel = self.groups[group].spec.numel
        return partition(
            numel, world_size, self._store.row_kinds.shard_align(group, numel)
        ).shard_numel

    @property
    def formats(self) -> Formats:
        master = MasterFormat("remainder" if self._store.row_kinds.remainder else "fp32")
        return Formats.of(master, self._moments, self._store.row_kinds.compressed, self._rounding)

    def row_format(self, group: str) -> RowFormat:
        return row_format(self.formats, group, self._store.row_kinds.param_dtype, self.kinds(group))


def row_format(
    formats: Formats, group: str, param_dtype: torch.dtype, kinds: list[str]
) -> RowFormat:
    """The ``RowFormat`` of ``group`` (whose rows are ``kinds``) under ``formats``."""
    master, moments = parse_formats(formats.master, formats.moments)
    stored_master = "none" if not {"master", "remainder"} & set(kinds) else master.kind
    return RowFormat(
        stored_master,
        moments if group in formats.compressed else MomentsFormat(),
        param_dtype,
        master.kind == "remainder" or formats.param_rounding == "ties_away",
    )


def _leaf(slot: str) -> int:
    return int(slot.split(".")[1])


@functools.cache
def _int8_zero_codes(fmt: MomentsFormat) -> tuple[int, int]:
    """The codes of 0.0 of leaf 0 (m) and leaf 1 (v), as the engine's init encodes its zero
    moments."""
    zeros = torch.zeros(fmt.block)
    return int(encode_leaf("int8", 0, zeros)[0][0]), int(encode_leaf("int8", 1, zeros)[0][0])


def check_values(kind: str, values: torch.Tensor) -> tuple[int, str] | None:
    """The first stored value of a row of ``kind`` that no write of the engine makes, as (its index
    in ``values``, what was expected there); None where all are valid. The one rule: an int8 scale
    is finite and >= 0 (a NaN, an infinity or a negative scale would decode its whole block
    wrong)."""
    if not kind.endswith(SCALES):
        return None
    bad = ~(torch.isfinite(values) & (values >= 0))
    if not bool(bad.any()):
        return None
    return int(bad.nonzero()[0]), f"a finite scale >= 0 (the absmax of a block of {BLOCK} elements)"
