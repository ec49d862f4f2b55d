"""AdamW over compressed optimizer states, one fused pass per piece; called by the updater per
piece.

States of one piece of a unit's row (``numel`` elements, starting at ``element_offset`` in the
row)::

    master:   fp32 (numel,)                       MasterFormat("fp32")
              RemainderMaster(param bf16, remainder int16)        MasterFormat("remainder")
    moments:  Fp32Moments(m, v)   fp32 (numel,) each               MomentsFormat("fp32")
              Bf16Moments(m, v)   bf16 (numel,) each               MomentsFormat("bf16")
              Int8Moments(m_codes, m_absmax, v_codes, v_absmax)    MomentsFormat("int8"):
                  uint8 (numel,) and fp32 (numel // 256,) each

``adamw_piece_(grad, master, moments, hyper, step, lr, element_offset, unit_seed, copy16, decay)``
reads the fp32 ``grad`` (numel,) and updates master and moments in place (and writes the bf16 copy
``copy16`` of an fp32 master, rounded ties away: ``remainder.to_bf16_ties_away``). The plain loop it
equals::

    p = master (fp32) or join(param, remainder);  m, v = decode(moments)      # fp32
    p, m, v = kernels.adamw_math(p, grad, m, v, step_scalars(...), decay)
    master = p or split_master(p);  moments = encode(m, v)                           # in place

Bf16 and int8 moments run that as one pass of the C kernels (``optim.native``: a block of 256 at a
time, in L1); where no C compiler builds them, as ``torch.compile`` of the plain torch of
``optim.kernels`` (compiled once per format and flag set, sizes dynamic). Both equal a plain-torch
reference bitwise (tests/optim/test_compressed_update.py). Fp32 moments run torch's fused AdamW
itself (``torch._fused_adamw_``), so an fp32-moments run is bitwise ``optimizers.adamw``'s, with the
remainder joined before and split after.

Engine constraints: int8 pieces and shards start and end on multiples of ``formats.BLOCK`` elements
of the row (blocks never straddle them); ``step`` counts the updates applied before this one;
``unit_seed`` is fixed per unit (its place in the model, not its rank or tier), so the rounding
noise is placement-free."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from ..formats import codebook
from ..native import ptr
from . import code_regions, formats, kernels, native
from .optimizers import DecaySpans, decay_groups
from .remainder import join, split_master, to_bf16_ties_away


class RemainderMaster(NamedTuple):
    # bf16 (numel,): the parameter copy, the master's high half (ties away)
    param: torch.Tensor
    remainder: torch.Tensor  # int16 (numel,)


class Fp32Moments(NamedTuple):
    m: torch.Tensor
    v: torch.Tensor


class Bf16Moments(NamedTuple):
    m: torch.Tensor
    v: torch.Tensor


class Int8Moments(NamedTuple):
    m_codes: torch.Tensor  # uint8 (numel,), codes of formats.dynamic_map(signed=True)
    m_absmax: torch.Tensor  # fp32 (numel // BLOCK,)
    v_codes: torch.Tensor  # uint8 (numel,), codes of formats.dynamic_map(signed=False)
    v_absmax: torch.Tensor


class AdamWHyper(NamedTuple):
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


Moments = Fp32Moments | Bf16Moments | Int8Moments


def init_master(fmt: formats.MasterFormat, master: torch.Tensor) -> torch.Tensor | RemainderMaster:
    """The stored master of fp32 ``master`` (numel,): itself, or
    ``RemainderMaster(*split_master(master))``."""
    return master if fmt.kind == "fp32" else RemainderMaster(*split_master(master))


def init_moments(fmt: formats.MomentsFormat, numel: int, device=None) -> Moments:
    """Zero moments of ``numel`` elements in format ``fmt`` (int8: ``numel`` a multiple of the
    block)."""
    if fmt.kind == "fp32":
        return Fp32Moments(*(torch.zeros(numel, device=device) for _ in range(2)))
    if fmt.kind == "bf16":
        return Bf16Moments(
            *(torch.zeros(numel, dtype=torch.bfloat16, device=device) for _ in range(2))
        )
    formats.check_blocks(0, numel)
    tables = code_tables(device)
    # the codes of 0.0
    zero_m, zero_v = (int(torch.searchsorted(t, 0.0)) for t in (tables[0], tables[2]))
    blocks = numel // formats.BLOCK
    codes = [
        torch.full((numel,), zero, dtype=torch.uint8, device=device) for zero in (zero_m, zero_v)
    ]
    return Int8Moments(
        codes[0], torch.zeros(blocks, device=device), codes[1], torch.zeros(blocks, device=device)
    )


_TABLES: dict = {}


def code_tables(device=None) -> tuple[torch.Tensor, ...]:
    """(m code, m bounds, v code, v bounds): fp32 (256,) each, cached per device."""
    key = str(torch.device(device or "cpu"))
    if key not in _TABLES:
        codes = (formats.dynamic_map(signed=True), formats.dynamic_map(signed=False))
        _TABLES[key] = tuple(t.to(key) for c in codes for t in (c, codebook.bounds(c)))
    return _TABLES[key]


def step_scalars(hyper: AdamWHyper, step: int, lr: float, decayed: bool = True) -> torch.Tensor:
    """fp32 (7,): (1 - lr wd, 1 - b1, b2, 1 - b2, sqrt(1 - b2^t), eps, lr / (1 - b1^t)) with t =
    step + 1, each computed in float64 and rounded to fp32, as torch's fused AdamW computes them."""
    t = step + 1
    wd = hyper.weight_decay if decayed else 0.0
    values = (
        1.0 - lr * wd,
        1.0 - hyper.b1,
        hyper.b2,
        1.0 - hyper.b2,
        math.sqrt(1.0 - hyper.b2**t),
        hyper.eps,
        lr / (1.0 - hyper.b1**t),
    )
    return torch.tensor(values, dtype=torch.float32)


