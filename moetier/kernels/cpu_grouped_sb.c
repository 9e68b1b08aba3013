/* The unpacked super-block tiles: prefill rows (moetier_moe_grouped, moetier_qgemm) of the 256-value formats (Q2_K,
 * Q3_K, Q5_K, IQ2_XXS / IQ2_XS / IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M; Q4_K / Q6_K too but in plain AVX2 builds, which
 * keep grp_tile_q8k for them) x int8 activations with one scale per 256 values (llama.cpp's Q8_K:
 * grp_quantize_q8k). Part of cpu_grouped.c, which #includes it after grp_quantize_q8k; not compiled on its own.
 * Before, these rows prefilled with float activations: each row dequantized to float once a call and a float FMA
 * tile (0.82-0.92x llama.cpp's prefill on 2-3-bit files, docs/perf-log.md session 39).
 *
 * Every format is brought to one form per super-block and row (gsb_unpack, once for up to GSB_P pairs, in L1):
 *   value_i = d (sc_g q_i) - mn_g,   i in group g = i / 16,
 * q_i unsigned bytes <= 128 (the format's signed value plus an offset, so one u8 x s8 maddubs serves every pair and
 * its int16 pair sums cannot saturate: 2 x 128 x 127 < 32768), sc_g an int16 scale per 16 values, d a float, mn_g a
 * float per 16 values (the offset's d sc_g off, or Q2_K / Q5_K's mins). A pair's dot with the row's super-block is
 *   d dy sum_g sc_g (q_g . y_g) - sum_g mn_g (dy sum y_g)
 * (y the pair's int8 values, dy its scale; dy sum y_g is grp_quantize_q8k's vs), the first sum in int32 (maddubs,
 * then a 16-bit madd with the scales: dpwssd on AVX-512 VNNI), converted once per super-block.
 *   Q2_K     q 0..3,                   sc 4 bits per 16,    mn = dmin m (4 bits per 16)
 *   Q3_K     q + 4 = 0..7,             sc - 32 per 16,      off 4
 *   Q5_K     q 0..31,                  sc 6 bits per 32,    mn = dmin m (6 bits per 32)
 *   IQ2_*    +-grid (8, 25, 43) + 43,  2 ls + 1 per 32 (XXS) or 16 (XS, S), d / 8, off 43
 *   IQ3_XXS  +-grid (4 .. 62) + 62,    2 ls + 1 per 32,     d / 4, off 62
 *   IQ3_S    +-grid (1 .. 15) + 15,    2 ls + 1 per 32,     off 15
 *   IQ1_S    8 (grid + delta) + 9 (0 .. 18: iq1_grid8u), 2 ls + 1 per 32 (IQ1_M: per 16), d / 8, off 9 */

#define GSB_R 4               /* rows unpacked per super-block */
#if defined(__AVX512BW__)
#define GSB_W 64              /* values per vector */
#define GSB_B 4               /* pairs at a time: 16 int32 accumulators + 4 activation registers of the 32 */
typedef __m512i gsb_vi;
typedef __m512 gsb_vf;
#else
#define GSB_W 32
#define GSB_B 2               /* 8 accumulators + 2 activations of the 16 (as the AVX2 Q8_K tile) */
typedef __m256i gsb_vi;
typedef __m256 gsb_vf;
#endif
#define GSB_P 64              /* pairs per call (grp_task's chunk) */
#ifndef GSL_ON                /* 256-bit dpbusd (AVX-512 VNNI, AVX-VNNI): rows in lanes (gsl_tile, below) for an */
#define GSL_ON GRP_VNNI       /* expert's rows with >= GSL_MIN_PAIRS pairs, else this tile */
#endif
#ifndef GSL_MIN_PAIRS
#define GSL_MIN_PAIRS 8
#endif
#ifndef GSB_K46               /* Q4_K / Q6_K here too: AVX-512BW and VNNI builds; plain AVX2 keeps its Q8_K tile for */
#define GSB_K46 (GSB_W == 64 || GSL_ON)   /* them (the same design, Q6_K 2-3% faster there); -DGSB_K46=1 an A/B */
#endif

static inline int gsb_type(int qtype) {
    switch (qtype) {
#if GSB_K46
    case Q4_K: case Q6_K:
#endif
    case Q2_K: case Q3_K: case Q5_K: case IQ2_XXS: case IQ2_XS: case IQ2_S: case IQ3_XXS: case IQ3_S: case IQ1_S:
    case IQ1_M: return 1;
    default: return 0;
    }
}

