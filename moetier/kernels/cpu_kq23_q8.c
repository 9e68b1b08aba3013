/* Q2_K / Q3_K rows (layouts in cpu_kquants.c) . int8 activations: part of cpu_moe.c, which #includes this file inside
 * its MOE_Q8 block after cpu_kq_q8.c (moe_dot_u8s8, q6_k_q8_dot in scope); not compiled on its own.
 * Q6_K's arrangement (cpu_kq_q8.c): 16 sub-blocks of 16 values, so each 32-value group g's int32 dot (4 values a lane:
 * lanes 0-3 sub-block 2 g, 4-7 sub-block 2 g + 1) is converted once and scaled per lane by d sc dx (one permute of the
 * super-block's 16 scales, each already times its group's dx).
 *   Q2_K: d sc dot(q, y) - dmin mn dot(1, y), q = 0..3 unsigned;
 *   Q3_K: d sc (dot(u, y) - 4 dot(1, y)), u = q | hbit << 2 = 0..7 unsigned (the value is u - 4).
 * The 4-row kernels (moe_rows_run_q8: the miss server, moe_tokens, matvec_q8) share the x side (Q3_K's -4 dot(1, y)
 * in int32, Q2_K's dot(1, y) converted) and are bit-identical to the one-row kernels row by row. */

static inline __m256 kq16_pick(__m256 sv, int j) {    /* lanes 0-3: sv[2 j], 4-7: sv[2 j + 1] */
    return _mm256_permutevar8x32_ps(sv, _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                                          2 * j + 1));
}

/* lane i of sv[h]: f * s[8 h + i] * dx[4 h + i / 2], s 16 scale bytes (signed: Q3_K's sc - 32; else unsigned) */
static inline void kq16_scales(__m128i s, int sgn, float f, const float *dx, __m256 *sv) {
    const __m256 dxv = _mm256_loadu_ps(dx), fv = _mm256_set1_ps(f);
    const __m256 dxl = _mm256_permutevar8x32_ps(dxv, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    const __m256 dxh = _mm256_permutevar8x32_ps(dxv, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
    const __m128i s1 = _mm_srli_si128(s, 8);
    const __m256i i0 = sgn ? _mm256_cvtepi8_epi32(s) : _mm256_cvtepu8_epi32(s);
    const __m256i i1 = sgn ? _mm256_cvtepi8_epi32(s1) : _mm256_cvtepu8_epi32(s1);
    sv[0] = _mm256_mul_ps(_mm256_mul_ps(fv, _mm256_cvtepi32_ps(i0)), dxl);
    sv[1] = _mm256_mul_ps(_mm256_mul_ps(fv, _mm256_cvtepi32_ps(i1)), dxh);
}

/* Q3_K's 16 scales - 32 (q3_k_scales) as bytes, in registers: low nibbles of s[0..7] then their high nibbles, or'd
 * with bits 2 (i / 4) .. + 1 of s[8 + i % 4] << 4 (the scalar unpack's stores and 16-byte reload stalled on the
 * store forwarding: Q3_K one thread, in cache, 14.6 -> 25.5 G values/s) */
static inline __m128i q3_k_scales_128(const uint8_t *s) {
    const __m128i a = _mm_loadl_epi64((const __m128i *)s), m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(3);
    uint32_t t;
    memcpy(&t, s + 8, 4);
    const __m128i lo = _mm_and_si128(_mm_unpacklo_epi64(a, _mm_srli_epi16(a, 4)), m4);
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)t), _mm_setr_epi32(0, 2, 4, 6)), m2);
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}

/* Q3_K group g's unsigned values u = q | hbit << 2 (qv: the 32 qs bytes of half g / 4, hm: hmask) */
static inline __m256i q3_k_group(__m256i qv, __m256i hm, int g) {
    const int j = g & 3;
    const __m256i q = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * j), _mm256_set1_epi8(3));
    const __m256i h = g <= 2 ? _mm256_slli_epi16(hm, 2 - g) : _mm256_srli_epi16(hm, g - 2);   /* bit g -> bit 2 */
    return _mm256_or_si256(q, _mm256_and_si256(h, _mm256_set1_epi8(4)));
}

static inline __m256i q2_k_group(__m256i qv, int g) {           /* Q2_K group g's q = 0..3 */
    return _mm256_and_si256(_mm256_srli_epi16(qv, 2 * (g & 3)), _mm256_set1_epi8(3));
}

static inline void q3_k_q8_offsets(const int8_t *qx, __m256i *neg4y) {   /* [8]: -4 sum of y per int32 lane */
    for (int g = 0; g < 8; g++)
        neg4y[g] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                    moe_dot_u8s8(_mm256_set1_epi8(4), _mm256_loadu_si256((const __m256i *)(qx + 32 * g))));
}

