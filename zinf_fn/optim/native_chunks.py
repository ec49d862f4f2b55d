"""The int8 pipeline's chunk step in C (part of ``native_source.SOURCE``), one version per
instruction set, chosen at build time by what the compiler targets: AVX-512 (two registers of 16
lanes), AVX2 (registers of 8 lanes) or scalar.

A chunk is 32 elements. ``update_chunk`` takes its decoded moments (decoded ahead by byte permutes
of the code tables, ``decode_ahead``, where AVX-512 VBMI is there; else looked up in the 1 KiB
code table), runs the AdamW step in registers, stores the master and hands the new moments on
(for the encode, beside the next block) with their running |max|; ``encode_chunk`` writes the
codes of 32 scaled values (a lookup in the nearest-code table, ``native.code_luts``, a register
at a time; with VBMI one byte permute packs both registers' codes); ``max_of`` reduces a block's
running max. AVX-512 joins a remainder master's two 16-bit halves into fp32 (and splits it back)
by word permutes over the chunk's 32 lanes. Every version runs the scalar ``adamw``'s and
``encode``'s operations in their order, each correctly rounded (vector division and square root
included): all three give the same bits.

The table lookups are the pipeline's cost beside the divider: four an element (decode m and v,
encode m and v). AVX-512 gathers them (``vpgatherdd``; the decode by byte permutes where VBMI is
there), fast on the Intel cores it was tuned on. AVX2 reads them by scalar loads instead
(``decode8``, ``lookup8``): on AMD Zen 3 (AVX2 only) the 8-lane gathers are microcoded and slower
than eight loads and inserts, and the indices are split on the integer ALUs, beside the vector
work. Measured on Zen 3 and not kept (no faster there): the hardware gather for the encode alone,
the decode a chunk ahead of the update, the encode interleaved with the update 8 lanes at a time,
and an encode without table lookups (the code as the integer part of an affine function of |y|
per decade of the dynamic map, the table only near a midpoint), though it ran fewer
instructions.
"""


def _table(values) -> str:
    """C initialiser text of ``values``."""
    return ", ".join(str(v) for v in values)


BYTE2 = _table((4 * k + 2) & 127 for k in range(64))
JOIN0 = _table(k // 2 + (32 if k % 2 else 0) for k in range(32))
JOIN1 = _table(16 + k // 2 + (32 if k % 2 else 0) for k in range(32))
EVEN = _table(2 * k for k in range(32))
ODD = _table(2 * k + 1 for k in range(32))

AVX512 = r"""
/* running max |.| as bits, per lane: for non-negative floats, integer order is float order */
typedef __m512i maxes;

static inline uint32_t max_of(maxes x) { return _mm512_reduce_max_epu32(x); }

/* encode(x[k] * scale) of 16 lanes, each in its lane's byte 2 (the other bytes are not the code's).
   The unsigned map's key is the whole prefix: a negative y's (sign bit set) clamps to the last
   entry, then its code is 0 */
static inline __m512i code_bytes(const float* restrict x, __m512 scale,
                                 const uint32_t* restrict lut, const int is_signed) {
    __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x), scale));
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

/* q[i] = encode(x[i] * scale) for CHUNK (32) elements: the two registers' code bytes packed by one
   byte permute (VBMI), else each shifted down and narrowed */
static inline void encode_chunk(const float* restrict x, float scale, uint8_t* restrict q,
                                const uint32_t* restrict lut, const int is_signed) {
    const __m512 s = _mm512_set1_ps(scale);
    __m512i c0 = code_bytes(x, s, lut, is_signed), c1 = code_bytes(x + 16, s, lut, is_signed);
#ifdef __AVX512VBMI__
    /* byte 2 of each lane of c0, then of c1 */
    static const uint8_t byte2[64] = {""" + BYTE2 + r"""};
    __m512i codes = _mm512_permutex2var_epi8(c0, _mm512_loadu_si512(byte2), c1);
    _mm256_storeu_si256((__m256i*)q, _mm512_castsi512_si256(codes));
#else
    _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(_mm512_srli_epi32(c0, 16)));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(_mm512_srli_epi32(c1, 16)));
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

AVX2 = r"""
typedef __m256i maxes;   /* running max |.| as bits, per lane (as AVX-512's) */

static inline uint32_t max_of(maxes x) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    return (uint32_t)_mm_cvtsi128_si32(_mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1)));
}


static inline __m256i i32(int x) { return _mm256_set1_epi32(x); }

