"""The int8 pipeline's chunk step in C (part of ``native_source.SOURCE``), one version per
instruction set, chosen at build time by what the compiler targets: AVX-512 (two registers of 16
lanes), AVX2 (registers of 8 lanes) or scalar.

A chunk is 32 elements. ``update_chunk`` takes its decoded moments (decoded ahead by byte permutes
of the code tables, ``decode_ahead``, where AVX-512 VBMI is there; else looked up in the 1 KiB
code table), runs the AdamW step in registers, stores the master and hands the new moments on
(for the encode, beside the next block) with their running |max|; ``encode_chunk`` writes the
codes of 32 scaled values (with VBMI one byte permute packs both registers' codes); ``max_of``
reduces a block's running max. AVX-512 joins a remainder master's two 16-bit halves into fp32 (and
splits it back) by word permutes over the chunk's 32 lanes. Every version runs the scalar
``adamw``'s operations in their order, each correctly rounded (vector division and square root
included), and writes ``encode``'s codes: all three give the same bits.

The table lookups were the pipeline's cost beside the divider: four an element (decode m and v,
encode m and v). AVX-512 decodes by byte permutes (VBMI; else gathers) and encodes without a
lookup: ``code_fast`` counts the midpoints below |y| from the even spacing of the map's codes
within a decade (``optim.code_regions``: a binade's region, one compare, a product, a floor, five
register permutes of small tables), and only the lanes within 2^-12 of a midpoint's place (about
1 value in 2,000) take the nearest-code table (``code_by_table``: a gather of ``native.code_luts``
under a branch that is rarely taken). On Zen 5 the gathers were half the update's time
(BENCHMARKS.md). The AVX2 and scalar versions are ``native_portable``'s (AVX2 reads its tables by
scalar loads: it says why).
"""

from .native_portable import AVX2, NO_DECODE_AHEAD, SCALAR


def _table(values) -> str:
    """C initialiser text of ``values``."""
    return ", ".join(str(v) for v in values)