static inline void q2_k_q8_sums(const int8_t *qx, __m256 *ys) {          /* [8]: sum of y per int32 lane, as float */
    for (int g = 0; g < 8; g++)
        ys[g] = _mm256_cvtepi32_ps(moe_dot_u8s8(_mm256_set1_epi8(1), _mm256_loadu_si256((const __m256i *)(qx + 32 * g))));
}

/* one Q3_K super-block of a row: acc0 (even groups) / acc1 (odd) += float(dot) d sc dx */
static inline __attribute__((always_inline)) void q3_k_q8_block(const uint8_t *w, const int8_t *qx, const float *dx,
                                                                const __m256i *neg4y, __m256 *acc0, __m256 *acc1) {
    __m256 sv[2];
    kq16_scales(q3_k_scales_128(w + 96), 1, fp16_to_f32(w + 108), dx, sv);
    const __m256i hm = _mm256_loadu_si256((const __m256i *)w);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(w + 32 + 32 * h));
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const int g = 4 * h + j;
            const __m256i y = _mm256_loadu_si256((const __m256i *)(qx + 32 * g));
            const __m256 p = _mm256_cvtepi32_ps(q6_k_q8_dot(q3_k_group(qv, hm, g), y, neg4y[g]));
            if (j & 1) *acc1 = _mm256_fmadd_ps(p, kq16_pick(sv[h], j), *acc1);
            else *acc0 = _mm256_fmadd_ps(p, kq16_pick(sv[h], j), *acc0);
        }
    }
}

/* one Q2_K super-block of a row: acc += float(dot(q, y)) d sc dx, off += float(dot(1, y)) dmin mn dx */
static inline __attribute__((always_inline)) void q2_k_q8_block(const uint8_t *w, const int8_t *qx, const float *dx,
                                                                const __m256 *ys, __m256 *acc, __m256 *off) {
    const __m128i s = _mm_loadu_si128((const __m128i *)w), m4 = _mm_set1_epi8(0x0F);
    __m256 sv[2], mv[2];
    kq16_scales(_mm_and_si128(s, m4), 0, fp16_to_f32(w + 80), dx, sv);
    kq16_scales(_mm_and_si128(_mm_srli_epi16(s, 4), m4), 0, fp16_to_f32(w + 82), dx, mv);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * h));
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const int g = 4 * h + j;
            const __m256i y = _mm256_loadu_si256((const __m256i *)(qx + 32 * g));
            const __m256 p = _mm256_cvtepi32_ps(moe_dot_u8s8(q2_k_group(qv, g), y));
            *acc = _mm256_fmadd_ps(p, kq16_pick(sv[h], j), *acc);
            *off = _mm256_fmadd_ps(ys[g], kq16_pick(mv[h], j), *off);
        }
    }
}

static float moe_row_q3_k_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 110, qx += 256, dx += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        __m256i neg4y[8];
        q3_k_q8_offsets(qx, neg4y);
        q3_k_q8_block(w, qx, dx, neg4y, &acc0, &acc1);
    }
    return hsum8(_mm256_add_ps(acc0, acc1));
}

static float moe_row_q2_k_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 84, qx += 256, dx += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        __m256 ys[8];
        q2_k_q8_sums(qx, ys);
        q2_k_q8_block(w, qx, dx, ys, &acc, &off);
    }
    return hsum8(acc) - hsum8(off);
}

/* 4 rows at w + r rs: the x side once per super-block for the 4 rows, prefetch bounded by pf_end (kq_prefetch) */
static void moe_rows4_run_q3_k_q8(const uint8_t *w, int64_t rs, const int8_t *qx, const float *dx, int64_t nsb,
                                  const uint8_t *pf_end, float *out) {
    const int64_t pfd = kq_prefetch_dist(rs);
    __m256 acc0[4], acc1[4];
    for (int r = 0; r < 4; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, qx += 256, dx += 8) {
        __m256i neg4y[8];
        q3_k_q8_offsets(qx, neg4y);
        for (int r = 0; r < 4; r++) {
            const uint8_t *wb = w + r * rs + b * 110;
            kq_prefetch(wb, pfd, 2, pf_end);
            q3_k_q8_block(wb, qx, dx, neg4y, &acc0[r], &acc1[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = hsum8(_mm256_add_ps(acc0[r], acc1[r]));
}

static void moe_rows4_run_q2_k_q8(const uint8_t *w, int64_t rs, const int8_t *qx, const float *dx, int64_t nsb,
                                  const uint8_t *pf_end, float *out) {
    const int64_t pfd = kq_prefetch_dist(rs);
    __m256 acc[4], off[4];
    for (int r = 0; r < 4; r++) acc[r] = off[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, qx += 256, dx += 8) {
        __m256 ys[8];
        q2_k_q8_sums(qx, ys);
        for (int r = 0; r < 4; r++) {
            const uint8_t *wb = w + r * rs + b * 84;
            kq_prefetch(wb, pfd, 2, pf_end);
            q2_k_q8_block(wb, qx, dx, ys, &acc[r], &off[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = hsum8(acc[r]) - hsum8(off[r]);
}
