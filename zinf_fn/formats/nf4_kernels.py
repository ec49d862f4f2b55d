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
so the thread count never changes a bit. Both read W once, asking the cache for the codes of the
rows ``AHEAD`` before their use: a fetched expert's codes come from DRAM, and arrive while the rows
before them compute (cold, 256 distinct experts, one thread: about 1.3x the in-cache time, against
2.6x without). A block whose absmax is not finite makes the kernels report it (the caller then
runs the torch twin).

Each block is decoded once a product. Up to ``GROUP`` (4) rows of ``x`` / ``g`` a block's weights
stay in registers between its decode and its multiply-adds (``grad_input`` reads W in its stored
order, dx's rows accumulators in memory, a few KB); more rows share one decode: ``forward`` decodes
a row of W into a thread's buffer (``d_in`` floats) that its rows' groups then read, and
``grad_input`` decodes each block once for all its rows, W's blocks taken in chunks of columns whose
rows of dx stay in L1 (``KEEP_DX``). Decoding a block per group of 4 rows made a product's time a
step function of ceil(rows / 4); on AVX2, whose expand is the costly part, an expert at 32 rows
took ~8x its time at 1 row (now ~4x), and the same decodes and multiply-adds in the same order
give the same bits.
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
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLK 64
#define GROUP 4   /* rows of x (g) whose sums share one decode of a block */
#define AHEAD 4   /* rows of W a thread asks the cache for before it reads them */

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
/* dx's n rows (ldx) += g's (ldg) times a block's 64 weights w (4 registers, element order) */
static inline __attribute__((always_inline)) void bwd_rows(
        int64_t n, const float* g, int64_t ldg, const __m512* w, float* dx, int64_t ldx) {
    for (int64_t r = 0; r < n; r++) {
        const __m512 gv = _mm512_set1_ps(g[r * ldg]);
        for (int c = 0; c < 4; c++) {
            float* p = dx + r * ldx + c * 16;
            _mm512_storeu_ps(p, _mm512_fmadd_ps(gv, w[c], _mm512_loadu_ps(p)));
        }
    }
}
static inline __attribute__((always_inline)) void bwd_step(
        int R, const float* g, int64_t ldg, const uint8_t* q, float a, const float* code, int rb,
        float* dx, int64_t ldx) {
    __m512 w[4];
    expand(q, vtable(code, a, rb), w);
    bwd_rows(R, g, ldg, w, dx, ldx);
}
/* a block's 64 weights into w64 (element order): the values expand makes */
static inline void decode_block(const uint8_t* q, float a, const float* code, int rb, float* w64) {
    __m512 w[4];
    expand(q, vtable(code, a, rb), w);
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(w64 + c * 16, w[c]);
}

/* fwd_row over a row of W already decoded (wrow, nb blocks): the same fused multiply-adds */
static inline __attribute__((always_inline)) void fwd_row_decoded(
        int R, const float* x, int64_t ldx, const float* wrow, int64_t nb, float* y, int64_t ldy) {
    __m512 acc[GROUP];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < nb; k++)
        for (int c = 0; c < 4; c++) {
            const __m512 w = _mm512_loadu_ps(wrow + k * BLK + c * 16);
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + k * BLK + c * 16), w,
                                         acc[r]);
        }
    for (int r = 0; r < R; r++) y[r * ldy] = hsum(acc[r]);
}

