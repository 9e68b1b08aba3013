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

/* ==== several rows per call (doorbell.c's miss server, through moe_rows_run_q8): rows w + r rs, r < 4, of one
 * matrix . the same q8 x, each row the arithmetic of its one-row kernel above (same int32 dot per lane, same
 * scales, same fma order per accumulator lane, same final sums): bit-identical. Per super-block the x loads and
 * scales (dx, sx) are shared by the rows, and 4 rows give 4x the independent fma chains (one row: 2 chains of 4
 * fmas per super-block, latency-bound). Software prefetch: the same row and block one or more whole 4-row groups
 * ahead (>= PREFETCH_AHEAD), stopping at pf_end as moe_rows4_run_q8 (w + 4096 from each of 4 rows landed only
 * ~700 bytes ahead of row 2 / 3: Q6_K from RAM, 1 thread, fell 12.7 -> 12.1 GB/s; with this, 12.7 as before).
 * Measured on the dev box, 1 thread, 256 rows in L2 (moe_rows_run_q8 against the one-row loop, GB/s):
 * Q6_K K=2048 19.6 -> 25.7, K=768 17.1 -> 23.1 (AVX2 build 15.6 -> 17.6); Q5_K 20.7 -> 22.1; Q4_K 18.9 -> 19.5:
 * Q4_K is bound by vector-port throughput (dpbusd, cvt, fma, nibbles, the scale permute per 32 weights), which
 * sharing x does not reduce, and 512-bit ops issue on 2 ports (256-bit on 3). Q5_K's AVX2 4-row kernel ran at
 * 12.0 against 15.3 for one row (register spills): moe_rows_run_q8 uses it only in the AVX-512 build. ==== */
static inline int64_t kq_prefetch_dist(int64_t rs) {   /* whole 4-row groups ahead, >= PREFETCH_AHEAD */
    return 4 * rs * ((PREFETCH_AHEAD + 4 * rs - 1) / (4 * rs));
}

static inline void kq_prefetch(const uint8_t *p, int64_t dist, int lines, const uint8_t *pf_end) {
    for (int l = 0; l < lines; l++)
        if (p + dist + 64 * l < pf_end) __builtin_prefetch(p + dist + 64 * l, 0, 3);
}

/* 4 Q4_K / Q5_K rows (AVX2): moe_row_q45_k_q8 per row, the 8 sub-block dots of each row against x loaded once */
static inline __attribute__((always_inline)) void moe_rows4_run_q45_k_q8(int q5, const uint8_t *w, int64_t rs,
                                                                         const int8_t *qx, const float *dx,
                                                                         const float *sx, int64_t nsb,
                                                                         const uint8_t *pf_end, float *out) {
    const int64_t pfd = kq_prefetch_dist(rs);   /* the same row and block of a later group */
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int64_t bb = q5 ? 176 : 144;
    __m256 acc0[4], acc1[4], off[4];
    for (int r = 0; r < 4; r++) acc0[r] = acc1[r] = off[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, qx += 256, dx += 8, sx += 8) {
        const __m256 dxv = _mm256_loadu_ps(dx), sxv = _mm256_loadu_ps(sx);
        __m256 s[4];
        for (int r = 0; r < 4; r++) {
            const uint8_t *wb = w + r * rs + b * bb;
            kq_prefetch(wb, pfd, 3, pf_end);
            uint64_t sc, mn;
            scale_min_k4(wb + 4, &sc, &mn);
            const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc)));
            const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mn)));
            s[r] = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(wb)), scf), dxv);
            off[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(wb + 2)), mnf), sxv, off[r]);
        }
        for (int c = 0; c < 4; c++) {
            const __m256i y0 = _mm256_loadu_si256((const __m256i *)(qx + 64 * c));
            const __m256i y1 = _mm256_loadu_si256((const __m256i *)(qx + 64 * c + 32));
            for (int r = 0; r < 4; r++) {
                const uint8_t *wb = w + r * rs + b * bb;
                const __m256i q = _mm256_loadu_si256((const __m256i *)(wb + (q5 ? 48 : 16) + 32 * c));
                __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                if (q5) {
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(wb + 16));
                    lo = _mm256_or_si256(lo, q5_k_high_bit(qh, 2 * c));
                    hi = _mm256_or_si256(hi, q5_k_high_bit(qh, 2 * c + 1));
                }
                const __m256i p0 = moe_dot_u8s8(lo, y0), p1 = moe_dot_u8s8(hi, y1);
                acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_permutevar8x32_ps(s[r], _mm256_set1_epi32(2 * c)),
                                          acc0[r]);
                acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1),
                                          _mm256_permutevar8x32_ps(s[r], _mm256_set1_epi32(2 * c + 1)), acc1[r]);
            }
        }
    }
    for (int r = 0; r < 4; r++) out[r] = hsum8(_mm256_add_ps(acc0[r], acc1[r])) - hsum8(off[r]);
}