typedef struct {
    uint8_t q[GSB_R][256];    /* unsigned values */
    int16_t s[GSB_R][128];    /* the scale of each maddubs output (values 2 j, 2 j + 1): sc_g in lanes 8 g .. 8 g + 7 */
    float mn[GSB_R][16];
    float d[GSB_R];
} gsb_rows;

static inline void gsb_store(uint8_t *q, __m256i v) { _mm256_store_si256((__m256i *)q, v); }

/* the 8 scales of 32-value sub-blocks as the 16 of 16-value groups */
static inline __m256i gsb_dup32(__m128i s8x16) { return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8x16, s8x16)); }

/* super-block w of one row -> q [256] (unsigned), *scv (16 int16 scales, one per 16 values), *dout; returns the
 * offset off (the signed value is q - off), or -1 for the formats with mins (Q2_K, Q4_K, Q5_K: q is the value, mn
 * [16] gets dmin m) */
static inline __attribute__((always_inline)) int gsb_unpack_core(int qtype, const uint8_t *w, uint8_t *q,
                                                                  __m256i *scv, float *mn, float *dout) {
    __m256i sc;
    float d;
    int off = 0, mins = 0;
    switch (qtype) {
    case Q2_K: {
        const __m128i b = _mm_loadu_si128((const __m128i *)w), m4 = _mm_set1_epi8(0x0F);
        sc = _mm256_cvtepu8_epi16(_mm_and_si128(b, m4));
        const __m128i m = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
        const __m256 dmin = _mm256_set1_ps(fp16_to_f32(w + 82));
        _mm256_storeu_ps(mn, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m))));
        _mm256_storeu_ps(mn + 8, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(m, 8)))));
        mins = 1;
        d = fp16_to_f32(w + 80);
        for (int h = 0; h < 2; h++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * h));
            for (int j = 0; j < 4; j++) gsb_store(q + 32 * (4 * h + j), q2_k_group(qv, j));
        }
        break;
    }
    case Q3_K: {
        sc = _mm256_cvtepi8_epi16(q3_k_scales_128(w + 96));
        d = fp16_to_f32(w + 108);
        off = 4;
        const __m256i hm = _mm256_loadu_si256((const __m256i *)w);
        for (int h = 0; h < 2; h++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(w + 32 + 32 * h));
            for (int j = 0; j < 4; j++) gsb_store(q + 32 * (4 * h + j), q3_k_group(qv, hm, 4 * h + j));
        }
        break;
    }
    case Q4_K: case Q5_K: {
        uint64_t s8, m8;
        scale_min_k4(w + 4, &s8, &m8);
        sc = gsb_dup32(_mm_cvtsi64_si128((int64_t)s8));
        const __m256i m16 = gsb_dup32(_mm_cvtsi64_si128((int64_t)m8));
        const __m256 dmin = _mm256_set1_ps(fp16_to_f32(w + 2));
        _mm256_storeu_ps(mn, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(m16)))));
        _mm256_storeu_ps(mn + 8, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(
                                                  _mm256_extracti128_si256(m16, 1)))));
        mins = 1;
        d = fp16_to_f32(w);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 16)), m4 = _mm256_set1_epi8(0x0F);
        const __m256i b4 = _mm256_set1_epi8(0x10);
        if (qtype == Q4_K) {
            for (int c = 0; c < 4; c++) {   /* values 64 c ..: low nibbles, then high */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * c));
                gsb_store(q + 64 * c, _mm256_and_si256(v, m4));
                gsb_store(q + 64 * c + 32, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            }
            break;
        }
        for (int c = 0; c < 4; c++) {       /* values 64 c ..: low nibbles + qh bit 2 c << 4, high + bit 2 c + 1 */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 48 + 32 * c));
            const __m256i h0 = 2 * c <= 4 ? _mm256_slli_epi16(qh, 4 - 2 * c) : _mm256_srli_epi16(qh, 2 * c - 4);
            const __m256i h1 = 2 * c + 1 <= 4 ? _mm256_slli_epi16(qh, 3 - 2 * c) : _mm256_srli_epi16(qh, 2 * c - 3);
            gsb_store(q + 64 * c, _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(h0, b4)));
            gsb_store(q + 64 * c + 32, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                                       _mm256_and_si256(h1, b4)));
        }
        break;
    }
    case Q6_K: {              /* half h, group g (32 values 128 h + 32 g): ql bytes 32 (g & 1), nibble g / 2, qh bits 2 g */
        sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
        d = fp16_to_f32(w + 208);
        off = 32;
        const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            for (int g = 0; g < 4; g++) {
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32 * (g & 1)));
                const __m256i lo = g & 2 ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4) : _mm256_and_si256(ql, m4);
                const __m256i hi = g == 0 ? _mm256_slli_epi16(qh, 4) : g == 1 ? _mm256_slli_epi16(qh, 2)
                                 : g == 2 ? qh : _mm256_srli_epi16(qh, 2);
                gsb_store(q + 128 * h + 32 * g, _mm256_or_si256(lo, _mm256_and_si256(hi, m30)));
            }
        }
        break;
    }
    case IQ2_XXS: case IQ2_XS: case IQ2_S: {
        const int kind = qtype == IQ2_XXS ? IQ2_KIND_XXS : qtype == IQ2_XS ? IQ2_KIND_XS : IQ2_KIND_S;
        d = 0.125f * fp16_to_f32(w);
        off = 43;
        const __m256i o = _mm256_set1_epi8(43);
        for (int j = 0; j < 8; j++) {
            __m256i sign;
            const __m256i grid = iq2_q8_grid(kind, w, j, &sign);
            gsb_store(q + 32 * j, _mm256_add_epi8(_mm256_sign_epi8(grid, sign), o));
        }
        __m128i ls;               /* ls per 16 values as bytes (low nibble first) */
        if (kind == IQ2_KIND_XXS) {
            uint8_t b[8];
            for (int j = 0; j < 8; j++) b[j] = w[9 + 8 * j] >> 4;
            ls = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)b), _mm_loadl_epi64((const __m128i *)b));
        } else {
            const __m128i v = _mm_loadl_epi64((const __m128i *)(w + iq2_bytes[kind] - 8)), m4 = _mm_set1_epi8(0x0F);
            ls = _mm_unpacklo_epi8(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
        }
        sc = _mm256_cvtepu8_epi16(_mm_or_si128(_mm_add_epi8(ls, ls), _mm_set1_epi8(1)));
        break;
    }
    case IQ3_XXS: {
        d = 0.25f * fp16_to_f32(w);
        off = 62;
        const __m256i o = _mm256_set1_epi8(62);
        uint32_t aux[8];
        memcpy(aux, w + 66, 32);
        for (int j = 0; j < 8; j++)
            gsb_store(q + 32 * j, _mm256_add_epi8(_mm256_sign_epi8(iq3_xxs_q8_grid(w + 2 + 8 * j), iq3_xxs_q8_signs(aux[j])),
                                                  o));
        const __m256i ls = _mm256_or_si256(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)aux), 27),
                                           _mm256_set1_epi32(1));       /* 2 ls + 1 per 32, int32 lanes */
        const __m128i l16 = _mm_packs_epi32(_mm256_castsi256_si128(ls), _mm256_extracti128_si256(ls, 1));
        sc = _mm256_setr_m128i(_mm_unpacklo_epi16(l16, l16), _mm_unpackhi_epi16(l16, l16));
        break;
    }
    case IQ3_S: {
        d = fp16_to_f32(w);
        off = 15;
        const __m256i o = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
        for (int j = 0; j < 8; j++) {
            const __m256i grid = iq3_s_grid32(w + 2 + 8 * j, w[66 + j]);
            gsb_store(q + 32 * j, _mm256_add_epi8(_mm256_sign_epi8(grid, _mm256_or_si256(iq3_s_neg32(w + 74 + 4 * j), one)),
                                                  o));
        }
        int32_t sb;
        memcpy(&sb, w + 106, 4);
        const __m128i v = _mm_cvtsi32_si128(sb), m4 = _mm_set1_epi8(0x0F);
        const __m128i ls = _mm_unpacklo_epi8(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
        sc = gsb_dup32(_mm_or_si128(_mm_add_epi8(ls, ls), _mm_set1_epi8(1)));
        break;
    }
    case IQ1_S: {
        d = 0.125f * fp16_to_f32(w);
        off = 9;
        const __m256i hq = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 34)));   /* lane j: qh[j] */
        const long long *g = (const long long *)iq1_grid8u;
        for (int j = 0; j < 8; j += 2) {
            const __m256i idx = iq1_s_idx8(w + 2, hq, j);
            gsb_store(q + 32 * j, _mm256_i32gather_epi64(g, _mm256_castsi256_si128(idx), 8));
            gsb_store(q + 32 * j + 32, _mm256_i32gather_epi64(g, _mm256_extracti128_si256(idx, 1), 8));
        }
        const __m256i ls = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hq, 12),
                                                                              _mm256_set1_epi32(7)), 1),
                                           _mm256_set1_epi32(1));
        const __m128i l16 = _mm_packs_epi32(_mm256_castsi256_si128(ls), _mm256_extracti128_si256(ls, 1));
        sc = _mm256_setr_m128i(_mm_unpacklo_epi16(l16, l16), _mm_unpackhi_epi16(l16, l16));
        break;
    }
    default: {                /* IQ1_M */
        d = 0.125f * iq1_m_d(w);
        off = 9;
        const long long *g = (const long long *)iq1_grid8u;
        for (int j = 0; j < 8; j += 2) {
            const __m256i idx = iq1_m_idx8(w, j);
            gsb_store(q + 32 * j, _mm256_i32gather_epi64(g, _mm256_castsi256_si128(idx), 8));
            gsb_store(q + 32 * j + 32, _mm256_i32gather_epi64(g, _mm256_extracti128_si256(idx, 1), 8));
        }
        uint64_t s4;          /* 4 x 16 bits: 3-bit fields t % 4 of word t / 4 (the top nibbles hold d) */
        memcpy(&s4, w + 48, 8);
        const __m256i words = _mm256_cvtepu16_epi32(_mm_set_epi64x(0, (int64_t)s4));
        int16_t v[16];
        uint32_t wv[8];
        _mm256_storeu_si256((__m256i *)wv, words);
        for (int t = 0; t < 16; t++) v[t] = (int16_t)(2 * ((wv[t / 4] >> (3 * (t % 4))) & 7) + 1);
        sc = _mm256_loadu_si256((const __m256i *)v);
        break;
    }
    }
    *scv = sc;
    *dout = d;
    return mins ? -1 : off;
}