/* dx's n rows (ldx) += g's (ldg) times a decoded block w64: bwd_step's multiply-adds */
static inline void bwd_decoded(int64_t n, const float* g, int64_t ldg, const float* w64,
                               float* dx, int64_t ldx) {
    __m512 w[4];
    for (int c = 0; c < 4; c++) w[c] = _mm512_loadu_ps(w64 + c * 16);
    bwd_rows(n, g, ldg, w, dx, ldx);
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
/* dx's n rows (ldx) += g's (ldg) times a block's 64 weights w (8 registers, element order) */
static inline __attribute__((always_inline)) void bwd_rows(
        int64_t n, const float* g, int64_t ldg, const __m256* w, float* dx, int64_t ldx) {
    for (int64_t r = 0; r < n; r++) {
        const __m256 gv = _mm256_set1_ps(g[r * ldg]);
        for (int c = 0; c < 8; c++) {
            float* p = dx + r * ldx + c * 8;
            _mm256_storeu_ps(p, _mm256_fmadd_ps(gv, w[c], _mm256_loadu_ps(p)));
        }
    }
}
static inline __attribute__((always_inline)) void bwd_step(
        int R, const float* g, int64_t ldg, const uint8_t* q, float a, const float* code, int rb,
        float* dx, int64_t ldx) {
    __m256 w[8];
    expand(q, code, a, rb, w);
    bwd_rows(R, g, ldg, w, dx, ldx);
}
/* a block's 64 weights into w64 (element order): the values expand makes */
static inline void decode_block(const uint8_t* q, float a, const float* code, int rb, float* w64) {
    __m256 w[8];
    expand(q, code, a, rb, w);
    for (int c = 0; c < 8; c++) _mm256_storeu_ps(w64 + c * 8, w[c]);
}

/* fwd_row over a row of W already decoded (wrow, nb blocks): the same fused multiply-adds */
static inline __attribute__((always_inline)) void fwd_row_decoded(
        int R, const float* x, int64_t ldx, const float* wrow, int64_t nb, float* y, int64_t ldy) {
    __m256 acc[GROUP][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < nb; k++)
        for (int c = 0; c < 8; c++) {
            const __m256 w = _mm256_loadu_ps(wrow + k * BLK + c * 8);
            for (int r = 0; r < R; r++)
                acc[r][c & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + k * BLK + c * 8), w,
                                                acc[r][c & 1]);
        }
    for (int r = 0; r < R; r++) y[r * ldy] = hsum2(acc[r][0], acc[r][1]);
}

/* dx's n rows (ldx) += g's (ldg) times a decoded block w64: bwd_step's multiply-adds */
static inline void bwd_decoded(int64_t n, const float* g, int64_t ldg, const float* w64,
                               float* dx, int64_t ldx) {
    __m256 w[8];
    for (int c = 0; c < 8; c++) w[c] = _mm256_loadu_ps(w64 + c * 8);
    bwd_rows(n, g, ldg, w, dx, ldx);
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

/* a block's 64 weights into w64 (element order): the values the products take */
static inline void decode_block(const uint8_t* q, float a, const float* code, int rb, float* w64) {
    float t[16];
    table16(code, a, rb, t);
    for (int i = 0; i < BLK; i++) w64[i] = t[nib(q, i)];
}

/* fwd_row over a row of W already decoded (wrow, nb blocks): the same fused multiply-adds */
static inline void fwd_row_decoded(int R, const float* x, int64_t ldx, const float* wrow,
                                   int64_t nb, float* y, int64_t ldy) {
    for (int r = 0; r < R; r++) {
        float acc[16] = {0};
        for (int64_t j = 0; j < nb * BLK; j++)
            acc[j & 15] = fmaf(x[r * ldx + j], wrow[j], acc[j & 15]);
        for (int h = 8; h >= 1; h /= 2) for (int l = 0; l < h; l++) acc[l] = acc[l] + acc[l + h];
        y[r * ldy] = acc[0];
    }
}

/* dx's n rows (ldx) += g's (ldg) times a decoded block w64: bwd_step's multiply-adds */
static inline void bwd_decoded(int64_t n, const float* g, int64_t ldg, const float* w64,
                               float* dx, int64_t ldx) {
    for (int64_t r = 0; r < n; r++)
        for (int i = 0; i < BLK; i++) dx[r * ldx + i] = fmaf(g[r * ldg], w64[i], dx[r * ldx + i]);
}

static inline void bwd_step(int R, const float* g, int64_t ldg, const uint8_t* q, float a,
                            const float* code, int rb, float* dx, int64_t ldx) {
    float w64[BLK];
    decode_block(q, a, code, rb, w64);
    bwd_decoded(R, g, ldg, w64, dx, ldx);
}
#endif

/* rows R <= GROUP with R a constant where inlined: each case its own specialised loop */
#define BY_ROWS(call) switch (R) { case 1: call(1); break; case 2: call(2); break; \
                                   case 3: call(3); break; default: call(4); }

