"""The AVX2 (with FMA) version of the NF4 kernels' block steps (``nf4_blocks.BLOCKS`` joins it
between the AVX-512 and the scalar versions): a block of 64 weights as 8 registers of 8, the table
of a block's 16 weights as two halves chosen by bit 3 of a code (``expand``), and where the rows
share a decode, multiply-adds in register tiles (``fwd_tile``: 2 rows of x by 3 decoded rows of W;
``bwd_half_rows``: half a block of 2 rows of dx held across a run of rows of W) so that a load feeds
several FMAs: ``TILES``, which the AVX-512 build runs too (``HSUM2`` their lanes' sum). The same
fused multiply-adds in the same order as the other versions: the same bits.
"""

AVX2 = r"""
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
        /* each byte d in a 64-bit lane; its low half d >> 4 (the high nibble, element 2i), its
           high half d (element 2i + 1: vpermps reads bits 0-2, the blend bit 3: the low
           nibble's) */
        uint32_t b4;
        memcpy(&b4, q + 4 * c, 4);
        const __m256i d = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128((int)b4));
        const __m256i k = _mm256_or_si256(_mm256_srli_epi64(d, 4), _mm256_slli_epi64(d, 32));
        const __m256 top = _mm256_castsi256_ps(_mm256_slli_epi32(k, 28));
        w[c] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, k),
                                _mm256_permutevar8x32_ps(t1, k), top);
    }
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

"""

# two registers of 8 lanes summed as the 16 lanes of one output: lanes l + l+8, then + 4, + 2, + 1
HSUM2 = r"""
static inline float hsum2(__m256 lo, __m256 hi) {
    const __m256 h = _mm256_add_ps(lo, hi);
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 r = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)));
}
"""