/* super-block w of one row -> q [256], s [128], mn [16], *d (the form above) */
static inline __attribute__((always_inline)) void gsb_unpack(int qtype, const uint8_t *w, uint8_t *q, int16_t *s,
                                                              float *mn, float *dout) {
    __m256i sc;
    float d;
    const int off = gsb_unpack_core(qtype, w, q, &sc, mn, &d);
    if (off >= 0) {           /* mn = off d sc */
        const __m256 f = _mm256_set1_ps((float)off * d);
        _mm256_storeu_ps(mn, _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(sc)))));
        _mm256_storeu_ps(mn + 8, _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(
                                                   _mm256_extracti128_si256(sc, 1)))));
    }
    int16_t s16[16] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)s16, sc);
    for (int g = 0; g < 16; g++) _mm_store_si128((__m128i *)(s + 8 * g), _mm_set1_epi16(s16[g]));
    *dout = d;
}

/* pairs p < pb (<= GSB_B) over super-block b of the unpacked rows: the int32 dots, then into facc[p][r] */
static inline __attribute__((always_inline)) void gsb_pairs(int pb, const gsb_rows *u, const int8_t *const *qx,
        const float *const *dk, const float *const *vs, int64_t b, gsb_vf (*facc)[GSB_R]) {
    gsb_vi acc[GSB_R][GSB_B];
#if GSB_W == 64
    for (int r = 0; r < GSB_R; r++)
        for (int p = 0; p < pb; p++) acc[r][p] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        __m512i y[GSB_B];
        for (int p = 0; p < pb; p++) {
            y[p] = _mm512_loadu_si512((const void *)(qx[p] + 256 * b + 64 * c));
#if GSL_ON
            y[p] = _mm512_xor_si512(y[p], _mm512_set1_epi8((char)0x80));   /* the side holds y + 128 (gsl_tile's) */
#endif
        }
        for (int r = 0; r < GSB_R; r++) {
            const __m512i wv = _mm512_load_si512((const void *)(u->q[r] + 64 * c));
            const __m512i sv = _mm512_load_si512((const void *)(u->s[r] + 32 * c));
            for (int p = 0; p < pb; p++) acc[r][p] = GRP_DPWSSD(acc[r][p], _mm512_maddubs_epi16(wv, y[p]), sv);
        }
    }
    for (int p = 0; p < pb; p++) {
        const __m512 dy = _mm512_set1_ps(dk[p][b]), v = _mm512_loadu_ps(vs[p] + 16 * b);
        for (int r = 0; r < GSB_R; r++)
            facc[p][r] = _mm512_fnmadd_ps(_mm512_load_ps(u->mn[r]), v,
                                          _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][p]),
                                                          _mm512_mul_ps(_mm512_set1_ps(u->d[r]), dy), facc[p][r]));
    }