/* 4 Q6_K rows (AVX2): moe_row_q6_k_q8 per row, but each group's int32 dot as sum q y - 32 sum y (q = ql | qh << 4,
 * 0..63, unsigned: no abs / sign per row) with 32 sum y per lane computed once per super-block for all rows: the
 * same integers as sum (q - 32) y (exact; maddubs pairs <= 2 63 127, no saturation) */
static inline void q6_k_q8_offsets(const int8_t *qx, __m256i *neg32y) {   /* [8]: -32 sum of y per int32 lane */
    for (int g = 0; g < 8; g++)
        neg32y[g] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                     moe_dot_u8s8(_mm256_set1_epi8(32), _mm256_loadu_si256((const __m256i *)(qx + 32 * g))));
}

static inline void q6_k_q8_groups(const uint8_t *w, int h, __m256i *q) {   /* half h's 4 groups, 0..63 */
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(hb, m30));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
}

static inline __m256i q6_k_q8_dot(__m256i q, __m256i y, __m256i neg32y) {   /* sum (q - 32) y per int32 lane */
#if VNNI256
    return DPBUSD256(neg32y, q, y);
#else
    return _mm256_add_epi32(moe_dot_u8s8(q, y), neg32y);
#endif
}

static inline void moe_rows4_run_q6_k_q8(const uint8_t *w, int64_t rs, const int8_t *qx, const float *dx, int64_t nsb,
                                         const uint8_t *pf_end, float *out) {
    const int64_t pfd = kq_prefetch_dist(rs);   /* the same row and block of a later group */
    const __m256i dup_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), dup_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    __m256 acc0[4], acc1[4];
    for (int r = 0; r < 4; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, qx += 256, dx += 8) {
        __m256i neg32y[8];
        q6_k_q8_offsets(qx, neg32y);
        const __m256 dxv = _mm256_loadu_ps(dx);
        const __m256 dxl = _mm256_permutevar8x32_ps(dxv, dup_lo), dxh = _mm256_permutevar8x32_ps(dxv, dup_hi);
        for (int r = 0; r < 4; r++) {
            const uint8_t *wb = w + r * rs + b * 210;
            kq_prefetch(wb, pfd, 4, pf_end);
            const __m256 d = _mm256_set1_ps(fp16_to_f32(wb + 208));
            const __m128i sc = _mm_loadu_si128((const __m128i *)(wb + 192));
            __m256 sv[2];
            sv[0] = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))), dxl);
            sv[1] = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))), dxh);
            for (int h = 0; h < 2; h++) {
                __m256i q[4];
                q6_k_q8_groups(wb, h, q);
                for (int g = 0; g < 4; g++) {
                    const __m256i y = _mm256_loadu_si256((const __m256i *)(qx + 128 * h + 32 * g));
                    const __m256i p = q6_k_q8_dot(q[g], y, neg32y[4 * h + g]);
                    const __m256 scale = _mm256_permutevar8x32_ps(
                        sv[h], _mm256_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1));
                    if (g & 1) acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc1[r]);
                    else acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc0[r]);
                }
            }
        }
    }
    for (int r = 0; r < 4; r++) out[r] = hsum8(_mm256_add_ps(acc0[r], acc1[r]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define MOE_KQ_512 1
/* The AVX-512 twins: two rows per 512-bit register (lanes 0-7 row r, 8-15 row r + 1, each half the 8-lane
 * accumulator of the one-row kernel: same int32 lanes, scales and fma order), as moe_rows4_run_q8_512. The fp16
 * d / dmin of the 4 rows in one conversion (exact, as fp16_to_f32). */
static inline __m512 kq_pair(__m256 v, int lo, int hi) {      /* lanes 0-7: v[lo], 8-15: v[hi] */
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(lo)), _mm256_set1_epi32(hi), 1);
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v));
}

