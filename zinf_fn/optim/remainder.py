"""The fp32 master as its bf16 copy plus a 16-bit remainder, exact; and the copy's rounding rule.

With u the 32 bits of an fp32 value, lo = u & 0xFFFF and hi = u >> 16::

    copy      = hi + (lo >= 0x8000)          the bf16 bits: round to nearest, exact ties away from
    zero remainder = lo - 0x10000 * (lo >= 0x8000) an int16 in [-0x8000, 0x7FFF]
    join      = copy * 0x10000 + remainder   == u, for every one of the 2^32 bit patterns but NaNs

Adding 0x8000 to the bits and truncating rounds the magnitude up iff lo >= 0x8000 (fp32 is
sign-magnitude), which is round-to-nearest with ties away from zero: the one rounding whose error
fits a signed 16-bit remainder. Torch's ``.to(torch.bfloat16)`` rounds ties to even, which differs
on exact ties only (lo == 0x8000 with hi even); every mode's engine must write the copy with
``to_bf16_ties_away`` so that ``master="fp32"`` and ``master="remainder"`` runs agree bitwise.

Edge cases: ±0, subnormals, ±inf and the largest finite values are exact (a finite master at or
above bf16's largest value plus half an ulp has the copy ±inf, as round-to-nearest-even gives, and
the remainder still rebuilds it). A NaN's copy is bf16's canonical quiet NaN (0x7FC0, as torch casts
it) and its join is a NaN: its sign and payload are not kept.

The functions are plain torch on ``.view(torch.int32)`` bits, traceable by ``torch.compile``: the
update kernels (``optim.compressed``) inline them into their one pass.
"""

from __future__ import annotations

import torch

_LOW = 0xFFFF
_HALF = 0x8000
_BF16_NAN = 0x7FC0


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The 32 bits of fp32 ``x`` as non-negative int64 (no signed overflow in what follows)."""
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _as_int16(u16: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 0x10000) as the int16 of the same 16 bits."""
    return ((u16 ^ _HALF) - _HALF).to(torch.int16)


def _copy_bits(u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    hi = ((u + _HALF) >> 16) & _LOW
    return torch.where(torch.isnan(x), _BF16_NAN, hi)


def to_bf16_ties_away(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` (any shape) -> bf16 of the same shape, round to nearest, exact ties away from
    zero."""
    return _as_int16(_copy_bits(_bits(x), x)).view(torch.bfloat16)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (bf16 copy, int16 remainder), each of its shape:
    ``join(*split_master(x))`` is ``x`` bitwise for every non-NaN ``x``; the copy is
    ``to_bf16_ties_away(x)``."""
    u = _bits(master)
    return _as_int16(_copy_bits(u, master)).view(torch.bfloat16), _as_int16(u & _LOW)


def join(copy: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16 copy, int16 remainder) of one shape -> the fp32 master: bits = copy * 2^16 +
    remainder."""
    hi = copy.view(torch.int16).to(torch.int64) & _LOW
    u = ((hi << 16) + remainder.to(torch.int64)) & 0xFFFFFFFF
    return ((u ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.float32)