#else
    for (int r = 0; r < GSB_R; r++)
        for (int p = 0; p < pb; p++) acc[r][p] = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        __m256i y[GSB_B];
        for (int p = 0; p < pb; p++) {
            y[p] = _mm256_loadu_si256((const __m256i *)(qx[p] + 256 * b + 32 * c));
#if GSL_ON
            y[p] = _mm256_xor_si256(y[p], _mm256_set1_epi8((char)0x80));   /* the side holds y + 128 (gsl_tile's) */
#endif
        }
        for (int r = 0; r < GSB_R; r++) {
            const __m256i wv = _mm256_load_si256((const __m256i *)(u->q[r] + 32 * c));
            const __m256i sv = _mm256_load_si256((const __m256i *)(u->s[r] + 16 * c));
            for (int p = 0; p < pb; p++) {
                acc[r][p] = GRP_DPWSSD(acc[r][p], _mm256_maddubs_epi16(wv, y[p]), sv);
                __asm__("" : "+x"(acc[r][p]));     /* keep the adds in order (as grp_q8k_pairs) */
            }
        }
    }
    for (int p = 0; p < pb; p++) {
        const __m256 dy = _mm256_set1_ps(dk[p][b]);
        const __m256 v0 = _mm256_loadu_ps(vs[p] + 16 * b), v1 = _mm256_loadu_ps(vs[p] + 16 * b + 8);
        for (int r = 0; r < GSB_R; r++) {
            const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][p]), _mm256_mul_ps(_mm256_set1_ps(u->d[r]), dy),
                                             facc[p][r]);
            facc[p][r] = _mm256_fnmadd_ps(_mm256_load_ps(u->mn[r] + 8), v1,
                                          _mm256_fnmadd_ps(_mm256_load_ps(u->mn[r]), v0, f));
        }
    }