/* ask the cache for [p, p + bytes) ahead of its use: codes read from DRAM (a fetched expert's,
   not yet in any cache) then arrive while the rows before them compute */
static inline void ahead(const void* p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char*)p + i, 0, 3);
}

/* y (n, d_out) = x (n, d_in) @ W^T, W (d_out, d_in) the codes q and scales s; 1 where a scale
   is not finite (y unwritten). Up to GROUP rows each row of W is decoded in registers as it is
   used; more rows share one decode of it into a thread's buffer (wrow): a row's cost is then
   one decode and its rows' multiply-adds, not a decode per GROUP rows */
int nf4_forward(int64_t n, int64_t d_out, int64_t d_in, const float* restrict x,
                const uint8_t* restrict q, const float* restrict s, const float* restrict code,
                int rb, float* restrict y, int threads) {
    const int64_t nb = d_in / BLK;
    if (bad_scales(d_out * nb, s)) return 1;
    float* bufs = n > GROUP ? malloc((size_t)threads * (size_t)d_in * sizeof(float)) : NULL;
    #pragma omp parallel num_threads(threads)
    {
        float* wrow = bufs ? bufs + (int64_t)omp_get_thread_num() * d_in : NULL;
        #pragma omp for schedule(static)
        for (int64_t o = 0; o < d_out; o++) {
            if (o + AHEAD < d_out) {
                ahead(q + (o + AHEAD) * nb * 32, nb * 32);
                ahead(s + (o + AHEAD) * nb, nb * 4);
            }
            if (wrow)
                for (int64_t k = 0; k < nb; k++)
                    decode_block(q + (o * nb + k) * 32, s[o * nb + k], code, rb, wrow + k * BLK);
            for (int64_t r0 = 0; r0 < n; r0 += GROUP) {
                const int R = (int)(n - r0 < GROUP ? n - r0 : GROUP);
                #define FWD(k) fwd_row(k, x + r0 * d_in, d_in, q + o * nb * 32, s + o * nb, nb, \
                                       code, rb, y + r0 * d_out + o, d_out)
                #define FWD_DECODED(k) fwd_row_decoded(k, x + r0 * d_in, d_in, wrow, nb, \
                                                       y + r0 * d_out + o, d_out)
                if (wrow) { BY_ROWS(FWD_DECODED) } else { BY_ROWS(FWD) }
                #undef FWD
                #undef FWD_DECODED
            }
        }
    }
    free(bufs);
    return 0;
}

/* dx[r0 .. r0+R) (ldx d_in) += g's rows (ldg d_out) @ W over the blocks [k0, k1) of each row of W,
   the rows of W in increasing order: W streams from memory once, as it is stored */
static void bwd_blocks(int R, const float* g, int64_t d_out, int64_t nb, int64_t k0, int64_t k1,
                       const uint8_t* q, const float* s, const float* code, int rb, float* dx,
                       int64_t d_in) {
    for (int64_t o = 0; o < d_out; o++) {
        if (o + AHEAD < d_out) {
            ahead(q + ((o + AHEAD) * nb + k0) * 32, (k1 - k0) * 32);
            ahead(s + (o + AHEAD) * nb + k0, (k1 - k0) * 4);
        }
        for (int64_t k = k0; k < k1; k++) {
            #define BWD(m) bwd_step(m, g + o, d_out, q + (o * nb + k) * 32, s[o * nb + k], code, \
                                    rb, dx + k * BLK, d_in)
            BY_ROWS(BWD)
            #undef BWD
        }
    }
}