/* the low 16 bits of 8 lanes (each in [0, 0xFFFF]), packed */
static inline __m128i pack16(__m256i x) {
    return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

/* t[idx[k]] for 8 lanes by scalar loads: Zen 3's vpgatherdd is microcoded and slower than 8 loads
   and inserts. The indices leave the vector register as four 64-bit words (vmovq / vpextrq) and
   are split by integer shifts, which run on the integer ALUs beside the vector work (vpextrd, a
   lane at a time, takes two vector uops each) */
static inline __m256i lookup8(const uint32_t* restrict t, __m256i idx) {
    __m128i lo = _mm256_castsi256_si128(idx), hi = _mm256_extracti128_si256(idx, 1);
    uint64_t k0 = (uint64_t)_mm_cvtsi128_si64(lo), k1 = (uint64_t)_mm_extract_epi64(lo, 1);
    uint64_t k2 = (uint64_t)_mm_cvtsi128_si64(hi), k3 = (uint64_t)_mm_extract_epi64(hi, 1);
    return _mm256_setr_epi32(t[(uint32_t)k0], t[k0 >> 32], t[(uint32_t)k1], t[k1 >> 32],
                             t[(uint32_t)k2], t[k2 >> 32], t[(uint32_t)k3], t[k3 >> 32]);
}

/* q[k] = encode(x[k] * scale) for 8 lanes (AVX-512's operations; vector masks for its mask ones) */
static inline void encode8(const float* restrict x, float scale, uint8_t* restrict q,
                           const uint32_t* restrict lut, const int is_signed) {
    __m256i u = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x), _mm256_set1_ps(scale)));
    __m256i negative = _mm256_srai_epi32(u, 31);
    __m256i key = _mm256_srli_epi32(_mm256_slli_epi32(u, 1), 17);
    key = _mm256_min_epu32(_mm256_subs_epu16(key, i32(KEY_LO)), i32(NK - 1));
    if (is_signed) key = _mm256_add_epi32(key, _mm256_and_si256(negative, i32(NK)));
    __m256i entry = lookup8(lut, key);
    __m256i low = _mm256_and_si256(u, i32(0xFFFF)), c;
    __m256i sum = _mm256_add_epi32(entry, low);
    if (is_signed) c = _mm256_blendv_epi8(sum, _mm256_sub_epi32(entry, low), negative);
    else c = _mm256_andnot_si256(negative, sum);
    __m128i words = pack16(_mm256_srli_epi32(c, 16));
    _mm_storel_epi64((__m128i*)q, _mm_packus_epi16(words, words));
}

static inline void encode_chunk(const float* restrict x, float scale, uint8_t* restrict q,
                                const uint32_t* restrict lut, const int is_signed) {
    for (int k = 0; k < CHUNK; k += 8) encode8(x + k, scale, q + k, lut, is_signed);
}

/* bf16_round(x, 0x8000) of 8 lanes, as 16-bit values */
static inline __m128i ties_away8(__m256 x) {
    __m256i h = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), i32(0x8000)), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return pack16(_mm256_blendv_epi8(h, i32(0x7FC0), nan));
}

/* adamw() of 8 lanes, as adamw16 */
INLINE __m256 adamw8(__m256 p, __m256 g, __m256* m, __m256* v, scalars s, __m256 decay) {
    p = _mm256_mul_ps(p, decay);
    *m = _mm256_add_ps(*m, _mm256_mul_ps(_mm256_set1_ps(s.c1), _mm256_sub_ps(g, *m)));
    __m256 gg = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(s.c2), g), g);
    *v = _mm256_add_ps(_mm256_mul_ps(*v, _mm256_set1_ps(s.b2)), gg);
    __m256 root = _mm256_div_ps(_mm256_sqrt_ps(*v), _mm256_set1_ps(s.bc2s));
    __m256 denom = _mm256_add_ps(root, _mm256_set1_ps(s.eps));
    return _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(s.step_size), *m), denom));
}

/* x[k] = code[q[k]] * absmax of 8 lanes, the table read by scalar loads (as lookup8; the byte
   indices load straight from the codes) */
static inline __m256 decode8(const uint8_t* restrict q, float absmax, const float* restrict code) {
    __m256 c = _mm256_setr_ps(code[q[0]], code[q[1]], code[q[2]], code[q[3]], code[q[4]], code[q[5]],
                              code[q[6]], code[q[7]]);
    return _mm256_mul_ps(c, _mm256_set1_ps(absmax));
}

