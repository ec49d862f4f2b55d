"""C kernels of a frozen weight's block-wise codes (``codebook.encode_leaf`` / ``decode_leaf``): one
pass over a block's values or codes each, on every torch thread.

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

SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CH 64

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* nb blocks of B fp32 values: absmax[b] = max |x|, and a block's codes the number of the n_mids
   (sorted) midpoints below x * (1 / max(absmax, 1e-38)) clamped to [-1, 1]; packed two a byte, high
   nibble first, where nibbles (B even). 1 where a value is not finite (its block unwritten). */
int block_quantize(int64_t nb, int64_t B, const float* restrict x,
                   const float* restrict mids, int n_mids, int nibbles, uint8_t* restrict q,
                   float* restrict absmax, int threads) {
    int bad = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(|:bad)
    for (int64_t b = 0; b < nb; b++) {
        const float* xb = x + b * B;
        float most = 0.0f;
        int odd = 0;
        for (int64_t i = 0; i < B; i++) {
            const float a = fabsf(xb[i]);
            odd |= !(a <= FLT_MAX);
            most = a > most ? a : most;
        }
        if (odd) { bad = 1; continue; }
        absmax[b] = most;
        const float inv = 1.0f / (most >= 1e-38f ? most : 1e-38f);
        for (int64_t j = 0; j < B; j += CH) {
            const int64_t m = B - j < CH ? B - j : CH;
            float s[CH];
            uint8_t c[CH];
            for (int64_t i = 0; i < m; i++) {
                const float v = xb[j + i] * inv;
                s[i] = v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v);
                c[i] = 0;
            }
            for (int k = 0; k < n_mids; k++) {
                const float t = mids[k];
                for (int64_t i = 0; i < m; i++) c[i] += s[i] > t;
            }
            if (nibbles) {
                uint8_t* out = q + (b * B + j) / 2;
                for (int64_t i = 0; i < m / 2; i++)
                    out[i] = (uint8_t)((c[2 * i] << 4) | c[2 * i + 1]);
            } else {
                memcpy(q + b * B + j, c, (size_t)m);
            }
        }
    }
    return bad;
}

/* nb blocks of B codes (two a byte, high first, where nibbles): code[c] * absmax[b], rounded to
   bfloat16 where round_bf16, written as bfloat16 bits (out_bf16) or fp32. 1 where an absmax is not
   finite (its block unwritten). */
int block_dequantize(int64_t nb, int64_t B, const uint8_t* restrict q, int nibbles,
                     const float* restrict absmax, const float* restrict code, int round_bf16,
                     void* restrict out, int out_bf16, int threads) {
    int bad = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(|:bad)
    for (int64_t b = 0; b < nb; b++) {
        const float a = absmax[b];
        if (!(fabsf(a) <= FLT_MAX)) { bad = 1; continue; }
        float v[CH];
        for (int64_t j = 0; j < B; j += CH) {
            const int64_t m = B - j < CH ? B - j : CH, e = b * B + j;
            if (nibbles) {
                const uint8_t* qb = q + e / 2;
                for (int64_t i = 0; i < m / 2; i++) {
                    v[2 * i] = code[qb[i] >> 4] * a;
                    v[2 * i + 1] = code[qb[i] & 15] * a;
                }
            } else {
                for (int64_t i = 0; i < m; i++) v[i] = code[q[e + i]] * a;
            }
            if (round_bf16 || out_bf16) {
                for (int64_t i = 0; i < m; i++) {
                    const uint32_t u = f2u(v[i]);
                    v[i] = u2f((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
                }
            }
            if (out_bf16) {
                uint16_t* o = (uint16_t*)out + e;
                for (int64_t i = 0; i < m; i++) o[i] = (uint16_t)(f2u(v[i]) >> 16);
            } else {
                memcpy((float*)out + e, v, (size_t)m * sizeof(float));
            }
        }
    }
    return bad;
}
"""

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# blocks a thread takes at least: a small leaf runs on one (waking another costs more than it saves)
BLOCKS_PER_THREAD = 2048


def _threads(nb: int) -> int:
    return max(1, min(torch.get_num_threads(), nb // BLOCKS_PER_THREAD))


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, once per process; None where they cannot be built."""
    lib = native.build("zinf_codebook", SOURCE)
    if lib is None:
        return None
    lib.block_quantize.argtypes = [_I64, _I64, _P, _P, _I32, _I32, _P, _P, _I32]
    lib.block_dequantize.argtypes = [_I64, _I64, _P, _I32, _P, _P, _I32, _P, _I32, _I32]
    lib.block_quantize.restype = lib.block_dequantize.restype = _I32
    return lib


def encode(x: torch.Tensor, mids: torch.Tensor, nibbles: bool) -> torch.Tensor | None:
    """fp32 ``x`` (nb, B) on the CPU -> uint8 (4 nb + its codes' bytes,): the fp32 absmax of each
    block's bytes, then its codes (``mids``: the code book's sorted midpoints, without the +inf
    pad); None where the kernels are not built or a value is not finite."""
    lib = library()
    if lib is None or x.device.type != "cpu":
        return None
    x, mids = x.contiguous(), mids.to(torch.float32).contiguous()
    nb, block = x.shape
    out = torch.empty(4 * nb + (nb * block // 2 if nibbles else nb * block), dtype=torch.uint8)
    absmax, codes = out[: 4 * nb].view(torch.float32), out[4 * nb :]
    bad = lib.block_quantize(
        nb,
        block,
        native.ptr(x),
        native.ptr(mids),
        mids.numel(),
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
        _threads(nb),
    )
    return not bad
