"""C kernels of a linear over a frozen weight stored as NF4 codes (``formats.nf4_linear``): the
products read the codes, never a decoded weight.

``W`` (d_out, d_in) is ``codebook.encode_leaf``'s bytes: its fp32 absmax scales (one a block of 64
along a row), then its codes, two a byte, high nibble first. ``forward`` is ``y = x @ W^T`` and
``grad_input`` is ``dx = g @ W`` for few rows of ``x`` / ``g`` (fp32). Per block of 64 the kernels
make its 16 possible weights once (``code[k] * absmax``, rounded to bfloat16 as torch's cast rounds
where the parameters are bf16: the weights are bitwise ``codebook.decode_leaf``'s), expand the codes
into them and fuse the products, so the weight is read once at 0.56 bytes an element.

The order of the sums is fixed, the same in the AVX-512, AVX2 and scalar paths (so each is bitwise
the others): ``forward`` accumulates each output in 16 lanes, lane l taking the terms j = l mod 16
in increasing j, one fused multiply-add each, then adds the lanes pairwise (l + 8, then + 4, + 2,
+ 1); ``grad_input`` accumulates each dx[n, j] over the output rows o in increasing o, one fused
multiply-add each. Threads split the outputs (rows of W forward, blocks of 64 columns backward),
so the thread count never changes a bit. A block whose absmax is not finite makes the kernels
report it (the caller then runs the torch twin).
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
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLK 64
#define GROUP 4   /* rows of x (g) whose sums share one decode of a block */

""" + native.BITS + r"""
/* the block's 16 weights: code[k] * a, rounded to bfloat16 (to nearest, ties to even) where rb */
static inline void table16(const float* code, float a, int rb, float* t) {
    for (int k = 0; k < 16; k++) {
        const float v = code[k] * a;
        const uint32_t u = f2u(v);
        t[k] = rb ? u2f(bf16_nearest(u)) : v;
    }
}

/* element i of a block's 32 code bytes */
static inline int nib(const uint8_t* q, int i) { return i & 1 ? q[i >> 1] & 15 : q[i >> 1] >> 4; }

static int bad_scales(int64_t n, const float* s) {
    for (int64_t i = 0; i < n; i++) if (!(fabsf(s[i]) <= FLT_MAX)) return 1;
    return 0;
}

#if defined(__AVX512F__)
/* the table as one register, and the block's 64 weights as 4 registers of 16 (element order) */
static inline __m512 vtable(const float* code, float a, int rb) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(code), _mm512_set1_ps(a));
    if (!rb) return v;
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline void expand(const uint8_t* q, __m512 t, __m512* w) {
    /* only an index's low 4 bits count: b >> 4 by 16-bit shifts, b itself as the low nibble */
    const __m256i b = _mm256_loadu_si256((const __m256i*)q);
    const __m256i hi = _mm256_srli_epi16(b, 4);
    const __m256i lo_pairs = _mm256_unpacklo_epi8(hi, b);   /* elements 0..15 | 32..47 */
    const __m256i hi_pairs = _mm256_unpackhi_epi8(hi, b);   /* elements 16..31 | 48..63 */
    w[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo_pairs)), t);
    w[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi_pairs)), t);
    w[2] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo_pairs, 1)), t);
    w[3] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi_pairs, 1)), t);
}
static inline float hsum(__m512 v) {   /* lanes l + l+8, then + 4, + 2, + 1 */
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 r = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)));
}
static inline __attribute__((always_inline)) void fwd_row(
        int R, const float* x, int64_t ldx, const uint8_t* q, const float* s, int64_t nb,
        const float* code, int rb, float* y, int64_t ldy) {
    __m512 acc[GROUP];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < nb; k++) {
        __m512 w[4];
        expand(q + k * 32, vtable(code, s[k], rb), w);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++)
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + k * BLK + c * 16), w[c],
                                         acc[r]);
    }
    for (int r = 0; r < R; r++) y[r * ldy] = hsum(acc[r]);
}
static inline __attribute__((always_inline)) void bwd_block(
        int R, const float* g, int64_t ldg, const uint8_t* q, const float* s, int64_t d_out,
        int64_t nb, const float* code, int rb, float* dx, int64_t ldx) {
    __m512 acc[GROUP][4];
    for (int r = 0; r < R; r++) for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t o = 0; o < d_out; o++) {
        __m512 w[4];
        expand(q + o * nb * 32, vtable(code, s[o * nb], rb), w);
        for (int r = 0; r < R; r++) {
            const __m512 gv = _mm512_set1_ps(g[r * ldg + o]);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(gv, w[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(dx + r * ldx + c * 16, acc[r][c]);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* 16 lanes as two registers of 8; the table as two halves chosen by bit 3 of the code */
static inline __m256 round8(__m256 v, int rb) {
    if (!rb) return v;
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline void expand(const uint8_t* q, const float* code, float a, int rb, __m256* w) {
    const __m256 av = _mm256_set1_ps(a);
    const __m256 t0 = round8(_mm256_mul_ps(_mm256_loadu_ps(code), av), rb);
    const __m256 t1 = round8(_mm256_mul_ps(_mm256_loadu_ps(code + 8), av), rb);
    for (int c = 0; c < 8; c++) {   /* elements 8c .. 8c+7: bytes 4c .. 4c+3 */
        int32_t idx[8];
        for (int i = 0; i < 8; i++) idx[i] = nib(q, 8 * c + i);
        const __m256i k = _mm256_loadu_si256((const __m256i*)idx);
        const __m256 top = _mm256_castsi256_ps(_mm256_slli_epi32(k, 28));
        w[c] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, k),
                                _mm256_permutevar8x32_ps(t1, k), top);
    }
}
static inline float hsum2(__m256 lo, __m256 hi) {
    const __m256 h = _mm256_add_ps(lo, hi);
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 r = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)));
}
static inline __attribute__((always_inline)) void fwd_row(
        int R, const float* x, int64_t ldx, const uint8_t* q, const float* s, int64_t nb,
        const float* code, int rb, float* y, int64_t ldy) {
    __m256 acc[GROUP][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < nb; k++) {
        __m256 w[8];
        expand(q + k * 32, code, s[k], rb, w);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 8; c++)
                acc[r][c & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + k * BLK + c * 8),
                                                w[c], acc[r][c & 1]);
    }
    for (int r = 0; r < R; r++) y[r * ldy] = hsum2(acc[r][0], acc[r][1]);
}
static inline __attribute__((always_inline)) void bwd_block(
        int R, const float* g, int64_t ldg, const uint8_t* q, const float* s, int64_t d_out,
        int64_t nb, const float* code, int rb, float* dx, int64_t ldx) {
    for (int r = 0; r < R; r++) {   /* 8 registers of 8: one row at a time */
        __m256 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t o = 0; o < d_out; o++) {
            __m256 w[8];
            expand(q + o * nb * 32, code, s[o * nb], rb, w);
            const __m256 gv = _mm256_set1_ps(g[r * ldg + o]);
            for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(gv, w[c], acc[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(dx + r * ldx + c * 8, acc[c]);
    }
}
#else
static inline void fwd_row(int R, const float* x, int64_t ldx, const uint8_t* q, const float* s,
                           int64_t nb, const float* code, int rb, float* y, int64_t ldy) {
    for (int r = 0; r < R; r++) {
        float acc[16] = {0};
        for (int64_t k = 0; k < nb; k++) {
            float t[16];
            table16(code, s[k], rb, t);
            for (int i = 0; i < BLK; i++)
                acc[i & 15] = fmaf(x[r * ldx + k * BLK + i], t[nib(q + k * 32, i)], acc[i & 15]);
        }
        for (int h = 8; h >= 1; h /= 2) for (int l = 0; l < h; l++) acc[l] = acc[l] + acc[l + h];
        y[r * ldy] = acc[0];
    }
}
static inline void bwd_block(int R, const float* g, int64_t ldg, const uint8_t* q, const float* s,
                             int64_t d_out, int64_t nb, const float* code, int rb, float* dx,
                             int64_t ldx) {
    for (int r = 0; r < R; r++) {
        float acc[BLK] = {0};
        for (int64_t o = 0; o < d_out; o++) {
            float t[16];
            table16(code, s[o * nb], rb, t);
            for (int i = 0; i < BLK; i++)
                acc[i] = fmaf(g[r * ldg + o], t[nib(q + o * nb * 32, i)], acc[i]);
        }
        memcpy(dx + r * ldx, acc, sizeof acc);
    }
}
#endif

/* rows R <= GROUP with R a constant where inlined: each case its own specialised loop */
#define BY_ROWS(call) switch (R) { case 1: call(1); break; case 2: call(2); break; \
                                   case 3: call(3); break; default: call(4); }

/* y (n, d_out) = x (n, d_in) @ W^T, W (d_out, d_in) the codes q and scales s; 1 where a scale
   is not finite (y unwritten) */
int nf4_forward(int64_t n, int64_t d_out, int64_t d_in, const float* restrict x,
                const uint8_t* restrict q, const float* restrict s, const float* restrict code,
                int rb, float* restrict y, int threads) {
    const int64_t nb = d_in / BLK;
    if (bad_scales(d_out * nb, s)) return 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < d_out; o++) {
        for (int64_t r0 = 0; r0 < n; r0 += GROUP) {
            const int R = (int)(n - r0 < GROUP ? n - r0 : GROUP);
            #define FWD(k) fwd_row(k, x + r0 * d_in, d_in, q + o * nb * 32, s + o * nb, nb, \
                                   code, rb, y + r0 * d_out + o, d_out)
            BY_ROWS(FWD)
            #undef FWD
        }
    }
    return 0;
}

/* dx (n, d_in) = g (n, d_out) @ W; 1 where a scale is not finite (dx unwritten) */
int nf4_grad_input(int64_t n, int64_t d_out, int64_t d_in, const float* restrict g,
                   const uint8_t* restrict q, const float* restrict s, const float* restrict code,
                   int rb, float* restrict dx, int threads) {
    const int64_t nb = d_in / BLK;
    if (bad_scales(d_out * nb, s)) return 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < nb; k++) {
        for (int64_t r0 = 0; r0 < n; r0 += GROUP) {
            const int R = (int)(n - r0 < GROUP ? n - r0 : GROUP);
            #define BWD(m) bwd_block(m, g + r0 * d_out, d_out, q + k * 32, s + k, d_out, nb, \
                                     code, rb, dx + r0 * d_in + k * BLK, d_in)
            BY_ROWS(BWD)
            #undef BWD
        }
    }
    return 0;
}
"""

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGS = [_I64, _I64, _I64, _P, _P, _P, _P, _I32, _P, _I32]
# multiply-adds a thread takes at least: a small product runs on one (waking another costs more)
WORK_PER_THREAD = 1 << 20


def threads(work: int) -> int:
    """The threads a product of ``work`` multiply-adds runs on: torch's, fewer where it is small."""
    return max(1, min(torch.get_num_threads(), work // WORK_PER_THREAD))


def _load(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    if lib is None:
        return None
    for fn in (lib.nf4_forward, lib.nf4_grad_input):
        fn.argtypes = _ARGS
        fn.restype = _I32
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, once per process; None where they cannot be built."""
    return _load(native.build("zinf_nf4_linear", SOURCE))


@functools.cache
def variant(isa: tuple[str, ...]) -> ctypes.CDLL | None:
    """The same source built for the instruction sets ``isa`` names instead of this CPU's
    (``()``: baseline x86-64 or any CPU, the scalar path; ``("-mavx2", "-mfma")``: the AVX2 path),
    which a test holds bitwise to the path ``library`` runs."""
    flags = tuple(f for f in native.FLAGS if not f.startswith(("-march", "-mprefer")))
    name = "zinf_nf4_linear_" + ("_".join(f.lstrip("-m") for f in isa) or "portable")
    return _load(native.build(name, SOURCE, (*isa, *flags)))
