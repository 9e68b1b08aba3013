/* K-quant row kernels (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): part of cpu_kernels.c, which #includes this file after
 * its SIMD vocabulary (vf / vi, vq5f / vq6f), fp16_to_f32 and PREFETCH; not compiled on its own. */

/* ---- Q4_K: 144-byte super-blocks of 256 {fp16 d, fp16 dmin, u8 scales[12], u8 qs[128]};
 * value = d * sc[j] * q - dmin * mn[j] for sub-block j (32 elements); qs chunk c (32 bytes)
 * holds sub-block 2c in its low nibbles and 2c+1 in its high nibbles ---- */
/* 12 scale bytes -> sc[0:8] and mn[0:8] (6-bit), each packed as 8 bytes in a u64:
 * bytes 0-3 hold sc[0:4] low 6 bits (top 2 bits -> sc[4:8]); 4-7 likewise for mn;
 * 8-11: sc[4:8] low nibble, mn[4:8] high nibble. Kept in registers, not stored bytewise. */
static inline void scale_min_k4(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    *sc = (a & 0x3F3F3F3Fu) | (uint64_t)((c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)) << 32;
    *mn = (b & 0x3F3F3F3Fu) | (uint64_t)(((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u)) << 32;
}

/* A Q4_K / Q5_K super-block's scales: sc[j], mn[j] (6 bits each, 8 sub-blocks), d and dmin. */
static inline void kq_unpack(const uint8_t *w, uint8_t *sc, uint8_t *mn, float *d, float *dmin) {
    uint64_t sc64, mn64;
    scale_min_k4(w + 4, &sc64, &mn64);
    memcpy(sc, &sc64, 8);                               /* little-endian: byte j = value j */
    memcpy(mn, &mn64, 8);
    *d = fp16_to_f32(w);
    *dmin = fp16_to_f32(w + 2);
}

#ifdef VW
/* A Q4_K / Q5_K super-block's prologue: prefetch it, dsc[j] = d * sc[j], and off += dmin * mn[j] * xs[j]
 * (8 lanes; the min term through x's block sums). */
static inline __m256 kq_scales(const uint8_t *w, const float *xs, float *dsc, __m256 off) {
    PREFETCH(w);
    PREFETCH(w + 64);
    PREFETCH(w + 128);
    uint64_t sc, mn;
    scale_min_k4(w + 4, &sc, &mn);
    __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc)));
    __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mn)));
    _mm256_storeu_ps(dsc, _mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(w)), scf));
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(w + 2)), mnf), _mm256_loadu_ps(xs), off);
}
#endif

static float row_q4_k(const uint8_t *w, const float *x, const float *xs, int64_t nsb) {
#ifdef VW
    vf acc = vzero();
    __m256 off = _mm256_setzero_ps();                   /* sum_j dmin mn[j] xs[j], 8 lanes */
    for (int64_t b = 0; b < nsb; b++, w += 144, x += 256, xs += 8) {
        float dsc[8];                                   /* d * sc[j] */
        off = kq_scales(w, xs, dsc, off);
        const uint8_t *qs = w + 16;
        for (int c = 0; c < 4; c++, qs += 32) {
            const float *x0 = x + 64 * c, *x1 = x0 + 32;
            vf s0 = vzero(), s1 = vzero();
            for (int j = 0; j < 32; j += VW) {
                vi q = vbytes_u8(qs + j);
                s0 = vfma(vlo4f(q), vload(x0 + j), s0);
                s1 = vfma(vhi4f(q), vload(x1 + j), s1);
            }
            acc = vfma(vset1(dsc[2 * c]), s0, acc);
            acc = vfma(vset1(dsc[2 * c + 1]), s1, acc);
        }
    }
    return vsum(acc) - hsum8(off);
#else
    float acc = 0.f, off = 0.f;
    for (int64_t b = 0; b < nsb; b++, w += 144, x += 256, xs += 8) {
        uint8_t sc[8], mn[8];
        float d, dmin;
        kq_unpack(w, sc, mn, &d, &dmin);
        const uint8_t *qs = w + 16;
        for (int c = 0; c < 4; c++, qs += 32) {
            const float *x0 = x + 64 * c, *x1 = x0 + 32;
            float s0 = 0.f, s1 = 0.f;
            for (int j = 0; j < 32; j++) { s0 += (qs[j] & 0x0F) * x0[j]; s1 += (qs[j] >> 4) * x1[j]; }
            acc += d * sc[2 * c] * s0 + d * sc[2 * c + 1] * s1;
        }
        for (int j = 0; j < 8; j++) off += dmin * mn[j] * xs[j];
    }
    return acc - off;
#endif
}

