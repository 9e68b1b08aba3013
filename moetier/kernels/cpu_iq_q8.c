/* Codebook rows (MXFP4, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) . int8 activations: part of cpu_moe.c, which #includes this file inside
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

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__) \
    && defined(__GFNI__)
/* AVX-512 VBMI + GFNI (Ice Lake, Sapphire Rapids, Zen 4): no gathers. A super-block's 64 grid indices are one
 * register; the grid values are 3-bit codes (levels 4, 12, .., 52, 62), so grid row i is two 6-bit pair codes,
 * pairs[0][i] = c0 | c1 << 3 and pairs[1][i] = c2 | c3 << 3, each looked up for all 64 indices by two vpermi2b
 * (128 entries) and a blend on index bit 7, then mapped to levels by one vpermb each: register Z_j holds value j
 * of all 64 grid rows (byte p: element 4 p + j). x is rearranged to match (Y_j byte p = x[4 p + j]: 4 vpermi2b,
 * 4 lane shuffles), the signs are 4 masks (bit p: element 4 p + j negative) tested from 64 bytes, byte p the
 * ksigns of group p / 2 (one multishift of the aux words, the parity bit by a GF(2) affine map); dword k of
 * the 4 chained dot products holds elements of sub-block k / 2 only: one convert and one FMA per super-block.
 * Dev box (1 thread, matrix hot in L2): 5.9 GB/s (the 16-lane-gather version) -> 8.3-8.8 GB/s, ~33 cycles per
 * super-block, bound by the shuffle port (vpermi2b counts twice); removing any one part (lookups, x rearranged,
 * signs) saves 6-8 cycles. Tried and slower: signs as element-order masks through memory applied to x before
 * its rearrangement (+2 cycles), masks by shift + vpmovb2m instead of vptestmb (+5), unrolled by 2 (same). */
static uint8_t iq3_xxs_q8_pairs[2][256] __attribute__((aligned(64)));   /* [0]: code0 | code1 << 3, [1]: 2, 3 */
static uint8_t iq3_xxs_q8_levels[2][64] __attribute__((aligned(64)));   /* [0]: level[v & 7], [1]: level[v >> 3] */
/* vpermi2b controls: 128 bytes of x -> [x[4 p + j] (p < 32), x[4 p + j + 1] (p < 32)], j = 0 ([0]) and 2 ([1]) */
#define IQ3_Q8_SEL(j) 4 * 0 + j, 4 * 1 + j, 4 * 2 + j, 4 * 3 + j, 4 * 4 + j, 4 * 5 + j, 4 * 6 + j, 4 * 7 + j, \
    4 * 8 + j, 4 * 9 + j, 4 * 10 + j, 4 * 11 + j, 4 * 12 + j, 4 * 13 + j, 4 * 14 + j, 4 * 15 + j, 4 * 16 + j, \
    4 * 17 + j, 4 * 18 + j, 4 * 19 + j, 4 * 20 + j, 4 * 21 + j, 4 * 22 + j, 4 * 23 + j, 4 * 24 + j, 4 * 25 + j, \
    4 * 26 + j, 4 * 27 + j, 4 * 28 + j, 4 * 29 + j, 4 * 30 + j, 4 * 31 + j
static const uint8_t iq3_xxs_q8_ysel[2][64] __attribute__((aligned(64))) = {{IQ3_Q8_SEL(0), IQ3_Q8_SEL(1)},
                                                                             {IQ3_Q8_SEL(2), IQ3_Q8_SEL(3)}};
#undef IQ3_Q8_SEL

