/* Codebook rows (MXFP4, IQ3_XXS) . int8 activations: part of cpu_moe.c, which #includes this file inside
 * its MOE_Q8 block (after moe_dot_u8s8); not compiled on its own. x is llama.cpp's Q8_0 for activations
 * (qx int8 [K], dx [K/32] scales), as for Q4_0 / Q8_0; each 32-block's integer dot product is scaled once.
 * The float kernels in cpu_iquants.c stay the reference (and the path without AVX2). */

/* ---- MXFP4: the 32 int8 weights of a block are two pshufb of the 16-entry doubled-E2M1 table; signed x
 * signed through the sign trick (as Q8_0); scale 2^(e-128) / 2 * dx ---- */
static inline __m256i mxfp4_q8_weights(const uint8_t *qs, __m128i values) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_shuffle_epi8(values, _mm_and_si128(q, m4));                    /* elements 0-15 */
    const __m128i hi = _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(q, 4), m4)); /* 16-31 */
    return _mm256_set_m128i(hi, lo);
}

static float moe_row_mxfp4_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nb) {
    const __m128i values = _mm_loadu_si128((const __m128i *)mxfp4_values);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();   /* two chains: blocks are short */
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 34, qx += 64) {
        PREFETCH(w);
        const __m256i q0 = mxfp4_q8_weights(w + 1, values), q1 = mxfp4_q8_weights(w + 18, values);
        const __m256i y0 = _mm256_loadu_si256((const __m256i *)qx), y1 = _mm256_loadu_si256((const __m256i *)(qx + 32));
        const __m256i p0 = moe_dot_u8s8(_mm256_sign_epi8(q0, q0), _mm256_sign_epi8(y0, q0));
        const __m256i p1 = moe_dot_u8s8(_mm256_sign_epi8(q1, q1), _mm256_sign_epi8(y1, q1));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(e8m0_half(w[0]) * dx[b]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(e8m0_half(w[17]) * dx[b + 1]), acc1);
    }
    if (b < nb) {
        const __m256i q = mxfp4_q8_weights(w + 1, values), y = _mm256_loadu_si256((const __m256i *)qx);
        const __m256i p = moe_dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(e8m0_half(w[0]) * dx[b]), acc0);
    }
    return hsum8(_mm256_add_ps(acc0, acc1));
}

/* ---- IQ3_XXS: sub-block s of a super-block = 8 grid rows (4 unsigned bytes each, 4..62: one gather of 8
 * u32, measured 3.0 -> 3.75 GB/s against 8 scalar loads on the dev box) and 4 sign patterns (iq_sign_bytes:
 * +-1 per byte) applied to x; u8 x s8 dot; scale d (0.5 + sc) 0.5 = d (2 sc + 1) / 4, times dx ---- */
static inline __m256i iq3_xxs_q8_grid(const uint8_t *q) {   /* 32 unsigned weights of grid rows q[0 .. 8) */
    return _mm256_i32gather_epi32((const int *)iq3xxs_grid, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)), 4);
}

static inline __m256i iq3_xxs_q8_signs(uint32_t aux) {      /* +-1 bytes for the 32 elements */
    return _mm256_set_epi64x((int64_t)iq_sign_bytes[(aux >> 21) & 127], (int64_t)iq_sign_bytes[(aux >> 14) & 127],
                             (int64_t)iq_sign_bytes[(aux >> 7) & 127], (int64_t)iq_sign_bytes[aux & 127]);
}

/* int32 partial sums (8 lanes) of sub-block qs / aux . y */
static inline __m256i iq3_xxs_q8_dot(const uint8_t *qs, uint32_t aux, const int8_t *y) {
    const __m256i ys = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y), iq3_xxs_q8_signs(aux));
    return moe_dot_u8s8(iq3_xxs_q8_grid(qs), ys);
}

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) && defined(__AVX512BITALG__) \
    && defined(__AVX512VNNI__)
/* AVX-512 (Ice Lake, Sapphire Rapids, Zen 4): two sub-blocks per 64-byte register; the grid rows through one
 * gather, the signs as a 64-bit mask (negate x where set), the scales of a super-block computed at once */

/* the 8 sub-blocks' sign words (bit j: element j negative) from their aux words at p: bytes 0-3 of each
 * word's qword = its four 7-bit fields (one multishift), bit 7 of each the field's parity (iq_ksigns) */
static inline __m256i iq3_xxs_sign_words(const uint8_t *p) {
    const __m512i a = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)p));
    const __m512i f = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x150e0700LL), a),
                                       _mm512_set1_epi8(0x7F));
    const __m512i par = _mm512_and_si512(_mm512_popcnt_epi8(f), _mm512_set1_epi8(1));
    return _mm512_cvtepi64_epi32(_mm512_or_si512(f, _mm512_slli_epi16(par, 7)));    /* low 4 bytes per qword */
}

static float moe_row_iq3_xxs_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    __m512 acc = _mm512_setzero_ps();
    const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    #pragma GCC unroll 2                                  /* measured 5.4 -> 5.9 GB/s (hot, 1 thread); 4: 5.8 */
    for (int64_t b = 0; b < nsb; b++, w += 98, qx += 256, dx += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        __mmask64 sg[4];                                   /* sign bits of sub-blocks 2 i and 2 i + 1 */
        _mm256_storeu_si256((__m256i *)sg, iq3_xxs_sign_words(w + 66));
        const __m256i aux = _mm256_loadu_si256((const __m256i *)(w + 66));
        const __m256i ls = _mm256_srli_epi32(aux, 28);
        const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(ls, ls), _mm256_set1_epi32(1))),
                                        _mm256_mul_ps(_mm256_set1_ps(0.25f * fp16_to_f32(w)), _mm256_loadu_ps(dx)));
        const __m512 scz = _mm512_castps256_ps512(sc);     /* lane s: d (2 sc_s + 1) / 4 * dx_s */
        for (int s = 0; s < 8; s += 2) {
            const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 2 + 8 * s)));
            const __m512i g = _mm512_i32gather_epi32(idx, (const void *)iq3xxs_grid, 4);
            const __m512i y = _mm512_loadu_si512((const void *)(qx + 32 * s));
            const __m512i ys = _mm512_mask_sub_epi8(y, _load_mask64(&sg[s / 2]), _mm512_setzero_si512(), y);
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g, ys);
            const __m512 scale = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32(s)), scz);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc);
        }
    }
    return _mm512_reduce_add_ps(acc);
}
#else
static float moe_row_iq3_xxs_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    #pragma GCC unroll 2
    for (int64_t b = 0; b < nsb; b++, w += 98, qx += 256, dx += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        const float d = 0.25f * fp16_to_f32(w);
        uint32_t aux[8];
        memcpy(aux, w + 66, 32);
        for (int s = 0; s < 8; s += 2) {
            const __m256i p0 = iq3_xxs_q8_dot(w + 2 + 8 * s, aux[s], qx + 32 * s);
            const __m256i p1 = iq3_xxs_q8_dot(w + 10 + 8 * s, aux[s + 1], qx + 32 * s + 32);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d * (float)(2 * (aux[s] >> 28) + 1) * dx[s]), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1),
                                   _mm256_set1_ps(d * (float)(2 * (aux[s + 1] >> 28) + 1) * dx[s + 1]), acc1);
        }
    }
    return hsum8(_mm256_add_ps(acc0, acc1));
}
#endif
