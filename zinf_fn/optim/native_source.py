"""The C source of the compressed AdamW kernels (built by ``optim.native``; kept as a string so it
ships with the package). Strict IEEE fp32: built without -ffast-math and with -ffp-contract=off, so
every operation rounds once, as the plain-torch twin's (``optim.kernels``) do, and the results are
bitwise theirs.

One pass per piece. bf16: a thread takes 4096 elements at a time and updates them in registers.
int8: the piece's blocks of 256 are cut into contiguous ranges (16 a thread where the piece is
large enough), which the threads take as they come free, so a thread another process delays leaves
its ranges to the others instead of them spinning at the end. A thread runs a range as a pipeline,
a chunk of 32 elements at a time: it decodes the chunk's moments, updates the chunk in registers
and, beside it, encodes the same chunk of the previous block, whose absmax is known by then, so
the divider's work (two divisions and a square root an element) and the encode's overlap;
the master, gradient and codes are prefetched a few blocks ahead, a prefetch a cache line. The
chunk step is written per instruction set (``optim.native_chunks``: AVX-512, AVX2, scalar), chosen
at build time. The nearest code is one table lookup and one add per element, keyed by the 16-bit
prefix of the scaled value (``native.code_luts``): scalar loads on AVX2 (whose gathers are slow on
AMD Zen 3: ``native_portable`` says why); AVX-512 counts it from the map's even spacing instead,
the table only near a midpoint (``native_chunks``, ``optim.code_regions``).
"""

from ..native import BITS
from .code_regions import BINADE_LO, NEAR, OFFSETS, WORDS
from .native_chunks import CHUNKS

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
""" + BITS + r"""
#define BLOCK 256
#define CHUNK 32      /* elements a step of the int8 pipeline takes (two AVX-512 registers) */
#define KEYS 0x3F81   /* 16-bit prefixes of |y| <= 1.0 (0x3F80 is 1.0's) */
#define KEY_LO 0x3400 /* prefixes below it (|y| < 1.2e-7) hold no midpoint of either map: they share one entry */
#define NK (KEYS - KEY_LO)   /* table entries per sign of a map */
#define BINADE_LO """ + str(BINADE_LO) + r"""   /* the arithmetic encode's binades (optim.code_regions) */
#define NEAR """ + f"{NEAR!r}f" + r"""   /* w this near an integer: the table decides (code_regions.NEAR) */
#define REGION_WORDS """ + str(WORDS) + r"""   /* a map's arithmetic-encode tables, after the nearest-code tables */
""" + "".join(f"#define AT_{k.upper()} {v}   /* (code_regions.OFFSETS) */\n" for k, v in OFFSETS.items()) + r"""#define DECODED 64    /* elements decode_ahead decodes at a time (where it does) */
/* elements the int8 pipeline prefetches its streams ahead (1 to 3 blocks measured alike, 4 blocks
   ~4 % slower, 12 blocks ~10 % slower, on this machine's 48 KB L1) */
#define AHEAD (2 * BLOCK)

/* s: 1 - lr wd, 1 - b1, b2, 1 - b2, sqrt(1 - b2^t), eps, lr / (1 - b1^t) (fp32, rounded by the caller) */
typedef struct { float decay, c1, b2, c2, bc2s, eps, step_size; } scalars;

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

/* the nearest code of y (y beyond [-1, 1] takes the end code, as y clamped would; a NaN, its
   sign's). A map's table entry for y's 16-bit prefix holds, in its high half, the number of
   midpoints below the prefix's smallest value, and in its low half a bias: adding y's low 16
   bits (y >= 0) carries into the high half, and subtracting them (y < 0) leaves it one larger,
   exactly where y lies above the one midpoint within the prefix (``native.code_luts``): the code
   is the high half of the result. Prefixes below KEY_LO hold no midpoint of either map and share
   one entry; those above 1.0's hold none either and share 1.0's (so no clamp is needed); the
   unsigned map has no midpoint below 0, so a negative y (or -0, or a NaN with the sign bit) is
   its code 0. */