__attribute__((constructor)) static void iq3_xxs_q8_init(void) {
    for (int i = 0; i < 256; i++)                          /* grid values 4, 12, .., 52, 62: code (v - 4) >> 3 */
        for (int h = 0; h < 2; h++)
            iq3_xxs_q8_pairs[h][i] = (uint8_t)(((iq3xxs_grid[i][2 * h] - 4) >> 3) | ((iq3xxs_grid[i][2 * h + 1] - 4) >> 3) << 3);
    for (int i = 0; i < 256; i++)
        for (int j = 0; j < 4; j++) {
            const int c = (iq3xxs_grid[i][j] - 4) >> 3;
            for (int v = 0; v < 64; v++) {
                if ((v & 7) == c) iq3_xxs_q8_levels[0][v] = iq3xxs_grid[i][j];
                if ((v >> 3) == c) iq3_xxs_q8_levels[1][v] = iq3xxs_grid[i][j];
            }
        }
}

static float moe_row_iq3_xxs_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    const __m512i t01a = _mm512_load_si512(iq3_xxs_q8_pairs[0]), t01b = _mm512_load_si512(iq3_xxs_q8_pairs[0] + 64);
    const __m512i t01c = _mm512_load_si512(iq3_xxs_q8_pairs[0] + 128), t01d = _mm512_load_si512(iq3_xxs_q8_pairs[0] + 192);
    const __m512i t23a = _mm512_load_si512(iq3_xxs_q8_pairs[1]), t23b = _mm512_load_si512(iq3_xxs_q8_pairs[1] + 64);
    const __m512i t23c = _mm512_load_si512(iq3_xxs_q8_pairs[1] + 128), t23d = _mm512_load_si512(iq3_xxs_q8_pairs[1] + 192);
    const __m512i lv0 = _mm512_load_si512(iq3_xxs_q8_levels[0]), lv1 = _mm512_load_si512(iq3_xxs_q8_levels[1]);
    const __m512i cy01 = _mm512_loadu_si512(iq3_xxs_q8_ysel[0]), cy23 = _mm512_loadu_si512(iq3_xxs_q8_ysel[1]);
    const __m512i cms = _mm512_set1_epi64(0x15150E0E07070000LL);  /* byte p of qword s (aux[s]) -> field (p % 8) / 2 */
    const __m512i b0 = _mm512_set1_epi16(0x1001), b1 = _mm512_set1_epi16(0x2002);
    const __m512i b2 = _mm512_set1_epi16(0x4004), b3 = _mm512_set1_epi16((short)0x8008);
    const __m512i spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  /* lane k: sub-block k / 2 */
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 98, qx += 256, dx += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        const __m512i idx = _mm512_loadu_si512((const void *)(w + 2));
        const __mmask64 hi = _mm512_movepi8_mask(idx);
        const __m512i t01 = _mm512_mask_blend_epi8(hi, _mm512_permutex2var_epi8(t01a, idx, t01b),
                                                   _mm512_permutex2var_epi8(t01c, idx, t01d));
        const __m512i t23 = _mm512_mask_blend_epi8(hi, _mm512_permutex2var_epi8(t23a, idx, t23b),
                                                   _mm512_permutex2var_epi8(t23c, idx, t23d));
        const __m512i y0 = _mm512_loadu_si512((const void *)qx), y1 = _mm512_loadu_si512((const void *)(qx + 64));
        const __m512i y2 = _mm512_loadu_si512((const void *)(qx + 128)), y3 = _mm512_loadu_si512((const void *)(qx + 192));
        const __m512i a01 = _mm512_permutex2var_epi8(y0, cy01, y1), a23 = _mm512_permutex2var_epi8(y0, cy23, y1);
        const __m512i e01 = _mm512_permutex2var_epi8(y2, cy01, y3), e23 = _mm512_permutex2var_epi8(y2, cy23, y3);
        __m512i Y0 = _mm512_shuffle_i64x2(a01, e01, 0x44), Y1 = _mm512_shuffle_i64x2(a01, e01, 0xEE);
        __m512i Y2 = _mm512_shuffle_i64x2(a23, e23, 0x44), Y3 = _mm512_shuffle_i64x2(a23, e23, 0xEE);
        const __m256i aux = _mm256_loadu_si256((const __m256i *)(w + 66));
        /* byte p: iq_ksigns[f] = f | parity(f) << 7 of its group's 7-bit field f, as one GF(2) affine map (matrix
         * byte 7 - i: the bits that output bit i xors; bits 0-6 copied, bit 7 = xor of bits 0-6, so the multishift's
         * 8th bit, the next field's first, drops out) */
        const __m512i sg = _mm512_gf2p8affine_epi64_epi8(_mm512_multishift_epi64_epi8(cms, _mm512_cvtepu32_epi64(aux)),
                                                         _mm512_set1_epi64(0x010204081020407FLL), 0);
        Y0 = _mm512_mask_sub_epi8(Y0, _mm512_test_epi8_mask(sg, b0), zero, Y0);
        Y1 = _mm512_mask_sub_epi8(Y1, _mm512_test_epi8_mask(sg, b1), zero, Y1);
        Y2 = _mm512_mask_sub_epi8(Y2, _mm512_test_epi8_mask(sg, b2), zero, Y2);
        Y3 = _mm512_mask_sub_epi8(Y3, _mm512_test_epi8_mask(sg, b3), zero, Y3);
        __m512i p = _mm512_dpbusd_epi32(zero, _mm512_permutexvar_epi8(t01, lv0), Y0);
        p = _mm512_dpbusd_epi32(p, _mm512_permutexvar_epi8(t01, lv1), Y1);
        __m512i q = _mm512_dpbusd_epi32(zero, _mm512_permutexvar_epi8(t23, lv0), Y2);
        q = _mm512_dpbusd_epi32(q, _mm512_permutexvar_epi8(t23, lv1), Y3);
        /* sub-block s: d (2 ls + 1) / 4 dx_s, the / 4 applied to the sum; 2 ls + 1 = aux >> 27 | 1 */
        const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(aux, 27), _mm256_set1_epi32(1))),
                                        _mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(w)), _mm256_loadu_ps(dx)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(p, q)), _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(sc)), acc);
    }
    return 0.25f * _mm512_reduce_add_ps(acc);
}
#else
static float moe_row_iq3_xxs_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    #pragma GCC unroll 2
    for (int64_t b = 0; b < nsb; b++, w += 98, qx += 256, dx += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        uint32_t aux[8];
        memcpy(aux, w + 66, 32);
        /* lane s: d (2 ls_s + 1) dx_s (the / 4 applied to the sum), broadcast per sub-block by one permute */
        const __m256 sc = _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)aux), 27), _mm256_set1_epi32(1))),
            _mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(w)), _mm256_loadu_ps(dx)));
        for (int s = 0; s < 8; s += 2) {
            const __m256i p0 = iq3_xxs_q8_dot(w + 2 + 8 * s, aux[s], qx + 32 * s);
            const __m256i p1 = iq3_xxs_q8_dot(w + 10 + 8 * s, aux[s + 1], qx + 32 * s + 32);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_permutevar8x32_ps(sc, _mm256_set1_epi32(s)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_permutevar8x32_ps(sc, _mm256_set1_epi32(s + 1)), acc1);
        }
    }
    return 0.25f * hsum8(_mm256_add_ps(acc0, acc1));
}
#endif