/* ---- Q5_K: 176-byte super-blocks {fp16 d, fp16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]}: Q4_K
 * plus a 5th bit, for element 32 s + j bit s of qh[j] (value = d sc q - dmin mn, q in [0, 32)) ---- */
#if VW == 16 && defined(__AVX512BW__) && defined(__AVX512VBMI__)
/* AVX-512 VBMI: chunk c's 64 values built as bytes in one register (qs broadcast, high half shifted by 4,
 * + 16 where the qh bit tests set), then 16 at a time zero-extended by one vpermb and converted:
 * ~22 uops per 64 values against ~30 for vq5f's per-16 permutes (Q4_K the same way: 7.2 -> 6.6-6.9, not kept) */
static float row_q5_k(const uint8_t *w, const float *x, const float *xs, int64_t nsb) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), k16 = _mm512_set1_epi8(16);
    const __m512i hbit = _mm512_inserti64x4(_mm512_set1_epi8(1), _mm256_set1_epi8(2), 1);   /* 2c -> << 2c */
    __m512i widen[4];                                   /* byte 4 i of widen[g] = 16 g + i: bytes 16 g .. +16 */
    for (int g = 0; g < 4; g++)
        widen[g] = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                    _mm512_set1_epi32(16 * g));
    const __mmask64 low_bytes = 0x1111111111111111ULL;
    __m512 acc = _mm512_setzero_ps();
    __m256 off = _mm256_setzero_ps();                   /* sum_j dmin mn[j] xs[j], 8 lanes */
    for (int64_t b = 0; b < nsb; b++, w += 176, x += 256, xs += 8) {
        float dsc[8];                                   /* d * sc[j] */
        off = kq_scales(w, xs, dsc, off);
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 16)));
        const uint8_t *qs = w + 48;
        for (int c = 0; c < 4; c++, qs += 32) {
            __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qs));
            q = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xFFFF0000u, q, 4), m4);
            const __mmask64 hk = _mm512_test_epi8_mask(h, _mm512_slli_epi16(hbit, 2 * c));
            q = _mm512_mask_add_epi8(q, hk, q, k16);      /* bytes 0-31: sub-block 2c, 32-63: 2c + 1 */
            const float *xc = x + 64 * c;
            __m512 v[4];
            for (int g = 0; g < 4; g++)
                v[g] = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(low_bytes, widen[g], q));
            const __m512 s0 = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(xc + 16), _mm512_mul_ps(v[0], _mm512_loadu_ps(xc)));
            const __m512 s1 = _mm512_fmadd_ps(v[3], _mm512_loadu_ps(xc + 48), _mm512_mul_ps(v[2], _mm512_loadu_ps(xc + 32)));
            acc = _mm512_fmadd_ps(_mm512_set1_ps(dsc[2 * c]), s0, acc);
            acc = _mm512_fmadd_ps(_mm512_set1_ps(dsc[2 * c + 1]), s1, acc);
        }
    }
    return _mm512_reduce_add_ps(acc) - hsum8(off);
}
#else
static float row_q5_k(const uint8_t *w, const float *x, const float *xs, int64_t nsb) {
    float acc_s = 0.f, off = 0.f;
#ifdef VW
    vf acc = vzero();
#endif
    for (int64_t b = 0; b < nsb; b++, w += 176, x += 256, xs += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        PREFETCH(w + 128);
        uint8_t sc[8], mn[8];
        float d, dmin;
        kq_unpack(w, sc, mn, &d, &dmin);
        const uint8_t *qh = w + 16, *qs = w + 48;
        for (int c = 0; c < 4; c++, qs += 32) {
            const float *x0 = x + 64 * c, *x1 = x0 + 32;
#ifdef VW
            vf s0 = vzero(), s1 = vzero();
            for (int j = 0; j < 32; j += VW) {
                vi q = vbytes_u8(qs + j), h = vbytes_u8(qh + j);
                s0 = vfma(vq5f(q, 0, h, 2 * c), vload(x0 + j), s0);
                s1 = vfma(vq5f(q, 4, h, 2 * c + 1), vload(x1 + j), s1);
            }
            acc = vfma(vset1(d * sc[2 * c]), s0, acc);
            acc = vfma(vset1(d * sc[2 * c + 1]), s1, acc);
#else
            float s0 = 0.f, s1 = 0.f;
            for (int j = 0; j < 32; j++) {
                s0 += ((qs[j] & 0x0F) | ((qh[j] >> (2 * c)) & 1) << 4) * x0[j];
                s1 += ((qs[j] >> 4) | ((qh[j] >> (2 * c + 1)) & 1) << 4) * x1[j];
            }
            acc_s += d * sc[2 * c] * s0 + d * sc[2 * c + 1] * s1;
#endif
        }
        for (int j = 0; j < 8; j++) off += dmin * mn[j] * xs[j];
    }
#ifdef VW
    acc_s = vsum(acc);
#endif
    return acc_s - off;
}
#endif

