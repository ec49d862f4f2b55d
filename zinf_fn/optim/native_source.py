"""The C source of the compressed AdamW kernels (built by ``optim.native``; kept as a string so it ships
with the package). Strict IEEE fp32: built without -ffast-math and with -ffp-contract=off, so every
operation rounds once, as the plain-torch twin's (``optim.kernels``) do, and the results are bitwise theirs.

One pass per piece: a thread takes a block of 256 elements at a time, reads its gradient, master and
moments, updates them in registers, writes the master (and bf16 copy), and encodes the block's moments
(int8: the absmax of the updated block, then each element's code) while the block is in L1.
"""

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define BLOCK 256
#define KEYS 0x3F81   /* 16-bit prefixes of |x| <= 1.0 (0x3F80 is 1.0's) */

/* s: 1 - lr wd, 1 - b1, b2, 1 - b2, sqrt(1 - b2^t), eps, lr / (1 - b1^t) (fp32, rounded by the caller) */
typedef struct { float decay, c1, b2, c2, bc2s, eps, step_size; } scalars;

static inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

static inline uint32_t hash32(uint32_t x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x1B873593u; return x ^ (x >> 16);
}

/* x's bits plus noise, truncated to bf16 (noise 0x8000: round to nearest, ties away); NaN -> 0x7FC0 */
static inline uint16_t bf16_round(float x, uint32_t noise) {
    uint16_t hi = (uint16_t)((f2u(x) + noise) >> 16);
    return x != x ? 0x7FC0 : hi;
}

/* the AdamW step of one element (torch's fused AdamW formula and order; each operation rounded once) */
static inline float adamw(float p, float g, float* m, float* v, scalars s, float decay) {
    p = p * decay;
    *m = *m + s.c1 * (g - *m);
    *v = *v * s.b2 + s.c2 * g * g;
    float denom = sqrtf(*v) / s.bc2s + s.eps;
    return p - s.step_size * *m / denom;
}

/* the nearest code of y in [-1, 1]: lut holds, per 16-bit prefix of y (|y|'s prefix, then the negative
   ones), the number of midpoints below the prefix's smallest value; at most one more lies within it */
static inline uint8_t encode(float y, const uint8_t* lut, const float* bounds) {
    uint32_t u = f2u(y), key = (u >> 16) & 0x7FFF;
    key = (key > KEYS - 1 ? KEYS - 1 : key) + ((u >> 31) ? KEYS : 0);
    int32_t c = lut[key];
    return (uint8_t)(c + (bounds[c] < y));
}

static inline float clamp1(float y) { return y < -1.0f ? -1.0f : (y > 1.0f ? 1.0f : y); }

/* x[i] = code[q[i]] * absmax for a block; AVX-512: a 256-entry lookup as 8 two-table permutes and a
   select on the index's high 3 bits (no gathers), the same product */
static inline void decode_block(const uint8_t* restrict q, float absmax, const float* restrict code,
                                float* restrict x) {
#ifdef __AVX512F__
    __m512 t[16];
    for (int k = 0; k < 16; k++) t[k] = _mm512_loadu_ps(code + 16 * k);
    const __m512 am = _mm512_set1_ps(absmax);
    for (int i = 0; i < BLOCK; i += 16) {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + i)));
        __m512 r[8];
        for (int k = 0; k < 8; k++) r[k] = _mm512_permutex2var_ps(t[2 * k], c, t[2 * k + 1]);
        __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
        __mmask16 b6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
        __mmask16 b7 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(128));
        __m512 q0 = _mm512_mask_blend_ps(b5, r[0], r[1]), q1 = _mm512_mask_blend_ps(b5, r[2], r[3]);
        __m512 q2 = _mm512_mask_blend_ps(b5, r[4], r[5]), q3 = _mm512_mask_blend_ps(b5, r[6], r[7]);
        __m512 lo = _mm512_mask_blend_ps(b6, q0, q1), hi = _mm512_mask_blend_ps(b6, q2, q3);
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_mask_blend_ps(b7, lo, hi), am));
    }
#else
    for (int i = 0; i < BLOCK; i++) x[i] = code[q[i]] * absmax;
#endif
}