/* ---- IQ3_S: a sub-block's 8 grid rows (9-bit indices: qs bytes | qh bits << 8) are one gather of 8 u32 (32
 * unsigned levels 1..15); its 32 sign bits become +-1 bytes applied to x (sign_epi8); u8 x s8 dot; scale
 * d (1 + 2 sc) dx per sub-block ---- */
static inline __m256i iq3_s_q8_dot(const uint8_t *qs, uint32_t qh, const uint8_t *sg, const int8_t *y) {
    const __m256i ys = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y), _mm256_or_si256(iq3_s_neg32(sg), _mm256_set1_epi8(1)));
    return moe_dot_u8s8(iq3_s_grid32(qs, qh), ys);
}

static float moe_row_iq3_s_q8_avx2(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 110, qx += 256, dx += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        const float d = fp16_to_f32(w);
        for (int s = 0; s < 8; s += 2) {
            const __m256i p0 = iq3_s_q8_dot(w + 2 + 8 * s, w[66 + s], w + 74 + 4 * s, qx + 32 * s);
            const __m256i p1 = iq3_s_q8_dot(w + 10 + 8 * s, w[67 + s], w + 78 + 4 * s, qx + 32 * s + 32);
            const uint8_t sc = w[106 + s / 2];
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d * (float)(1 + 2 * (sc & 15)) * dx[s]), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d * (float)(1 + 2 * (sc >> 4)) * dx[s + 1]), acc1);
        }
    }
    return hsum8(_mm256_add_ps(acc0, acc1));
}