# the tiles of the rows that share a decode (the AVX2 and the AVX-512 builds: on Zen 5 they ran an
# expert at 32 rows 2.3x as fast as one row of W at a time in 16-lane registers)
TILES = r"""
/* more than GROUP rows forward: tiles of FWD_X rows of x by FWD_W decoded rows of W, each
   output its two accumulators (lanes 0-7, 8-15) in fwd_row's order: 12 registers, the
   tile's x vectors 2 and a W vector 1. A vector of x read serves 3 FMAs, a vector of W 2 (one
   row of x against one of W took a load an FMA) */
#define FWD_W 3
#define FWD_X 2
/* columns a forward chunk runs: its FWD_W rows of W (12 KB) stay in L1 while the rows of x
   pass (a whole row of W and a group of rows of x were more than L1 at d_in 2048) */
#define FWD_KC 1024
/* groups of FWD_X rows of x whose accumulators wait in memory between chunks (6 KB) */
#define FWD_BATCH 16

/* a tile's R <= FWD_X rows of x (ldx) against M <= FWD_W decoded rows of W (ldw) over len
   columns (a multiple of 16): acc[r][m][0] and [1] carry output (r, m)'s lanes 0-7 and 8-15 */
static inline __attribute__((always_inline)) void fwd_tile(
        int R, int M, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t len,
        __m256 (*acc)[FWD_W][2]) {
    __m256 a[FWD_X][FWD_W][2];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) a[r][m][0] = acc[r][m][0], a[r][m][1] = acc[r][m][1];
    for (int64_t j = 0; j < len; j += 16)
        for (int h = 0; h < 2; h++) {   /* lanes 0-7, then 8-15 */
            __m256 xv[FWD_X];
            for (int r = 0; r < R; r++) {
                xv[r] = _mm256_loadu_ps(x + r * ldx + j + h * 8);
                __asm__("" : "+x"(xv[r]));   /* in a register: not reloaded for each row of W */
            }
            for (int m = 0; m < M; m++) {
                __m256 wv = _mm256_loadu_ps(w + m * ldw + j + h * 8);
                __asm__("" : "+x"(wv));   /* in a register: not reloaded for each row of x */
                for (int r = 0; r < R; r++) a[r][m][h] = _mm256_fmadd_ps(xv[r], wv, a[r][m][h]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m][0] = a[r][m][0], acc[r][m][1] = a[r][m][1];
}

/* y's n rows (ldy), columns 0 .. M = x's n rows (ldx) @ M <= FWD_W decoded rows of W (w, ldw
   apart, nb blocks each), each output fwd_row's sum: the columns in chunks of FWD_KC,
   each chunk passed by up to FWD_BATCH tiles of rows of x, whose accumulators wait in acc */
#define TILE_M(r) switch (M) { case 1: TILE(r, 1); break; case 2: TILE(r, 2); break; \
                               default: TILE(r, 3); }
static inline void fwd_rows_decoded(int64_t n, int M, const float* x, int64_t ldx,
                                    const float* w, int64_t ldw, int64_t nb, float* y,
                                    int64_t ldy) {
    __m256 acc[FWD_BATCH][FWD_X][FWD_W][2];
    for (int64_t b0 = 0; b0 < n; b0 += FWD_BATCH * FWD_X) {
        const int64_t rows = n - b0 < FWD_BATCH * FWD_X ? n - b0 : FWD_BATCH * FWD_X;
        const int64_t tiles = (rows + FWD_X - 1) / FWD_X;
        for (int64_t t = 0; t < tiles; t++)
            for (int r = 0; r < FWD_X; r++)
                for (int m = 0; m < FWD_W; m++)
                    acc[t][r][m][0] = acc[t][r][m][1] = _mm256_setzero_ps();
        for (int64_t j0 = 0; j0 < nb * BLK; j0 += FWD_KC) {
            const int64_t len = nb * BLK - j0 < FWD_KC ? nb * BLK - j0 : FWD_KC;
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t r0 = b0 + t * FWD_X;
                #define TILE(r, m) fwd_tile(r, m, x + r0 * ldx + j0, ldx, w + j0, ldw, len, \
                                            acc[t])
                if (n - r0 >= 2) { TILE_M(2) } else { TILE_M(1) }
                #undef TILE
            }
        }
        for (int64_t r = 0; r < rows; r++)
            for (int m = 0; m < M; m++) {
                const __m256* out = acc[r / FWD_X][r % FWD_X][m];
                y[(b0 + r) * ldy + m] = hsum2(out[0], out[1]);
            }
    }
}
#undef TILE_M

/* from BWD_SHARED rows backward: the rows of W in runs of BWD_O (their blocks at a column
   decoded into an 8 KB buffer), each pair of rows of dx holding half a block (8 registers)
   across a run: a load and a store of dx per BWD_O FMAs (a pair a load and store an FMA before),
   a vector of W read serving both rows; at 4 rows this beats a decode in registers per block */
#define BWD_O 32
#define BWD_SHARED 4

/* dx's R <= 2 rows' half h of a block (ldx) += g's (ldg) columns 0 .. O times the half of O
   decoded blocks (w, BLK apart), in increasing o */
static inline __attribute__((always_inline)) void bwd_half_rows(
        int R, int h, int O, const float* g, int64_t ldg, const float* w, float* dx,
        int64_t ldx) {
    __m256 acc[2][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_loadu_ps(dx + r * ldx + h * 32 + c * 8);
    for (int i = 0; i < O; i++) {
        __m256 gv[2];
        for (int r = 0; r < R; r++) gv[r] = _mm256_set1_ps(g[r * ldg + i]);
        for (int c = 0; c < 4; c++) {
            __m256 wv = _mm256_loadu_ps(w + i * BLK + h * 32 + c * 8);
            __asm__("" : "+x"(wv));   /* in a register: not reloaded for each row */
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(gv[r], wv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(dx + r * ldx + h * 32 + c * 8, acc[r][c]);
}

/* dx's n rows (ldx) += g's (ldg) columns 0 .. O times O <= BWD_O decoded blocks (w, BLK apart):
   each dx element's terms in increasing o, as bwd_step one block at a time adds them */
static inline void bwd_decoded_run(int64_t n, int O, const float* g, int64_t ldg,
                                   const float* w, float* dx, int64_t ldx) {
    for (int64_t r = 0; r < n; r += 2)
        for (int h = 0; h < 2; h++) {
            const float* gr = g + r * ldg;
            if (n - r >= 2) bwd_half_rows(2, h, O, gr, ldg, w, dx + r * ldx, ldx);
            else bwd_half_rows(1, h, O, gr, ldg, w, dx + r * ldx, ldx);
        }
}

"""