/* q[i] = encode(clamp1(x[i] * scale)) for a block; AVX-512: 16 at a time with gathers, the same operations */
static inline void encode_block(const float* restrict x, float scale, uint8_t* restrict q,
                                const uint8_t* restrict lut, const float* restrict bounds) {
#ifdef __AVX512F__
    const __m512 sc = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-1.0f), hi = _mm512_set1_ps(1.0f);
    const __m512i low15 = _mm512_set1_epi32(0x7FFF), last = _mm512_set1_epi32(KEYS - 1);
    const __m512i negative = _mm512_set1_epi32(KEYS), one = _mm512_set1_epi32(1);
    for (int i = 0; i < BLOCK; i += 16) {
        __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x + i), sc);
        __mmask16 below = _mm512_cmp_ps_mask(y, lo, _CMP_LT_OQ), above = _mm512_cmp_ps_mask(y, hi, _CMP_GT_OQ);
        y = _mm512_mask_blend_ps(below, _mm512_mask_blend_ps(above, y, hi), lo);   /* clamp1, NaN kept */
        __m512i u = _mm512_castps_si512(y);
        __m512i key = _mm512_min_epu32(_mm512_and_si512(_mm512_srli_epi32(u, 16), low15), last);
        key = _mm512_mask_add_epi32(key, _mm512_cmplt_epi32_mask(u, _mm512_setzero_si512()), key, negative);
        /* byte table (L1-sized): gather 4 bytes at lut + key (the table is padded by 3), keep the first */
        __m512i c = _mm512_and_si512(_mm512_i32gather_epi32(key, (const void*)lut, 1), _mm512_set1_epi32(0xFF));
        __mmask16 up = _mm512_cmp_ps_mask(_mm512_i32gather_ps(c, bounds, 4), y, _CMP_LT_OQ);
        _mm_storeu_si128((__m128i*)(q + i), _mm512_cvtepi32_epi8(_mm512_mask_add_epi32(c, up, c, one)));
    }
#else
    for (int i = 0; i < BLOCK; i++) q[i] = encode(clamp1(x[i] * scale), lut, bounds);
#endif
}

/* one piece of elements [0, n); master: fp32 p (copy16 optional) when REMAINDER is 0, else hi + rem.
   DECAY_MASK: mask[i] == 0 takes no decay. The flags are constants in each caller: gcc specialises. */
#define MASTER_IO(REMAINDER)                                                                           \
    float x = REMAINDER ? u2f(((uint32_t)hi[i] << 16) + (uint32_t)(int32_t)rem[i]) : p[i];

#define MASTER_STORE(REMAINDER, COPY)                                                                  \
    if (REMAINDER) { hi[i] = bf16_round(x, 0x8000); rem[i] = (int16_t)(f2u(x) & 0xFFFFu); }           \
    else { p[i] = x; if (COPY) copy16[i] = bf16_round(x, 0x8000); }

#define INLINE static inline __attribute__((always_inline))   /* 6 specialised copies each: keep them vectorised */

INLINE void int8_block(int64_t b, const float* restrict g, float* restrict p, uint16_t* restrict hi,
                              int16_t* restrict rem, uint16_t* restrict copy16, uint8_t* restrict mq,
                              float* restrict ma, uint8_t* restrict vq, float* restrict va,
                              const float* restrict codes, const float* restrict bounds,
                              const uint8_t* restrict luts, scalars s, const uint8_t* restrict mask,
                              const int remainder, const int copy, const int masked) {
    float m[BLOCK], v[BLOCK];
    const float am = ma[b], av = va[b];
    uint32_t mmax = 0, vmax = 0;   /* max |.| as bits: for non-negative floats, integer order is float order */
    g += b * BLOCK; mq += b * BLOCK; vq += b * BLOCK;
    if (remainder) { hi += b * BLOCK; rem += b * BLOCK; } else { p += b * BLOCK; if (copy) copy16 += b * BLOCK; }
    if (masked) mask += b * BLOCK;
    decode_block(mq, am, codes, m);
    decode_block(vq, av, codes + 256, v);
    for (int i = 0; i < BLOCK; i++) {
        MASTER_IO(remainder)
        x = adamw(x, g[i], &m[i], &v[i], s, (masked && !mask[i]) ? 1.0f : s.decay);
        MASTER_STORE(remainder, copy)
        uint32_t um = f2u(m[i]) & 0x7FFFFFFFu, uv = f2u(v[i]) & 0x7FFFFFFFu;
        mmax = um > mmax ? um : mmax;
        vmax = uv > vmax ? uv : vmax;
    }
    const float mmaxf = u2f(mmax), vmaxf = u2f(vmax);
    const float ms = 1.0f / (mmaxf > 1e-38f ? mmaxf : 1e-38f), vs = 1.0f / (vmaxf > 1e-38f ? vmaxf : 1e-38f);
    encode_block(m, ms, mq, luts, bounds);
    encode_block(v, vs, vq, luts + 2 * KEYS, bounds + 256);
    ma[b] = mmaxf;
    va[b] = vmaxf;
}

