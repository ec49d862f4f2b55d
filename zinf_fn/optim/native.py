"""Build and call the C kernels of the compressed AdamW update (``optim.native_source``).

The library is built on first use by ``zinf_fn.native.build`` (the system C compiler, cached on
disk by source, flags and CPU). ``library()`` is None where no compiler works; the updater then
runs ``optim.compressed``'s ``torch.compile`` twins (same results, slower).

The pointers passed are the tensors' own (contiguous, on the CPU): the kernels write in place.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ..native import FLAGS, build
from .native_source import SOURCE

_P, _I64, _I32, _U32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels (built or loaded once per process), or None where they cannot be built."""
    return load(FLAGS)


def load(flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernels built with the compiler flags ``flags`` (``FLAGS``; the tests add
    -mno-avx512vbmi, -mno-avx512f, -mno-avx2 to run the paths of other CPUs), built once per source,
    compiler, flags and CPU; None where they cannot be built."""
    lib = build("zinf_adamw", SOURCE, flags)
    if lib is None:
        return None
    lib.adamw_int8.argtypes = [_I64, *[_P] * 13, _I32]
    lib.int8_quantize.argtypes = [_I64, _P, _P, _P, _P, _I32, _I32]
    lib.adamw_bf16.argtypes = [_I64, *[_P] * 7, _U32, _I64, _P, _P, _I32]
    lib.remainder_join.argtypes = lib.remainder_split.argtypes = [_I64, _P, _P, _P, _I32]
    lib.ties_away.argtypes = [_I64, _P, _P, _I32]
    lib.round_bf16.argtypes = [_I64, _P, _P, _U32, _I32]
    for fn in (
        lib.adamw_int8,
        lib.int8_quantize,
        lib.adamw_bf16,
        lib.remainder_join,
        lib.remainder_split,
        lib.ties_away,
        lib.round_bf16,
    ):
        fn.restype = None
    return lib


KEYS = 0x3F81  # 16-bit prefixes of |y| <= 1.0 (0x3F80 is 1.0's), as native_source's KEYS
KEY_LO = 0x3400  # the prefixes below it share one entry (native_source's KEY_LO)


def code_luts(bounds_m: torch.Tensor, bounds_v: torch.Tensor) -> torch.Tensor:
    """int32 (3 * (KEYS - KEY_LO),): the C kernels' nearest-code tables, m's (the prefixes of y >= 0
    from KEY_LO to KEYS - 1, then those of y < 0) and v's (y >= 0 only: the unsigned map has no
    midpoint below 0).

    An entry, for the 16-bit prefix of y (the prefixes below KEY_LO taken as one, down to 0), holds
    in its high half the number of midpoints (``bounds`` without its +inf pad) below the prefix's
    smallest value, and in its low half a bias for y's low 16 bits: where a midpoint lies within the
    prefix, y >= 0 lies above it iff low + (0xFFFF - the midpoint's low bits) carries into the high
    half, and y < 0 iff (the midpoint's low bits - 1) - low does not borrow from a high half one
    larger (bias 0, resp. 0xFFFF, where no midpoint does). A prefix spans 0.8 % and the maps' codes
    are at least 1.4 % apart, so at most one midpoint lies within it (checked here); the nearest
    code of y is then the high half of entry + low (y >= 0) or entry - low (y < 0):
    ``torch.bucketize(y, midpoints)``, bit for bit."""
    keys = torch.arange(KEY_LO, KEYS, dtype=torch.int64)
    # a prefix's values of the smallest and largest magnitude
    small, large = keys << 16, (keys << 16) | 0xFFFF
    small[0] = 0
    sign = 1 << 31
    rows = [
        _entries(small, large, bounds_m, False),
        _entries(large | sign, small | sign, bounds_m, True),
        _entries(small, large, bounds_v, False),
    ]
    return ((torch.cat(rows) ^ sign) - sign).to(torch.int32)  # as int32 bits


def _as_f32(bits: torch.Tensor) -> torch.Tensor:
    """int64 tensors holding uint32 bit patterns, as the fp32 values they are."""
    return ((bits ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.float32)


def _entries(
    lo_bits: torch.Tensor, hi_bits: torch.Tensor, bounds: torch.Tensor, negative: bool
) -> torch.Tensor:
    """The table entries (int64 holding uint32) of the prefixes whose values span bits ``lo_bits``
    to ``hi_bits``."""
    mids = bounds[:-1]
    below = torch.bucketize(_as_f32(lo_bits), mids)  # midpoints < the smallest value
    within = torch.bucketize(_as_f32(hi_bits), mids, right=True) - below  # in [smallest, largest]
    assert int(within.max()) <= 1, "a 16-bit prefix holds two midpoints"
    low = mids[below.clamp(max=mids.numel() - 1)].view(torch.int32).to(torch.int64) & 0xFFFF
    if negative:  # y above the midpoint iff its low bits are below the midpoint's
        return torch.where(within == 1, ((below + 1) << 16) + low - 1, (below << 16) | 0xFFFF)
    return (below << 16) | torch.where(within == 1, 0xFFFF - low, 0)