/* ---- Q6_K: 210-byte super-blocks {u8 ql[128], u8 qh[64], i8 scales[16], fp16 d}; per half h (128
 * elements, ql + 64 h, qh + 32 h) element 32 g + l (g < 4, l < 32) is (ql[l + 32 (g & 1)] nibble g >> 1
 * | bits 2g..2g+1 of qh[l] << 4) - 32, scaled by d * scales[8 h + 2 g + l / 16] ---- */
#if VW == 16 && defined(__AVX512BW__) && defined(__AVX512VBMI__)
/* AVX-512 VBMI: half h's 128 values as 2 x 64 bytes (A: groups 0, 1 = ql's low nibbles; B: groups 2, 3 = the
 * high ones; the 2 qh bits of each moved to bits 4-5 by one 16-bit shift), minus 32; then 16 at a time placed in
 * the top byte of int32 lanes by one vpermb and converted: (q - 32) 2^24 exactly, 2^-24 folded into d */
static float row_q6_k(const uint8_t *w, const float *x, int64_t nsb) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30), k32 = _mm512_set1_epi8(32);
    const __m512i sa = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);  /* group 0: << 4, 1: << 2 */
    __m512i widen[4];                                   /* byte 4 i + 3 of widen[m] = 16 m + i */
    for (int m = 0; m < 4; m++)
        widen[m] = _mm512_slli_epi32(_mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                         14, 15), _mm512_set1_epi32(16 * m)), 24);
    const __mmask64 top_bytes = 0x8888888888888888ULL;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 210, x += 256) {
        PREFETCH(w);
        PREFETCH(w + 64);
        PREFETCH(w + 128);
        PREFETCH(w + 192);
        float dsc[16];                                  /* d sc[j] 2^-24 */
        _mm512_storeu_ps(dsc, _mm512_mul_ps(_mm512_set1_ps(fp16_to_f32(w + 208) * 0x1p-24f),
                                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 192))))));
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_loadu_si512((const void *)(w + 64 * h));
            const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h)));
            const __m512i ha = _mm512_and_si512(_mm512_sllv_epi16(hb, sa), m30);               /* groups 0, 1 */
            const __m512i hc = _mm512_and_si512(_mm512_mask_srli_epi16(hb, 0xFFFF0000u, hb, 2), m30);  /* 2, 3 */
            __m512i q[2];
            q[0] = _mm512_sub_epi8(_mm512_ternarylogic_epi32(l, ha, m4, 0xEC), k32);            /* l & 15 | ha */
            q[1] = _mm512_sub_epi8(_mm512_ternarylogic_epi32(_mm512_srli_epi16(l, 4), hc, m4, 0xEC), k32);
            const float *xh = x + 128 * h, *sh = dsc + 8 * h;
            for (int m = 0; m < 8; m += 2) {             /* 16 values m: x + 16 m, scale sh[m] */
                const __m512 v0 = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(top_bytes, widen[m & 3], q[m >> 2]));
                const __m512 v1 = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(top_bytes, widen[(m + 1) & 3], q[m >> 2]));
                acc0 = _mm512_fmadd_ps(_mm512_mul_ps(v0, _mm512_loadu_ps(xh + 16 * m)), _mm512_set1_ps(sh[m]), acc0);
                acc1 = _mm512_fmadd_ps(_mm512_mul_ps(v1, _mm512_loadu_ps(xh + 16 * m + 16)), _mm512_set1_ps(sh[m + 1]), acc1);
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#else
static float row_q6_k(const uint8_t *w, const float *x, int64_t nsb) {
    float acc_s = 0.f;
#ifdef VW
    vf acc = vzero();
#endif
    for (int64_t b = 0; b < nsb; b++, w += 210, x += 256) {
        PREFETCH(w);
        PREFETCH(w + 64);
        PREFETCH(w + 128);
        PREFETCH(w + 192);
        const float d = fp16_to_f32(w + 208);
        const int8_t *sc = (const int8_t *)(w + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            const float *xh = x + 128 * h;
            for (int l0 = 0; l0 < 32; l0 += 16) {      /* each byte of ql / qh widened once for its 2 / 4 values */
#ifdef VW
                vf s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
                for (int l = l0; l < l0 + 16; l += VW) {
                    vi a = vbytes_u8(ql + l), b2 = vbytes_u8(ql + 32 + l), hb = vbytes_u8(qh + l);
                    s0 = vfma(vq6f(a, 0, hb, 0), vload(xh + l), s0);
                    s1 = vfma(vq6f(b2, 0, hb, 2), vload(xh + 32 + l), s1);
                    s2 = vfma(vq6f(a, 4, hb, 4), vload(xh + 64 + l), s2);
                    s3 = vfma(vq6f(b2, 4, hb, 6), vload(xh + 96 + l), s3);
                }
                const int8_t *sg = sc + 8 * h + l0 / 16;  /* group g's scale: sg[2 g] */
                acc = vfma(vset1(d * sg[0]), s0, acc);
                acc = vfma(vset1(d * sg[2]), s1, acc);
                acc = vfma(vset1(d * sg[4]), s2, acc);
                acc = vfma(vset1(d * sg[6]), s3, acc);
#else
                for (int g = 0; g < 4; g++) {
                    const uint8_t *qg = ql + 32 * (g & 1);
                    const int ls = 4 * (g >> 1);
                    float s = 0.f;
                    for (int l = l0; l < l0 + 16; l++)
                        s += ((((qg[l] >> ls) & 0x0F) | ((qh[l] >> (2 * g)) & 3) << 4) - 32) * xh[32 * g + l];
                    acc_s += d * sc[8 * h + 2 * g + l0 / 16] * s;
                }
#endif
            }
        }
    }
#ifdef VW
    acc_s = vsum(acc);
#endif
    return acc_s;
}
#endif