/* ---- IQ1_S / IQ1_M: each index picks 8 int8 weights 8 (v + delta) from iq1_grid8 (cpu_iquants.c): two
 * sub-blocks' 8 indices are one vector, two gathers of 4 u64 give their 2 x 32 weights; signed x signed through the
 * sign trick (no weight is 0); the 1/8 folded into the scale. IQ1_M's per-16 scales 2 ls + 1 multiply the
 * maddubs pair sums (madd: <= 2 x 2286 x 15, no overflow) before the per-32 dx. ---- */
static inline __m256i iq1_q8_signed(__m256i w, const int8_t *y) {   /* |w| (u8) and y with w's signs */
    return _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y), w);
}

/* IQ1_S: iq1_grid8 + 9 (unsigned 0..18, iq1_grid8u) x y through maddubs (pairs <= 2 x 18 x 128: no saturation), no
 * sign trick; 9 sum y taken off once per row through sx (dx sum qx): off = sum over sub-blocks of dl sx. The int32
 * dot per 32 is the old one plus 9 sum y exactly; only the float rounding of the result moves.
 * 1 thread, 768 x 2048 hot (haswell build, best of 5): 124-138 -> 101-115 us (1.20-1.23x; llama.cpp AVX2: 110);
 * 4 scalar row loads per 32 instead of the two gathers: 139 against 114. */
static uint64_t iq1_grid8u[4096] __attribute__((aligned(64)));      /* iq1_grid8 + 9 per byte */

__attribute__((constructor)) static void iq1_grid8u_init(void) {
    iq1_grid8_init();                        /* constructors' order across the unit is not guaranteed */
    for (int i = 0; i < 4096; i++) {
        uint8_t v[8];
        memcpy(v, &iq1_grid8[i], 8);
        for (int j = 0; j < 8; j++) v[j] = (uint8_t)((int8_t)v[j] + 9);
        memcpy(&iq1_grid8u[i], v, 8);
    }
}

static float moe_row_iq1_s_q8_avx2(const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, int64_t nsb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 50, qx += 256, dx += 8, sx += 8) {
        PREFETCH(w);
        const __m256i hq = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 34)));   /* lane s: qh[s] */
        const __m256i ls = _mm256_and_si256(_mm256_srli_epi32(hq, 12), _mm256_set1_epi32(7));
        const __m256i ls21 = _mm256_or_si256(_mm256_slli_epi32(ls, 1), _mm256_set1_epi32(1));     /* 2 ls + 1 */
        const __m256 dl = _mm256_mul_ps(_mm256_set1_ps(0.125f * fp16_to_f32(w)), _mm256_cvtepi32_ps(ls21));
        off = _mm256_fmadd_ps(dl, _mm256_loadu_ps(sx), off);
        const __m256 sc = _mm256_mul_ps(dl, _mm256_loadu_ps(dx));
        for (int s = 0; s < 8; s += 2) {
            const __m256i idx = iq1_s_idx8(w + 2, hq, s);
            const long long *g = (const long long *)iq1_grid8u;
            const __m256i w0 = _mm256_i32gather_epi64(g, _mm256_castsi256_si128(idx), 8);
            const __m256i w1 = _mm256_i32gather_epi64(g, _mm256_extracti128_si256(idx, 1), 8);
            const __m256i p0 = moe_dot_u8s8(w0, _mm256_loadu_si256((const __m256i *)(qx + 32 * s)));
            const __m256i p1 = moe_dot_u8s8(w1, _mm256_loadu_si256((const __m256i *)(qx + 32 * s + 32)));
            const __m256 sc0 = _mm256_permutevar8x32_ps(sc, _mm256_set1_epi32(s));
            const __m256 sc1 = _mm256_permutevar8x32_ps(sc, _mm256_set1_epi32(s + 1));
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), sc0, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), sc1, acc1);
        }
    }
    return hsum8(_mm256_add_ps(acc0, acc1)) - 9.f * hsum8(off);
}

