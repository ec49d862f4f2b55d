"""The C source of the frozen weights' code kernels (built by ``formats.codebook_kernels``; kept as
a string so it ships with the package). Strict IEEE fp32 (``native.FLAGS``: no -ffast-math,
-ffp-contract=off): a product is rounded once, as torch's is, so the values are bitwise the twins'.

Decode runs a block's codes 64 at a time, written per instruction set, chosen at build time:

    AVX-512  NF4: the block's 16 values (``code[k] * absmax``, rounded to bfloat16 where asked) in
             one register, looked up for 16 codes by one ``vpermps`` (fp32 out) or for 32 codes by
             one ``vpermw`` of their bfloat16 halves (bf16 out); int8: a 16-lane gather of the
             code book, then the product
    AVX2     the same with 8 lanes (NF4: two ``vpermps`` of 8 values and a blend)
    scalar   one value at a time (any CPU; also a block's tail where it is not a multiple of 64)

A byte's two codes reach two neighbouring index lanes at once: the byte widened to twice the
lane's width, ``(byte >> 4) | (byte << lane bits)``, puts the high nibble in the even lane and the
whole byte in the odd one, whose top bits the lookups ignore (``vpermps`` reads an index's low 4
bits, ``vpermw`` 5, of a table written twice).

Encode takes fp32 or bfloat16 values: a block's absmax is an integer max of the values' bits (a
non-negative float's bits order as it does), and a code, the number of midpoints below the scaled
value, is (AVX-512) a binary search over the midpoints padded with +inf: 4 steps of ``vpermps`` for
NF4, 8 of gathers for int8; elsewhere a count over every midpoint.
"""

from ..native import BITS

_HEAD = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CODES_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__)
#define CODES_AVX2 1
#include <immintrin.h>
#endif

#define CH 64
"""

_ENCODE = r"""
/* m values from element e of x (fp32, or bfloat16 bits where bf16) as fp32, into v */
static inline void widen(const void* x, int bf16, int64_t e, int64_t m, float* restrict v) {
    if (bf16) {
        const uint16_t* h = (const uint16_t*)x + e;
        for (int64_t i = 0; i < m; i++) v[i] = u2f((uint32_t)h[i] << 16);
    } else {
        memcpy(v, (const float*)x + e, (size_t)m * sizeof(float));
    }
}

/* max |x| of the B values from element e on; -1 where one is not finite. A non-negative float's
   bits order as the float does, so the max is taken on them (an integer max, which vectorises) */
static float block_absmax(const void* x, int bf16, int64_t e, int64_t B) {
    uint32_t most = 0;
    if (bf16) {
        const uint16_t* h = (const uint16_t*)x + e;
        for (int64_t i = 0; i < B; i++) {
            const uint32_t a = ((uint32_t)h[i] << 16) & 0x7FFFFFFFu;
            most = a > most ? a : most;
        }
    } else {
        const float* f = (const float*)x + e;
        for (int64_t i = 0; i < B; i++) {
            const uint32_t a = f2u(f[i]) & 0x7FFFFFFFu;
            most = a > most ? a : most;
        }
    }
    return most > 0x7F7FFFFFu ? -1.0f : u2f(most);  /* above FLT_MAX's bits: inf or NaN */
}

/* the codes of m values s (scaled, clamped): the number of the n_mids midpoints below each */
static void count_scalar(const float* restrict s, int64_t m, const float* restrict mids,
                         int n_mids, uint8_t* restrict c) {
    for (int64_t i = 0; i < m; i++) c[i] = 0;
    for (int k = 0; k < n_mids; k++) {
        const float t = mids[k];
        for (int64_t i = 0; i < m; i++) c[i] += s[i] > t;
    }
}

#ifdef CODES_AVX512
/* count_scalar's codes of m values, 16 at a time by a binary search of 'steps' steps over the
   midpoints padded with +inf to 2^steps - 1 (or more): a code book of up to 16 codes looked up in
   one register (vpermps), a larger one gathered */
