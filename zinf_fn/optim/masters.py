"""The fp32 master of a piece, as the optimizer tier stores it: whole, or as the param copy plus a
remainder.

``master="fp32"``: the optimizer tier's "master" row is the fp32 master; the update writes the
16-bit copy by a cast (``cast16_``: torch's round to nearest even, or ties away with
``Config.param_rounding``). ``master="remainder"``: the tier keeps an int16 "remainder" row instead,
and the bf16 param row is the master's high half (``optim.remainder``). An update of a piece joins
the two into an fp32 scratch buffer,
runs the same fp32 update on it, and splits it back into the param and remainder pieces::

    master = join(param[lo:hi], remainder[lo:hi])       # fp32, bit for bit the master
    update(master, ...)                                  # as with master="fp32"
    param[lo:hi], remainder[lo:hi] = split_master(master)       # the copy rounds ties away

so a remainder run equals an fp32-master run with ``param_rounding="ties_away"`` bitwise. The three
functions run the C kernels (``optim.native``) where they build, else their plain-torch twins (the
same bits: tests/optim/test_compressed_update.py). An update of compressed moments takes the two
halves themselves (``piece_master``): its kernel joins, updates and splits them in its one pass,
with no scratch buffer.
"""

from __future__ import annotations

import functools

import torch

from ..io.buffers import BufferPool
from ..native import ptr
from . import native
from .compressed import RemainderMaster
from .remainder import join, split_master, to_bf16_ties_away


def _lib(*tensors: torch.Tensor):
    """The C kernels where they build and every tensor is a contiguous CPU tensor, else None."""
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    return native.library()


def cast16_(dst: torch.Tensor, src: torch.Tensor, ties_away: bool) -> None:
    """``dst`` (the 16-bit copy) = ``src`` (fp32 master, same numel), rounded ties away (bf16) or by
    torch's cast; ``src`` of ``dst``'s dtype is copied as it is."""
    if not ties_away or src.dtype != torch.float32:
        dst.copy_(src)
        return
    lib = _lib(src, dst)
    if lib is None or dst.dtype != torch.bfloat16:
        dst.copy_(to_bf16_ties_away(src))
    else:
        lib.ties_away(src.numel(), ptr(src), ptr(dst), torch.get_num_threads())


def cast16_widened_(out: torch.Tensor, master: torch.Tensor) -> None:
    """``out`` (fp32) = ``master`` (fp32, same numel) cast to bf16 by torch and back to fp32, bit
    for bit (a NaN as torch's cast makes it), in one pass: what a fetch of the 16-bit copy the
    update wrote from this master computes with (``overlap.gather``: a lent master)."""
    lib = _lib(out, master)
    nan16 = _torch_nan16()
    if lib is None or nan16 is None:
        out.copy_(master.to(torch.bfloat16))
    else:
        lib.round_bf16(master.numel(), ptr(master), ptr(out), nan16, torch.get_num_threads())


@functools.cache
def _torch_nan16() -> int | None:
    """The bf16 bits torch's cast gives a NaN (each sign and payload, in a vectorised body and a
    scalar tail alike), or None where they differ (the kernel would not be torch's cast)."""
    payloads = [0x7FC00000, 0x7F800001, 0xFFC00000, 0x7FA12345, 0xFF812345, 0x7FFFFFFF]
    bits = torch.tensor(payloads * 11, dtype=torch.int64)
    nans = ((bits ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.float32)
    cast = nans.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return int(cast[0]) if bool((cast == cast[0]).all()) else None


def join_(out: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32) = the master of the bf16 ``param`` and int16 ``remainder`` pieces; returns
    ``out``."""
    lib = _lib(out, param, remainder)
    if lib is None:
        out.copy_(join(param, remainder))
    else:
        lib.remainder_join(
            out.numel(), ptr(param), ptr(remainder), ptr(out), torch.get_num_threads()
        )
    return out


def split_master_(master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
    """``param`` (bf16), ``remainder`` (int16) = ``split_master(master)`` (fp32), in place."""
    lib = _lib(master, param, remainder)
    if lib is None:
        high, low = split_master(master)
        param.copy_(high)
        remainder.copy_(low)
    else:
        lib.remainder_split(
            master.numel(), ptr(master), ptr(param), ptr(remainder), torch.get_num_threads()
        )


def piece_master(
    pool: BufferPool, param: torch.Tensor, remainder: torch.Tensor, compressed: bool
) -> torch.Tensor | RemainderMaster:
    """The master of a remainder piece as an update takes it: the halves themselves where its
    moments are compressed (the kernels update them in one pass), else joined into a pool buffer
    (torch's fused fp32 update); ``stored_`` puts it back."""
    if compressed:
        return RemainderMaster(param, remainder)
    return join_(pool.take(param.numel(), torch.float32, param.device), param, remainder)


def stored_(
    pool: BufferPool,
    master: torch.Tensor | RemainderMaster,
    param: torch.Tensor,
    remainder: torch.Tensor,
) -> None:
    """After the update of ``piece_master``'s master: a joined buffer split back into ``param`` and
    ``remainder`` and given back to the pool; the halves themselves are already written."""
    if not isinstance(master, RemainderMaster):
        split_master_(master, param, remainder)
        pool.give(master)