#endif
}

/* out[r * ldo + p] = rows w + r * rs (r < nr <= GSB_R) . pairs p < np <= GSB_P (qx, dk, vs as grp_quantize_q8k),
 * nsb super-blocks. Rows past nr repeat row 0 (computed, not stored). */
__attribute__((noinline)) static void gsb_tile(int qtype, const uint8_t *w, int64_t rs, int nr,
        const int8_t *const *qx, const float *const *dk, const float *const *vs, int np, int64_t nsb,
        float *out, int64_t ldo) {
    const int64_t bb = block_bytes(qtype);
    gsb_rows u __attribute__((aligned(64)));
    gsb_vf facc[GSB_P][GSB_R];
    for (int p = 0; p < np; p++)
        for (int r = 0; r < GSB_R; r++) facc[p][r] = (gsb_vf){0};
    for (int64_t b = 0; b < nsb; b++) {
        for (int r = 0; r < GSB_R; r++) {
            const uint8_t *blk = w + (r < nr ? r : 0) * rs + b * bb;
            PREFETCH(blk + bb);
            PREFETCH(blk + bb + 64);
            gsb_unpack(qtype, blk, u.q[r], u.s[r], u.mn[r], &u.d[r]);
        }
        int p = 0;
        for (; p + GSB_B <= np; p += GSB_B) gsb_pairs(GSB_B, &u, qx + p, dk + p, vs + p, b, facc + p);
        for (; p < np; p++) gsb_pairs(1, &u, qx + p, dk + p, vs + p, b, facc + p);
    }
    for (int r = 0; r < nr; r++)
        for (int p = 0; p < np; p++) {
#if GSB_W == 64
            out[r * ldo + p] = _mm512_reduce_add_ps(facc[p][r]);
#else
            out[r * ldo + p] = hsum8(facc[p][r]);
#endif
        }
}

