/* K-quant rows (Q4_K, Q5_K, Q6_K) . int8 activations: part of cpu_moe.c, which #includes this file inside its
 * MOE_Q8 block (after moe_dot_u8s8, with cpu_kquants.c's scale_min_k4 in scope); not compiled on its own.
 * x is llama.cpp's Q8_0 for activations (qx int8 [K], per-32 scales dx, sx = dx * sum qx): each 32-value
 * sub-block's integer dot (unsigned 4/5/6-bit weights x int8, maddubs or VNNI) is scaled once by d sc dx; Q4_K /
 * Q5_K's mins go through sx. The float kernels in cpu_kquants.c stay the reference (and the path without AVX2). */

/* ---- Q4_K / Q5_K (layouts in cpu_kquants.c): sub-block j's dot scaled by d sc_j dx_j (8 lanes, one permute
 * each), minus dmin mn_j sx_j; Q5_K ORs bit j of qh into bit 4 ---- */
static inline __m256i q5_k_high_bit(__m256i qh, int j) {    /* bit j of each qh byte -> 0x10 (16-bit shifts) */
    const __m256i h = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
    return _mm256_and_si256(h, _mm256_set1_epi8(0x10));
}

static inline __attribute__((always_inline)) float moe_row_q45_k_q8(const uint8_t *w, const int8_t *qx,
                                                                    const float *dx, const float *sx,
                                                                    int64_t nsb, int q5) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();   /* sub-blocks 2c, 2c + 1 */
    __m256 off = _mm256_setzero_ps();                                 /* dmin mn_j sx_j, 8 lanes */
    for (int64_t b = 0; b < nsb; b++, w += q5 ? 176 : 144, qx += 256, dx += 8, sx += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        PREFETCH(w + 128);
        uint64_t sc, mn;
        scale_min_k4(w + 4, &sc, &mn);
        const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc)));
        const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mn)));
        const __m256 s = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(w)), scf), _mm256_loadu_ps(dx));
        off = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(w + 2)), mnf), _mm256_loadu_ps(sx), off);
        const uint8_t *qs = w + (q5 ? 48 : 16);
        const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (q5) {
                lo = _mm256_or_si256(lo, q5_k_high_bit(qh, 2 * c));
                hi = _mm256_or_si256(hi, q5_k_high_bit(qh, 2 * c + 1));
            }
            const __m256i p0 = moe_dot_u8s8(lo, _mm256_loadu_si256((const __m256i *)(qx + 64 * c)));
            const __m256i p1 = moe_dot_u8s8(hi, _mm256_loadu_si256((const __m256i *)(qx + 64 * c + 32)));
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(2 * c)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(2 * c + 1)), acc1);
        }
    }
    return hsum8(_mm256_add_ps(acc0, acc1)) - hsum8(off);
}

static float moe_row_q4_k_q8(const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, int64_t nsb) {
    return moe_row_q45_k_q8(w, qx, dx, sx, nsb, 0);
}

static float moe_row_q5_k_q8(const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, int64_t nsb) {
    return moe_row_q45_k_q8(w, qx, dx, sx, nsb, 1);
}

/* ---- Q6_K: group g of half h (32 values, qx block 4 h + g) = ql nibble | 2 qh bits << 4, minus 32 (int8);
 * signed x signed through the sign trick; lanes 0-3 (values 0-15) scaled by d sc[8 h + 2 g] dx, 4-7 by
 * sc[8 h + 2 g + 1] ---- */
static float moe_row_q6_k_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
    const __m256i dup_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), dup_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 210, qx += 256, dx += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        PREFETCH(w + 128);
        PREFETCH(w + 192);
        const __m256 d = _mm256_set1_ps(fp16_to_f32(w + 208)), dxv = _mm256_loadu_ps(dx);
        const __m128i sc = _mm_loadu_si128((const __m128i *)(w + 192));
        __m256 sv[2];                                   /* lane i of sv[h]: d sc[8 h + i] dx[4 h + i / 2] */
        sv[0] = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
                              _mm256_permutevar8x32_ps(dxv, dup_lo));
        sv[1] = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))),
                              _mm256_permutevar8x32_ps(dxv, dup_hi));
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
            q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(hb, m30));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
            for (int g = 0; g < 4; g++) {
                const __m256i v = _mm256_sub_epi8(q[g], k32);
                const __m256i y = _mm256_loadu_si256((const __m256i *)(qx + 128 * h + 32 * g));
                const __m256i p = moe_dot_u8s8(_mm256_abs_epi8(v), _mm256_sign_epi8(y, v));
                const __m256 scale = _mm256_permutevar8x32_ps(
                    sv[h], _mm256_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1));
                if (g & 1) acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc1);
                else acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc0);
            }
        }
    }
    return hsum8(_mm256_add_ps(acc0, acc1));
}
