"""The NF4 kernels' steps on one block of 64 weights (part of ``nf4_kernels.SOURCE``), one version
per instruction set, chosen at build time by what the compiler targets: AVX-512 (the block as 4
registers of 16), AVX2 with FMA (8 registers of 8) or scalar.

``table16`` makes a block's 16 possible weights, ``expand`` (``decode_block`` into memory) puts
each code's weight in its place; ``fwd_row`` runs up to ``GROUP`` rows of ``x`` against a row of W,
decoding its blocks as it goes; ``bwd_step`` adds a block's share of ``dx`` for up to ``GROUP`` rows
of ``g`` (``bwd_rows``). Every version makes the same fused multiply-adds in the same order
(``nf4_kernels`` gives it): all three give the same bits. The AVX2 version is
``nf4_blocks_avx2.AVX2``.

Where the rows share a decode the drivers call ``fwd_rows_decoded`` (all the rows of ``x`` against
``FWD_W`` decoded rows of W) and ``bwd_decoded_run`` (all the rows of ``dx`` plus ``BWD_O``
decoded blocks of consecutive rows of W, from ``BWD_SHARED`` rows). The AVX2 and AVX-512 builds
both run ``nf4_blocks_avx2.TILES`` there (``fwd_tile``: 2 rows of x by 3 of W, ``bwd_half_rows``:
half a block of 2 rows of dx held across the run, in registers of 8 lanes), so that a load feeds
several FMAs: on Zen 5, AVX-512's one row of W at a time in 16-lane registers (one load an FMA)
took 2.3x as long for an expert at 32 rows. The scalar build runs one row of W or one block at a
time (``fwd_row_decoded``, ``bwd_decoded``).
"""

from .nf4_blocks_avx2 import AVX2, HSUM2, TILES

BLOCKS = (
    r"""
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

"""
    + HSUM2
    + TILES
    + r"""
#elif defined(__AVX2__) && defined(__FMA__)"""
    + HSUM2
    + AVX2
    + TILES
    + r"""#else
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

#ifndef FWD_W
/* the path without tiles (scalar): one row of W at a time against GROUP rows of x forward, one
   decoded block at a time backward, from GROUP + 1 rows */
#define FWD_W 1
#define BWD_O 1
#define BWD_SHARED (GROUP + 1)
static inline void fwd_rows_decoded(int64_t n, int M, const float* x, int64_t ldx,
                                    const float* w, int64_t ldw, int64_t nb, float* y,
                                    int64_t ldy) {
    (void)M;
    (void)ldw;
    for (int64_t r0 = 0; r0 < n; r0 += GROUP) {
        const int R = (int)(n - r0 < GROUP ? n - r0 : GROUP);
        #define FWD_DECODED(k) fwd_row_decoded(k, x + r0 * ldx, ldx, w, nb, y + r0 * ldy, ldy)
        BY_ROWS(FWD_DECODED)
        #undef FWD_DECODED
    }
}
static inline void bwd_decoded_run(int64_t n, int O, const float* g, int64_t ldg,
                                   const float* w, float* dx, int64_t ldx) {
    (void)O;
    bwd_decoded(n, g, ldg, w, dx, ldx);
}
#endif
"""
)
