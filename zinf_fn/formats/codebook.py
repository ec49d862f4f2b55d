"""Block-wise absmax quantization on a code book: the one quantize / dequantize of the engine.

A block of ``B`` values is stored as one fp32 scale, its absmax, and per value the index of the code
nearest ``x / absmax`` in a sorted code book of at most 256 values in [-1, 1]; it reads back as
``code[i] * absmax``. Two users share it: int8 optimizer moments (``optim.compressed``:
bitsandbytes' dynamic maps, blocks of 256) and frozen base weights (``Config(frozen_storage=...)``,
``zinf_fn.formats.frozen``):

    "nf4"   bitsandbytes' NF4 code book (QLoRA), 16 values, two codes a byte (high nibble first, as
            ``bitsandbytes.functional.quantize_4bit``), blocks of 64: 0.5 + 4 / 64 bytes a weight
    "int8"  the linear code k / 127, k = -127 .. 127 (255 values, 0 exact: plain absmax int8), a
            code a byte, blocks of 64 (NF4's: one block rule and one divisibility rule for both): 1
            + 4 / 64 bytes

A frozen weight's stored bytes (``encode_leaf``) are its scales (fp32, ``numel // block``) then its
codes; ``decode_leaf`` reads them back. The input is the weight in the 16-bit parameter dtype (what
the row would hold unquantized, as QLoRA quantizes the bf16 weights), and the values come back
rounded to that dtype, as ``bitsandbytes.functional.dequantize_4bit`` returns them for a bf16
weight.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..tree import FlatSpec
from . import codebook_kernels

NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)  # bitsandbytes.functional.get_4bit_type("nf4"), as fp32
# the frozen storages that quantize (``Config.frozen_storage``; "bf16" does not)
QUANTIZED = ("int8", "nf4")
FROZEN_BLOCK = 64  # elements per scale of a quantized frozen weight
TABLED = 16  # code books up to this size are quantized through a table (``_code_table``)


def bounds(code: torch.Tensor) -> torch.Tensor:
    """The midpoints between neighbouring codes of a sorted ``code`` (at most 256), padded with +inf
    to 256 entries: the nearest code of x is the number of midpoints strictly below x
    (``torch.bucketize``, as bitsandbytes), and ``quantize``'s 8-step search never passes the last
    real code."""
    mids = (code[:-1] + code[1:]) / 2
    return torch.cat(
        [
            mids,
            torch.full((256 - mids.numel(),), float("inf"), dtype=mids.dtype, device=mids.device),
        ]
    )


def quantize(
    x: torch.Tensor, bounds: torch.Tensor, n_codes: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` (nb, B) -> (uint8 codes (nb, B), fp32 absmax (nb,)): per block absmax = max |x|,
    and the code nearest x / absmax, i.e. the number of midpoints below it (``bounds``, 256 with the
    +inf pad): ``torch.bucketize`` as bitsandbytes, written as a binary search so it fuses.

    ``n_codes`` (at most 256) bounds the search: log2 of it rounded up steps (NF4's 16 codes: 4, not
    8); the steps it leaves out would compare against the +inf pad only, so the codes are the
    same. A code book of at most ``TABLED`` codes looks the number up by the top 16 bits of x
    instead (``_tabled``: the same number; NF4's encode 3x faster)."""
    absmax = x.abs().amax(dim=1)
    scaled = torch.clamp(x * (1.0 / absmax.clamp(min=1e-38))[:, None], -1.0, 1.0)
    if n_codes <= TABLED and scaled.is_contiguous():
        # sync: a few floats, once per call (the table is cached by them)
        table = _code_table(tuple(bounds[: n_codes - 1].tolist()), scaled.device)
        return _tabled(scaled, table), absmax
    index = torch.zeros_like(scaled, dtype=torch.int64)
    top = 1 << max(0, (n_codes - 1).bit_length() - 1)  # the first step: half the searched range
    for step in (top >> k for k in range(top.bit_length())):
        candidate = index + step
        index = torch.where(bounds[candidate - 1] < scaled, candidate, index)
    return index.to(torch.uint8), absmax


