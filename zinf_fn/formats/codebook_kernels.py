"""C kernels of a frozen weight's block-wise codes (``codebook.encode_leaf`` / ``decode_leaf``): one
pass over a block's values or codes each, encode on every torch thread, decode on the calling
thread (``DECODE_THREADS``); their source, vectorised per instruction set, is
``formats.codebook_source``.

``encode`` is ``codebook.quantize`` (absmax of each block, the number of code-book midpoints below
each value over its absmax, clamped to [-1, 1]) with the two codes of NF4 packed in a byte;
``decode`` is ``codebook.dequantize`` (``code[c] * absmax``), the product rounded to bfloat16 as
torch's cast rounds it (to nearest, ties to even), written as fp32 or as bfloat16. Both give torch's
twins' bits (tested). A block holding a value that is not finite (an inf or NaN weight, or its
absmax) is left to the twins, whose NaN rules are torch's: the kernels report it and the caller
runs the twin on the whole leaf.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .. import native
from .codebook_source import SOURCE

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# blocks an encode thread takes at least: a small leaf runs on one (waking another costs more than
# it saves)
BLOCKS_PER_THREAD = 2048
# Decode runs on the calling thread alone: the fetch thread, beside the compute's threads. A second
# OpenMP thread halves a tile's decode at best (it is bound by the memory it writes) and then spins
# in libgomp's wait for the next call, which on a CPU-bound step takes the compute's core: an
# expert tile's decode cost several times the CPU on two threads that it does on one (measured).
DECODE_THREADS = 1


def _threads(nb: int) -> int:
    """The threads an encode of ``nb`` blocks runs on."""
    return max(1, min(torch.get_num_threads(), nb // BLOCKS_PER_THREAD))


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, once per process; None where they cannot be built."""
    return load(native.FLAGS)


def load(flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernels built with the compiler flags ``flags`` (``native.FLAGS``; the tests add
    -mno-avx512f, -mno-avx2 to run the paths of other CPUs), once per source, compiler, flags and
    CPU; None where they cannot be built."""
    lib = native.build("zinf_codebook", SOURCE, flags)
    if lib is None:
        return None
    lib.block_quantize.argtypes = [_I64, _I64, _P, _I32, _P, _I32, _I32, _P, _P, _I32]
    lib.block_dequantize.argtypes = [_I64, _I64, _P, _I32, _P, _P, _I32, _P, _I32, _I32]
    lib.block_quantize.restype = lib.block_dequantize.restype = _I32
    return lib


def encode(
    x: torch.Tensor, bounds: torch.Tensor, n_codes: int, nibbles: bool
) -> torch.Tensor | None:
    """``x`` (nb, B; bfloat16, or any float dtype read as fp32) on the CPU -> uint8 (4 nb + its
    codes' bytes,): the fp32 absmax of each block's bytes, then its codes (``bounds``: the code
    book's sorted midpoints with the +inf pad, ``codebook.bounds``; ``n_codes``: its codes); None
    where the kernels are not built or a value is not finite."""
    lib = library()
    if lib is None or x.device.type != "cpu":
        return None
    if x.dtype != torch.bfloat16:
        x = x.float()
    x, bounds = x.contiguous(), bounds.to(torch.float32).contiguous()
    assert bounds.numel() == 256, "the kernel's binary search reads the +inf pad"
    nb, block = x.shape
    out = torch.empty(4 * nb + (nb * block // 2 if nibbles else nb * block), dtype=torch.uint8)
    absmax, codes = out[: 4 * nb].view(torch.float32), out[4 * nb :]
    bad = lib.block_quantize(
        nb,
        block,
        native.ptr(x),
        int(x.dtype == torch.bfloat16),
        native.ptr(bounds),
        n_codes - 1,
        int(nibbles),
        native.ptr(codes),
        native.ptr(absmax),
        _threads(nb),
    )
    return None if bad else out


def decode_(
    stored: torch.Tensor, block: int, nibbles: bool, code: torch.Tensor, dtype, out: torch.Tensor
) -> bool:
    """Fill contiguous ``out`` (fp32 or bfloat16, the leaf's numel) with the values uint8
    ``stored`` (``encode``'s layout) holds, each ``code[c] * absmax`` rounded to ``dtype`` (bfloat16
    or fp32); False (``out`` partly written) where the kernels cannot: not built, another dtype, not
    on the CPU, an absmax not finite."""
    lib = library()
    kinds = (torch.float32, torch.bfloat16)
    if lib is None or dtype not in kinds or out.dtype not in kinds or out.device.type != "cpu":
        return False
    if stored.device.type != "cpu" or not out.is_contiguous():
        return False
    nb = out.numel() // block
    # bound to names: a copy made here must outlive the call
    absmax = stored[: 4 * nb].view(torch.float32).contiguous()
    codes = stored[4 * nb :].contiguous()
    code = code.to(torch.float32).contiguous()
    bad = lib.block_dequantize(
        nb,
        block,
        native.ptr(codes),
        int(nibbles),
        native.ptr(absmax),
        native.ptr(code),
        int(dtype == torch.bfloat16),
        native.ptr(out),
        int(out.dtype == torch.bfloat16),
        DECODE_THREADS,
    )
    return not bad