#if GSL_ON
/* Rows in lanes (256-bit dpbusd: AVX-512 VNNI 16 rows a zmm, AVX-VNNI 8 a ymm). GSL_L rows' super-blocks are
 * unpacked (gsb_unpack_core), made signed (q - off) and transposed so that one register holds 4 consecutive values
 * of each row (a quad); a pair's 4 activation bytes broadcast to all lanes make one dpbusd a 4-value step of all
 * the rows' dots, and a group of 16 values (4 dpbusd) is converted once and scaled by the rows' d sc_g in one FMA:
 * 5-6 uops per GSL_L rows x 16 values against 8 (AVX-512) or 12 (AVX2) for the maddubs + madd tile above.
 * dpbusd multiplies unsigned by signed bytes: the activations are stored as y + 128 (the side's u8), the 128 sum w
 * it adds taken off per row and super-block in float (corr); the mins of Q2_K / Q4_K / Q5_K (their q centred by
 * 2 / 8 / 16) go through the pair's vs as above. */
#if GSB_W == 64
#define GSL_L 16              /* rows = lanes */
#define GSL_P 8               /* pairs at a time: 8 accumulators + 8 group sums + the quad in registers */
typedef __m512i gl_i;
typedef __m512 gl_f;
#define GL_LOAD_I(p) _mm512_load_si512((const void *)(p))
#define GL_STORE_I(p, v) _mm512_store_si512((void *)(p), v)
#define GL_ZERO_I() _mm512_setzero_si512()
#define GL_SET1_I(v) _mm512_set1_epi32(v)
#define GL_SUB_I8(a, b) _mm512_sub_epi8(a, b)
#define GL_SET1_I8(v) _mm512_set1_epi8(v)
#define GL_DPBUSD(acc, u, w) _mm512_dpbusd_epi32(acc, u, w)
#define GL_LOAD_F(p) _mm512_load_ps(p)
#define GL_STORE_F(p, v) _mm512_store_ps(p, v)
#define GL_ZERO_F() _mm512_setzero_ps()
#define GL_SET1_F(v) _mm512_set1_ps(v)
#define GL_CVT(v) _mm512_cvtepi32_ps(v)
#define GL_MUL(a, b) _mm512_mul_ps(a, b)
#define GL_ADD(a, b) _mm512_add_ps(a, b)
#define GL_FMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define GL_FNMADD(a, b, c) _mm512_fnmadd_ps(a, b, c)
#else
#define GSL_L 8
#define GSL_P 4               /* 4 accumulators + 4 group sums + quad, broadcast, scales of the 16 registers */
typedef __m256i gl_i;
typedef __m256 gl_f;
#define GL_LOAD_I(p) _mm256_load_si256((const __m256i *)(p))
#define GL_STORE_I(p, v) _mm256_store_si256((__m256i *)(p), v)
#define GL_ZERO_I() _mm256_setzero_si256()
#define GL_SET1_I(v) _mm256_set1_epi32(v)
#define GL_SUB_I8(a, b) _mm256_sub_epi8(a, b)
#define GL_SET1_I8(v) _mm256_set1_epi8(v)
#define GL_DPBUSD(acc, u, w) DPBUSD256(acc, u, w)
#define GL_LOAD_F(p) _mm256_load_ps(p)
#define GL_STORE_F(p, v) _mm256_store_ps(p, v)
#define GL_ZERO_F() _mm256_setzero_ps()
#define GL_SET1_F(v) _mm256_set1_ps(v)
#define GL_CVT(v) _mm256_cvtepi32_ps(v)
#define GL_MUL(a, b) _mm256_mul_ps(a, b)
#define GL_ADD(a, b) _mm256_add_ps(a, b)
#define GL_FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#define GL_FNMADD(a, b, c) _mm256_fnmadd_ps(a, b, c)
#endif

typedef struct {
    int32_t w[64][GSL_L];     /* quad j (values 4 j .. 4 j + 3), lane r: those 4 signed bytes of row r */
    float s[16][GSL_L];       /* group g, row r: d sc_g */
    float mn[16][GSL_L];      /* group g, row r: dmin m_g - o d sc_g (formats with mins, centred by o) */
    float corr[GSL_L];        /* row r: -128 sum_g s_g sum_{i in g} w_i */
} gsl_rows;

