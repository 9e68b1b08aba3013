/* IQ2_XXS / IQ2_XS / IQ2_S rows . int8 activations: part of cpu_moe.c, which #includes this file inside its MOE_Q8
 * block (after cpu_iq_q8.c); not compiled on its own. x is llama.cpp's Q8_0 for activations (qx int8 [K], dx [K/32]),
 * as for IQ3_XXS. Layouts and the float twins: cpu_iq2.c.
 * A sub-block of 32 values = 4 groups: their grid rows (4 u64 loads: unsigned bytes 8 / 25 / 43) and sign bits as +-1
 * bytes applied to x (sign_epi8), one u8 x s8 dot into 8 int32 lanes (lanes 0-3: values 0-15, 4-7: 16-31), times
 * (2 ls + 1) d dx per lane (IQ2_XS / IQ2_S: one ls per 16 values, so per 4 lanes), the / 8 applied to the row's sum:
 * d (0.5 + ls) / 4 = d (2 ls + 1) / 8. Products <= 43 x 128: maddubs' int16 pair sums cannot saturate. */

/* +-1 bytes of the 32 values of sub-block s, and its 32 unsigned grid values */
static inline __attribute__((always_inline)) __m256i iq2_q8_grid(int kind, const uint8_t *w, int s, __m256i *sign) {
    if (kind == IQ2_KIND_XXS) {
        const uint8_t *q = w + 2 + 8 * s;
        uint32_t b;
        memcpy(&b, q + 4, 4);
        *sign = _mm256_set_epi64x((int64_t)iq_sign_bytes[(b >> 21) & 127], (int64_t)iq_sign_bytes[(b >> 14) & 127],
                                  (int64_t)iq_sign_bytes[(b >> 7) & 127], (int64_t)iq_sign_bytes[b & 127]);
        return _mm256_set_epi64x((int64_t)iq2xxs_grid[q[3]], (int64_t)iq2xxs_grid[q[2]], (int64_t)iq2xxs_grid[q[1]],
                                 (int64_t)iq2xxs_grid[q[0]]);
    }
    if (kind == IQ2_KIND_XS) {
        uint16_t q[4];
        memcpy(q, w + 2 + 8 * s, 8);
        *sign = _mm256_set_epi64x((int64_t)iq_sign_bytes[q[3] >> 9], (int64_t)iq_sign_bytes[q[2] >> 9],
                                  (int64_t)iq_sign_bytes[q[1] >> 9], (int64_t)iq_sign_bytes[q[0] >> 9]);
        return _mm256_set_epi64x((int64_t)iq2xs_grid[q[3] & 511], (int64_t)iq2xs_grid[q[2] & 511],
                                 (int64_t)iq2xs_grid[q[1] & 511], (int64_t)iq2xs_grid[q[0] & 511]);
    }
    const uint8_t *q = w + 2 + 4 * s;
    const uint32_t h = w[66 + s];
    *sign = _mm256_or_si256(moe_bits_to_bytes(w + 34 + 4 * s), _mm256_set1_epi8(1));   /* 0xFF | 1 = -1, else +1 */
    return _mm256_set_epi64x((int64_t)iq2s_grid[q[3] | (h << 2 & 0x300)], (int64_t)iq2s_grid[q[2] | (h << 4 & 0x300)],
                             (int64_t)iq2s_grid[q[1] | (h << 6 & 0x300)], (int64_t)iq2s_grid[q[0] | (h << 8 & 0x300)]);
}

/* (2 ls + 1) of sub-block s per int32 lane, as floats */
static inline __attribute__((always_inline)) __m256 iq2_q8_scales(int kind, const uint8_t *w, int s) {
    if (kind == IQ2_KIND_XXS) return _mm256_set1_ps((float)(2 * (w[9 + 8 * s] >> 4) + 1));
    const int sc = w[iq2_bytes[kind] - 8 + s];
    return _mm256_set_m128(_mm_set1_ps((float)(2 * (sc >> 4) + 1)), _mm_set1_ps((float)(2 * (sc & 15) + 1)));
}

static inline __attribute__((always_inline)) __m256i iq2_q8_dot(int kind, const uint8_t *w, int s, const int8_t *y) {
    __m256i sign;
    const __m256i grid = iq2_q8_grid(kind, w, s, &sign);
    return moe_dot_u8s8(grid, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y), sign));
}

static inline __attribute__((always_inline)) float moe_row_iq2_q8(int kind, const uint8_t *w, const int8_t *qx,
                                                                   const float *dx, int64_t nsb) {
    const int bb = iq2_bytes[kind];
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += bb, qx += 256, dx += 8) {
        PREFETCH(w);
        const __m256 dd = _mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(w)), _mm256_loadu_ps(dx));   /* lane s: d dx_s */
        for (int s = 0; s < 8; s += 2) {
            const __m256i p0 = iq2_q8_dot(kind, w, s, qx + 32 * s), p1 = iq2_q8_dot(kind, w, s + 1, qx + 32 * s + 32);
            const __m256 f0 = _mm256_mul_ps(iq2_q8_scales(kind, w, s), _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(s)));
            const __m256 f1 = _mm256_mul_ps(iq2_q8_scales(kind, w, s + 1),
                                            _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(s + 1)));
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), f0, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), f1, acc1);
        }
    }
    return 0.125f * hsum8(_mm256_add_ps(acc0, acc1));
}

static float moe_row_iq2_xxs_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    return moe_row_iq2_q8(IQ2_KIND_XXS, w, qx, dx, nsb);
}
static float moe_row_iq2_xs_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    return moe_row_iq2_q8(IQ2_KIND_XS, w, qx, dx, nsb);
}
static float moe_row_iq2_s_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    return moe_row_iq2_q8(IQ2_KIND_S, w, qx, dx, nsb);
}