class CodeTable(NamedTuple):
    """The number of midpoints below x by the top 16 bits of fp32 x (``key``): ``below[key]``,
    plus one where x is above ``mid[key]``, the one midpoint inside that key's range of values
    (+inf where none is: at most one is, the midpoints lying farther apart than a range is wide)."""

    below: torch.Tensor  # (65536,) uint8
    mid: torch.Tensor  # (65536,) fp32


@functools.cache
def _code_table(mids: tuple[float, ...], device: torch.device) -> CodeTable:
    """The ``CodeTable`` of the sorted midpoints ``mids`` (fp32 values), on ``device``."""
    mid = torch.tensor(mids, dtype=torch.float32)
    keys = torch.arange(1 << 16, dtype=torch.int32) << 16
    ends = torch.stack([keys.view(torch.float32), (keys | 0xFFFF).view(torch.float32)])  # (2, K)
    low, high = ends.min(dim=0).values, ends.max(dim=0).values  # each key's range of values
    below = (mid[None, :] < low[:, None]).sum(dim=1)  # (K,)
    inside = (mid[None, :] < high[:, None]).sum(dim=1) - below  # 0 or 1 midpoints in the range
    nan = ends.isnan().any(dim=0)  # NaN: no midpoint below it, as the search counts
    if int(inside[~nan].max()) > 1:
        raise ValueError(f"codebook: midpoints {mids} too close for a 16-bit table")
    below = torch.where(nan, 0, below)
    above = torch.full((1 << 16,), float("inf"))
    split = (inside == 1) & ~nan
    above[split] = mid[below[split]]
    return CodeTable(below.to(torch.uint8).to(device), above.to(device))


def _tabled(scaled: torch.Tensor, table: CodeTable) -> torch.Tensor:
    """The number of midpoints below each of ``scaled`` (contiguous fp32), as uint8 of its shape,
    through ``table``: one lookup by the value's top 16 bits, one comparison."""
    flat = scaled.reshape(-1)
    key = (flat.view(torch.int32) >> 16) & 0xFFFF  # (n,) the top 16 bits
    index = table.below.index_select(0, key)
    index += flat > table.mid.index_select(0, key)
    return index.view(scaled.shape)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """uint8 ``codes`` (nb, B), fp32 ``absmax`` (nb,), fp32 ``code`` -> fp32 (nb, B): code[c] *
    absmax."""
    return code[codes.to(torch.int64)] * absmax[:, None]


@functools.cache
def frozen_code(kind: str, device: torch.device | None = None) -> torch.Tensor:
    """The fp32 code book of frozen storage ``kind`` ("nf4" or "int8", ``QUANTIZED``), cached per
    device."""
    if kind == "nf4":
        return torch.tensor(NF4, dtype=torch.float32, device=device)
    return (torch.arange(-127, 128, dtype=torch.float32) / 127).to(device)


