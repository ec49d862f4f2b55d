"""The int8 pipeline's chunk step in C where AVX-512 is not there (part of ``native_source.SOURCE``,
joined by ``native_chunks``): AVX2 (registers of 8 lanes) and scalar, the same operations in the same
order as the AVX-512 version, so all three give the same bits.

The table lookups are the pipeline's cost beside the divider: four an element (decode m and v,
encode m and v). AVX-512 gathers them; AVX2 reads them by scalar loads instead
(``decode8``, ``lookup8``): on AMD Zen 3 (AVX2 only) the 8-lane gathers are microcoded and slower
than eight loads and inserts, and the indices are split on the integer ALUs, beside the vector
work. Measured on Zen 3 and not kept (no faster there): the hardware gather for the encode alone,
the decode a chunk ahead of the update, the encode interleaved with the update 8 lanes at a time,
and an encode without table lookups (the code as the integer part of an affine function of |y|
per decade of the dynamic map, the table only near a midpoint), though it ran fewer
instructions.
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