#define INT8_CASE(R, C, M)                                                                             \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                  \
    for (int64_t b = 0; b < n / BLOCK; b++)                                                            \
        int8_block(b, g, p, hi, rem, copy16, mq, ma, vq, va, codes, bounds, luts, s, mask, R, C, M);

void adamw_int8(int64_t n, const float* g, float* p, uint16_t* hi, int16_t* rem, uint16_t* copy16,
                uint8_t* mq, float* ma, uint8_t* vq, float* va, const float* codes, const float* bounds,
                const uint8_t* luts, const float* s_, const uint8_t* mask, int threads) {
    scalars s; memcpy(&s, s_, sizeof s);
    int mode = (p == 0) * 4 + (copy16 != 0) * 2 + (mask != 0);
    switch (mode) {
        case 0: INT8_CASE(0, 0, 0) break;
        case 1: INT8_CASE(0, 0, 1) break;
        case 2: INT8_CASE(0, 1, 0) break;
        case 3: INT8_CASE(0, 1, 1) break;
        case 4: INT8_CASE(1, 0, 0) break;
        default: INT8_CASE(1, 0, 1) break;
    }
}

INLINE void bf16_range(int64_t lo, int64_t hi_, const float* restrict g, float* restrict p,
                              uint16_t* restrict hi, int16_t* restrict rem, uint16_t* restrict copy16,
                              uint16_t* restrict m16, uint16_t* restrict v16, uint32_t key, int64_t offset,
                              scalars s, const uint8_t* restrict mask, const int remainder, const int copy,
                              const int masked) {
    for (int64_t i = lo; i < hi_; i++) {
        float m = u2f((uint32_t)m16[i] << 16), v = u2f((uint32_t)v16[i] << 16);
        MASTER_IO(remainder)
        x = adamw(x, g[i], &m, &v, s, (masked && !mask[i]) ? 1.0f : s.decay);
        MASTER_STORE(remainder, copy)
        uint32_t h = hash32(((uint32_t)(offset + i)) ^ key);
        m16[i] = bf16_round(m, h & 0xFFFFu);
        v16[i] = bf16_round(v, h >> 16);
    }
}

#define BF16_CASE(R, C, M)                                                                             \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                  \
    for (int64_t b = 0; b < chunks; b++) {                                                             \
        int64_t lo = b * 4096, end = lo + 4096 < n ? lo + 4096 : n;                                    \
        bf16_range(lo, end, g, p, hi, rem, copy16, m16, v16, key, offset, s, mask, R, C, M);           \
    }

void adamw_bf16(int64_t n, const float* g, float* p, uint16_t* hi, int16_t* rem, uint16_t* copy16,
                uint16_t* m16, uint16_t* v16, uint32_t key, int64_t offset, const float* s_,
                const uint8_t* mask, int threads) {
    scalars s; memcpy(&s, s_, sizeof s);
    int64_t chunks = (n + 4095) / 4096;
    int mode = (p == 0) * 4 + (copy16 != 0) * 2 + (mask != 0);
    switch (mode) {
        case 0: BF16_CASE(0, 0, 0) break;
        case 1: BF16_CASE(0, 0, 1) break;
        case 2: BF16_CASE(0, 1, 0) break;
        case 3: BF16_CASE(0, 1, 1) break;
        case 4: BF16_CASE(1, 0, 0) break;
        default: BF16_CASE(1, 0, 1) break;
    }
}

/* the remainder format around torch's fused fp32 update: join before it, split (or the copy) after */
void remainder_join(int64_t n, const uint16_t* restrict hi, const int16_t* restrict rem, float* restrict out,
                    int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) out[i] = u2f(((uint32_t)hi[i] << 16) + (uint32_t)(int32_t)rem[i]);
}

void remainder_split(int64_t n, const float* restrict x, uint16_t* restrict hi, int16_t* restrict rem,
                     int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        hi[i] = bf16_round(x[i], 0x8000);
        rem[i] = (int16_t)(f2u(x[i]) & 0xFFFFu);
    }
}

void ties_away(int64_t n, const float* restrict x, uint16_t* restrict out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) out[i] = bf16_round(x[i], 0x8000);
}
"""