static inline __m512i kq_rows2(const uint8_t *a, const uint8_t *b) {   /* 32 bytes of a | 32 bytes of b */
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

static inline __m512i q5_k_high_bit_512(__m512i qh, int j) {
    const __m512i h = j <= 4 ? _mm512_slli_epi16(qh, 4 - j) : _mm512_srli_epi16(qh, j - 4);
    return _mm512_and_si512(h, _mm512_set1_epi8(0x10));
}

/* rows a, b's 6-bit scales and mins (scale_min_k4's values) as int32 lanes [a's 8 | b's 8], converted to float:
 * each 128-bit lane holds one row's first 16 bytes (d, dmin, 12 scale bytes; row a in lanes 0-1, b in 2-3), one
 * pshufb puts the byte(s) of int32 lane j (scale j) into its bytes 0-1, shifts and masks finish; replaces two
 * scalar scale_min_k4 and the inserts that moved their u64 results into vectors */
static const int8_t q45_k_sc_idx[64] = {           /* per 128-bit lane; -1: zero */
    4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1,      /* j 0-3: s_j */
    12, 4, -1, -1, 13, 5, -1, -1, 14, 6, -1, -1, 15, 7, -1, -1,      /* j 4-7: s_{j+4}, s_{j-4} */
    4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1,
    12, 4, -1, -1, 13, 5, -1, -1, 14, 6, -1, -1, 15, 7, -1, -1};
static const int8_t q45_k_mn_idx[64] = {
    8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,    /* j 0-3: s_{j+4} */
    12, 8, -1, -1, 13, 9, -1, -1, 14, 10, -1, -1, 15, 11, -1, -1,    /* j 4-7: s_{j+4}, s_j */
    8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
    12, 8, -1, -1, 13, 9, -1, -1, 14, 10, -1, -1, 15, 11, -1, -1};

static inline void q45_k_scales_512(__m128i a, __m128i b, __m512 *scf, __m512 *mnf) {
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(a)),
                                         _mm256_broadcastsi128_si256(b), 1);
    const __m512i sh4 = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i lom = _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
    const __m512i k30 = _mm512_set1_epi32(0x30);
    const __m512i t = _mm512_shuffle_epi8(z, _mm512_loadu_si512(q45_k_sc_idx));
    const __m512i u = _mm512_shuffle_epi8(z, _mm512_loadu_si512(q45_k_mn_idx));
    /* sc: t & (63 | 15) | (t >> 10) & 0x30; mn: (u >> (0 | 4)) & (63 | 15) | (u >> 10) & 0x30 */
    const __m512i sc = _mm512_ternarylogic_epi32(_mm512_and_si512(t, lom), _mm512_srli_epi32(t, 10), k30, 0xF8);
    const __m512i mn = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srlv_epi32(u, sh4), lom), _mm512_srli_epi32(u, 10),
                                                 k30, 0xF8);
    *scf = _mm512_cvtepi32_ps(sc);
    *mnf = _mm512_cvtepi32_ps(mn);
}