BYTE0 = _table((4 * k) & 127 for k in range(64))
JOIN0 = _table(k // 2 + (32 if k % 2 else 0) for k in range(32))
JOIN1 = _table(16 + k // 2 + (32 if k % 2 else 0) for k in range(32))
EVEN = _table(2 * k for k in range(32))
ODD = _table(2 * k + 1 for k in range(32))

AVX512 = r"""
/* running max |.| as bits, per lane: for non-negative floats, integer order is float order */
typedef __m512i maxes;

static inline uint32_t max_of(maxes x) { return _mm512_reduce_max_epu32(x); }

/* the code of y (16 lanes) by the table, as encode(): in each lane's byte 2 (the other bytes are not
   the code's). The unsigned map's key is the whole prefix: a negative y's (sign bit set) clamps to
   the last entry, then its code is 0 */
static inline __m512i code_by_table(__m512i u, const uint32_t* restrict lut, const int is_signed) {
    __m512i low = _mm512_and_si512(u, _mm512_set1_epi32(0xFFFF));
    __mmask16 negative = _mm512_movepi32_mask(u);
    __m512i key = is_signed ? _mm512_srli_epi32(_mm512_slli_epi32(u, 1), 17)
                            : _mm512_srli_epi32(u, 16);
    /* clamp to [KEY_LO, KEYS - 1], less KEY_LO: the 16-bit saturating subtract floors at 0 */
    key = _mm512_subs_epu16(key, _mm512_set1_epi32(KEY_LO));
    key = _mm512_min_epu32(key, _mm512_set1_epi32(NK - 1));
    if (is_signed) key = _mm512_mask_add_epi32(key, negative, key, _mm512_set1_epi32(NK));
    __m512i entry = _mm512_i32gather_epi32(key, (const void*)lut, 4);
    if (!is_signed) return _mm512_maskz_add_epi32((__mmask16)~negative, entry, low);
    return _mm512_mask_sub_epi32(_mm512_add_epi32(entry, low), negative, entry, low);
}

/* the code of y (16 lanes) without a table lookup (``optim.code_regions``): the count of the map's
   midpoints between 0 and |y| from its region's even spacing, in each lane's byte 0; *slow marks
   the lanes it cannot answer (|y| >= 2, or w within NEAR of an integer: near a midpoint) */
static inline __m512i code_fast(__m512i u, const uint32_t* restrict t, const int is_signed,
                                __mmask16* slow) {
    const __m512i one = _mm512_set1_epi32(1);
    const float* restrict f = (const float*)t;
    __mmask16 negative = _mm512_movepi32_mask(u);
    __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    if (is_signed) a = _mm512_mask_add_epi32(a, negative, a, one);   /* <= |y| for y < 0 */
    /* binade (the permute reads its low 5 bits: a binade past 31 is |y| >= 2, slow) */
    __m512i binade = _mm512_subs_epu16(_mm512_srli_epi32(a, 23), _mm512_set1_epi32(BINADE_LO));
    __m512i r = _mm512_permutex2var_epi32(_mm512_loadu_si512(t + AT_REGION), binade,
                                          _mm512_loadu_si512(t + AT_REGION + 16));
    const __m512 x = _mm512_castsi512_ps(a);
    __m512 enter = _mm512_permutexvar_ps(r, _mm512_loadu_ps(f + AT_ENTER));
    r = _mm512_mask_add_epi32(r, _mm512_cmp_ps_mask(x, enter, _CMP_GT_OQ), r, one);
    __m512 inv = _mm512_permutexvar_ps(r, _mm512_loadu_ps(f + AT_INV));
    __m512 k = _mm512_permutexvar_ps(r, _mm512_loadu_ps(f + AT_K));
    __m512 w = _mm512_sub_ps(_mm512_mul_ps(x, inv), k);
    __m512 off = _mm512_reduce_ps(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);   /* w - round(w) */
    *slow = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x40000000))
          | _mm512_cmp_ps_mask(_mm512_abs_ps(off), _mm512_set1_ps(NEAR), _CMP_LT_OQ);
    __m512i floor = _mm512_cvt_roundps_epi32(w, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512i top = _mm512_permutexvar_epi32(r, _mm512_loadu_si512(t + AT_TOP));
    __m512i count = _mm512_min_epi32(floor, top);
    if (!is_signed) return _mm512_maskz_mov_epi32((__mmask16)~negative, count);
    const __m512i zero = _mm512_set1_epi32(127);   /* m's code of 0.0 */
    return _mm512_mask_sub_epi32(_mm512_add_epi32(zero, count), negative, zero,
                                 _mm512_min_epi32(count, zero));
}

/* encode(x[k] * scale) of 16 lanes, each in its lane's byte 0 (the bytes above it are not the
   code's): the arithmetic code, the table's in the lanes near a midpoint */
static inline __m512i code_bytes(const float* restrict x, __m512 scale,
                                 const uint32_t* restrict lut, const int is_signed) {
    __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x), scale));
    __mmask16 slow;
    __m512i code = code_fast(u, lut + (is_signed ? 3 * NK : NK + REGION_WORDS), is_signed, &slow);
    if (__builtin_expect(slow != 0, 0))
        code = _mm512_mask_srli_epi32(code, slow, code_by_table(u, lut, is_signed), 16);
    return code;
}

/* q[i] = encode(x[i] * scale) for CHUNK (32) elements: the two registers' code bytes packed by one
   byte permute (VBMI), else each narrowed */
static inline void encode_chunk(const float* restrict x, float scale, uint8_t* restrict q,
                                const uint32_t* restrict lut, const int is_signed) {
    const __m512 s = _mm512_set1_ps(scale);
    __m512i c0 = code_bytes(x, s, lut, is_signed), c1 = code_bytes(x + 16, s, lut, is_signed);
#ifdef __AVX512VBMI__
    /* byte 0 of each lane of c0, then of c1 */
    static const uint8_t byte0[64] = {""" + BYTE0 + r"""};
    __m512i codes = _mm512_permutex2var_epi8(c0, _mm512_loadu_si512(byte0), c1);
    _mm256_storeu_si256((__m256i*)q, _mm512_castsi512_si256(codes));
#else
    _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(c0));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(c1));
#endif
}

/* the word permutes that join and split the remainder master's halves over 32 lanes: the lanes'
   16-bit halves (low, high) interleaved from two registers of 32 words, and each taken back out */
static const uint16_t JOIN[2][32] = {{""" + JOIN0 + r"""},
                                     {""" + JOIN1 + r"""}};
static const uint16_t HALF[2][32] = {{""" + EVEN + r"""},
                                     {""" + ODD + r"""}};

/* x (fp32 master or hi + rem) of CHUNK (32) elements at i, as two registers. hi + rem is
   (hi << 16) + rem: a lane's low half is rem's bits, its high half hi less 1 where rem < 0 */
INLINE void load_master(int64_t i, const float* restrict p, const uint16_t* restrict hi,
                        const int16_t* restrict rem, const int remainder, __m512* x) {
    if (!remainder) {
        x[0] = _mm512_loadu_ps(p + i);
        x[1] = _mm512_loadu_ps(p + i + 16);
        return;
    }
    __m512i r = _mm512_loadu_si512(rem + i);
    __m512i h = _mm512_add_epi16(_mm512_loadu_si512(hi + i), _mm512_srai_epi16(r, 15));
    for (int k = 0; k < 2; k++)
        x[k] = _mm512_castsi512_ps(_mm512_permutex2var_epi16(r, _mm512_loadu_si512(JOIN[k]), h));
}

/* bf16_round(x, 0x8000) of the 32 lanes of x[0], x[1], as 16-bit values */
static inline __m512i ties_away32(const __m512* x) {
    const __m512i half = _mm512_set1_epi32(0x8000);
    __m512i u0 = _mm512_add_epi32(_mm512_castps_si512(x[0]), half);
    __m512i u1 = _mm512_add_epi32(_mm512_castps_si512(x[1]), half);
    __m512i h = _mm512_permutex2var_epi16(u0, _mm512_loadu_si512(HALF[1]), u1);
    __mmask32 nan = _mm512_kunpackw(_mm512_cmp_ps_mask(x[1], x[1], _CMP_UNORD_Q),
                                    _mm512_cmp_ps_mask(x[0], x[0], _CMP_UNORD_Q));
    return _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7FC0));
}

INLINE void store_master(int64_t i, const __m512* x, float* restrict p, uint16_t* restrict hi,
                         int16_t* restrict rem, uint16_t* restrict copy16, const int remainder,
                         const int copy) {
    if (remainder) {
        _mm512_storeu_si512(hi + i, ties_away32(x));
        __m512i low = _mm512_permutex2var_epi16(_mm512_castps_si512(x[0]),
                                                _mm512_loadu_si512(HALF[0]),
                                                _mm512_castps_si512(x[1]));
        _mm512_storeu_si512(rem + i, low);
        return;
    }
    _mm512_storeu_ps(p + i, x[0]);
    _mm512_storeu_ps(p + i + 16, x[1]);
    if (copy) _mm512_storeu_si512(copy16 + i, ties_away32(x));
}

/* the factor of each lane: s.decay, or 1 where mask[i] == 0 */
INLINE __m512 decay_of(int64_t i, scalars s, const uint8_t* restrict mask, const int masked) {
    __m512 decay = _mm512_set1_ps(s.decay);
    if (!masked) return decay;
    __m128i bytes = _mm_loadu_si128((const __m128i*)(mask + i));
    return _mm512_mask_blend_ps(_mm_test_epi8_mask(bytes, bytes), _mm512_set1_ps(1.0f), decay);
}

/* adamw() of 16 lanes: the same operations in the same order, each correctly rounded */
INLINE __m512 adamw16(__m512 p, __m512 g, __m512* m, __m512* v, scalars s, __m512 decay) {
    p = _mm512_mul_ps(p, decay);
    *m = _mm512_add_ps(*m, _mm512_mul_ps(_mm512_set1_ps(s.c1), _mm512_sub_ps(g, *m)));
    __m512 gg = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(s.c2), g), g);
    *v = _mm512_add_ps(_mm512_mul_ps(*v, _mm512_set1_ps(s.b2)), gg);
    __m512 root = _mm512_div_ps(_mm512_sqrt_ps(*v), _mm512_set1_ps(s.bc2s));
    __m512 denom = _mm512_add_ps(root, _mm512_set1_ps(s.eps));
    return _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(s.step_size), *m), denom));
}

static inline __m512i abs_bits(__m512 x) {
    return _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
}

/* x[k] = code[q[k]] * absmax of 16 lanes (one gather from the 1 KiB table, in L1) */
static inline __m512 decode16(const uint8_t* restrict q, float absmax, const float* restrict code) {
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
    return _mm512_mul_ps(_mm512_i32gather_ps(c, code, 4), _mm512_set1_ps(absmax));
}

#ifdef __AVX512VBMI__
/* the code tables as byte planes, planes[(map * 4 + k) * 256 + q] = byte k of code q's fp32 bits,
   so 64 codes decode by byte permutes (vpermi2b) in place of four gathers */
static inline void code_planes(const float* restrict codes, uint8_t* restrict planes) {
    for (int i = 0; i < 512; i += 16) {   /* once a call, before the threads: 32 x 4 steps */
        __m512i bits = _mm512_loadu_si512(codes + i);
        for (int k = 0; k < 4; k++) {
            __m128i bytes = _mm512_cvtepi32_epi8(_mm512_srli_epi32(bits, 8 * k));
            _mm_storeu_si128((__m128i*)(planes + ((i >> 8) * 4 + k) * 256 + (i & 255)), bytes);
        }
    }
}

/* byte k of code[q] for 64 indices q (a plane's 256 bytes: bit 7 of q picks the half) */
static inline __m512i plane_lookup(const uint8_t* restrict plane, __m512i q, __mmask64 top) {
    __m512i t0 = _mm512_loadu_si512(plane), t1 = _mm512_loadu_si512(plane + 64);
    __m512i t2 = _mm512_loadu_si512(plane + 128), t3 = _mm512_loadu_si512(plane + 192);
    __m512i lo = _mm512_permutex2var_epi8(t0, q, t1), hi = _mm512_permutex2var_epi8(t2, q, t3);
    return _mm512_mask_blend_epi8(top, lo, hi);
}

/* x[i] = code[q[i]] * absmax for 64 elements of one map. The four planes' bytes interleave into
   fp32 by unpacks within 128-bit lanes: the indices are first transposed (position 16 L + 4 a + j
   takes element 16 a + 4 L + j) so that the unpacks' lane order is the elements' */
static inline void decode64(const uint8_t* restrict q, float absmax, const uint8_t* restrict planes,
                            float* restrict x) {
    static const uint8_t order[64] = {
        0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
        4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
        8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
        12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
    __m512i idx = _mm512_permutexvar_epi8(_mm512_loadu_si512(order), _mm512_loadu_si512(q));
    __mmask64 top = _mm512_movepi8_mask(idx);
    __m512i b0 = plane_lookup(planes, idx, top), b1 = plane_lookup(planes + 256, idx, top);
    __m512i b2 = plane_lookup(planes + 512, idx, top), b3 = plane_lookup(planes + 768, idx, top);
    __m512i lo01 = _mm512_unpacklo_epi8(b0, b1), hi01 = _mm512_unpackhi_epi8(b0, b1);
    __m512i lo23 = _mm512_unpacklo_epi8(b2, b3), hi23 = _mm512_unpackhi_epi8(b2, b3);
    const __m512 scale = _mm512_set1_ps(absmax);
    __m512i words[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                        _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
    for (int a = 0; a < 4; a++)
        _mm512_storeu_ps(x + 16 * a, _mm512_mul_ps(_mm512_castsi512_ps(words[a]), scale));
}

/* the moments of the DECODED elements at i, into m and v (update_chunk then reads them there) */
static inline void decode_ahead(int64_t i, const uint8_t* restrict mq, float am,
                                const uint8_t* restrict vq, float av,
                                const uint8_t* restrict planes, float* restrict m,
                                float* restrict v) {
    decode64(mq + i, am, planes, m);
    decode64(vq + i, av, planes + 1024, v);
}

#define DECODE_AHEAD 1
#endif

/* the decoded moments of the 16 elements at i: decode_ahead's at m_in and v_in (VBMI), else
   gathered here */
static inline void moments16(int64_t i, const uint8_t* restrict mq, float am,
                             const uint8_t* restrict vq, float av, const float* restrict codes,
                             const float* restrict m_in, const float* restrict v_in, __m512* m,
                             __m512* v) {
#ifdef DECODE_AHEAD
    *m = _mm512_loadu_ps(m_in);
    *v = _mm512_loadu_ps(v_in);
#else
    *m = decode16(mq + i, am, codes);
    *v = decode16(vq + i, av, codes + 256);
#endif
}

/* CHUNK (32) elements at i, in registers: decode the moments, update, store the master; the new
   moments go to m_out, v_out (for the encode) and their |.| into the block's running maxes */
INLINE void update_chunk(int64_t i, const float* restrict g, float* restrict p,
                         uint16_t* restrict hi, int16_t* restrict rem, uint16_t* restrict copy16,
                         const uint8_t* restrict mq, float am, const uint8_t* restrict vq, float av,
                         const float* restrict codes, scalars s, const uint8_t* restrict mask,
                         float* restrict m_out, float* restrict v_out, maxes* mmax, maxes* vmax,
                         const int remainder, const int copy, const int masked) {
    __m512 x[2], m, v;
    load_master(i, p, hi, rem, remainder, x);
    for (int k = 0; k < 2; k++) {
        const int64_t at = i + 16 * k;
        moments16(at, mq, am, vq, av, codes, m_out + 16 * k, v_out + 16 * k, &m, &v);
        x[k] = adamw16(x[k], _mm512_loadu_ps(g + at), &m, &v, s, decay_of(at, s, mask, masked));
        _mm512_storeu_ps(m_out + 16 * k, m);
        _mm512_storeu_ps(v_out + 16 * k, v);
        *mmax = _mm512_max_epu32(*mmax, abs_bits(m));
        *vmax = _mm512_max_epu32(*vmax, abs_bits(v));
    }
    store_master(i, x, p, hi, rem, copy16, remainder, copy);
}
"""

CHUNKS = "".join(("\n#if defined(__AVX512F__)\n", AVX512, "\n#elif defined(__AVX2__)\n", AVX2,
                  "\n#else\n", SCALAR, "\n#endif\n", NO_DECODE_AHEAD))
