"""Stored formats of the optimizer's state: data with a version, and one answer per rule about them.

A format is a small frozen dataclass naming its parameters, so a checkpoint manifest records it
(``describe``) and a reader refuses what it does not know (``from_description``):

    MasterFormat("fp32")        the fp32 master, 4 bytes an element
    MasterFormat("remainder")   a 16-bit remainder beside the bf16 parameter copy; copy + remainder
                                rebuilds the fp32 master bit for bit (``optim.remainder``), 2 bytes
    MomentsFormat("fp32")       m and v in fp32, 8 bytes an element
    MomentsFormat("bf16")       m and v in bf16, written with stochastic rounding keyed by
                                (unit seed, step, element index of the unit's row), 4 bytes
    MomentsFormat("int8")       m and v as 8-bit codes of blocks of ``block`` elements, one fp32
                                absmax per block each: m on the signed dynamic map, v on the
                                unsigned one (bitsandbytes' ``create_dynamic_map``), 2 + 8 / block
                                bytes

Engine constraint (int8): a block never straddles a piece or a shard. Blocks are aligned on the
element index of the unit's flat row, so every piece and shard boundary, and every row's padded
length, must be a multiple of ``BLOCK`` (256) elements; the kernels assert it (``check_blocks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..formats.codebook import QUANTIZED

BLOCK = 256
MASTERS = ("fp32", "remainder")
MOMENTS = ("fp32", "bf16", "int8")
FROZEN_STORAGES = ("bf16", *QUANTIZED)  # Config.frozen_storage
MIN_COMPRESSED_NUMEL = 4096  # leaves smaller than this keep fp32 moments by default
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class MasterFormat:
    """How the fp32 master is stored: "fp32", or "remainder" (needs a bf16 parameter copy)."""

    kind: str = "fp32"
    version: int = FORMAT_VERSION

    def __post_init__(self):
        check_choice("master", self.kind, MASTERS)
        _check_version(self)


@dataclasses.dataclass(frozen=True)
class MomentsFormat:
    """How Adam's m and v are stored. ``block``, ``maps`` (int8) and ``rounding`` (bf16) are part of
    the format: a reader of another block size or map refuses the state rather than misread it."""

    kind: str = "fp32"
    block: int = BLOCK
    maps: tuple[str, str] = ("dynamic-signed-7", "dynamic-unsigned-7")
    rounding: str = "stochastic-hash32"
    version: int = FORMAT_VERSION

    def __post_init__(self):
        check_choice("moments", self.kind, MOMENTS)
        _check_version(self)
        if self.kind == "int8" and (self.block != BLOCK or self.maps != MomentsFormat.maps):
            raise ValueError(
                f"MomentsFormat: int8 blocks of {BLOCK} on the maps {MomentsFormat.maps} are "
                f"what this version reads, got block={self.block}, maps={self.maps}"
            )
        if self.kind == "bf16" and self.rounding != MomentsFormat.rounding:
            raise ValueError(
                "MomentsFormat: bf16 moments are written with "
                f"rounding={MomentsFormat.rounding!r}, "
                f"got {self.rounding!r}"
            )


def check_choice(
    field: str, value, allowed: tuple, what: str = "a known format", hint: str = ""
) -> None:
    """ValueError naming ``field`` where ``value`` is not one of ``allowed`` (``what`` it should be,
    ``hint`` how to fix it): the one check of a named choice, for the formats and ``zf.Config``'s
    fields."""
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not {what}; expected one of {allowed}{hint}")


def _check_version(fmt) -> None:
    if fmt.version != FORMAT_VERSION:
        raise ValueError(
            f"{type(fmt).__name__} version {fmt.version} is not one this reader knows "
            f"(it reads version {FORMAT_VERSION}); upgrade zinf_fn to read this state"
        )


def describe(fmt: MasterFormat | MomentsFormat) -> dict:
    """JSON-able description for a checkpoint manifest: ``{"format": <class>, **fields}``."""
    return {"format": type(fmt).__name__, **dataclasses.asdict(fmt)}


def from_description(desc: dict) -> MasterFormat | MomentsFormat:
    """The format a manifest names; ValueError for a format, field or version this reader does not
    know."""
    known = {"MasterFormat": MasterFormat, "MomentsFormat": MomentsFormat}
    fields = dict(desc)
    cls = known.get(fields.pop("format", None))
    if cls is None:
        raise ValueError(
            f"unknown state format {desc.get('format')!r}; this reader knows {sorted(known)}"
        )
    extra = set(fields) - {f.name for f in dataclasses.fields(cls)}
    if extra:
        raise ValueError(
            f"{cls.__name__}: unknown fields {sorted(extra)} in {desc}; written by a newer zinf_fn?"
        )
    if "maps" in fields:
        fields["maps"] = tuple(fields["maps"])
    return cls(**fields)


def master_bytes_per_element(fmt: MasterFormat) -> int:
    """Bytes the optimizer tier keeps per element for the master (the bf16 copy lives in the param
    tier)."""
    return {"fp32": 4, "remainder": 2}[fmt.kind]


def moments_bytes_per_element(fmt: MomentsFormat) -> float:
    """Bytes the optimizer tier keeps per element for m and v together (int8: codes + per-block
    absmaxes)."""
    return {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 8.0 / fmt.block}[fmt.kind]


def moments_nbytes(fmt: MomentsFormat, numel: int) -> int:
    """Exact bytes of m and v for a row of ``numel`` elements (int8: a multiple of
    ``fmt.block``)."""
    if fmt.kind == "int8":
        check_blocks(0, numel)
        return 2 * numel + 8 * (numel // fmt.block)
    return int(moments_bytes_per_element(fmt)) * numel


def check_blocks(element_offset: int, numel: int, block: int = BLOCK) -> None:
    """Internal invariant of the int8 kernels: a piece starts and ends on a block boundary of the
    row."""
    assert element_offset % block == 0 and numel % block == 0, (
        f"int8 moments need pieces and shards on multiples of {block} elements; got a piece of "
        f"{numel} "
        f"elements at element {element_offset} (the engine must cut pieces and shards on block "
        "boundaries)"
    )


CompressPredicate = Callable[[str, int], bool]


def default_compress(path: str, numel: int) -> bool:
    """The default rule: compress a leaf's moments iff it has at least ``MIN_COMPRESSED_NUMEL``
    elements."""
    return numel >= MIN_COMPRESSED_NUMEL


def compressed_leaf(compress: CompressPredicate | None, path: str, numel: int) -> bool:
    """Whether the leaf at key path ``path`` (e.g. ``"blocks.3.attn.qkv.w"``) of ``numel`` elements
    keeps compressed moments: ``compress(path, numel)``, or the default rule when ``compress`` is
    None. A user keeps the embedding in fp32 with e.g. ``compress=lambda p, n: n >= 4096 and not
    p.startswith("embed")``.
    """
    return default_compress(path, numel) if compress is None else bool(compress(path, numel))


def dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed)``: 256 sorted fp32 codes in [-1, 1] (signed) or
    [0, 1], holding an exact 0 and 1; written out here so the engine does not import bitsandbytes
    (the test checks the two agree bitwise). Dynamic exponent 10^(i - 6) times a linear fraction in
    (0.1, 1)."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    extra = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = (
            2 ** (i + non_sign_bits - max_exponent_bits) + 1
            if signed
            else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        )
        data += _scaled_means(items, i, max_exponent_bits, signed)
    if extra > 0:
        data += _scaled_means(extra + 1, max_exponent_bits - 1, max_exponent_bits, signed)
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def _scaled_means(items: int, i: int, max_exponent_bits: int, signed: bool) -> list[float]:
    bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
    means = ((10 ** (-(max_exponent_bits - 1) + i)) * ((bounds[:-1] + bounds[1:]) / 2.0)).tolist()
    return means + [-x for x in means] if signed else means