static void count_vector(const float* restrict s, int64_t m, const float* restrict mids,
                         int n_mids, uint8_t* restrict c) {
    int steps = 0;
    while ((1 << steps) - 1 < n_mids) steps++;
    const __m512 table = _mm512_loadu_ps(mids);
    const __m512i one = _mm512_set1_epi32(1);
    int64_t i = 0;
    for (; i + 16 <= m; i += 16) {
        const __m512 v = _mm512_loadu_ps(s + i);
        __m512i idx = _mm512_setzero_si512();
        for (int step = steps ? 1 << (steps - 1) : 0; step > 0; step >>= 1) {
            const __m512i next = _mm512_add_epi32(idx, _mm512_set1_epi32(step));
            const __m512i at = _mm512_sub_epi32(next, one);
            const __m512 t = steps <= 4 ? _mm512_permutexvar_ps(at, table)
                                        : _mm512_i32gather_ps(at, mids, 4);
            idx = _mm512_mask_mov_epi32(idx, _mm512_cmp_ps_mask(t, v, _CMP_LT_OQ), next);
        }
        _mm_storeu_si128((__m128i*)(c + i), _mm512_cvtepi32_epi8(idx));
    }
    if (i < m) count_scalar(s + i, m - i, mids, n_mids, c + i);
}
#define COUNT count_vector
#else
#define COUNT count_scalar
#endif

/* nb blocks of B values x (fp32, or bfloat16 bits where bf16): absmax[b] = max |x|, and a block's
   codes the number of the n_mids (sorted) midpoints below x * (1 / max(absmax, 1e-38)) clamped to
   [-1, 1] (mids padded with +inf to 256); packed two a byte, high nibble first, where nibbles (B
   even). 1 where a value is not finite (its block unwritten). */
int block_quantize(int64_t nb, int64_t B, const void* restrict x, int bf16,
                   const float* restrict mids, int n_mids, int nibbles, uint8_t* restrict q,
                   float* restrict absmax, int threads) {
    int bad = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(|:bad)
    for (int64_t b = 0; b < nb; b++) {
        const float most = block_absmax(x, bf16, b * B, B);
        if (most < 0.0f) { bad = 1; continue; }
        absmax[b] = most;
        const float inv = 1.0f / (most >= 1e-38f ? most : 1e-38f);
        for (int64_t j = 0; j < B; j += CH) {
            const int64_t m = B - j < CH ? B - j : CH;
            float s[CH];
            uint8_t c[CH];
            widen(x, bf16, b * B + j, m, s);
            for (int64_t i = 0; i < m; i++) {
                const float v = s[i] * inv;
                s[i] = v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v);
            }
            COUNT(s, m, mids, n_mids, c);
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
"""

_SCALAR = r"""
/* One decode call's constants: the codes (two a byte, high first, where nibbles), the code book,
   whether a value is rounded to bfloat16 (always where written as bfloat16), the output. */
typedef struct {
    const uint8_t* q; const float* code; void* out; int nibbles, round, out_bf16;
} job;

/* the m values from element e on, all of one block (scale a), one at a time */
static void chunk_scalar(const job* J, int64_t e, int64_t m, float a) {
    float v[CH];
    if (J->nibbles) {
        const uint8_t* qb = J->q + e / 2;
        for (int64_t i = 0; i < m / 2; i++) {
            v[2 * i] = J->code[qb[i] >> 4] * a;
            v[2 * i + 1] = J->code[qb[i] & 15] * a;
        }
    } else {
        for (int64_t i = 0; i < m; i++) v[i] = J->code[J->q[e + i]] * a;
    }
    if (J->round)
        for (int64_t i = 0; i < m; i++) v[i] = u2f(bf16_nearest(f2u(v[i])));
    if (J->out_bf16) {
        uint16_t* o = (uint16_t*)J->out + e;
        for (int64_t i = 0; i < m; i++) o[i] = (uint16_t)(f2u(v[i]) >> 16);
    } else {
        memcpy((float*)J->out + e, v, (size_t)m * sizeof(float));
    }
}
"""

_AVX512 = r"""
#ifdef CODES_AVX512
/* bf16_nearest of each lane */
static inline __m512i round512(__m512i u) {
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u));
}