static inline uint8_t encode(float y, const uint32_t* lut, const int is_signed) {
    uint32_t u = f2u(y), key = (u >> 16) & 0x7FFF, negative = u >> 31;
    if (negative && !is_signed) return 0;
    key = (key > KEYS - 1 ? KEYS - 1 : (key < KEY_LO ? KEY_LO : key)) - KEY_LO + (negative ? NK : 0);
    uint32_t entry = lut[key], low = u & 0xFFFFu;
    return (uint8_t)((negative ? entry - low : entry + low) >> 16);
}

/* elements i of a piece; master: fp32 p (copy16 optional) when REMAINDER is 0, else hi + rem.
   DECAY_MASK: mask[i] == 0 takes no decay. The flags are constants in each caller: gcc specialises. */
#define MASTER_IO(REMAINDER)                                                                           \
    float x = REMAINDER ? u2f(((uint32_t)hi[i] << 16) + (uint32_t)(int32_t)rem[i]) : p[i];

#define MASTER_STORE(REMAINDER, COPY)                                                                  \
    if (REMAINDER) { hi[i] = bf16_round(x, 0x8000); rem[i] = (int16_t)(f2u(x) & 0xFFFFu); }           \
    else { p[i] = x; if (COPY) copy16[i] = bf16_round(x, 0x8000); }

#define INLINE static inline __attribute__((always_inline))   /* 6 specialised copies each: keep them vectorised */

""" + CHUNKS + r"""
/* the int8 pipeline's input streams, AHEAD elements on (the hardware prefetcher alone leaves loads
   waiting), a prefetch a cache line: a chunk's fp32 is two lines, its 16-bit halves one each, and a
   line of codes holds two chunks' */
#define PREFETCH_AHEAD(i) { const int64_t k = (i) + AHEAD;                                      \
    __builtin_prefetch(g + k); __builtin_prefetch(g + k + 16);                                  \
    if (k % 64 == 0) { __builtin_prefetch(mq + k); __builtin_prefetch(vq + k); }                 \
    if (remainder) { __builtin_prefetch(hi + k); __builtin_prefetch(rem + k); }                  \
    else { __builtin_prefetch(p + k); __builtin_prefetch(p + k + 16); } }

/* the factor a block's values are scaled by before encoding: 1 / absmax (1e38 for an all-zero block) */
static inline float scale_of(float absmax) { return 1.0f / (absmax > 1e-38f ? absmax : 1e-38f); }

/* the moments of one block in fp32 while it is encoded: the block's absmaxes give the scales */
typedef struct { float m[BLOCK], v[BLOCK], m_scale, v_scale; } decoded;

INLINE void encode_moments(const decoded* restrict d, int j, uint8_t* restrict mq, uint8_t* restrict vq,
                           const uint32_t* restrict luts) {
    encode_chunk(d->m + j, d->m_scale, mq + j, luts, 1);
    encode_chunk(d->v + j, d->v_scale, vq + j, luts + 2 * NK, 0);
}

/* blocks [b0, b1), software-pipelined: while a block is decoded and updated a chunk at a time (bound by the
   divider), the previous block's moments are encoded (bound by the table lookups), chunk by chunk beside it */