static inline __attribute__((always_inline)) void moe_rows4_run_q45_k_q8_512(int q5, const uint8_t *w, int64_t rs,
                                                                             const int8_t *qx, const float *dx,
                                                                             const float *sx, int64_t nsb,
                                                                             const uint8_t *pf_end, float *out) {
    const int64_t pfd = kq_prefetch_dist(rs);   /* the same row and block of a later group */
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const int64_t bb = q5 ? 176 : 144, qo = q5 ? 48 : 16;
    __m512 acc0[2], acc1[2], off[2];
    for (int p = 0; p < 2; p++) acc0[p] = acc1[p] = off[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, qx += 256, dx += 8, sx += 8) {
        const uint8_t *wr[4];
        __m128i hx[4];                                     /* each row's d, dmin, 12 scale bytes */
        for (int r = 0; r < 4; r++) {
            wr[r] = w + r * rs + b * bb;
            kq_prefetch(wr[r], pfd, 3, pf_end);
            hx[r] = _mm_loadu_si128((const __m128i *)wr[r]);
        }
        /* [d0 m0 d1 m1 d2 m2 d3 m3]: d, dmin of rows 0-3 (exact conversion, as fp16_to_f32) */
        const __m256 dd = _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm_unpacklo_epi32(hx[0], hx[1]), _mm_unpacklo_epi32(hx[2], hx[3])));
        const __m512 dxv = _mm512_broadcast_f32x8(_mm256_loadu_ps(dx)), sxv = _mm512_broadcast_f32x8(_mm256_loadu_ps(sx));
        __m512 s[2];
        for (int p = 0; p < 2; p++) {
            __m512 scf, mnf;
            q45_k_scales_512(hx[2 * p], hx[2 * p + 1], &scf, &mnf);
            s[p] = _mm512_mul_ps(_mm512_mul_ps(kq_pair(dd, 4 * p, 4 * p + 2), scf), dxv);
            off[p] = _mm512_fmadd_ps(_mm512_mul_ps(kq_pair(dd, 4 * p + 1, 4 * p + 3), mnf), sxv, off[p]);
        }
        for (int c = 0; c < 4; c++) {
            const __m512i y0 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qx + 64 * c)));
            const __m512i y1 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qx + 64 * c + 32)));
            const __m512i i0 = _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(8 + 2 * c), 1);
            const __m512i i1 = _mm512_inserti64x4(_mm512_set1_epi32(2 * c + 1), _mm256_set1_epi32(9 + 2 * c), 1);
            for (int p = 0; p < 2; p++) {
                const __m512i q = kq_rows2(wr[2 * p] + qo + 32 * c, wr[2 * p + 1] + qo + 32 * c);
                __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                if (q5) {
                    const __m512i qh = kq_rows2(wr[2 * p] + 16, wr[2 * p + 1] + 16);
                    lo = _mm512_or_si512(lo, q5_k_high_bit_512(qh, 2 * c));
                    hi = _mm512_or_si512(hi, q5_k_high_bit_512(qh, 2 * c + 1));
                }
                const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, y0);
                const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, y1);
                acc0[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_permutexvar_ps(i0, s[p]), acc0[p]);
                acc1[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_permutexvar_ps(i1, s[p]), acc1[p]);
            }
        }
    }
    for (int p = 0; p < 2; p++) {
        const __m512 a = _mm512_add_ps(acc0[p], acc1[p]);
        out[2 * p] = hsum8(_mm512_castps512_ps256(a)) - hsum8(_mm512_castps512_ps256(off[p]));
        out[2 * p + 1] = hsum8(_mm512_extractf32x8_ps(a, 1)) - hsum8(_mm512_extractf32x8_ps(off[p], 1));
    }
}

/* Q6_K: sum q y - 32 sum y as the AVX2 kernel, one VNNI op per group and row pair (the one-row kernel: sub, abs,
 * sign, dpbusd per group and row) */