def leaf_nbytes(kind: str, numel: int, block: int = FROZEN_BLOCK) -> int:
    """Bytes of a frozen weight of ``numel`` elements stored as ``kind``: fp32 scales, then the
    codes."""
    return 4 * (numel // block) + (numel // 2 if kind == "nf4" else numel)


def encode_leaf(
    kind: str, x: torch.Tensor, block: int = FROZEN_BLOCK, native: bool = True
) -> torch.Tensor:
    """A frozen weight ``x`` (any shape, ``numel`` a multiple of ``block``; its 16-bit values) as
    ``kind`` stores it: uint8 (``leaf_nbytes``,), the fp32 scales' bytes then the codes (nf4: two a
    byte, high nibble first). On the CPU the C kernel (``codebook_kernels.encode``) writes them in
    one pass, bitwise the torch twin's below (``native=False`` runs the twin)."""
    code = frozen_code(kind)
    if native:
        x_blocks = x.reshape(-1, block)  # (nb, block)
        stored = codebook_kernels.encode(x_blocks, bounds(code), code.numel(), kind == "nf4")
        if stored is not None:
            return stored
    codes, absmax = quantize(x.reshape(-1, block).float(), bounds(code), code.numel())
    codes = codes.reshape(-1)
    if kind == "nf4":
        codes = (codes[::2] << 4) | codes[1::2]
    return torch.cat([absmax.view(torch.uint8), codes])


def decode_leaf(
    kind: str,
    stored: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    block: int = FROZEN_BLOCK,
    native: bool = True,
) -> torch.Tensor:
    """The weight of shape ``shape`` that ``encode_leaf``'s bytes ``stored`` hold, its values
    rounded to ``dtype`` (the 16-bit parameter dtype): ``code[i] * absmax`` in fp32, then the cast,
    as bitsandbytes dequantizes (on the CPU in one pass of the C kernel where it can,
    ``decode_leaf_``; ``native=False`` runs the torch twin)."""
    if native:
        out = torch.empty(shape, dtype=dtype, device=stored.device)
        if decode_leaf_(kind, stored, out, dtype, block):
            return out
    numel = 1
    for n in shape:
        numel *= n
    scales = 4 * (numel // block)
    absmax = stored[:scales].view(torch.float32)
    codes = stored[scales:]
    if kind == "nf4":  # a byte's two values at once (``nf4_pairs``): dequantize's products
        pairs = nf4_pairs(stored.device).index_select(0, codes.to(torch.int32))  # (numel / 2, 2)
        values = pairs.view(-1, block).mul_(absmax[:, None])
    else:
        values = dequantize(codes.reshape(-1, block), absmax, frozen_code(kind, stored.device))
    return values.reshape(shape).to(dtype)


@functools.cache
def nf4_pairs(device: torch.device | None = None) -> torch.Tensor:
    """(256, 2) fp32: the NF4 code values a stored byte holds, its high nibble's then its low's."""
    code = frozen_code("nf4", device)
    return torch.stack([code.repeat_interleave(16), code.repeat(16)], dim=1)


def decode_leaf_(
    kind: str,
    stored: torch.Tensor,
    out: torch.Tensor,
    dtype: torch.dtype,
    block: int = FROZEN_BLOCK,
) -> bool:
    """Write into ``out`` (contiguous, fp32 or bfloat16) ``decode_leaf``'s values of ``stored``
    (rounded to ``dtype``) by the C kernel (``codebook_kernels.decode_``) in one pass; False
    where it cannot (``decode_leaf``'s twin then does)."""
    code = frozen_code(kind, stored.device)
    return codebook_kernels.decode_(stored, block, kind == "nf4", code, dtype, out)


class Decode(NamedTuple):
    """A row stored as bytes of codes (``Config.frozen_storage``), decoded after its gather
    (``decode_row_``).

    ``stored`` is the row's byte layout (uint8 leaves), ``values`` the leaves' real shapes (what
    everything that names a leaf uses), ``codes`` each stored leaf's code ("int8" / "nf4", or "" for
    its ``dtype`` values' bytes), ``storage`` the format's name."""

    storage: str
    values: FlatSpec
    stored: FlatSpec
    codes: tuple[str, ...]
    dtype: torch.dtype


def decode_row_(decode: Decode, row: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (``decode.values``' numel, any dtype and device; written, returned) filled with the
    values the uint8 ``row`` holds: ``decode.dtype`` values, dequantized as ``decode_leaf`` reads
    them, then cast to ``out``'s dtype."""
    leaves = zip(decode.values.leaves, decode.stored.leaves, decode.codes, strict=True)
    for leaf, stored, code in leaves:
        b = row[stored.offset : stored.offset + stored.numel]
        dst = out[leaf.offset : leaf.offset + leaf.numel]
        if code and decode_leaf_(code, b, dst, decode.dtype):
            continue  # written in place, in one pass
        dst.copy_(
            decode_leaf(code, b, leaf.shape, decode.dtype, native=False).reshape(-1)
            if code
            else b.view(decode.dtype)
        )
    return out