/* 64 NF4 values from element e on; lut: the block's 16 values' bits (rounded where J->round) */
static inline void nf4_64(const job* J, int64_t e, __m512i lut) {
    const uint8_t* qb = J->q + e / 2;
    if (J->out_bf16) {  /* the 16 bfloat16 halves twice over: vpermw reads 5 bits of an index */
        const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(lut, 16));
        const __m512i table = _mm512_inserti64x4(_mm512_castsi256_si512(half), half, 1);
        uint16_t* o = (uint16_t*)J->out + e;
        for (int k = 0; k < 2; k++) {  /* 16 bytes: 32 codes, a byte's two in one 32-bit lane */
            const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qb + 16 * k)));
            const __m512i idx = _mm512_or_si512(_mm512_srli_epi32(d, 4), _mm512_slli_epi32(d, 16));
            _mm512_storeu_si512(o + 32 * k, _mm512_permutexvar_epi16(idx, table));
        }
        return;
    }
    const __m512 values = _mm512_castsi512_ps(lut);
    float* o = (float*)J->out + e;
    for (int k = 0; k < 4; k++) {  /* 8 bytes: 16 codes */
        const __m512i d = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i*)(qb + 8 * k)));
        const __m512i idx = _mm512_or_si512(_mm512_srli_epi64(d, 4), _mm512_slli_epi64(d, 32));
        _mm512_storeu_ps(o + 16 * k, _mm512_permutexvar_ps(idx, values));
    }
}

/* 64 values of a code a byte from element e on, scale a: the code book gathered, times a */
static inline void int8_64(const job* J, int64_t e, float a) {
    const __m512 scale = _mm512_set1_ps(a);
    for (int k = 0; k < 4; k++) {
        const __m128i bytes = _mm_loadu_si128((const __m128i*)(J->q + e + 16 * k));
        const __m512i idx = _mm512_cvtepu8_epi32(bytes);
        __m512i u = _mm512_castps_si512(
            _mm512_mul_ps(_mm512_i32gather_ps(idx, J->code, 4), scale));
        if (J->round) u = round512(u);
        if (J->out_bf16)
            _mm256_storeu_si256((__m256i*)((uint16_t*)J->out + e + 16 * k),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
        else
            _mm512_storeu_si512((float*)J->out + e + 16 * k, u);
    }
}

/* the block's values from element e on (B of them, scale a) */
static void block_vector(const job* J, int64_t e, int64_t B, float a) {
    int64_t j = 0;
    if (J->nibbles) {
        const __m512 values = _mm512_mul_ps(_mm512_loadu_ps(J->code), _mm512_set1_ps(a));
        __m512i lut = _mm512_castps_si512(values);
        if (J->round) lut = round512(lut);
        for (; j + CH <= B; j += CH) nf4_64(J, e + j, lut);
    } else {
        for (; j + CH <= B; j += CH) int8_64(J, e + j, a);
    }
    if (j < B) chunk_scalar(J, e + j, B - j, a);
}
#endif
"""

_AVX2 = r"""
#ifdef CODES_AVX2
/* bf16_nearest of each lane */
static inline __m256i round256(__m256i u) {
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u));
}

/* 8 values' bits to element e on: fp32, or their (rounded) bfloat16 halves */
static inline void store8(const job* J, int64_t e, __m256i u) {
    if (J->out_bf16) {
        const __m256i h = _mm256_srli_epi32(u, 16);  /* at most 0xFFFF: packs as it is */
        const __m128i low = _mm256_castsi256_si128(h), high = _mm256_extracti128_si256(h, 1);
        const __m128i w = _mm_packus_epi32(low, high);
        _mm_storeu_si128((__m128i*)((uint16_t*)J->out + e), w);
    } else {
        _mm256_storeu_si256((__m256i*)((float*)J->out + e), u);
    }
}