/* r[i] lane j -> r[j] lane i (GSL_L x GSL_L int32) */
static inline __attribute__((always_inline)) void gsl_tr(gl_i r[GSL_L]) {
    gl_i t[GSL_L];
#if GSL_L == 16
#define GL_UNPACK(op, a, b) _mm512_##op(a, b)
#else
#define GL_UNPACK(op, a, b) _mm256_##op(a, b)
#endif
    for (int i = 0; i < GSL_L / 2; i++) {
        t[2 * i] = GL_UNPACK(unpacklo_epi32, r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = GL_UNPACK(unpackhi_epi32, r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < GSL_L / 4; i++) {
        r[4 * i] = GL_UNPACK(unpacklo_epi64, t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = GL_UNPACK(unpackhi_epi64, t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = GL_UNPACK(unpacklo_epi64, t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = GL_UNPACK(unpackhi_epi64, t[4 * i + 1], t[4 * i + 3]);
    }
#undef GL_UNPACK
#if GSL_L == 16
    for (int h = 0; h < 2; h++)               /* rows 8 h ..: 128-bit lanes 0 | 2 and 1 | 3 of r[i], r[i + 4] */
        for (int i = 0; i < 4; i++) {
            t[8 * h + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + i + 4], 0x88);
            t[8 * h + i + 4] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + i + 4], 0xDD);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    }
#else
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
#endif
}

/* super-block b of GSL_L rows (row r at w + r rs; rows >= nr repeat row 0) -> u; returns whether the format has
 * mins. The per-row scales, mins and weights reach the lanes by GSL_L x GSL_L transposes; the group sums of the
 * signed weights (for corr) are dpbusd's of the transposed quads with ones. */
static int gsl_unpack(int qtype, const uint8_t *w, int64_t rs, int nr, int64_t b, gsl_rows *u) {
    uint8_t q[GSL_L][256] __attribute__((aligned(64)));
    int32_t sc[GSL_L][16] __attribute__((aligned(64)));
    float mn[GSL_L][16] __attribute__((aligned(64))), d[GSL_L] __attribute__((aligned(64)));
    gl_i t[GSL_L];
    const int64_t bb = block_bytes(qtype);
    int off = 0;
    for (int r = 0; r < GSL_L; r++) {
        const uint8_t *blk = w + (r < nr ? r : 0) * rs + b * bb;
        PREFETCH(blk + bb);
        PREFETCH(blk + bb + 64);
        __m256i scv;
        off = gsb_unpack_core(qtype, blk, q[r], &scv, mn[r], &d[r]);
        _mm256_store_si256((__m256i *)sc[r], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(scv)));
        _mm256_store_si256((__m256i *)(sc[r] + 8), _mm256_cvtepi16_epi32(_mm256_extracti128_si256(scv, 1)));
    }
    /* the formats with mins are centred too (q - o, o d sc_g moved into their mins): 128 sum q on unsigned q cost
     * Q4_K / Q5_K ~8e-6 of the result in float against 4e-7 */
    const int mins = off < 0, o = !mins ? off : qtype == Q2_K ? 2 : qtype == Q4_K ? 8 : 16;
    const gl_i ov = GL_SET1_I8((char)o);
    for (int r = 0; r < GSL_L; r++)
        for (int c = 0; c < 256; c += 4 * GSL_L)
            GL_STORE_I(q[r] + c, GL_SUB_I8(GL_LOAD_I(q[r] + c), ov));
    const gl_f dv = GL_LOAD_F(d);
    for (int g0 = 0; g0 < 16; g0 += GSL_L) {    /* groups g0 .. g0 + GSL_L */
        for (int r = 0; r < GSL_L; r++) t[r] = GL_LOAD_I(sc[r] + g0);
        gsl_tr(t);                              /* t[j] lane r: sc of row r, group g0 + j */
        for (int j = 0; j < GSL_L; j++) GL_STORE_F(u->s[g0 + j], GL_MUL(GL_CVT(t[j]), dv));
        if (mins) {
            for (int r = 0; r < GSL_L; r++) t[r] = GL_LOAD_I(mn[r] + g0);
            gsl_tr(t);
            for (int j = 0; j < GSL_L; j++) {
                gl_f m;
                memcpy(&m, &t[j], sizeof m);
                GL_STORE_F(u->mn[g0 + j], GL_FNMADD(GL_SET1_F((float)o), GL_LOAD_F(u->s[g0 + j]), m));
            }
        }
    }
    for (int jb = 0; jb < 64; jb += GSL_L) {    /* quads jb .. jb + GSL_L */
        for (int r = 0; r < GSL_L; r++) t[r] = GL_LOAD_I(q[r] + 4 * jb);
        gsl_tr(t);
        for (int j = 0; j < GSL_L; j++) GL_STORE_I(u->w[jb + j], t[j]);
    }
    const gl_i ones = GL_SET1_I8(1);
    gl_f c = GL_ZERO_F();
    for (int g = 0; g < 16; g++) {              /* sum of row r's signed weights in group g, lane r */
        gl_i sum = GL_ZERO_I();
        for (int j = 0; j < 4; j++) sum = GL_DPBUSD(sum, ones, GL_LOAD_I(u->w[4 * g + j]));
        c = GL_FMADD(GL_LOAD_F(u->s[g]), GL_CVT(sum), c);
    }
    GL_STORE_F(u->corr, GL_MUL(GL_SET1_F(-128.f), c));
    return mins;
}

/* pairs p < pb (<= GSL_P) over super-block b of the unpacked rows, into facc[p] (the rows' float sums) */
static inline __attribute__((always_inline)) void gsl_pairs(int pb, const gsl_rows *u, int mins,
        const uint8_t *const *qx, const float *const *dk, const float *const *vs, int64_t b, gl_f *facc) {
    gl_f fs[GSL_P];
    for (int p = 0; p < pb; p++) fs[p] = GL_ZERO_F();
    for (int g = 0; g < 16; g++) {
        gl_i acc[GSL_P];
        for (int p = 0; p < pb; p++) acc[p] = GL_ZERO_I();
        for (int j = 0; j < 4; j++) {
            const gl_i wv = GL_LOAD_I(u->w[4 * g + j]);
            for (int p = 0; p < pb; p++) {
                int32_t y4;
                memcpy(&y4, qx[p] + 256 * b + 16 * g + 4 * j, 4);
                acc[p] = GL_DPBUSD(acc[p], GL_SET1_I(y4), wv);
            }
        }
        const gl_f sg = GL_LOAD_F(u->s[g]);
        for (int p = 0; p < pb; p++) fs[p] = GL_FMADD(GL_CVT(acc[p]), sg, fs[p]);
        if (mins) {
            const gl_f m = GL_LOAD_F(u->mn[g]);
            for (int p = 0; p < pb; p++) facc[p] = GL_FNMADD(m, GL_SET1_F(vs[p][16 * b + g]), facc[p]);
        }
    }
    const gl_f corr = GL_LOAD_F(u->corr);
    for (int p = 0; p < pb; p++) facc[p] = GL_FMADD(GL_ADD(fs[p], corr), GL_SET1_F(dk[p][b]), facc[p]);
}

/* as gsb_tile for up to GSL_L rows, the activations as u8 (y + 128) */
__attribute__((noinline)) static void gsl_tile(int qtype, const uint8_t *w, int64_t rs, int nr,
        const uint8_t *const *qx, const float *const *dk, const float *const *vs, int np, int64_t nsb,
        float *out, int64_t ldo) {
    gsl_rows u __attribute__((aligned(64)));
    gl_f facc[GSB_P];
    for (int p = 0; p < np; p++) facc[p] = GL_ZERO_F();
    for (int64_t b = 0; b < nsb; b++) {
        const int mins = gsl_unpack(qtype, w, rs, nr, b, &u);
        int p = 0;
        for (; p + GSL_P <= np; p += GSL_P) gsl_pairs(GSL_P, &u, mins, qx + p, dk + p, vs + p, b, facc + p);
#if GSL_P > 4
        for (; p + 4 <= np; p += 4) gsl_pairs(4, &u, mins, qx + p, dk + p, vs + p, b, facc + p);
#endif
        for (; p < np; p++) gsl_pairs(1, &u, mins, qx + p, dk + p, vs + p, b, facc + p);
    }
    for (int p = 0; p < np; p++) {
        float f[GSL_L] __attribute__((aligned(64)));
        GL_STORE_F(f, facc[p]);
        for (int r = 0; r < nr; r++) out[r * ldo + p] = f[r];
    }
}
#endif