def decay_mask(decay: DecaySpans | None, numel: int) -> torch.Tensor | None:
    """None where every element of the piece decays (or none does: see ``adamw_piece_``), else a
    bool (numel,) mask of the decayed elements."""
    if decay is None or decay.spans == ((0, numel),) or not decay.spans:
        return None
    mask = torch.zeros(numel, dtype=torch.bool)
    for lo, hi in decay.spans:
        mask[lo:hi] = True
    return mask


def adamw_piece_(
    grad: torch.Tensor,
    master,
    moments: Moments,
    hyper: AdamWHyper,
    step: int,
    lr: float,
    element_offset: int = 0,
    unit_seed: int = 0,
    copy16: torch.Tensor | None = None,
    decay: DecaySpans | None = None,
) -> None:
    """One AdamW update of one piece, in place (see the module docstring). ``grad`` fp32 (numel,) is
    read only; ``master``, ``moments`` and ``copy16`` (bf16 (numel,), or None: an fp32 master's copy
    is not wanted; a remainder master's copy is its ``param``) are written. ``decay``: the piece's
    ``DecaySpans`` (counted from the piece's start), None: every element decays."""
    numel = grad.numel()
    if isinstance(moments, Fp32Moments):
        return _fp32_moments_(grad, master, moments, hyper, step, lr, copy16, decay)
    mask = decay_mask(decay, numel)
    decayed = decay is None or bool(decay.spans)
    s = step_scalars(hyper, step, lr, decayed)
    lib = _library(grad)
    if isinstance(moments, Bf16Moments):
        key = kernels.rounding_key(unit_seed, step)
        if lib is None:
            counter = torch.tensor([element_offset, key], dtype=torch.int64)
            return _compiled(_bf16_body_)(grad, master, moments, s, counter, copy16, mask)
        lib.adamw_bf16(
            numel,
            ptr(grad),
            *_master_ptrs(master, copy16),
            ptr(moments.m.view(torch.int16)),
            ptr(moments.v.view(torch.int16)),
            key,
            element_offset,
            ptr(s),
            ptr(mask),
            _threads(),
        )
    elif isinstance(moments, Int8Moments):
        formats.check_blocks(element_offset, numel)
        if lib is None:
            return _compiled(_int8_body_)(
                grad, master, moments, s, code_tables(grad.device), copy16, mask
            )
        codes, luts = native_tables()
        lib.adamw_int8(
            numel,
            ptr(grad),
            *_master_ptrs(master, copy16),
            *(ptr(t) for t in moments),
            ptr(codes),
            ptr(luts),
            ptr(s),
            ptr(mask),
            _threads(),
        )
    else:
        raise TypeError(
            f"adamw_piece_: moments must be Fp32Moments, Bf16Moments or Int8Moments, "
            f"got {type(moments).__name__}"
        )