/* the 8 values code[first .. first + 7] * a, rounded where J->round */
static inline __m256 lut8(const job* J, int first, float a) {
    __m256i u = _mm256_castps_si256(
        _mm256_mul_ps(_mm256_loadu_ps(J->code + first), _mm256_set1_ps(a)));
    return _mm256_castsi256_ps(J->round ? round256(u) : u);
}

/* 64 NF4 values from element e on: vpermps of the low and the high 8 of the block's 16 values,
   the high where an index's bit 3 is set */
static inline void nf4_64(const job* J, int64_t e, __m256 low, __m256 high) {
    const uint8_t* qb = J->q + e / 2;
    for (int k = 0; k < 8; k++) {  /* 4 bytes: 8 codes */
        uint32_t w;
        memcpy(&w, qb + 4 * k, 4);
        const __m256i d = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128((int)w));
        const __m256i idx = _mm256_or_si256(_mm256_srli_epi64(d, 4), _mm256_slli_epi64(d, 32));
        const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, idx),
                                          _mm256_permutevar8x32_ps(high, idx),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
        store8(J, e + 8 * k, _mm256_castps_si256(v));
    }
}

/* 64 values of a code a byte from element e on, scale a: the code book gathered, times a */
static inline void int8_64(const job* J, int64_t e, float a) {
    const __m256 scale = _mm256_set1_ps(a);
    for (int k = 0; k < 8; k++) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i*)(J->q + e + 8 * k));
        const __m256i idx = _mm256_cvtepu8_epi32(bytes);
        const __m256i u = _mm256_castps_si256(
            _mm256_mul_ps(_mm256_i32gather_ps(J->code, idx, 4), scale));
        store8(J, e + 8 * k, J->round ? round256(u) : u);
    }
}

/* the block's values from element e on (B of them, scale a) */
static void block_vector(const job* J, int64_t e, int64_t B, float a) {
    int64_t j = 0;
    if (J->nibbles) {
        const __m256 low = lut8(J, 0, a), high = lut8(J, 8, a);
        for (; j + CH <= B; j += CH) nf4_64(J, e + j, low, high);
    } else {
        for (; j + CH <= B; j += CH) int8_64(J, e + j, a);
    }
    if (j < B) chunk_scalar(J, e + j, B - j, a);
}
#endif
"""

_DECODE = r"""
#if !defined(CODES_AVX512) && !defined(CODES_AVX2)
/* the block's values from element e on (B of them, scale a), 64 at a time */
static void block_vector(const job* J, int64_t e, int64_t B, float a) {
    for (int64_t j = 0; j < B; j += CH) chunk_scalar(J, e + j, B - j < CH ? B - j : CH, a);
}
#endif

/* nb blocks of B codes (two a byte, high first, where nibbles): code[c] * absmax[b], rounded to
   bfloat16 where round_bf16, written as bfloat16 bits (out_bf16) or fp32. 1 where an absmax is not
   finite (its block unwritten). */
int block_dequantize(int64_t nb, int64_t B, const uint8_t* restrict q, int nibbles,
                     const float* restrict absmax, const float* restrict code, int round_bf16,
                     void* restrict out, int out_bf16, int threads) {
    const job J = {q, code, out, nibbles, round_bf16 || out_bf16, out_bf16};
    int bad = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(|:bad)
    for (int64_t b = 0; b < nb; b++) {
        const float a = absmax[b];
        if (!(fabsf(a) <= FLT_MAX)) { bad = 1; continue; }
        block_vector(&J, b * B, B, a);
    }
    return bad;
}
"""

SOURCE = _HEAD + BITS + _ENCODE + _SCALAR + _AVX512 + _AVX2 + _DECODE