/* ---- Q2_K / Q3_K (llama.cpp's Q2_K and Q3_K_S/M/L files): 256 values in 16 sub-blocks of 16, 2-bit quants in
 * qs[64]; value 128 h + 32 j + l (h < 2, j < 4, l < 32) is q = (qs[32 h + l] >> 2 j) & 3 of sub-block
 * i = 8 h + 2 j + l / 16. Group g = 4 h + j (32 values) holds sub-blocks 2 g, 2 g + 1.
 * Q2_K: 84 bytes {u8 scales[16], u8 qs[64], fp16 d, fp16 dmin}, value d (scales[i] & 15) q - dmin (scales[i] >> 4).
 * Q3_K: 110 bytes {u8 hmask[32], u8 qs[64], u8 scales[12], fp16 d}, value d (sc_i - 32) (q + 4 hbit - 4), hbit =
 * bit g of hmask[l], sc_i 6 bits (q3_k_scales). ---- */
static inline void q3_k_scales(const uint8_t *s, int8_t *sc) {     /* 12 bytes -> 16 scales, 32 taken off */
    uint32_t a[3], o[4];
    memcpy(a, s, 12);
    const uint32_t m4 = 0x0F0F0F0Fu, m2 = 0x03030303u;
    o[0] = (a[0] & m4) | (a[2] & m2) << 4;                  /* i < 4: low nibble of s[i], bits 0-1 of s[8 + i] */
    o[1] = (a[1] & m4) | (a[2] >> 2 & m2) << 4;             /* 4-7: low nibble of s[i], bits 2-3 of s[4 + i] */
    o[2] = (a[0] >> 4 & m4) | (a[2] >> 4 & m2) << 4;        /* 8-11: high nibble of s[i - 8], bits 4-5 */
    o[3] = (a[1] >> 4 & m4) | (a[2] >> 6 & m2) << 4;        /* 12-15: high nibble of s[i - 8], bits 6-7 */
    uint8_t u[16];
    memcpy(u, o, 16);
    for (int i = 0; i < 16; i++) sc[i] = (int8_t)(u[i] - 32);
}