static inline __m256i iq1_m_q8_scales(uint16_t sc, int half) {    /* int16 lanes: 2 ls + 1 of values 0-15 | 16-31 */
    const int lo = 2 * ((sc >> (6 * half)) & 7) + 1, hi = 2 * ((sc >> (6 * half + 3)) & 7) + 1;
    return _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo));
}

static float moe_row_iq1_m_q8_avx2(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 56, qx += 256, dx += 8) {
        PREFETCH(w);
        const float d = 0.125f * iq1_m_d(w);
        uint16_t sc[4];
        memcpy(sc, w + 48, 8);
        for (int s = 0; s < 8; s += 2) {
            __m256i w0, w1;
            iq1_weights64(iq1_m_idx8(w, s), &w0, &w1);
            const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w0), iq1_q8_signed(w0, qx + 32 * s)),
                                                 iq1_m_q8_scales(sc[s / 2], 0));
            const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w1), iq1_q8_signed(w1, qx + 32 * s + 32)),
                                                 iq1_m_q8_scales(sc[s / 2], 1));
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d * dx[s]), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d * dx[s + 1]), acc1);
        }
    }
    return hsum8(_mm256_add_ps(acc0, acc1));
}

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
/* AVX-512 VNNI: two sub-blocks (64 values) per register. IQ3_S: one gather of 16 grid rows, the 64 sign bits a byte
 * mask negating x (no expansion), one dpbusd. IQ1_S / IQ1_M: one gather of 8 rows of iq1_grid8 + 9 (unsigned 0..18),
 * one dpbusd, the 9 sum x taken off: IQ1_S per 32 through sx (dx sum qx, float), IQ1_M per 4 lanes in the integer
 * sum (its scales are per 16). Scales: a super-block's as one float vector, spread to lanes by a permute. */
static float moe_row_iq3_s_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    const __m512i bits = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 110, qx += 256, dx += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        uint32_t sc4;
        memcpy(&sc4, w + 106, 4);           /* nibble s: sub-block s's scale */
        const __m256i ls = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)sc4), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                            _mm256_set1_epi32(15));
        const __m512 sc = _mm512_castps256_ps512(_mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_slli_epi32(ls, 1), _mm256_set1_epi32(1))),
            _mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(w)), _mm256_loadu_ps(dx))));
        for (int r = 0; r < 4; r++) {       /* sub-blocks 2 r, 2 r + 1 */
            uint16_t qh;
            uint64_t sg;
            memcpy(&qh, w + 66 + 2 * r, 2);
            memcpy(&sg, w + 74 + 8 * r, 8);
            const __m512i idx = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 2 + 16 * r))),
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(qh), bits), _mm512_set1_epi32(1)), 8));
            const __m512i grid = _mm512_i32gather_epi32(idx, (const int *)iq3s_grid, 4);
            const __m512i y = _mm512_loadu_si512((const void *)(qx + 64 * r));
            const __m512i p = _mm512_dpbusd_epi32(zero, grid, _mm512_mask_sub_epi8(y, (__mmask64)sg, zero, y));
            const __m512i lane = _mm512_set_epi32(2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1,
                                                  2 * r + 1, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(lane, sc), acc);
        }
    }
    return _mm512_reduce_add_ps(acc);
}