/* 8 elements at i: update_chunk's half (the same steps as AVX-512's update_chunk) */
INLINE void update8(int64_t i, const float* restrict g, float* restrict p, uint16_t* restrict hi,
                    int16_t* restrict rem, uint16_t* restrict copy16, const uint8_t* restrict mq,
                    float am, const uint8_t* restrict vq, float av, const float* restrict codes,
                    scalars s, const uint8_t* restrict mask, float* restrict m_out,
                    float* restrict v_out, maxes* mmax, maxes* vmax, const int remainder,
                    const int copy, const int masked) {
    __m256 m = decode8(mq + i, am, codes), v = decode8(vq + i, av, codes + 256), x;
    if (remainder) {
        __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(hi + i)));
        __m256i r = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)(rem + i)));
        x = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(h, 16), r));
    } else x = _mm256_loadu_ps(p + i);
    __m256 decay = _mm256_set1_ps(s.decay);
    if (masked) {
        __m256i off = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(mask + i)));
        off = _mm256_cmpeq_epi32(off, _mm256_setzero_si256());
        decay = _mm256_blendv_ps(decay, _mm256_set1_ps(1.0f), _mm256_castsi256_ps(off));
    }
    x = adamw8(x, _mm256_loadu_ps(g + i), &m, &v, s, decay);
    if (remainder) {
        _mm_storeu_si128((__m128i*)(hi + i), ties_away8(x));
        __m256i low = _mm256_and_si256(_mm256_castps_si256(x), i32(0xFFFF));
        _mm_storeu_si128((__m128i*)(rem + i), pack16(low));
    } else {
        _mm256_storeu_ps(p + i, x);
        if (copy) _mm_storeu_si128((__m128i*)(copy16 + i), ties_away8(x));
    }
    _mm256_storeu_ps(m_out, m);
    _mm256_storeu_ps(v_out, v);
    *mmax = _mm256_max_epu32(*mmax, _mm256_and_si256(_mm256_castps_si256(m), i32(0x7FFFFFFF)));
    *vmax = _mm256_max_epu32(*vmax, _mm256_and_si256(_mm256_castps_si256(v), i32(0x7FFFFFFF)));
}

INLINE void update_chunk(int64_t i, const float* restrict g, float* restrict p,
                         uint16_t* restrict hi, int16_t* restrict rem, uint16_t* restrict copy16,
                         const uint8_t* restrict mq, float am, const uint8_t* restrict vq, float av,
                         const float* restrict codes, scalars s, const uint8_t* restrict mask,
                         float* restrict m_out, float* restrict v_out, maxes* mmax, maxes* vmax,
                         const int remainder, const int copy, const int masked) {
    for (int k = 0; k < CHUNK; k += 8)
        update8(i + k, g, p, hi, rem, copy16, mq, am, vq, av, codes, s, mask, m_out + k, v_out + k,
                mmax, vmax, remainder, copy, masked);
}
"""

SCALAR = r"""
typedef uint32_t maxes;   /* running max |.| as bits (as AVX-512's) */

static inline uint32_t max_of(maxes x) { return x; }



/* q[i] = encode(x[i] * scale) for CHUNK elements */
static inline void encode_chunk(const float* restrict x, float scale, uint8_t* restrict q,
                                const uint32_t* restrict lut, const int is_signed) {
    for (int i = 0; i < CHUNK; i++) q[i] = encode(x[i] * scale, lut, is_signed);
}

INLINE void update_chunk(int64_t i0, const float* restrict g, float* restrict p,
                         uint16_t* restrict hi, int16_t* restrict rem, uint16_t* restrict copy16,
                         const uint8_t* restrict mq, float am, const uint8_t* restrict vq, float av,
                         const float* restrict codes, scalars s, const uint8_t* restrict mask,
                         float* restrict m_out, float* restrict v_out, maxes* mmax, maxes* vmax,
                         const int remainder, const int copy, const int masked) {
    for (int k = 0; k < CHUNK; k++) {
        const int64_t i = i0 + k;
        m_out[k] = codes[mq[i]] * am;
        v_out[k] = codes[256 + vq[i]] * av;
        MASTER_IO(remainder)
        x = adamw(x, g[i], &m_out[k], &v_out[k], s, (masked && !mask[i]) ? 1.0f : s.decay);
        MASTER_STORE(remainder, copy)
        uint32_t um = f2u(m_out[k]) & 0x7FFFFFFFu, uv = f2u(v_out[k]) & 0x7FFFFFFFu;
        *mmax = um > *mmax ? um : *mmax;
        *vmax = uv > *vmax ? uv : *vmax;
    }
}
"""

NO_DECODE_AHEAD = r"""
#ifndef DECODE_AHEAD   /* update_chunk decodes its own moments: nothing to do ahead */
static inline void code_planes(const float* restrict codes, uint8_t* restrict planes) {}

static inline void decode_ahead(int64_t i, const uint8_t* restrict mq, float am,
                                const uint8_t* restrict vq, float av,
                                const uint8_t* restrict planes, float* restrict m,
                                float* restrict v) {}
#endif
"""

CHUNKS = "".join(("\n#if defined(__AVX512F__)\n", AVX512, "\n#elif defined(__AVX2__)\n", AVX2,
                  "\n#else\n", SCALAR, "\n#endif\n", NO_DECODE_AHEAD))