def _master_ptrs(master, copy16) -> tuple:
    """(fp32 master, bf16 copy of a remainder master, remainder, bf16 copy of an fp32 master):
    pointers or None."""
    if isinstance(master, RemainderMaster):
        return None, ptr(master.param), ptr(master.remainder), None
    return ptr(master), None, None, ptr(copy16)


def _library(t: torch.Tensor):
    """The C kernels for tensors on the CPU like ``t`` (None elsewhere, or where they do not build:
    the ``torch.compile`` twins run, on any device)."""
    return native.library() if t.device.type == "cpu" else None


def _threads() -> int:
    return torch.get_num_threads()


@functools.cache
def native_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """(codes fp32 (512,): m's then v's; int32: the nearest-code tables (``native.code_luts``),
    then m's and v's arithmetic-encode tables (``code_regions.region_tables``)) for the C
    kernels."""
    code_m, bounds_m, code_v, bounds_v = code_tables()
    regions = [
        code_regions.region_tables(code_m, bounds_m),
        code_regions.region_tables(code_v, bounds_v),
    ]
    return torch.cat([code_m, code_v]), torch.cat([native.code_luts(bounds_m, bounds_v), *regions])


# the int8 map of optimizer leaf i: leaf 0 (Adam's m) signed, leaf 1 (v) unsigned
SIGNED = (True, False)


def encode_moments(fmt: str, leaves: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Adam's fp32 (m, v) of a piece as a group of moments format ``fmt`` stores them, in its row
    order (``RowKinds.rows_of``; the fields of ``Fp32Moments`` / ``Bf16Moments`` / ``Int8Moments``):
    each leaf's ``encode_leaf`` (bf16 by a cast: exact for init's zeros), int8 (m codes, m scales, v
    codes, v scales)."""
    return tuple(t for i, leaf in enumerate(leaves) for t in encode_leaf(fmt, i, leaf))


def encode_leaf(fmt: str, leaf: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32 ``x`` of optimizer leaf ``leaf`` as moments format ``fmt`` stores it, in its rows'
    order: fp32 as it is, bf16 cast, int8 (codes, scales) by ``quantize`` on the leaf's map
    (``SIGNED``): the one map between a leaf and its rows (``layout.kinds.leaf_rows``; an update's
    ``Int8Moments`` fields in order), for init and for a checkpoint's conversions
    (``optim.stored``); ``decode_leaf`` is its inverse."""
    if fmt == "int8":
        return quantize(x, SIGNED[leaf])
    return (x.to(torch.bfloat16) if fmt == "bf16" else x,)


def decode_leaf(fmt: str, leaf: int, rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The fp32 values an update reads optimizer leaf ``leaf``'s stored ``rows`` (``encode_leaf``'s
    order) as: the upcast of fp32 or bf16 values, int8 ``dequantize``d on the leaf's map."""
    if fmt == "int8":
        return dequantize(*rows, SIGNED[leaf])
    return rows[0].float()


def quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` (n,), n a multiple of ``formats.BLOCK`` -> (uint8 codes (n,), fp32 absmax (n //
    BLOCK,)) on the signed map (m) or the unsigned one (v): the codes an update writes for moments
    of these values (a format conversion's fp32 -> int8). The C kernels' encode where they build,
    else ``codebook.quantize``."""
    formats.check_blocks(0, x.numel())
    lib, blocks = _library(x), x.numel() // formats.BLOCK
    if lib is None:
        bounds = code_tables(x.device)[1 if signed else 3]
        codes, absmax = codebook.quantize(x.reshape(blocks, formats.BLOCK), bounds)
        return codes.reshape(-1), absmax
    x = x.contiguous()
    codes, absmax = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(blocks)
    luts = native_tables()[1]
    table = luts if signed else luts[2 * (native.KEYS - native.KEY_LO) :]
    lib.int8_quantize(
        x.numel(), ptr(x), ptr(codes), ptr(absmax), ptr(table), int(signed), _threads()
    )
    return codes, absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 ``codes`` (n,) and fp32 ``absmax`` (n // BLOCK,) -> the fp32 values (n,) an update
    reads them as."""
    code = code_tables(codes.device)[0 if signed else 2]
    return codebook.dequantize(codes.reshape(-1, formats.BLOCK), absmax, code).reshape(-1)


_COMPILED: dict = {}


def _compiled(fn):
    """``torch.compile(fn, dynamic=True)``, once per process: sizes are symbols, so one graph per
    (master kind, copy wanted, decay mask) serves every piece size."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def _load_master(master) -> torch.Tensor:
    return join(*master) if isinstance(master, RemainderMaster) else master


def _store_master_(master, p: torch.Tensor, copy16: torch.Tensor | None) -> None:
    if isinstance(master, RemainderMaster):
        param, remainder = split_master(p)
        master.param.copy_(param)
        master.remainder.copy_(remainder)
        return
    master.copy_(p)
    if copy16 is not None:
        copy16.copy_(to_bf16_ties_away(p))


def _bf16_body_(grad, master, moments: Bf16Moments, s, counter, copy16, mask) -> None:
    p = _load_master(master)
    p, m, v = kernels.adamw_math(p, grad, moments.m.float(), moments.v.float(), s, mask)
    noise_m, noise_v = kernels.rounding_noise(grad.numel(), counter)
    moments.m.copy_(kernels.to_bf16_stochastic(m, noise_m))
    moments.v.copy_(kernels.to_bf16_stochastic(v, noise_v))
    _store_master_(master, p, copy16)


def _int8_body_(grad, master, moments: Int8Moments, s, tables, copy16, mask) -> None:
    code_m, bounds_m, code_v, bounds_v = tables
    nb = moments.m_absmax.numel()
    # (blocks, BLOCK): a block's absmax is one row's
    p = _load_master(master).view(nb, formats.BLOCK)
    m = codebook.dequantize(moments.m_codes.view(nb, formats.BLOCK), moments.m_absmax, code_m)
    v = codebook.dequantize(moments.v_codes.view(nb, formats.BLOCK), moments.v_absmax, code_v)
    rows = grad.view(nb, formats.BLOCK)
    p, m, v = kernels.adamw_math(
        p, rows, m, v, s, None if mask is None else mask.view(nb, formats.BLOCK)
    )
    for codes, absmax, x, bounds in (
        (moments.m_codes, moments.m_absmax, m, bounds_m),
        (moments.v_codes, moments.v_absmax, v, bounds_v),
    ):
        new_codes, new_absmax = codebook.quantize(x, bounds)
        codes.view(nb, formats.BLOCK).copy_(new_codes)
        absmax.copy_(new_absmax)
    _store_master_(master, p.reshape(-1), copy16)


def _fp32_moments_(
    grad,
    master,
    moments: Fp32Moments,
    hyper: AdamWHyper,
    step: int,
    lr: float,
    copy16,
    decay: DecaySpans | None,
) -> None:
    """torch's fused AdamW (as ``optimizers.adamw``), on the master joined from its remainder if
    need be."""
    lib, n = _library(grad), grad.numel()
    p = master
    if isinstance(master, RemainderMaster):
        p = join(*master) if lib is None else torch.empty(n)
        if lib is not None:
            lib.remainder_join(n, ptr(master.param), ptr(master.remainder), ptr(p), _threads())
    t = torch.tensor(float(step + 1), device=p.device)
    for wd, spans in decay_groups(decay, n, hyper.weight_decay):
        views = [[x[lo:hi] for lo, hi in spans] for x in (p, grad, moments.m, moments.v)]
        torch._fused_adamw_(
            *views,
            [],
            [t] * len(spans),
            lr=lr,
            beta1=hyper.b1,
            beta2=hyper.b2,
            weight_decay=wd,
            eps=hyper.eps,
            amsgrad=False,
            maximize=False,
        )
    if isinstance(master, RemainderMaster):
        if lib is None:
            _store_master_(master, p, None)
        else:
            lib.remainder_split(n, ptr(p), ptr(master.param), ptr(master.remainder), _threads())
    elif copy16 is not None:
        if lib is None:
            copy16.copy_(to_bf16_ties_away(p))
        else:
            lib.ties_away(n, ptr(p), ptr(copy16), _threads())