static float moe_row_iq1_s_q8_sx(const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, int64_t nsb) {
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    __m256 off = _mm256_setzero_ps();       /* sum over sub-blocks of dl sx: 9 of it taken off at the end */
    for (int64_t b = 0; b < nsb; b++, w += 50, qx += 256, dx += 8, sx += 8) {
        PREFETCH(w);
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 34)));    /* lane s: qh[s] */
        const __m256 dl = _mm256_mul_ps(_mm256_set1_ps(0.125f * fp16_to_f32(w)), _mm256_cvtepi32_ps(_mm256_or_si256(
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 12), _mm256_set1_epi32(7)), 1), _mm256_set1_epi32(1))));
        off = _mm256_fmadd_ps(dl, _mm256_loadu_ps(sx), off);
        const __m512 sc = _mm512_castps256_ps512(_mm256_mul_ps(dl, _mm256_loadu_ps(dx)));
        for (int r = 0; r < 4; r++) {
            const __m512i wq = _mm512_i32gather_epi64(iq1_s_idx8(w + 2, h, 2 * r), (const long long *)iq1_grid8u, 8);
            const __m512i p = _mm512_dpbusd_epi32(zero, wq, _mm512_loadu_si512((const void *)(qx + 64 * r)));
            const __m512i lane = _mm512_set_epi32(2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1,
                                                  2 * r + 1, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(lane, sc), acc);
        }
    }
    return _mm512_reduce_add_ps(acc) - 9.f * hsum8(off);
}

static float moe_row_iq1_m_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    const __m512i word = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);     /* lane t: sc[t / 4] */
    const __m512i field = _mm512_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9);
    const __m512i half = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);      /* lane t: dx[t / 2] */
    const __m512i nine = _mm512_set1_epi8(9), zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 56, qx += 256, dx += 8) {
        PREFETCH(w);
        /* lane t: d (2 ls_t + 1) dx[t / 2], the scale of values 16 t .. 16 t + 15 */
        const __m512i ls = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(word,
            _mm512_cvtepu16_epi32(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(w + 48))))), field), _mm512_set1_epi32(7));
        const __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_or_si512(_mm512_slli_epi32(ls, 1), _mm512_set1_epi32(1))),
            _mm512_mul_ps(_mm512_set1_ps(0.125f * iq1_m_d(w)), _mm512_permutexvar_ps(half, _mm512_castps256_ps512(_mm256_loadu_ps(dx)))));
        for (int r = 0; r < 4; r++) {       /* values 64 r .. 64 r + 63: rows 8 r .. 8 r + 7, scales 4 r .. 4 r + 3 */
            const __m512i wq = _mm512_i32gather_epi64(iq1_m_idx8(w, 2 * r), (const long long *)iq1_grid8u, 8);
            const __m512i y = _mm512_loadu_si512((const void *)(qx + 64 * r));
            const __m512i p = _mm512_dpbusd_epi32(_mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, nine, y)), wq, y);
            const __m512i lane = _mm512_setr_epi32(4 * r, 4 * r, 4 * r, 4 * r, 4 * r + 1, 4 * r + 1, 4 * r + 1, 4 * r + 1,
                                                   4 * r + 2, 4 * r + 2, 4 * r + 2, 4 * r + 2, 4 * r + 3, 4 * r + 3, 4 * r + 3, 4 * r + 3);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(lane, sc), acc);
        }
    }
    return _mm512_reduce_add_ps(acc);
}
#else
static float moe_row_iq3_s_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    return moe_row_iq3_s_q8_avx2(w, qx, dx, nsb);
}
static float moe_row_iq1_s_q8_sx(const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, int64_t nsb) {
    return moe_row_iq1_s_q8_avx2(w, qx, dx, sx, nsb);
}
static float moe_row_iq1_m_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    return moe_row_iq1_m_q8_avx2(w, qx, dx, nsb);
}
#endif