#if VW == 16
static inline vi vsrl(vi v, int s) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(s)); }
static inline vi vand(vi v, int m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
static inline vi vor(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vsub1(vi v, int c) { return _mm512_sub_epi32(v, _mm512_set1_epi32(c)); }
static inline vi vsll(vi v, int s) { return _mm512_sll_epi32(v, _mm_cvtsi32_si128(s)); }
static inline vf kq_vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline void kq_vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
#elif defined(VW)
static inline vi vsrl(vi v, int s) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(s)); }
static inline vi vand(vi v, int m) { return _mm256_and_si256(v, _mm256_set1_epi32(m)); }
static inline vi vor(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vsub1(vi v, int c) { return _mm256_sub_epi32(v, _mm256_set1_epi32(c)); }
static inline vi vsll(vi v, int s) { return _mm256_sll_epi32(v, _mm_cvtsi32_si128(s)); }
static inline vf kq_vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline void kq_vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
#endif

static float row_q2_k(const uint8_t *w, const float *x, int64_t nsb) {
    float acc_s = 0.f, off_s = 0.f;
#ifdef VW
    vf acc = vzero(), off = vzero();                    /* d sc q x, dmin mn x */
#endif
    for (int64_t b = 0; b < nsb; b++, w += 84, x += 256) {
        PREFETCH(w);
        PREFETCH(w + 64);
        const float d = fp16_to_f32(w + 80), dmin = fp16_to_f32(w + 82);
        const uint8_t *sc = w;
        for (int g = 0; g < 8; g++) {
            const uint8_t *qs = w + 16 + 32 * (g >> 2);
            const float *xg = x + 32 * g;
            const int sh = 2 * (g & 3);
#ifdef VW
            vf s[2] = {vzero(), vzero()}, t[2] = {vzero(), vzero()};      /* per sub-block: q x, x */
            for (int l = 0; l < 32; l += VW) {
                const vf xv = vload(xg + l);
                s[l / 16] = vfma(vcvt(vand(vsrl(vbytes_u8(qs + l), sh), 3)), xv, s[l / 16]);
                t[l / 16] = vadd(t[l / 16], xv);
            }
            for (int u = 0; u < 2; u++) {
                acc = vfma(vset1(d * (float)(sc[2 * g + u] & 15)), s[u], acc);
                off = vfma(vset1(dmin * (float)(sc[2 * g + u] >> 4)), t[u], off);
            }
#else
            for (int u = 0; u < 2; u++) {
                float s = 0.f, t = 0.f;
                for (int l = 16 * u; l < 16 * u + 16; l++) {
                    s += (float)((qs[l] >> sh) & 3) * xg[l];
                    t += xg[l];
                }
                acc_s += d * (float)(sc[2 * g + u] & 15) * s;
                off_s += dmin * (float)(sc[2 * g + u] >> 4) * t;
            }
#endif
        }
    }
#ifdef VW
    acc_s = vsum(acc);
    off_s = vsum(off);
#endif
    return acc_s - off_s;
}

static float row_q3_k(const uint8_t *w, const float *x, int64_t nsb) {
    float acc_s = 0.f;
#ifdef VW
    vf acc = vzero();
#endif
    for (int64_t b = 0; b < nsb; b++, w += 110, x += 256) {
        PREFETCH(w);
        PREFETCH(w + 64);
        const float d = fp16_to_f32(w + 108);
        int8_t sc[16];
        q3_k_scales(w + 96, sc);
        for (int g = 0; g < 8; g++) {
            const uint8_t *qs = w + 32 + 32 * (g >> 2), *hm = w;
            const float *xg = x + 32 * g;
            const int sh = 2 * (g & 3);
#ifdef VW
            vf s[2] = {vzero(), vzero()};
            for (int l = 0; l < 32; l += VW) {
                const vi q = vor(vand(vsrl(vbytes_u8(qs + l), sh), 3), vsll(vand(vsrl(vbytes_u8(hm + l), g), 1), 2));
                s[l / 16] = vfma(vcvt(vsub1(q, 4)), vload(xg + l), s[l / 16]);
            }
            acc = vfma(vset1(d * (float)sc[2 * g]), s[0], acc);
            acc = vfma(vset1(d * (float)sc[2 * g + 1]), s[1], acc);
#else
            for (int u = 0; u < 2; u++) {
                float s = 0.f;
                for (int l = 16 * u; l < 16 * u + 16; l++)
                    s += (float)((int)((qs[l] >> sh) & 3) + 4 * ((hm[l] >> g) & 1) - 4) * xg[l];
                acc_s += d * (float)sc[2 * g + u] * s;
            }
#endif
        }
    }
#ifdef VW
    acc_s = vsum(acc);
#endif
    return acc_s;
}

/* dequantizers, the torch twin's float ops in its order (quant/kquants.py): bit-exact (dl q - ml as dl q + (-ml)) */
static void dequant_q2_k(const uint8_t *w, float *o) {
    const float d = fp16_to_f32(w + 80), dmin = fp16_to_f32(w + 82);
    for (int g = 0; g < 8; g++)
        for (int u = 0; u < 2; u++) {
            const float dl = d * (float)(w[2 * g + u] & 15), ml = dmin * (float)(w[2 * g + u] >> 4);
            const uint8_t *qs = w + 16 + 32 * (g >> 2) + 16 * u;
            float *og = o + 32 * g + 16 * u;
#ifdef VW
            for (int l = 0; l < 16; l += VW)
                kq_vstore(og + l, vadd(kq_vmul(vset1(dl), vcvt(vand(vsrl(vbytes_u8(qs + l), 2 * (g & 3)), 3))), vset1(-ml)));
#else
            for (int l = 0; l < 16; l++) og[l] = dl * (float)((qs[l] >> (2 * (g & 3))) & 3) - ml;
#endif
        }
}

static void dequant_q3_k(const uint8_t *w, float *o) {
    const float d = fp16_to_f32(w + 108);
    int8_t sc[16];
    q3_k_scales(w + 96, sc);
    for (int g = 0; g < 8; g++)
        for (int u = 0; u < 2; u++) {
            const float dl = d * (float)sc[2 * g + u];
            const uint8_t *qs = w + 32 + 32 * (g >> 2) + 16 * u, *hm = w + 16 * u;
            float *og = o + 32 * g + 16 * u;
#ifdef VW
            for (int l = 0; l < 16; l += VW) {
                const vi q = vor(vand(vsrl(vbytes_u8(qs + l), 2 * (g & 3)), 3), vsll(vand(vsrl(vbytes_u8(hm + l), g), 1), 2));
                kq_vstore(og + l, kq_vmul(vset1(dl), vcvt(vsub1(q, 4))));
            }
#else
            for (int l = 0; l < 16; l++)
                og[l] = dl * (float)((int)((qs[l] >> (2 * (g & 3))) & 3) + 4 * ((hm[l] >> g) & 1) - 4);
#endif
        }
}

/* Q4_K / Q5_K / Q6_K super-blocks -> float32 with the torch dequantizer's products (quant.kquants: d * sc per
 * sub-block, then dl * q - ml, or dl * q; no FMA: bit-exact): dequant_row (the dense weights the CPU released in
 * favour of their blocks, runtime.cpu_compile) and the grouped prefill's float path. */
static void dequant_q45_k(const uint8_t *w, float *o, int q5) {
    uint8_t sc[8], mn[8];
    float d, dmin;
    kq_unpack(w, sc, mn, &d, &dmin);
    const uint8_t *qh = w + 16, *qs = w + (q5 ? 48 : 16);
    PREFETCH(w);
    PREFETCH(w + 64);
    PREFETCH(w + 128);
    for (int c = 0; c < 4; c++, qs += 32, o += 64) {
        const float d0 = d * sc[2 * c], m0 = dmin * mn[2 * c], d1 = d * sc[2 * c + 1], m1 = dmin * mn[2 * c + 1];
#ifdef VW
        for (int j = 0; j < 32; j += VW) {
            const vi q = vbytes_u8(qs + j);
            vf lo, hi;
            if (q5) {
                const vi h = vbytes_u8(qh + j);
                lo = vq5f(q, 0, h, 2 * c), hi = vq5f(q, 4, h, 2 * c + 1);
            } else {
                lo = vlo4f(q), hi = vhi4f(q);
            }
            kq_vstore(o + j, vadd(kq_vmul(vset1(d0), lo), vset1(-m0)));
            kq_vstore(o + 32 + j, vadd(kq_vmul(vset1(d1), hi), vset1(-m1)));
        }
#else
        for (int j = 0; j < 32; j++) {
            const int h0 = q5 ? ((qh[j] >> (2 * c)) & 1) << 4 : 0, h1 = q5 ? ((qh[j] >> (2 * c + 1)) & 1) << 4 : 0;
            o[j] = d0 * (float)((qs[j] & 0x0F) | h0) - m0;
            o[32 + j] = d1 * (float)((qs[j] >> 4) | h1) - m1;
        }
#endif
    }
}

static void dequant_q6_k(const uint8_t *w, float *o) {
    const float d = fp16_to_f32(w + 208);
    const int8_t *sc = (const int8_t *)(w + 192);
    for (int i = 0; i < 210; i += 64) PREFETCH(w + i);
    for (int h = 0; h < 2; h++, o += 128) {
        const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
        const int8_t *sg = sc + 8 * h;            /* group g, element l: sg[2 g + l / 16] */
#ifdef VW
        for (int l = 0; l < 32; l += VW) {
            const vi a = vbytes_u8(ql + l), b = vbytes_u8(ql + 32 + l), hb = vbytes_u8(qh + l);
            const int u = l / 16;
            kq_vstore(o + l, kq_vmul(vset1(d * sg[u]), vq6f(a, 0, hb, 0)));
            kq_vstore(o + 32 + l, kq_vmul(vset1(d * sg[2 + u]), vq6f(b, 0, hb, 2)));
            kq_vstore(o + 64 + l, kq_vmul(vset1(d * sg[4 + u]), vq6f(a, 4, hb, 4)));
            kq_vstore(o + 96 + l, kq_vmul(vset1(d * sg[6 + u]), vq6f(b, 4, hb, 6)));
        }
#else
        for (int g = 0; g < 4; g++) {
            const uint8_t *qg = ql + 32 * (g & 1);
            const int ls = 4 * (g >> 1);
            for (int l = 0; l < 32; l++)
                o[32 * g + l] = d * sg[2 * g + l / 16]
                                * (float)((((qg[l] >> ls) & 0x0F) | ((qh[l] >> (2 * g)) & 3) << 4) - 32);
        }
#endif
    }
}