static void moe_rows4_run_q6_k_q8_512(const uint8_t *w, int64_t rs, const int8_t *qx, const float *dx, int64_t nsb,
                                      const uint8_t *pf_end, float *out) {
    const int64_t pfd = kq_prefetch_dist(rs);   /* the same row and block of a later group */
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30), k32 = _mm512_set1_epi8(32);
    const __m512i dup_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1, 2, 2, 3, 3);
    const __m512i dup_hi = _mm512_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512 acc0[2], acc1[2];
    for (int p = 0; p < 2; p++) acc0[p] = acc1[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, qx += 256, dx += 8) {
        const uint8_t *wr[4];
        uint16_t hd[8] = {0};
        for (int r = 0; r < 4; r++) {
            wr[r] = w + r * rs + b * 210;
            kq_prefetch(wr[r], pfd, 4, pf_end);
            memcpy(&hd[r], wr[r] + 208, 2);
        }
        const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hd));
        const __m512 dxv = _mm512_castps256_ps512(_mm256_loadu_ps(dx));
        const __m512 dxl = _mm512_permutexvar_ps(dup_lo, dxv), dxh = _mm512_permutexvar_ps(dup_hi, dxv);
        __m512i y[8], neg32y[8];
        for (int g = 0; g < 8; g++) {
            y[g] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qx + 32 * g)));
            neg32y[g] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), k32, y[g]));
        }
        for (int p = 0; p < 2; p++) {
            const uint8_t *w0 = wr[2 * p], *w1 = wr[2 * p + 1];
            const __m512 d = kq_pair(dd, 2 * p, 2 * p + 1);
            const __m128i sc0 = _mm_loadu_si128((const __m128i *)(w0 + 192)), sc1 = _mm_loadu_si128((const __m128i *)(w1 + 192));
            __m512 sv[2];                              /* lane i of half r of sv[h]: row r's d sc[8 h + i] dx[4 h + i / 2] */
            sv[0] = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(sc0, sc1)))), dxl);
            sv[1] = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(sc0, sc1)))), dxh);
            for (int h = 0; h < 2; h++) {
                const __m512i ql0 = kq_rows2(w0 + 64 * h, w1 + 64 * h), ql1 = kq_rows2(w0 + 64 * h + 32, w1 + 64 * h + 32);
                const __m512i hb = kq_rows2(w0 + 128 + 32 * h, w1 + 128 + 32 * h);
                __m512i q[4];
                q[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(ql0, m4), _mm512_slli_epi16(hb, 4), m30, 0xF8);
                q[1] = _mm512_ternarylogic_epi32(_mm512_and_si512(ql1, m4), _mm512_slli_epi16(hb, 2), m30, 0xF8);
                q[2] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql0, 4), m4), hb, m30, 0xF8);
                q[3] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql1, 4), m4), _mm512_srli_epi16(hb, 2),
                                                 m30, 0xF8);
                for (int g = 0; g < 4; g++) {
                    const __m512i pi = _mm512_dpbusd_epi32(neg32y[4 * h + g], q[g], y[4 * h + g]);
                    const __m512i si = _mm512_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1,
                                                         8 + 2 * g, 8 + 2 * g, 8 + 2 * g, 8 + 2 * g, 9 + 2 * g, 9 + 2 * g,
                                                         9 + 2 * g, 9 + 2 * g);
                    const __m512 scale = _mm512_permutexvar_ps(si, sv[h]);
                    if (g & 1) acc1[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pi), scale, acc1[p]);
                    else acc0[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pi), scale, acc0[p]);
                }
            }
        }
    }
    for (int p = 0; p < 2; p++) {
        const __m512 a = _mm512_add_ps(acc0[p], acc1[p]);
        out[2 * p] = hsum8(_mm512_castps512_ps256(a));
        out[2 * p + 1] = hsum8(_mm512_extractf32x8_ps(a, 1));
    }
}
#endif