/* dx[:, k0*BLK .. k1*BLK) (n rows, ldx d_in) += g (n rows, ldg d_out) @ W over those blocks of
   every row of W, each block decoded once for all n rows; the blocks in chunks whose n rows of dx
   stay in L1 (KEEP_DX bytes) while the rows of W pass, in increasing order */
#define KEEP_DX (32 << 10)
static void bwd_all_rows(int64_t n, const float* g, int64_t d_out, int64_t nb, int64_t k0,
                         int64_t k1, const uint8_t* q, const float* s, const float* code, int rb,
                         float* dx, int64_t d_in) {
    const int64_t chunk = n * BLK * 4 >= KEEP_DX ? 1 : KEEP_DX / (n * BLK * 4);
    float w64[BLK];
    for (int64_t c0 = k0; c0 < k1; c0 += chunk) {
        const int64_t c1 = c0 + chunk < k1 ? c0 + chunk : k1;
        for (int64_t o = 0; o < d_out; o++) {
            if (o + AHEAD < d_out) {
                ahead(q + ((o + AHEAD) * nb + c0) * 32, (c1 - c0) * 32);
                ahead(s + (o + AHEAD) * nb + c0, (c1 - c0) * 4);
            }
            for (int64_t k = c0; k < c1; k++) {
                decode_block(q + (o * nb + k) * 32, s[o * nb + k], code, rb, w64);
                bwd_decoded(n, g + o, d_out, w64, dx + k * BLK, d_in);
            }
        }
    }
}

/* dx (n, d_in) = g (n, d_out) @ W; 1 where a scale is not finite (dx unwritten). Up to GROUP
   rows each block of W is decoded in registers per GROUP rows (W streamed once, as stored);
   more rows share one decode of each block (bwd_all_rows) */
int nf4_grad_input(int64_t n, int64_t d_out, int64_t d_in, const float* restrict g,
                   const uint8_t* restrict q, const float* restrict s, const float* restrict code,
                   int rb, float* restrict dx, int threads) {
    const int64_t nb = d_in / BLK;
    if (bad_scales(d_out * nb, s)) return 1;
    memset(dx, 0, (size_t)(n * d_in) * sizeof(float));
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++) {   /* thread t: the blocks [k0, k1) of every row */
        const int64_t k0 = nb * t / threads, k1 = nb * (t + 1) / threads;
        if (n > GROUP) {
            bwd_all_rows(n, g, d_out, nb, k0, k1, q, s, code, rb, dx, d_in);
            continue;
        }
        for (int64_t r0 = 0; r0 < n; r0 += GROUP) {
            const int R = (int)(n - r0 < GROUP ? n - r0 : GROUP);
            bwd_blocks(R, g + r0 * d_out, d_out, nb, k0, k1, q, s, code, rb, dx + r0 * d_in,
                       d_in);
        }
    }
    return 0;
}
"""

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGS = [_I64, _I64, _I64, _P, _P, _P, _P, _I32, _P, _I32]
# multiply-adds a thread takes at least: a small product runs on one (waking another costs more)
WORK_PER_THREAD = 1 << 20
# rows a product runs on one thread up to: the kernels read and decode the codes once, so such a
# product's time is one pass over the codes and its rows' multiply-adds, a few milliseconds for an
# expert; a second thread would halve that on an idle core, but each product is then
# one OpenMP region whose wake-up and end barrier put the compute thread to sleep and back (a
# futex each) while the engine's fetch, issue and I/O threads take the other core: a 30B step at
# 32 tokens routes 1-32 rows to an expert, and on one thread each its step ran 4 % faster with
# ~640 fewer sleeps of the compute thread (examples/train_larger_than_ram.py, 8 layers)
ONE_THREAD_ROWS = 32


def threads(rows: int, work: int) -> int:
    """The threads a product of ``rows`` rows and ``work`` multiply-adds runs on: torch's, fewer
    where it is small, one up to ``ONE_THREAD_ROWS`` rows."""
    if rows <= ONE_THREAD_ROWS:
        return 1
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