INLINE void int8_range(int64_t b0, int64_t b1, const float* restrict g, float* restrict p, uint16_t* restrict hi,
                       int16_t* restrict rem, uint16_t* restrict copy16, uint8_t* restrict mq, float* restrict ma,
                       uint8_t* restrict vq, float* restrict va, const float* restrict codes,
                       const uint8_t* restrict planes, const uint32_t* restrict luts, scalars s,
                       const uint8_t* restrict mask, const int remainder, const int copy,
                       const int masked) {
    decoded d[2];
    for (int64_t b = b0; b < b1; b++) {
        decoded* restrict cur = &d[b & 1];
        const decoded* restrict prev = &d[(b & 1) ^ 1];
        const float am = ma[b], av = va[b];
        maxes mmax = {0}, vmax = {0};
        for (int j = 0; j < BLOCK; j += CHUNK) {
            PREFETCH_AHEAD(b * BLOCK + j)
            if (j % DECODED == 0)
                decode_ahead(b * BLOCK + j, mq, am, vq, av, planes, cur->m + j, cur->v + j);
            update_chunk(b * BLOCK + j, g, p, hi, rem, copy16, mq, am, vq, av, codes, s, mask,
                         cur->m + j, cur->v + j, &mmax, &vmax, remainder, copy, masked);
            if (b > b0) encode_moments(prev, j, mq + (b - 1) * BLOCK, vq + (b - 1) * BLOCK, luts);
        }
        cur->m_scale = scale_of(ma[b] = u2f(max_of(mmax)));
        cur->v_scale = scale_of(va[b] = u2f(max_of(vmax)));
    }
    for (int j = 0; b1 > b0 && j < BLOCK; j += CHUNK)   /* the last block's, with nothing beside it */
        encode_moments(&d[(b1 - 1) & 1], j, mq + (b1 - 1) * BLOCK, vq + (b1 - 1) * BLOCK, luts);
}

/* ranges of contiguous blocks (RANGES a thread, each of at least MIN_RANGE blocks where there are that
   many), taken by the threads as they come free: the pipeline runs along each; a thread that another
   process delays leaves its next ranges to the others, which take them instead of spinning at the end */
#define RANGES 16
#define MIN_RANGE 64
#define INT8_CASE(R, C, M)                                                                             \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")                              \
    for (int64_t r = 0; r < ranges; r++)                                                               \
        int8_range(blocks * r / ranges, blocks * (r + 1) / ranges, g, p, hi, rem, copy16, mq, ma, vq, va, \
                   codes, planes, luts, s, mask, R, C, M);

void adamw_int8(int64_t n, const float* g, float* p, uint16_t* hi, int16_t* rem, uint16_t* copy16,
                uint8_t* mq, float* ma, uint8_t* vq, float* va, const float* codes, const uint32_t* luts,
                const float* s_, const uint8_t* mask, int threads) {
    scalars s; memcpy(&s, s_, sizeof s);
    const int64_t blocks = n / BLOCK;
    int64_t ranges = blocks / MIN_RANGE < (int64_t)threads * RANGES ? blocks / MIN_RANGE : threads * RANGES;
    ranges = ranges < threads ? threads : ranges;
    uint8_t planes[2048] __attribute__((aligned(64)));   /* the code tables' bytes, if used */
    code_planes(codes, planes);
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

/* codes (n,) and absmax (n / BLOCK,) of fp32 x (n a multiple of BLOCK) on one map: what the update writes
   for moments of these values (format conversions and the tests use it) */
void int8_quantize(int64_t n, const float* restrict x, uint8_t* restrict q, float* restrict absmax,
                   const uint32_t* restrict lut, int is_signed, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n / BLOCK; b++) {
        uint32_t most = 0;
        for (int i = 0; i < BLOCK; i++) {
            uint32_t u = f2u(x[b * BLOCK + i]) & 0x7FFFFFFFu;
            most = u > most ? u : most;
        }
        const float scale = scale_of(absmax[b] = u2f(most));
        for (int64_t j = b * BLOCK; j < (b + 1) * BLOCK; j += CHUNK) encode_chunk(x + j, scale, q + j, lut, is_signed);
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

/* out = x cast to bf16 as torch casts it (to nearest, ties to even; a NaN -> the bf16 bits nan16) and
   widened back to fp32, in one pass */
void round_bf16(int64_t n, const float* restrict x, float* restrict out, uint32_t nan16, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = f2u(x[i]);
        out[i] = u2f(x[i] != x[i] ? nan16 << 16 : bf16_nearest(u));
    }
}

void ties_away(int64_t n, const float* restrict x, uint16_t* restrict out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) out[i] = bf16_round(x[i], 0x8000);
}
"""
