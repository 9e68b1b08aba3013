/* One SwiGLU MoE layer for many tokens (prefill), expert-major: part of cpu_kernels.c, which #includes this file
 * after cpu_moe.c; not compiled on its own. llama.cpp's way: the T k (token, expert) pairs are bucketed by expert,
 * and each weight row is read once per call and dotted with every pair routed to its expert (row-outer,
 * pair-inner), instead of once per pair (moetier_moe_tokens, token-major).
 *   1. x quantized once per token (int8 per 32 values, q8 and an int8 row type; per 256 for the Q4_K / Q6_K tile)
 *      or its block sums;
 *   2. tasks (expert, block of GRP_ROWS gate/up rows) over OpenMP: h[s] = [gate_e x, up_e x] for sorted pair s;
 *   3. a[s] = silu(gate) * up, quantized per pair;
 *   4. tasks (expert, block of down rows): o[s] = down_e a[s];
 *   5. y[t] = sum_j w[t, j] o[pos(t, j)] in j order (results do not depend on the thread count).
 * Row kernels, 4 rows x GRP_PAIRS pairs at a time: int8 activations: Q4_0 / Q8_0 an integer tile (each block's
 * weights widened to int8 once for all pairs; Q4_0 8 rows in lanes x 8 pairs, grp_tile8_nib, with AVX-512 VNNI,
 * AVX-VNNI or AVX2 (Q8_0 too where dpbusd is; 16 rows in 512-bit lanes with AVX-512 VNNI, unpacked once an expert:
 * grp_tile16_nib, grp_rows16_buf; on AMX, 16 rows x 16 pairs a TDPBUSD: grp_amx_tile), and on
 * AVX2 an expert's rows unpacked once for >= GRP_OUTER_PAIRS pairs); the 256-value formats (K-quants,
 * IQ1-IQ3) a Q8_K tile: 4 rows unpacked per super-block for up to 64 pairs, activations int8 per 256 values as
 * llama.cpp's Q8_K, sub-block scales applied in int32, one float conversion per super-block (cpu_grouped_sb.c; AVX2
 * builds keep their own for Q4_K / Q6_K, grp_tile_q8k); IQ4_NL / IQ4_XS in lanes as Q8_0; other
 * moe_q8_type rows the q8 row dot per (row, pair); float activations: the 4
 * rows dequantized to float (GRP_KC values at a time, in L1) and a float FMA tile, so the products are the
 * dequantized model's (max relative error ~1e-6, the summation order); an expert with one pair: the row dot. */

#ifndef GRP_ROWS
#define GRP_ROWS 64           /* rows per task: 2 I / 64 x used experts tasks (thousands at prefill sizes); 32 until
                               * session 43: 64 took 5% less on AMX, 2% on the VNNI / Q8_K tiles (128 experts, 512
                               * tokens, 2 threads; a task's first 16 rows wait for RAM, the next are prefetched) */
#endif
#if defined(__AVX512F__)
#define GRP_PAIRS 4           /* 16 accumulators + 4 weight + 4 scale registers of the 32 */
#else
#define GRP_PAIRS 2           /* 16 registers */
#endif
#define GRP_OUTER_PAIRS 16    /* an expert's pairs from which AVX2 Q4_0 rows are unpacked once (grp_rows8_q4_0_avx2) */

#ifdef MOE_Q8
#define GRP_VNNI VNNI256       /* 256-bit dpbusd (AVX-512 VNNI or AVX-VNNI) */
/* block b of a Q4_0 / Q8_0 row as signed int8 (Q4_0: nibble - 8) */
static inline __m256i grp_weights(int qtype, const uint8_t *blk) {
    if (qtype == Q4_0) {
        const __m128i t = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
        return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
    }
    return _mm256_loadu_si256((const __m256i *)(blk + 2));
}

/* out[r * ldo + p] = rows w + r * rs (r < 4) . pairs qx[p] (p < np <= GRP_PAIRS), Q4_0 / Q8_0 blocks.
 * The activations are made unsigned (y + 128) so one u8 x s8 dot serves signed weights; the 128 sum w_j
 * it adds is taken off by starting each dot at corr = -128 sum w_j (per row and block, shared by the pairs). */
static inline __attribute__((always_inline)) void grp_tile_q8(int qtype, const uint8_t *w, int64_t rs,
        const int8_t *const *qx, const float *const *dx, int np, int64_t nb, float *out, int64_t ldo) {
    const int64_t bb = qtype == Q4_0 ? 18 : 34;
    __m256 acc[4][GRP_PAIRS];
    for (int r = 0; r < 4; r++)
        for (int p = 0; p < GRP_PAIRS; p++) acc[r][p] = _mm256_setzero_ps();
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++) {
        __m256i wq[4], corr[4];
        __m256 d[4];
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = w + r * rs + b * bb;
            PREFETCH(blk);
            wq[r] = grp_weights(qtype, blk);
            d[r] = _mm256_set1_ps(fp16_to_f32(blk));
#if GRP_VNNI
            const __m256i z = _mm256_setzero_si256();
            corr[r] = _mm256_sub_epi32(z, DPBUSD256(z, bias, wq[r]));
#else
            corr[r] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                       _mm256_madd_epi16(_mm256_maddubs_epi16(bias, wq[r]), _mm256_set1_epi16(1)));
#endif
        }
        for (int p = 0; p < np; p++) {
            const __m256i y = _mm256_loadu_si256((const __m256i *)(qx[p] + 32 * b));
            const __m256i yu = _mm256_xor_si256(y, bias);              /* y + 128 as u8 */
            const __m256 dp = _mm256_set1_ps(dx[p][b]);
            for (int r = 0; r < 4; r++) {
                __m256i s;
#if GRP_VNNI
                s = DPBUSD256(corr[r], yu, wq[r]);
#else
                if (qtype == Q4_0)      /* |w| <= 8: the int16 pair sums of maddubs cannot saturate */
                    s = _mm256_add_epi32(corr[r],
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(yu, wq[r]), _mm256_set1_epi16(1)));
                else                    /* the sign trick, as moe_row_q8_0_q8 */
                    s = moe_dot_u8s8(_mm256_sign_epi8(wq[r], wq[r]), _mm256_sign_epi8(y, wq[r]));
#endif
                acc[r][p] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), d[r]), dp, acc[r][p]);
            }
        }
    }
    for (int r = 0; r < 4; r++)
        for (int p = 0; p < np; p++) out[r * ldo + p] = hsum8(acc[r][p]);
}

/* the tile for a constant np (so each variant keeps its accumulators in registers) */
static void grp_tile_q8_any(int qtype, const uint8_t *w, int64_t rs, const int8_t *const *qx,
                            const float *const *dx, int np, int64_t nb, float *out, int64_t ldo) {
    switch (np) {
    case 1: grp_tile_q8(qtype, w, rs, qx, dx, 1, nb, out, ldo); break;
    case 2: grp_tile_q8(qtype, w, rs, qx, dx, 2, nb, out, ldo); break;
#if GRP_PAIRS == 4
    case 3: grp_tile_q8(qtype, w, rs, qx, dx, 3, nb, out, ldo); break;
    case 4: grp_tile_q8(qtype, w, rs, qx, dx, 4, nb, out, ldo); break;
#endif
    default: break;
    }
}

#if GRP_VNNI || defined(__AVX2__)
#define GRP_ROWS8 1
#define GRP_PAIRS8 8          /* AVX2 (1 thread, 128 tokens): 4 pairs 0.7x, 6 0.8x, 12 0.8x the speed of 8 */
#ifndef MOETIER_TILE16        /* MOETIER_TILE16=0 at build time (kernels.cpu.build_library): 8 rows only (A/B) */
#define MOETIER_TILE16 1
#endif
#ifndef MOETIER_UNPACK16      /* MOETIER_UNPACK16=0: 16-row blocks unpacked per tile of pairs (A/B) */
#define MOETIER_UNPACK16 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define GRP_TILE16 1          /* 16 rows in the lanes of 512-bit vectors (grp_tile16_nib) */
#else
#define GRP_TILE16 0
#endif
#if GRP_VNNI
#define GRP_TILE8_IQ4 1       /* IQ4_NL / IQ4_XS / Q8_0 rows too (their values + 128 need dpbusd: maddubs saturates) */
#else
#define GRP_TILE8_IQ4 0
#endif
/* The nibbles of 8 rows' 32-value blocks (16 bytes at blk + r * rs + qo, GGML's order) transposed into the lanes:
 * wq[j] lane r holds row r's values 4j .. 4j + 3 (0..15 each) */
static inline __attribute__((always_inline)) void grp_nib8(const uint8_t *blk, int64_t rs, int64_t qo, __m256i wq[8]) {
    const __m256i lo = _mm256_set1_epi8(0x0F);
    __m256i t[4];                                       /* t[r]: row r's 16 bytes | row r + 4's */
    for (int r = 0; r < 4; r++)
        t[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(blk + r * rs + qo))),
                                       _mm_loadu_si128((const __m128i *)(blk + (r + 4) * rs + qo)), 1);
    const __m256i u0 = _mm256_unpacklo_epi32(t[0], t[1]), u1 = _mm256_unpackhi_epi32(t[0], t[1]);
    const __m256i u2 = _mm256_unpacklo_epi32(t[2], t[3]), u3 = _mm256_unpackhi_epi32(t[2], t[3]);
    const __m256i c[4] = {_mm256_unpacklo_epi64(u0, u2), _mm256_unpackhi_epi64(u0, u2),
                          _mm256_unpacklo_epi64(u1, u3), _mm256_unpackhi_epi64(u1, u3)};
    for (int j = 0; j < 4; j++) {
        wq[j] = _mm256_and_si256(c[j], lo);
        wq[j + 4] = _mm256_and_si256(_mm256_srli_epi16(c[j], 4), lo);
    }
}

/* Q8_0: the 32 int8 values of 8 rows' blocks (blk + r * rs + 2) transposed into the lanes as unsigned bytes (+ 128,
 * dpbusd's u8 side): wq[j] lane r holds row r's values 4j .. 4j + 3. An 8 x 8 transpose of int32 words. */
static inline __attribute__((always_inline)) void grp_q8_8(const uint8_t *blk, int64_t rs, __m256i wq[8]) {
    __m256i t[8], u[8];
    for (int r = 0; r < 8; r++) t[r] = _mm256_loadu_si256((const __m256i *)(blk + r * rs + 2));
    for (int r = 0; r < 8; r += 2) {
        u[r] = _mm256_unpacklo_epi32(t[r], t[r + 1]);      /* words 0, 1 (4, 5) of rows r, r + 1 interleaved */
        u[r + 1] = _mm256_unpackhi_epi32(t[r], t[r + 1]);  /* words 2, 3 (6, 7) */
    }
    for (int h = 0; h < 8; h += 4)
        for (int i = 0; i < 2; i++) {                       /* rows h .. h + 3: word 2i (+ 4), word 2i + 1 (+ 4) */
            t[h + 2 * i] = _mm256_unpacklo_epi64(u[h + i], u[h + 2 + i]);
            t[h + 2 * i + 1] = _mm256_unpackhi_epi64(u[h + i], u[h + 2 + i]);
        }
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    for (int j = 0; j < 4; j++) {       /* t[j]: word j (lane 1: j + 4) of rows 0..3; t[4 + j]: rows 4..7 */
        wq[j] = _mm256_xor_si256(_mm256_permute2x128_si256(t[j], t[4 + j], 0x20), bias);
        wq[j + 4] = _mm256_xor_si256(_mm256_permute2x128_si256(t[j], t[4 + j], 0x31), bias);
    }
}

/* lane r: the fp16 scale at the start of row r's block (blk + r * rs), each row's block line prefetched */
static inline __m256 grp_scales8(const uint8_t *blk, int64_t rs) {
    uint16_t h[8];
    for (int r = 0; r < 8; r++) {
        PREFETCH(blk + r * rs);
        memcpy(h + r, blk + r * rs, 2);
    }
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* out[p * ldo + r] = Q4_0 rows w + r * rs (r < 8) . pairs qx[p] (p < np <= GRP_PAIRS8), the rows in lanes: lane r
 * of a vector holds row r, each block's nibbles transposed once (4 values of a row per int32 lane) for all pairs, so a
 * pair costs 8 dpbusd with its 4 int8 values broadcast, one conversion and two fma for the 8 rows per block (the 4 x 4
 * tile: a dpbusd, a conversion, a mul and an fma per row and pair), and the results land as dst's rows (no transpose).
 * Per row and block d (dx dot(nib, qx) - 8 sx), as moe_row_q4_0_q8 (its rounding differs: one int32 dot per block).
 * Default model's layer (8 experts, D 384, I 256, 256 tokens, 1 thread, Zen 4): the 4 x 4 tile 4.17 ms, this 2.14.
 * kind 1 / 2: IQ4_NL / IQ4_XS rows (the same nibble bytes per 32 values; the codebook + 128 as unsigned bytes by one
 * shuffle, 128 sx off: d (dx dot(book + 128, qx) - 128 sx); IQ4_XS: d (ls - 32) of the row's sub-block); kind 3: Q8_0
 * rows (grp_q8_8: the values + 128, 128 sx off, as IQ4). nb: blocks of 32 values.
 * AVX2 without VNNI (Q4_0 only): a pair's 8 maddubs (nibble u8 x int8, pair sums <= 2 x 15 x 128) summed in int16
 * (<= 30720: exact), one madd to int32: the same integer sums, so the same bits as dpbusd. */
static inline __attribute__((always_inline)) __m256 grp_block8(const int kind, const uint8_t *w, int64_t rs, int64_t b,
                                                               __m256i book, __m256i wq[8]) {
    const uint8_t *blk = kind == 2 ? w + 136 * (b / 8) : w + (kind == 3 ? 34 : 18) * b;   /* or its super-block */
    const int64_t qo = kind == 2 ? 8 + 16 * (b % 8) : 2;                  /* its nibble bytes */
    __m256 d;                                           /* lane r: row r's scale */
    if (kind == 2) {
        float sc[8];
        for (int r = 0; r < 8; r++) {
            PREFETCH(blk + r * rs + qo);
            sc[r] = iq4_xs_scale(blk + r * rs, (int)(b % 8));
        }
        d = _mm256_loadu_ps(sc);
    } else {
        d = grp_scales8(blk, rs);
    }
    if (kind == 3) {
        grp_q8_8(blk, rs, wq);
    } else {
        grp_nib8(blk, rs, qo, wq);
        if (kind)
            for (int j = 0; j < 8; j++) wq[j] = _mm256_shuffle_epi8(book, wq[j]);
    }
    return d;
}

static inline __attribute__((always_inline)) void grp_tile8_nib(const int kind, const uint8_t *w, int64_t rs,
        const int8_t *const *qx, const float *const *dx, const float *const *sx, int np, int64_t nb, float *out,
        int64_t ldo) {
    __m256 acc[GRP_PAIRS8];
    for (int p = 0; p < GRP_PAIRS8; p++) acc[p] = _mm256_setzero_ps();
    const __m256i book = _mm256_add_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)iq4nl_values)),
                                         _mm256_set1_epi8((char)0x80));       /* value + 128 as an unsigned byte */
    const float off = kind ? 128.f : 8.f;
    for (int64_t b = 0; b < nb; b++) {
        __m256i wq[8];                                  /* wq[j] lane r: row r's values 4j .. 4j + 3 */
        const __m256 d = grp_block8(kind, w, rs, b, book, wq);
        for (int p = 0; p < np; p++) {
            const int8_t *q = qx[p] + 32 * b;
#if GRP_VNNI
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            for (int j = 0; j < 8; j += 2) {
                int32_t q0, q1;
                memcpy(&q0, q + 4 * j, 4);
                memcpy(&q1, q + 4 * j + 4, 4);
                s0 = DPBUSD256(s0, wq[j], _mm256_set1_epi32(q0));
                s1 = DPBUSD256(s1, wq[j + 1], _mm256_set1_epi32(q1));
            }
            const __m256i s = _mm256_add_epi32(s0, s1);
#else
            __m256i h0 = _mm256_setzero_si256(), h1 = _mm256_setzero_si256();
            for (int j = 0; j < 8; j += 2) {
                int32_t q0, q1;
                memcpy(&q0, q + 4 * j, 4);
                memcpy(&q1, q + 4 * j + 4, 4);
                h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(wq[j], _mm256_set1_epi32(q0)));
                h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(wq[j + 1], _mm256_set1_epi32(q1)));
            }
            const __m256i s = _mm256_madd_epi16(_mm256_add_epi16(h0, h1), _mm256_set1_epi16(1));
#endif
            const __m256 f = _mm256_fmsub_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dx[p][b]),
                                             _mm256_set1_ps(off * sx[p][b]));
            acc[p] = _mm256_fmadd_ps(f, d, acc[p]);
        }
    }
    for (int p = 0; p < np; p++) _mm256_storeu_ps(out + p * ldo, acc[p]);
}

/* a rows-in-lanes tile `fn` called with a constant np and kind (each variant keeps its accumulators in registers) */
#define GRP_NIB_CASE(fn, n) case 4 * n: fn(0, w, rs, qx, dx, sx, n, nb, out, ldo); break; \
                            case 4 * n + 1: fn(1, w, rs, qx, dx, sx, n, nb, out, ldo); break; \
                            case 4 * n + 2: fn(2, w, rs, qx, dx, sx, n, nb, out, ldo); break; \
                            case 4 * n + 3: fn(3, w, rs, qx, dx, sx, n, nb, out, ldo); break;
#define GRP_NIB_SWITCH(fn) switch (np * 4 + kind) { \
        GRP_NIB_CASE(fn, 1) GRP_NIB_CASE(fn, 2) GRP_NIB_CASE(fn, 3) GRP_NIB_CASE(fn, 4) \
        GRP_NIB_CASE(fn, 5) GRP_NIB_CASE(fn, 6) GRP_NIB_CASE(fn, 7) GRP_NIB_CASE(fn, 8) \
        default: break; \
    }

#if GRP_TILE16
/* grp_tile8_nib for 16 rows in the lanes of 512-bit vectors (AVX-512 VNNI): rows 0..7 and 8..15 unpacked as there
 * (grp_block8) into the two halves, so a pair's block costs the 8-row tile's instructions for twice the rows; the
 * same integer sums and float operations per row, so the same bits. Dev box (1 thread, 16 experts, D 2048, I 768,
 * 128 tokens x 8): docs/perf-log.md session 42. */
/* acc + d (dx dot(wq, q) - off_sx): one block of 16 rows in lanes (wq[j] lane r: row r's values 4j .. 4j + 3) and
 * one pair's 32 int8 values q, its scale dx and off times its scaled sum */
static inline __attribute__((always_inline)) __m512 grp_dot16(const __m512i *wq, const int8_t *q, float dxb,
                                                              float off_sx, __m512 d, __m512 acc) {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
        int32_t q0, q1;
        memcpy(&q0, q + 4 * j, 4);
        memcpy(&q1, q + 4 * j + 4, 4);
        s0 = _mm512_dpbusd_epi32(s0, wq[j], _mm512_set1_epi32(q0));
        s1 = _mm512_dpbusd_epi32(s1, wq[j + 1], _mm512_set1_epi32(q1));
    }
    const __m512 f = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_set1_ps(dxb),
                                     _mm512_set1_ps(off_sx));
    return _mm512_fmadd_ps(f, d, acc);
}

/* block b of 16 rows (w, stride rs) unpacked into the lanes: wq[8], and the rows' scales as the return value */
static inline __attribute__((always_inline)) __m512 grp_block16(const int kind, const uint8_t *w, int64_t rs,
                                                                int64_t b, __m512i wq[8]) {
    const __m256i book = _mm256_add_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)iq4nl_values)),
                                         _mm256_set1_epi8((char)0x80));
    __m256i lo[8], hi[8];
    const __m256 dlo = grp_block8(kind, w, rs, b, book, lo), dhi = grp_block8(kind, w + 8 * rs, rs, b, book, hi);
    for (int j = 0; j < 8; j++) wq[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo[j]), hi[j], 1);
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(dlo)), _mm256_castps_pd(dhi),
                                               1));
}

static inline __attribute__((always_inline)) void grp_tile16_nib(const int kind, const uint8_t *w, int64_t rs,
        const int8_t *const *qx, const float *const *dx, const float *const *sx, int np, int64_t nb, float *out,
        int64_t ldo) {
    __m512 acc[GRP_PAIRS8];
    for (int p = 0; p < GRP_PAIRS8; p++) acc[p] = _mm512_setzero_ps();
    const float off = kind ? 128.f : 8.f;
    for (int64_t b = 0; b < nb; b++) {
        __m512i wq[8];
        const __m512 d = grp_block16(kind, w, rs, b, wq);
        for (int p = 0; p < np; p++) acc[p] = grp_dot16(wq, qx[p] + 32 * b, dx[p][b], off * sx[p][b], d, acc[p]);
    }
    for (int p = 0; p < np; p++) _mm512_storeu_ps(out + p * ldo, acc[p]);
}

/* grp_tile16_nib over 16 rows unpacked once (grp_unpack16) for all of an expert's pairs: an expert with more pairs
 * than one tile no longer unpacks every block once per GRP_PAIRS8 pairs */
static void grp_unpack16(int kind, const uint8_t *w, int64_t rs, int64_t nb, __m512i *wq, __m512 *d) {
    for (int64_t b = 0; b < nb; b++) d[b] = grp_block16(kind, w, rs, b, wq + 8 * b);
}

static inline __attribute__((always_inline)) void grp_rows16_buf(const __m512i *wbuf, const __m512 *dbuf,
        const int8_t *const *qx, const float *const *dx, const float *const *sx, int np, int64_t nb, float off,
        float *out, int64_t ldo) {
    __m512 acc[GRP_PAIRS8];
    for (int p = 0; p < GRP_PAIRS8; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int p = 0; p < np; p++)
            acc[p] = grp_dot16(wbuf + 8 * b, qx[p] + 32 * b, dx[p][b], off * sx[p][b], dbuf[b], acc[p]);
    for (int p = 0; p < np; p++) _mm512_storeu_ps(out + p * ldo, acc[p]);
}

static void grp_rows16_buf_any(const __m512i *wbuf, const __m512 *dbuf, const int8_t *const *qx,
                               const float *const *dx, const float *const *sx, int np, int64_t nb, float off,
                               float *out, int64_t ldo) {
    switch (np) {
#define GRP_BUF16_CASE(n) case n: grp_rows16_buf(wbuf, dbuf, qx, dx, sx, n, nb, off, out, ldo); break;
    GRP_BUF16_CASE(1) GRP_BUF16_CASE(2) GRP_BUF16_CASE(3) GRP_BUF16_CASE(4)
    GRP_BUF16_CASE(5) GRP_BUF16_CASE(6) GRP_BUF16_CASE(7) GRP_BUF16_CASE(8)
#undef GRP_BUF16_CASE
    default: break;
    }
}

static void grp_tile16_nib_any(int kind, const uint8_t *w, int64_t rs, const int8_t *const *qx,
                               const float *const *dx, const float *const *sx, int np, int64_t nb, float *out,
                               int64_t ldo) {
    GRP_NIB_SWITCH(grp_tile16_nib)
}
#endif

/* the tile for a constant np (its accumulators in registers) */
static void grp_tile8_nib_any(int kind, const uint8_t *w, int64_t rs, const int8_t *const *qx, const float *const *dx,
                               const float *const *sx, int np, int64_t nb, float *out, int64_t ldo) {
    GRP_NIB_SWITCH(grp_tile8_nib)
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 256-value rows x int8 activations with one scale per 256 values (llama.cpp's Q8_K) on AVX-512BW: every such format,
 * Q4_K / Q6_K included, on the unpacked super-block tile (cpu_grouped_sb.c, 64 values a vector). Until session 40
 * Q4_K / Q6_K had a tile of their own here (2 rows x 8 pairs in registers, each row's super-block unpacked again for
 * every 8 pairs): 1 thread, 16 experts, D 2048, I 768, 128 tokens x 8: Q4_K 101.9 -> 83.2 ms, Q6_K 103.1 -> 88.6 on
 * the unpacked tile (float activations 110-113). */
#define GRP_Q8K 1
#if defined(__AVX512VNNI__)
#define GRP_DPWSSD(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define GRP_DPWSSD(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif

/* x [K] -> qx [K] int8 (round to nearest even of x / d), dk [K / 256] the scales d = max |x| / 127 of each 256
 * values, vs [K / 16] d times the sums of qx per 16 (the Q4_K mins and Q6_K's -32 go through them) */
static void grp_quantize_q8k(const float *x, int64_t K, int8_t *qx, float *dk, float *vs, int u8) {
    const __m512 abs = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const __m128i flip = _mm_set1_epi8(u8 ? (char)0x80 : 0);         /* u8: y + 128 stored (the rows-in-lanes tile) */
    for (int64_t b = 0; b < K / 256; b++) {
        const float *xb = x + 256 * b;
        __m512 m = _mm512_setzero_ps();
        for (int j = 0; j < 256; j += 16) m = _mm512_max_ps(m, _mm512_and_ps(_mm512_loadu_ps(xb + j), abs));
        const float d = _mm512_reduce_max_ps(m) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < 256; j += 16) {
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + j), _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(qx + 256 * b + j), _mm_xor_si128(_mm512_cvtsepi32_epi8(q), flip));
            vs[16 * b + j / 16] = d * (float)_mm512_reduce_add_epi32(q);
        }
        dk[b] = d;
    }
}

#else
/* Q4_K / Q6_K rows x int8 activations per 256 values on AVX2 without VNNI (with AVX-VNNI or AVX-512 they take
 * cpu_grouped_sb.c's tiles, GSB_K46): 32 values per instruction, one sub-block's integer dot per maddubs (the
 * unsigned weights, Q4_K's 4 bits or Q6_K's 6, x int8 activations in int16 pair sums), then a 16-bit madd with the
 * sub-block's scale (Q4_K: one per 32 values; Q6_K: one per 16, the two 128-bit halves) into int32; the float
 * conversion, the mins and Q6_K's -32 once per super-block. 16 registers cannot hold a
 * tile's accumulators and its rows' weights for many pairs, so each super-block of GRP_QR rows is unpacked once
 * (weights and broadcast scales, 512 bytes a row, in L1) and every pair of the call (GRP_QP: all of grp_task's
 * 64-pair chunk) runs over it, GRP_QB pairs x GRP_QR rows of int32 accumulators at a time. Measured (same layer as
 * above, -march=haswell, 1 thread): float activations 237 ms, the q8 row dot 223 ms; this tile (rows x pairs in
 * registers) 2 x 4: 158 ms, 2 x 8: 140, 4 rows over the unpacked super-block, 1 pair: 136 (126 with the adds kept in
 * order, below), 4 x 2: 123, 4 x 3: 125, 2 x 5: 127, 8 x 1: 137. */
#define GRP_Q8K 1
#define GRP_QR 4              /* rows unpacked per super-block */
#define GRP_QB 2              /* pairs at a time over them: 8 int32 accumulators + 2 activation registers */
#define GRP_QP 64             /* pairs per call */
#define GRP_DPWSSD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))   /* AVX-VNNI's dpwssd: no faster here */

/* as the AVX-512 grp_quantize_q8k (same rounding, same results), 8 lanes */
static void grp_quantize_q8k(const float *x, int64_t K, int8_t *qx, float *dk, float *vs, int u8) {
    const __m256i flip = _mm256_set1_epi8(u8 ? (char)0x80 : 0);       /* u8: y + 128 stored (the rows-in-lanes tile) */
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);    /* undoes packs' 128-bit lanes */
    for (int64_t b = 0; b < K / 256; b++) {
        const float *xb = x + 256 * b;
        __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
        for (int j = 0; j < 256; j += 16) {
            m0 = _mm256_max_ps(m0, _mm256_and_ps(_mm256_loadu_ps(xb + j), abs));
            m1 = _mm256_max_ps(m1, _mm256_and_ps(_mm256_loadu_ps(xb + j + 8), abs));
        }
        const __m256 m = _mm256_max_ps(m0, m1);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float d = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        const __m256 s = _mm256_set1_ps(id);
        for (int j = 0; j < 256; j += 64) {
            __m256i q[8];
            for (int u = 0; u < 8; u++) q[u] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8 * u), s));
            for (int u = 0; u < 2; u++) {
                const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[4 * u], q[4 * u + 1]),
                                                     _mm256_packs_epi32(q[4 * u + 2], q[4 * u + 3]));
                _mm256_storeu_si256((__m256i *)(qx + 256 * b + j + 32 * u),
                                    _mm256_xor_si256(_mm256_permutevar8x32_epi32(p, order), flip));
            }
            /* the 4 sums per 16: hadd twice gives [low 4 lanes | high 4 lanes] of each, then the two halves */
            const __m256i t = _mm256_hadd_epi32(
                _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])),
                _mm256_hadd_epi32(_mm256_add_epi32(q[4], q[5]), _mm256_add_epi32(q[6], q[7])));
            const __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            _mm_storeu_ps(vs + 16 * b + j / 16, _mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(t4)));
        }
        dk[b] = d;
    }
}

/* pairs p < pb (<= GRP_QB) of the AVX2 tile over super-block b of its GRP_QR unpacked rows (wu, su, mnf, dr as
 * grp_tile_q8k): the int32 dots, then into the pairs' float accumulators facc[p][r] */
static inline __attribute__((always_inline)) void grp_q8k_pairs(int pb, __m256i (*wu)[8], __m256i (*su)[8],
        __m256 (*mnf)[2], const float *dr, const int8_t *const *qx, const float *const *dk,
        const float *const *vs, int64_t b, __m256 (*facc)[GRP_QR]) {
    __m256i acc[GRP_QR][GRP_QB];
    for (int r = 0; r < GRP_QR; r++)
        for (int p = 0; p < pb; p++) acc[r][p] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        __m256i y[GRP_QB];
        for (int p = 0; p < pb; p++) y[p] = _mm256_loadu_si256((const __m256i *)(qx[p] + 256 * b + 32 * j));
        for (int r = 0; r < GRP_QR; r++) {
            const __m256i wv = wu[r][j], sv = su[r][j];
            for (int p = 0; p < pb; p++) {
                acc[r][p] = GRP_DPWSSD(acc[r][p], _mm256_maddubs_epi16(wv, y[p]), sv);
                __asm__("" : "+x"(acc[r][p]));     /* else gcc reassociates the adds and spills the products */
            }
        }
    }
    for (int p = 0; p < pb; p++) {
        const __m256 dyv = _mm256_set1_ps(dk[p][b]);
        const __m256 v0 = _mm256_loadu_ps(vs[p] + 16 * b), v1 = _mm256_loadu_ps(vs[p] + 16 * b + 8);
        for (int r = 0; r < GRP_QR; r++) {
            const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][p]), _mm256_mul_ps(_mm256_set1_ps(dr[r]), dyv),
                                             facc[p][r]);
            facc[p][r] = _mm256_fnmadd_ps(mnf[r][1], v1, _mm256_fnmadd_ps(mnf[r][0], v0, f));
        }
    }
}

/* out[r * ldo + p] = rows w + r * rs (r < GRP_QR) . pairs p < np <= GRP_QP (qx, dk, vs as grp_quantize_q8k):
 * Q4_K d sum_j sc_j dot_j - dmin sum_j mn_j bsum_j; Q6_K d sum_g sc_g (dot_g(q6 unsigned) - 32 bsum_g); each times
 * the pair's dk. Sub-block j (32
 * values): Q4_K bytes 32 (j / 2) of qs, low nibbles for even j; Q6_K half j / 4, group g = j % 4: ql bytes
 * 32 (g & 1), bits 4 (g / 2), qh bits 2 g */
static inline __attribute__((always_inline)) void grp_tile_q8k(int qtype, const uint8_t *w, int64_t rs,
        const int8_t *const *qx, const float *const *dk, const float *const *vs, int np, int64_t nsb,
        float *out, int64_t ldo) {
    const int q6 = qtype == Q6_K;
    const int64_t bb = q6 ? 210 : 144;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 facc[GRP_QP][GRP_QR];
    __m256i wu[GRP_QR][8], su[GRP_QR][8];      /* a super-block's unpacked weights and scales per row */
    __m256 mnf[GRP_QR][2];     /* per 16 values: Q4_K dmin mn_j, Q6_K 32 d sc_g (times the pair's scaled sums) */
    float dr[GRP_QR];
    for (int r = 0; r < GRP_QR; r++)
        for (int p = 0; p < np; p++) facc[p][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        for (int r = 0; r < GRP_QR; r++) {
            const uint8_t *blk = w + r * rs + b * bb;
            PREFETCH(blk);
            PREFETCH(blk + 64);
            PREFETCH(blk + 128);
            if (q6) {             /* sd: the 16 scales as int32 lanes of duplicated int16 (sd[0]: 0-3, 8-11) */
                PREFETCH(blk + 192);
                const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
                const __m256i s16 = _mm256_cvtepi8_epi16(sc);
                const __m256i sd[2] = {_mm256_unpacklo_epi16(s16, s16), _mm256_unpackhi_epi16(s16, s16)};
                dr[r] = fp16_to_f32(blk + 208);
                const __m256 d32 = _mm256_set1_ps(32.f * dr[r]);
                mnf[r][0] = _mm256_mul_ps(d32, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
                mnf[r][1] = _mm256_mul_ps(d32, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
                for (int h = 0; h < 2; h++) {
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                    for (int g = 0; g < 4; g++) {
                        const int j = 4 * h + g, g0 = 2 * j, i0 = (g0 & 3) + (g0 >= 8 ? 4 : 0);
                        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (g & 1)));
                        const __m256i lo = g & 2 ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4)
                                                 : _mm256_and_si256(ql, m4);
                        const __m256i hi = g == 0 ? _mm256_slli_epi16(qh, 4) : g == 1 ? _mm256_slli_epi16(qh, 2)
                                         : g == 2 ? qh : _mm256_srli_epi16(qh, 2);
                        wu[r][j] = _mm256_or_si256(lo, _mm256_and_si256(hi, m30));
                        /* scales 2 j (low 128-bit lane: values 0-15), 2 j + 1 (high) */
                        su[r][j] = _mm256_permutevar8x32_epi32(sd[(g0 >> 2) & 1], _mm256_setr_epi32(
                            i0, i0, i0, i0, i0 + 1, i0 + 1, i0 + 1, i0 + 1));
                    }
                }
            } else {
                uint64_t sc, mn;
                scale_min_k4(blk + 4, &sc, &mn);
                const __m256i s32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc));
                const __m256i sd = _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16));
                const __m128i m = _mm_cvtsi64_si128((int64_t)mn), mm = _mm_unpacklo_epi8(m, m);
                dr[r] = fp16_to_f32(blk);           /* mn_j at 16-groups 2 j, 2 j + 1 */
                const __m256 dmin = _mm256_set1_ps(fp16_to_f32(blk + 2));
                mnf[r][0] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mm)));
                mnf[r][1] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mm, 8))));
                for (int c = 0; c < 4; c++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
                    wu[r][2 * c] = _mm256_and_si256(q, m4);
                    wu[r][2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    su[r][2 * c] = _mm256_permutevar8x32_epi32(sd, _mm256_set1_epi32(2 * c));
                    su[r][2 * c + 1] = _mm256_permutevar8x32_epi32(sd, _mm256_set1_epi32(2 * c + 1));
                }
            }
        }
        int p = 0;
        for (; p + GRP_QB <= np; p += GRP_QB)
            grp_q8k_pairs(GRP_QB, wu, su, mnf, dr, qx + p, dk + p, vs + p, b, facc + p);
        for (; p < np; p++) grp_q8k_pairs(1, wu, su, mnf, dr, qx + p, dk + p, vs + p, b, facc + p);
    }
    for (int r = 0; r < GRP_QR; r++)
        for (int p = 0; p < np; p++) out[r * ldo + p] = hsum8(facc[p][r]);
}
/* the AVX2 tile's entry (not inlined: its frame inside grp_rows_pairs made the float tile there 1.5x slower,
 * -march=haswell) */
__attribute__((noinline)) static void grp_tile_q8k_any(int qtype, const uint8_t *w, int64_t rs, const int8_t *const *qx,
                                                       const float *const *dk, const float *const *vs, int np,
                                                       int64_t nsb, float *out, int64_t ldo) {
    if (np >= 1 && np <= GRP_QP) grp_tile_q8k(qtype, w, rs, qx, dk, vs, np, nsb, out, ldo);
}
#endif
#endif  /* MOE_Q8 */

#ifdef GRP_Q8K
#include "cpu_grouped_sb.c"
#endif

/* float activations, rows with a C dequantizer (Q8_0 / Q4_0 / MXFP4 / IQ3_XXS): 4 rows dequantized to float once
 * (wf [4, K], bit-exact with the torch dequantizer), then a 4-row x np-pair float tile: 16 FMAs per 8 loads */
static inline __attribute__((always_inline)) void grp_tile_f32(const float *wf, int64_t K, const float *const *xp,
                                                               int np, float *out, int64_t ldo) {
#ifdef VW
    vf acc[4][GRP_PAIRS];
    for (int r = 0; r < 4; r++)
        for (int p = 0; p < GRP_PAIRS; p++) acc[r][p] = vzero();
    for (int64_t j = 0; j < K; j += VW) {
        const vf w0 = vload(wf + j), w1 = vload(wf + K + j), w2 = vload(wf + 2 * K + j), w3 = vload(wf + 3 * K + j);
        for (int p = 0; p < np; p++) {
            const vf xv = vload(xp[p] + j);
            acc[0][p] = vfma(w0, xv, acc[0][p]);
            acc[1][p] = vfma(w1, xv, acc[1][p]);
            acc[2][p] = vfma(w2, xv, acc[2][p]);
            acc[3][p] = vfma(w3, xv, acc[3][p]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int p = 0; p < np; p++) out[r * ldo + p] = vsum(acc[r][p]);
#else
    for (int r = 0; r < 4; r++)
        for (int p = 0; p < np; p++) {
            float s = 0.f;
            for (int64_t j = 0; j < K; j++) s += wf[r * K + j] * xp[p][j];
            out[r * ldo + p] = s;
        }
#endif
}

static void grp_tile_f32_any(const float *wf, int64_t K, const float *const *xp, int np, float *out, int64_t ldo) {
    switch (np) {
    case 1: grp_tile_f32(wf, K, xp, 1, out, ldo); break;
    case 2: grp_tile_f32(wf, K, xp, 2, out, ldo); break;
#if GRP_PAIRS == 4
    case 3: grp_tile_f32(wf, K, xp, 3, out, ldo); break;
    case 4: grp_tile_f32(wf, K, xp, 4, out, ldo); break;
#endif
    default: break;
    }
}

#if defined(VW) && VW == 16
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
#elif defined(VW)
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
#endif

#define GRP_KC 1024           /* float path: K chunk (a multiple of every block size); measured 256: 166, 512: 144,
                              * 1024: 135, 2048: 156 ms (Q4_0, 30B-A3B shape, 128 tokens, 1 thread) */
#define GRP_KC_MAX 4096       /* K not a multiple of GRP_KC runs whole up to this (stack tile) */

/* silu(g) * u over n values (n a multiple of 32), in place of g. AVX-512: exp as Cephes' expf (range reduction by
 * ln 2 in two parts, degree-6 polynomial, ~1 ulp; input clamped to +-88), 16 lanes (the scalar expf took ~3 ms of a
 * 30B-A3B layer's 128-token prefill) */
static void grp_swiglu(float *g, const float *u, int64_t n) {
    int64_t i = 0;
#if defined(VW) && VW == 16
    for (; i + 16 <= n; i += 16) {
        const __m512 a = _mm512_loadu_ps(g + i);
        const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), _mm512_set1_ps(-88.f)),
                                       _mm512_set1_ps(88.f));                      /* -a */
        const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
        r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
        __m512 p = _mm512_set1_ps(1.9875691500e-4f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
        p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
        const __m512 e = _mm512_scalef_ps(p, k);                                     /* exp(-a) */
        _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                              _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* n values of a row from its blocks at w -> o (Q4_0 / Q8_0 vectorised, as dequant_row; K-quants above) */
static void grp_dequant(int qtype, const uint8_t *w, int64_t n, float *o) {
    switch (qtype) {
    case Q4_K: case Q5_K:
        for (int64_t b = 0; b < n / 256; b++) dequant_q45_k(w + b * block_bytes(qtype), o + 256 * b, qtype == Q5_K);
        return;
    case Q6_K:
        for (int64_t b = 0; b < n / 256; b++) dequant_q6_k(w + 210 * b, o + 256 * b);
        return;
    default: break;
    }
#ifdef VW
    if (qtype == Q4_0 || qtype == Q8_0) {
        const int64_t bb = qtype == Q4_0 ? 18 : 34;
        for (int64_t b = 0; b < n / 32; b++, w += bb, o += 32) {
            PREFETCH(w);
            const vf d = vset1(fp16_to_f32(w));
#if VW == 16
            if (qtype == Q4_0) {        /* one permute of the 16 values d (i - 8) per nibble: 12 -> 8 uops a block */
                const vf tab = vmul(d, _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
                const vi q = vbytes_u8(w + 2);
                vstore(o, _mm512_permutexvar_ps(q, tab));
                vstore(o + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), tab));
                continue;
            }
#endif
            if (qtype == Q4_0)
                for (int j = 0; j < 16; j += VW) {
                    const vi q = vbytes_u8(w + 2 + j);
                    _Static_assert(VW <= 16, "Q4_0 halves");
                    const vf lo = vadd(vlo4f(q), vset1(-8.f)), hi = vadd(vhi4f(q), vset1(-8.f));
                    vstore(o + j, vmul(d, lo));
                    vstore(o + 16 + j, vmul(d, hi));
                }
            else
                for (int j = 0; j < 32; j += VW) vstore(o + j, vmul(d, vcvt(vbytes_i8(w + 2 + j))));
        }
        return;
    }
#endif
    dequant_row(qtype, w, o, n);
}

/* Q4_K / Q6_K q8 rows: the Q8_K tile; the other 256-value formats: the unpacked super-block tile (AVX2 and
 * AVX-512BW builds) */
static int grp_int8_tile(int qtype) {
#ifdef GRP_Q8K
    return qtype == Q4_K || qtype == Q6_K || gsb_type(qtype);
#else
    (void)qtype;
    return 0;
#endif
}

/* Activations of one side (x: K = D, or a: K = I) for all pairs in sorted order, in the form its row kernel reads. */
typedef struct {
    int q8;                   /* int8 activations (moe_q8_type and q8 requested) */
    int u8;                   /* ... stored as y + 128 (the rows-in-lanes tile, GSL_ON) */
    int q8k;                  /* ... one scale per 256 values for the K-quant tile (grp_quantize_q8k): dx holds the
                               * K / 256 scales, vs the K / 16 scaled sums; else per 32 (moe_quantize_q8) */
    int64_t K, ldx;
    const float *x;           /* float: row of pair s at x + row[s] ldx, block sums at xs + row[s] (K / 32) */
    float *xs;
    int8_t *qx;               /* int8 copies, scales dx, scaled sums sx: same row indexing */
    float *dx, *sx, *vs;      /* vs [K / 16] per row: the K-quant tile's scaled sums per 16 */
    const int64_t *row;       /* sorted pair s -> its activation row (token t for x, s itself for a) */
    int8_t *qt;               /* AMX (grp_amx_side): the int8 rows of each group of 16 pairs in AMX's B layout, */
    float *dxt, *sxt;         /* their scales and scaled sums 16 a block; NULL: no AMX tile on this side */
    const int64_t *gof;       /* sorted pair s -> its group (a group: up to 16 pairs of one expert from its first) */
} grp_side;

static inline const float *grp_x(const grp_side *a, int64_t s) { return a->x + a->row[s] * a->ldx; }

/* the Q8_K-form activations of sorted pairs s .. s + np: int8 values, scales per 256 values, scaled sums per 16 */
static inline void grp_q8k_side(const grp_side *a, int64_t s, int np, const int8_t **qx, const float **dk,
                                const float **vs) {
    for (int p = 0; p < np; p++) {
        const int64_t row = a->row[s + p];
        qx[p] = a->qx + row * a->K;
        dk[p] = a->dx + row * (a->K / 32);
        vs[p] = a->vs + row * (a->K / 16);
    }
}

/* out[(r0 + r) * ldo + (s - s0)] = row r0 + r (w + r * rs, r < nr) . activation of sorted pair s in [s0, s1) */
static void grp_rows_pairs(int qtype, const uint8_t *w, int64_t rs, int64_t nr, const grp_side *a,
                           int64_t s0, int64_t s1, float *out, int64_t ldo) {
    const int64_t K = a->K, nb = K / 32;
    int64_t r = 0;
#ifdef GRP_Q8K
    if (a->q8k && gsb_type(qtype)) {  /* the unpacked super-block tiles */
#if GSL_ON
        const int64_t rows = s1 - s0 >= GSL_MIN_PAIRS ? GSL_L : GSB_R;   /* rows in lanes for an expert's many pairs */
#else
        const int64_t rows = GSB_R;
#endif
        for (int64_t s = s0; s < s1; s += GSB_P) {
            const int np = (int)(s1 - s < GSB_P ? s1 - s : GSB_P);
            const int8_t *qx[GSB_P];
            const float *dk[GSB_P], *vs[GSB_P];
            grp_q8k_side(a, s, np, qx, dk, vs);
            for (r = 0; r < nr; r += rows) {
                const int n = (int)(nr - r < rows ? nr - r : rows);
#if GSL_ON
                if (rows == GSL_L) {
                    gsl_tile(qtype, w + r * rs, rs, n, (const uint8_t *const *)qx, dk, vs, np, K / 256,
                             out + r * ldo + (s - s0), ldo);
                    continue;
                }
#endif
                gsb_tile(qtype, w + r * rs, rs, n, qx, dk, vs, np, K / 256, out + r * ldo + (s - s0), ldo);
            }
        }
        return;
    }
#ifdef GRP_QR
    if (a->q8k) {                     /* AVX2 Q4_K / Q6_K: their tile; rows past the last GRP_QR through a padded copy */
        const int64_t rb = K / 256 * block_bytes(qtype);
        for (; r < nr; r += GRP_QR) {
            const uint8_t *wr = w + r * rs;
            int64_t wrs = rs;
            float part[GRP_QR * GRP_QP];
            uint8_t pad[GRP_QR * rb];
            if (r + GRP_QR > nr) {
                for (int i = 0; i < GRP_QR; i++) memcpy(pad + i * rb, w + (r + (r + i < nr ? i : 0)) * rs, rb);
                wr = pad, wrs = rb;
            }
            for (int64_t s = s0; s < s1; s += GRP_QP) {
                const int np = (int)(s1 - s < GRP_QP ? s1 - s : GRP_QP);
                const int8_t *qx[GRP_QP];
                const float *dk[GRP_QP], *vs[GRP_QP];
                grp_q8k_side(a, s, np, qx, dk, vs);
                grp_tile_q8k_any(qtype, wr, wrs, qx, dk, vs, np, K / 256, part, GRP_QP);
                for (int64_t i = 0; i < GRP_QR && r + i < nr; i++)
                    for (int p = 0; p < np; p++) out[(r + i) * ldo + (s - s0) + p] = part[i * GRP_QP + p];
            }
        }
        return;
    }
#endif
#endif
#ifdef MOE_Q8
    if (a->q8 && (qtype == Q4_0 || qtype == Q8_0)) {
        for (; r + 4 <= nr; r += 4)
            for (int64_t s = s0; s < s1; s += GRP_PAIRS) {
                const int np = (int)(s1 - s < GRP_PAIRS ? s1 - s : GRP_PAIRS);
                const int8_t *qx[GRP_PAIRS];
                const float *dx[GRP_PAIRS];
                for (int p = 0; p < np; p++) {
                    const int64_t row = a->row[s + p];
                    qx[p] = a->qx + row * K;
                    dx[p] = a->dx + row * nb;
                }
                grp_tile_q8_any(qtype, w + r * rs, rs, qx, dx, np, nb, out + r * ldo + (s - s0), ldo);
            }
    }
#endif
    if (!a->q8 && nr >= 4 && s1 - s0 > 1) {
        /* K in chunks of GRP_KC: 4 dequantized row chunks and the pairs' x chunks stay in L1 */
        const int64_t kc = K % GRP_KC ? K : GRP_KC, cb = kc / block_elems(qtype) * block_bytes(qtype);
        float wf[4 * GRP_KC_MAX] __attribute__((aligned(64))), part[4 * GRP_PAIRS];
        if (kc <= GRP_KC_MAX)
            for (; r + 4 <= nr; r += 4)
                for (int64_t k0 = 0, c = 0; k0 < K; k0 += kc, c++) {
                    for (int i = 0; i < 4; i++) grp_dequant(qtype, w + (r + i) * rs + c * cb, kc, wf + i * kc);
                    for (int64_t s = s0; s < s1; s += GRP_PAIRS) {
                        const int np = (int)(s1 - s < GRP_PAIRS ? s1 - s : GRP_PAIRS);
                        const float *xp[GRP_PAIRS];
                        for (int p = 0; p < np; p++) xp[p] = grp_x(a, s + p) + k0;
                        grp_tile_f32_any(wf, kc, xp, np, part, GRP_PAIRS);
                        for (int i = 0; i < 4; i++)
                            for (int p = 0; p < np; p++)
                                out[(r + i) * ldo + (s - s0) + p] = (k0 ? out[(r + i) * ldo + (s - s0) + p] : 0.f)
                                                                    + part[i * GRP_PAIRS + p];
                    }
                }
    }
    for (; r < nr; r++)
        for (int64_t s = s0; s < s1; s++) {
            const int64_t row = a->row[s];
            float v;
#ifdef MOE_Q8
            if (a->q8) v = moe_row_q8(qtype, w + r * rs, a->qx + row * K, a->dx + row * nb, a->sx + row * nb, K);
            else
#endif
            v = row_dot(qtype, w + r * rs, grp_x(a, s), a->xs + row * nb, K);
            out[r * ldo + (s - s0)] = v;
        }
}

/* fill activation row i in the side's form */
static void grp_prepare(grp_side *a, int64_t i) {
    const float *x = a->x + i * a->ldx;
#ifdef GRP_Q8K
    if (a->q8k) {
        grp_quantize_q8k(x, a->K, a->qx + i * a->K, a->dx + i * (a->K / 32), a->vs + i * (a->K / 16), a->u8);
        return;
    }
#endif
#ifdef MOE_Q8
    if (a->q8) { moe_quantize_q8(x, a->K, a->qx + i * a->K, a->dx + i * (a->K / 32), a->sx + i * (a->K / 32)); return; }
#endif
    block_sums(x, a->K, a->xs + i * (a->K / 32));
}

static void grp_side_init(grp_side *a, int qtype, int q8, int64_t K, const float *x, int64_t ldx, const int64_t *row,
                          char **mem, int64_t n) {
    a->K = K;
    a->ldx = ldx;
    a->x = x;
    a->row = row;
#ifdef MOE_Q8
    a->q8 = q8 && moe_q8_type(qtype);
#else
    (void)qtype; (void)q8;
    a->q8 = 0;
#endif
    a->q8k = 0;
#ifdef GRP_Q8K
    a->q8k = a->q8 && grp_int8_tile(qtype);
#endif
    a->u8 = 0;
#if defined(GRP_Q8K) && GSL_ON
    a->u8 = a->q8k && gsb_type(qtype);
#endif
    a->qt = NULL, a->dxt = a->sxt = NULL, a->gof = NULL;
    a->xs = (float *)*mem;
    a->dx = a->xs + n * (K / 32);
    a->sx = a->dx + n * (K / 32);
    a->vs = a->sx + n * (K / 32);
    a->qx = (int8_t *)(a->vs + n * (K / 16));
    *mem += sizeof(float) * 5 * n * (K / 32) + n * K;
}

#if defined(GRP_ROWS8) && !GRP_VNNI
/* AVX2 without VNNI, Q4_0 rows: grp_tile8_nib's arithmetic (rows in lanes, the same bits) with the 8 rows' blocks
 * unpacked once into wq / d (L1: 288 bytes a block) for all of an expert's pairs, pairs outer: a pair's block is 8
 * loads, 8 broadcasts, 8 maddubs summed in int16 (exact: <= 30720), one madd, and its accumulator stays in a register
 * (the in-register tile spills on 16 registers). */
static void grp_rows8_q4_0_avx2(const uint8_t *w, int64_t rs, const grp_side *a, int64_t s0, int64_t s1, int64_t nb,
                                __m256i *wq, __m256 *d, float *dst, int64_t ld) {
    const __m256i one = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        d[b] = grp_scales8(w + 18 * b, rs);
        grp_nib8(w + 18 * b, rs, 2, wq + 8 * b);
    }
    for (int64_t s = s0; s < s1; s++) {
        const int64_t row = a->row[s];
        const int8_t *q = a->qx + row * a->K;
        const float *dx = a->dx + row * nb, *sx = a->sx + row * nb;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++, q += 32) {
            __m256i h = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                int32_t x0;
                memcpy(&x0, q + 4 * j, 4);
                h = _mm256_add_epi16(h, _mm256_maddubs_epi16(wq[8 * b + j], _mm256_set1_epi32(x0)));
            }
            const __m256 f = _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(h, one)), _mm256_set1_ps(dx[b]),
                                             _mm256_set1_ps(8.f * sx[b]));
            acc = _mm256_fmadd_ps(f, d[b], acc);
        }
        _mm256_storeu_ps(dst + s * ld, acc);
    }
}
#endif

/* a rows-in-lanes format's kind (grp_block8, grp_amx_unpack): Q4_0 0, IQ4_NL 1, IQ4_XS 2, Q8_0 3 */
static inline int grp_nib_kind(int qtype) { return qtype == Q4_0 ? 0 : qtype == IQ4_NL ? 1 : qtype == IQ4_XS ? 2 : 3; }

#if GRP_TILE16 && defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
/* AMX (Sapphire Rapids and later) for the rows-in-lanes formats (Q4_0, Q8_0, IQ4_NL, IQ4_XS): TDPBUSD multiplies a
 * block of 16 weight rows (A: 16 x 32 bytes, the values unsigned as the VNNI tile has them: Q4_0's nibbles, IQ4's and
 * Q8_0's + 128) by a block of 16 pairs' int8 activations (B: 8 x 64 bytes, pair p's values 4j .. 4j + 3 in int32
 * word p of row j) into a 16 x 16 int32 tile. The activations are put in that layout once a call per group of 16
 * pairs (grp_amx_side), the weights unpacked once per 16 rows of a task (grp_amx_unpack) for all its pairs. The tile
 * goes to L1 and each row's 16 sums get grp_dot16's float operations (d (dx dot - off sx): the same integer sums, the
 * same order, so the same bits as the VNNI tile), pairs in the lanes; the 16 x 16 result is transposed at the end.
 * Tiles in two sets, three blocks in flight, so the tile unit's work may overlap the float work of the block before
 * (measured: partly; a tile store and the loads after it are what bind, docs/perf-log.md session 43).
 * Linux grants the tile state once a process (arch_prctl ARCH_REQ_XCOMP_PERM); MOETIER_AMX=0 in the environment or
 * moetier_amx(0) keeps the VNNI tile. */
#include <sys/syscall.h>
#include <unistd.h>
#define GRP_AMX 1
#ifndef GRP_AMX_MIN_PAIRS
#define GRP_AMX_MIN_PAIRS 9   /* an expert with fewer pairs: the VNNI tile (128 experts, 96 tokens x 8, 2 threads:
                               * 9 took 4-6% less than 6, 3 9% more, 13 2-4% more; at 512 tokens 9 as 6) */
#endif
static int grp_amx_state;      /* 0 not asked yet, 1 on, -1 off */

/* Linux's permission for the tile state: 1 granted, -1 not */
static int grp_amx_ask(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
}

static int grp_amx_on(void) {
    int s = __atomic_load_n(&grp_amx_state, __ATOMIC_RELAXED);
    if (!s) {
        const char *e = getenv("MOETIER_AMX");
        s = e && e[0] == '0' ? -1 : grp_amx_ask();
        __atomic_store_n(&grp_amx_state, s, __ATOMIC_RELAXED);
    }
    return s > 0;
}

/* the formats with an AMX tile (the rows-in-lanes ones) */
static inline int grp_amx_format(int qtype) {
    return qtype == Q4_0 || qtype == Q8_0 || qtype == IQ4_NL || qtype == IQ4_XS;
}

/* ... where it is on */
static int grp_amx_type(int qtype) { return grp_amx_format(qtype) && grp_amx_on(); }

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } grp_tilecfg;

static void grp_amx_config(void) {
    grp_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2; t++) c.rows[t] = 16, c.colsb[t] = 64;    /* 0, 1: C, 16 rows x 16 pairs of int32 */
    for (int t = 2; t < 4; t++) c.rows[t] = 16, c.colsb[t] = 32;    /* 2, 3: A, 16 rows x 32 values */
    for (int t = 4; t < 6; t++) c.rows[t] = 8, c.colsb[t] = 64;     /* 4, 5: B, 8 x (16 pairs x 4 values) */
    _tile_loadconfig(&c);
}

/* group G of side a: pairs s .. s + np (np <= 16; the rest zero) in the B layout, 512 bytes a block */
static void grp_amx_side(grp_side *a, int64_t s, int np, int64_t G) {
    const int64_t K = a->K, nb = K / 32;
    int32_t *qt = (int32_t *)(a->qt + G * nb * 512);
    float *dxt = a->dxt + G * nb * 16, *sxt = a->sxt + G * nb * 16;
    for (int p = 0; p < 16; p++) {
        const int64_t row = p < np ? a->row[s + p] : 0;
        const int32_t *q = (const int32_t *)(a->qx + row * K);
        for (int64_t b = 0; b < nb; b++) {
            for (int j = 0; j < 8; j++) qt[b * 128 + j * 16 + p] = p < np ? q[8 * b + j] : 0;
            dxt[b * 16 + p] = p < np ? a->dx[row * nb + b] : 0.f;
            sxt[b * 16 + p] = p < np ? a->sx[row * nb + b] : 0.f;
        }
    }
}

/* every group of side a in the B layout, over the threads of the enclosing parallel region (an orphaned worksharing
 * loop: all of its threads call this, and a->qt, shared, sends all or none of them past the test) */
static void grp_amx_sides(grp_side *a, const int64_t *gstart, const int64_t *gnp, int64_t ngroups) {
    if (!a->qt) return;
    #pragma omp for schedule(dynamic, 4)
    for (int64_t G = 0; G < ngroups; G++) grp_amx_side(a, gstart[G], (int)gnp[G], G);
}

/* 16 rows (w, stride rs) -> their blocks as A tiles (wa + 512 b, a row's 32 values unsigned, in order) and their
 * scales (d[16 b + r]) */
static inline __attribute__((always_inline)) void grp_amx_unpack(const int kind, const uint8_t *w, int64_t rs,
                                                                 int64_t nb, uint8_t *wa, float *d) {
    const __m128i lo = _mm_set1_epi8(0x0F);
    const __m128i book = _mm_add_epi8(_mm_load_si128((const __m128i *)iq4nl_values), _mm_set1_epi8((char)0x80));
    for (int r = 0; r < 16; r++) {
        const uint8_t *row = w + r * rs;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = wa + 512 * b + 32 * r;
            if (kind == 3) {
                const uint8_t *blk = row + 34 * b;
                d[16 * b + r] = fp16_to_f32(blk);
                _mm256_store_si256((__m256i *)o, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)),
                                                                  _mm256_set1_epi8((char)0x80)));
                continue;
            }
            const uint8_t *blk = kind == 2 ? row + 136 * (b / 8) : row + 18 * b;
            d[16 * b + r] = kind == 2 ? iq4_xs_scale(blk, (int)(b % 8)) : fp16_to_f32(blk);
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (kind == 2 ? 8 + 16 * (b % 8) : 2)));
            __m128i l = _mm_and_si128(q, lo), h = _mm_and_si128(_mm_srli_epi16(q, 4), lo);
            if (kind) l = _mm_shuffle_epi8(book, l), h = _mm_shuffle_epi8(book, h);
            _mm_store_si128((__m128i *)o, l);
            _mm_store_si128((__m128i *)(o + 16), h);
        }
    }
}

/* grp_amx_unpack for a constant kind (the kind's branches out of the loop, its constants in registers: as one
 * function with the kind a variable, inlined into grp_task, it reloaded them from the stack every block) */
static __attribute__((noinline)) void grp_amx_unpack_any(int kind, const uint8_t *w, int64_t rs, int64_t nb,
                                                          uint8_t *wa, float *d) {
    switch (kind) {
    case 0: grp_amx_unpack(0, w, rs, nb, wa, d); break;
    case 1: grp_amx_unpack(1, w, rs, nb, wa, d); break;
    case 2: grp_amx_unpack(2, w, rs, nb, wa, d); break;
    default: grp_amx_unpack(3, w, rs, nb, wa, d); break;
    }
}

#define GRP_AMX_ISSUE(tc, ta, tb, b) do { _tile_zero(tc); _tile_loadd(ta, wa + 512 * (b), 32); \
    _tile_loadd(tb, qt + 512 * (b), 64); _tile_dpbusd(tc, ta, tb); _tile_stored(tc, c[(b) & 3], 64); } while (0)

/* out[p * ldo + r] = 16 unpacked rows (wa, d) . the pairs p < np of one group (qt, dxt, sxt), nb blocks */
static void grp_amx_tile(const uint8_t *wa, const float *d, const int8_t *qt, const float *dxt, const float *sxt,
                         int64_t nb, float off, int np, float *out, int64_t ldo, const char *pf, int64_t pfn) {
    int32_t c[4][256] __attribute__((aligned(64)));
    __m512 acc[16];
    const __m512 voff = _mm512_set1_ps(off);
    const int64_t pfq = (pfn + nb - 1) / nb;          /* lines of pf asked for a block */
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
#define GRP_AMX_EPI(b) do { \
        const __m512 dxv = _mm512_loadu_ps(dxt + 16 * (b)); \
        const __m512 osx = _mm512_mul_ps(_mm512_loadu_ps(sxt + 16 * (b)), voff); \
        const int32_t *cb = c[(b) & 3]; \
        _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++) \
            acc[r] = _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * r)), dxv, osx), \
                                     _mm512_set1_ps(d[16 * (b) + r]), acc[r]); \
    } while (0)
    GRP_AMX_ISSUE(0, 2, 4, 0);
    if (nb > 1) GRP_AMX_ISSUE(1, 3, 5, 1);
    if (nb > 2) GRP_AMX_ISSUE(0, 2, 4, 2);
    for (int64_t b = 0; b < nb; b += 2) {
        for (int64_t l = b * pfq; l < (b + 2) * pfq && l < pfn; l++) __builtin_prefetch(pf + 64 * l, 0, 3);
        GRP_AMX_EPI(b);
        if (b + 3 < nb) GRP_AMX_ISSUE(1, 3, 5, b + 3);
        if (b + 1 < nb) {
            GRP_AMX_EPI(b + 1);
            if (b + 4 < nb) GRP_AMX_ISSUE(0, 2, 4, b + 4);
        }
    }
#undef GRP_AMX_EPI
    /* acc[r] lane p -> out[p * ldo + r]: a 16 x 16 transpose through L1 */
    float t[16][16] __attribute__((aligned(64)));
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) _mm512_store_ps(t[r], acc[r]);
    const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    for (int p = 0; p < np; p++)
        _mm512_storeu_ps(out + p * ldo, _mm512_i32gather_ps(col, &t[0][p], 4));
}

/* Whether grp_task runs qtype's rows of this side on AMX */
static inline int grp_amx_task(int qtype, const grp_side *a, int64_t m, int64_t np) {
    return a->qt && m % 16 == 0 && np >= GRP_AMX_MIN_PAIRS && grp_amx_format(qtype);
}

/* An AMX side for groups of up to 16 pairs: gstart / gnp of each group, gof of each pair, and the B-layout buffers
 * (one allocation, *buf; NULL when out of memory: the side stays without) */
static void grp_amx_alloc(grp_side *a, int64_t ngroups, const int64_t *gof, void **buf) {
    const int64_t nb = a->K / 32;
    char *m = aligned_alloc(64, (size_t)(ngroups * nb * (512 + 2 * 16 * sizeof(float))));
    *buf = m;
    if (!m) return;
    a->qt = (int8_t *)m;
    a->dxt = (float *)(m + ngroups * nb * 512);
    a->sxt = a->dxt + ngroups * nb * 16;
    a->gof = gof;
}
#else
#define GRP_AMX 0
#endif

/* -1: whether this process computes the 32-value formats' int8 prefill tile on AMX; 0 / 1: turn it off / on (where
 * the CPU, the build and the OS allow it); returns the state then */
int moetier_amx(int want) {
#if GRP_AMX
    if (want == 0) __atomic_store_n(&grp_amx_state, -1, __ATOMIC_RELAXED);
    if (want == 1) __atomic_store_n(&grp_amx_state, grp_amx_ask(), __ATOMIC_RELAXED);
    return grp_amx_on();
#else
    (void)want;
    return 0;
#endif
}

/* out rows [r, r + m) of expert e's matrix (rows at w, stride rs) for all its pairs [s0, s1), scattered to
 * dst[s ld + r + j] (pairs in chunks of 64: a tile on the stack) */
static void grp_task(int qtype, const uint8_t *w, int64_t rs, int64_t m, const grp_side *a, int64_t s0, int64_t s1,
                     float *dst, int64_t ld, int64_t r) {
#if GRP_AMX
    if (grp_amx_task(qtype, a, m, s1 - s0)) {
        const int kind = grp_nib_kind(qtype);
        const int64_t nb = a->K / 32;
        /* the unpacked rows: a buffer per thread, kept (grown) across calls */
        static __thread uint8_t *wa;
        static __thread int64_t wa_nb;
        if (wa_nb < nb) {
            free(wa);
            wa = aligned_alloc(64, nb * (512 + 16 * sizeof(float)));
            wa_nb = wa ? nb : 0;
        }
        if (wa) {
            float *d = (float *)(wa + nb * 512);
            /* the next 16 rows' bytes asked for while these 16 are multiplied (the unpack would wait for RAM) */
            const int64_t groups = (s1 - s0 + 15) / 16, lines = (16 * rs + 63) / 64;
            const int64_t per = (lines + groups - 1) / groups;
            grp_amx_config();
            for (int64_t i = 0; i < m; i += 16) {
                grp_amx_unpack_any(kind, w + i * rs, rs, nb, wa, d);
                for (int64_t s = s0, g = 0; s < s1; s += 16, g++) {
                    const int64_t G = a->gof[s], first = g * per;
                    const int64_t n = first >= lines ? 0 : lines - first < per ? lines - first : per;
                    grp_amx_tile(wa, d, a->qt + G * nb * 512, a->dxt + G * nb * 16, a->sxt + G * nb * 16, nb,
                                 kind ? 128.f : 8.f, (int)(s1 - s < 16 ? s1 - s : 16), dst + s * ld + r + i, ld,
                                 (const char *)(w + (i + 16) * rs) + 64 * first, n);
                }
            }
            _tile_release();
            return;
        }
    }
#endif
#if defined(GRP_ROWS8) && !GRP_VNNI
    __m256i *wq = qtype == Q4_0 && a->q8 && m % 8 == 0 && s1 - s0 >= GRP_OUTER_PAIRS
                  ? aligned_alloc(32, (a->K / 32) * (8 * sizeof(__m256i) + sizeof(__m256))) : NULL;
    if (wq) {           /* many pairs: each block unpacked once (grp_rows8_q4_0_avx2), else the in-register tile */
        for (int64_t i = 0; i < m; i += 8)
            grp_rows8_q4_0_avx2(w + i * rs, rs, a, s0, s1, a->K / 32, wq, (__m256 *)(wq + 8 * (a->K / 32)),
                                dst + r + i, ld);
        free(wq);
        return;
    }
#endif
#ifdef GRP_ROWS8
    /* rows in lanes: 8 rows of a pair contiguous in dst */
    if ((qtype == Q4_0 || (GRP_TILE8_IQ4 && (qtype == IQ4_NL || qtype == IQ4_XS || qtype == Q8_0))) && a->q8
        && m % 8 == 0) {
        const int kind = grp_nib_kind(qtype);
        const int64_t nb = a->K / 32;
        const int rows = GRP_TILE16 && m % 16 == 0 && MOETIER_TILE16 ? 16 : 8;
#if GRP_TILE16
        /* an expert's 16 rows unpacked once into L1 for all its pairs (grp_rows16_buf) when it has more than a tile */
        __m512i *wbuf = rows == 16 && s1 - s0 > GRP_PAIRS8 && MOETIER_UNPACK16
                        ? aligned_alloc(64, nb * (8 * sizeof(__m512i) + sizeof(__m512))) : NULL;
        __m512 *dbuf = wbuf ? (__m512 *)(wbuf + 8 * nb) : NULL;
#endif
        for (int64_t i = 0; i < m; i += rows) {
#if GRP_TILE16
            if (wbuf)
                grp_unpack16(kind, w + i * rs, rs, nb, wbuf, dbuf);
#endif
            for (int64_t s = s0; s < s1; s += GRP_PAIRS8) {
                const int np = (int)(s1 - s < GRP_PAIRS8 ? s1 - s : GRP_PAIRS8);
                const int8_t *qx[GRP_PAIRS8];
                const float *dx[GRP_PAIRS8], *sx[GRP_PAIRS8];
                for (int p = 0; p < np; p++) {
                    const int64_t row = a->row[s + p];
                    qx[p] = a->qx + row * a->K;
                    dx[p] = a->dx + row * nb;
                    sx[p] = a->sx + row * nb;
                }
                float *o = dst + s * ld + r + i;
#if GRP_TILE16
                if (wbuf) {
                    grp_rows16_buf_any(wbuf, dbuf, qx, dx, sx, np, nb, kind ? 128.f : 8.f, o, ld);
                    continue;
                }
                if (rows == 16) {
                    grp_tile16_nib_any(kind, w + i * rs, rs, qx, dx, sx, np, nb, o, ld);
                    continue;
                }
#endif
                grp_tile8_nib_any(kind, w + i * rs, rs, qx, dx, sx, np, nb, o, ld);
            }
        }
#if GRP_TILE16
        free(wbuf);
#endif
        return;
    }
#endif
    float tile[GRP_ROWS * 64];
    for (int64_t c0 = s0; c0 < s1; c0 += 64) {
        const int64_t c1 = s1 - c0 < 64 ? s1 : c0 + 64, n = c1 - c0;
        grp_rows_pairs(qtype, w, rs, m, a, c0, c1, tile, n);
        for (int64_t j = 0; j < m; j++)
            for (int64_t s = c0; s < c1; s++) dst[s * ld + r + j] = tile[j * n + (s - c0)];
    }
}

/* Tasks a thread takes at a time: 4 consecutive ones where there are >= 16 a thread, so a task's prefetch of the next
 * rows (grp_amx_tile's pf) lands in the cache of the thread that reads them (128 experts, 512 tokens x 8, 2 threads:
 * AMX 71.0 -> 66.8 ms for Q4_0, 76.5 -> 72.6 for Q8_0; VNNI / Q8_K tiles 1-2%; 8 no better); else one (balance) */
static inline int grp_chunk(int64_t tasks, int nthreads) { return tasks >= 16 * (int64_t)nthreads ? 4 : 1; }

/* (expert, first row) tasks over the used experts' n rows, split at `cut` too (gate | up); -> their count */
static int64_t grp_tasks(const int64_t *start, int64_t E, int64_t n, int64_t cut, int64_t *task) {
    int64_t nt = 0;
    for (int64_t e = 0; e < E; e++)
        if (start[e + 1] > start[e])
            for (int64_t r = 0; r < n;) {
                int64_t m = n - r < GRP_ROWS ? n - r : GRP_ROWS;
                if (r < cut && r + m > cut) m = cut - r;
                task[3 * nt] = e, task[3 * nt + 1] = r, task[3 * nt + 2] = m, nt++;
                r += m;
            }
    return nt;
}

/* The calls' workspace, kept for the next call (up to GRP_WS_KEEP bytes): a prompt's layer needs tens of MB (h and
 * o alone 58 MB at 512 tokens of Qwen3-30B-A3B), above glibc's largest mmap threshold (32 MB), so a fresh one was
 * mapped and faulted in page by page every call. One cached block, taken and given back by atomic exchange (calls
 * from two threads at once: the second allocates its own). */
#define GRP_WS_KEEP ((size_t)256 << 20)
static void *grp_ws_cache;     /* a block: its size in the first 8 of 64 header bytes */

static char *grp_ws_take(size_t n) {
    char *h = __atomic_exchange_n((char **)&grp_ws_cache, NULL, __ATOMIC_ACQUIRE);
    if (h && *(size_t *)h >= n) return h + 64;
    free(h);
    h = malloc(64 + n);
    if (!h) return NULL;
    *(size_t *)h = n;
    return h + 64;
}

static void grp_ws_give(char *p) {
    if (!p) return;
    char *h = p - 64;
    if (*(size_t *)h > GRP_WS_KEEP) {
        free(h);
        return;
    }
    free(__atomic_exchange_n((char **)&grp_ws_cache, h, __ATOMIC_RELEASE));   /* the block cached before, if any */
}

/* Types whose q8 rows run an integer tile in this build (each block's weights unpacked once for all pairs);
 * the others take the q8 row dot per (row, pair) */
int moetier_grouped_int8_tile(int qtype) {
#ifdef MOE_Q8
    if (qtype == Q4_0 || qtype == Q8_0) return 1;
#endif
#ifdef GRP_ROWS8
    if (GRP_TILE8_IQ4 && (qtype == IQ4_NL || qtype == IQ4_XS)) return 1;
#endif
    return grp_int8_tile(qtype);
}

/* Rows per rows-in-lanes step of the Q8_K tiles in this build (16: AVX-512 VNNI, 8: AVX-VNNI), 0 without one */
int moetier_grouped_lanes(void) {
#if defined(GRP_Q8K) && GSL_ON
    return GSL_L;
#else
    return 0;
#endif
}

/* Returns 0, -1 for an unsupported type / shape / expert id, -2 if out of memory. */
int moetier_moe_grouped(int gq, int dq, const uint8_t *gate, const uint8_t *up, int64_t g_estride, int64_t g_rstride,
                        const uint8_t *down, int64_t d_estride, int64_t d_rstride, int64_t E, int64_t D, int64_t I,
                        int64_t T, int64_t k, const int64_t *ids, const float *w, const float *x, float *y,
                        int q8, int nthreads) {
    if (!moetier_supported(gq) || !moetier_supported(dq) || D % block_elems(gq) || I % block_elems(dq)) return -1;
    const int64_t P = T * k;
    for (int64_t i = 0; i < P; i++)
        if (ids[i] < 0 || ids[i] >= E) return -1;
    /* int64: start [E + 1], pos of pair p [P], token of sorted s [P], identity [P], tasks [3 E (Gg + Gd)];
     * float: h [P, 2I] (gate | up; then a in the gate half), o [P, D]; the two activation sides */
    const int64_t Gg = 2 * I / GRP_ROWS + 2, Gd = D / GRP_ROWS + 1;
    const int64_t ni = E + 1 + 3 * P + 3 * E * (Gg + Gd);
    const int64_t sides = sizeof(float) * 5 * (T * (D / 32) + P * (I / 32)) + T * D + P * I;
    char *mem = grp_ws_take(sizeof(int64_t) * ni + sizeof(float) * P * (2 * I + D) + sides + 256);
    if (!mem) return -2;
    int64_t *start = (int64_t *)mem, *pos = start + E + 1, *tok = pos + P, *self = tok + P;
    int64_t *gtask = self + P, *dtask = gtask + 3 * E * Gg;
    float *h = (float *)(((uintptr_t)(dtask + 3 * E * Gd) + 63) & ~(uintptr_t)63);   /* rows 64-byte aligned */
    float *o = h + P * 2 * I;
    char *cur = (char *)(o + P * D);

    /* counting sort of the pairs by expert (stable: pair order within an expert) */
    memset(start, 0, sizeof(int64_t) * (E + 1));
    for (int64_t p = 0; p < P; p++) start[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t p = 0; p < P; p++) {
        const int64_t s = start[ids[p]]++;
        pos[p] = s;
        tok[s] = p / k;
        self[s] = s;
    }
    for (int64_t e = E; e > 0; e--) start[e] = start[e - 1];     /* undo the ++: start[e] = first pair of e */
    start[0] = 0;
    const int64_t ng = grp_tasks(start, E, 2 * I, I, gtask), nd = grp_tasks(start, E, D, D, dtask);

    grp_side ax, ah;
    grp_side_init(&ax, gq, q8, D, x, D, tok, &cur, T);
    grp_side_init(&ah, dq, q8, I, h, 2 * I, self, &cur, P);
#if GRP_AMX
    /* AMX sides: each expert's pairs in groups of 16 from its first */
    int64_t *gof = NULL, *gstart = NULL, *gnp = NULL, ngroups = 0;
    void *bx = NULL, *bh = NULL;
    const int x_amx = ax.q8 && !ax.q8k && grp_amx_type(gq), h_amx = ah.q8 && !ah.q8k && grp_amx_type(dq);
    if (x_amx || h_amx) {
        for (int64_t e = 0; e < E; e++) ngroups += (start[e + 1] - start[e] + 15) / 16;
        gof = malloc(sizeof(int64_t) * (P + 2 * ngroups));
        if (gof) {
            gstart = gof + P, gnp = gstart + ngroups;
            for (int64_t e = 0, G = 0; e < E; e++)
                for (int64_t s = start[e]; s < start[e + 1]; s += 16, G++) {
                    gstart[G] = s, gnp[G] = start[e + 1] - s < 16 ? start[e + 1] - s : 16;
                    for (int64_t j = s; j < s + gnp[G]; j++) gof[j] = G;
                }
            if (x_amx) grp_amx_alloc(&ax, ngroups, gof, &bx);
            if (h_amx) grp_amx_alloc(&ah, ngroups, gof, &bh);
        }
    }
#endif
    const int64_t gbytes = 2 * I * (D / block_elems(gq)) * block_bytes(gq);
    const int64_t dbytes = D * (I / block_elems(dq)) * block_bytes(dq);
    int64_t used = 0;
    for (int64_t e = 0; e < E; e++) used += start[e + 1] > start[e];
    const int64_t bytes = used * (gbytes + dbytes);
    if (nthreads > 1 + bytes / MIN_BYTES_PER_THREAD) nthreads = (int)(1 + bytes / MIN_BYTES_PER_THREAD);
    const int gchunk = grp_chunk(ng, nthreads), dchunk = grp_chunk(nd, nthreads);

    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) grp_prepare(&ax, t);
#if GRP_AMX
        grp_amx_sides(&ax, gstart, gnp, ngroups);
#endif
        #pragma omp for schedule(dynamic, gchunk)
        for (int64_t i = 0; i < ng; i++) {             /* gate / up rows: h[s, r .. r + m) */
            const int64_t e = gtask[3 * i], r = gtask[3 * i + 1], m = gtask[3 * i + 2];
            const uint8_t *base = (r < I ? gate + r * g_rstride : up + (r - I) * g_rstride) + e * g_estride;
            grp_task(gq, base, g_rstride, m, &ax, start[e], start[e + 1], h, 2 * I, r);
        }
        #pragma omp for schedule(static)
        for (int64_t s = 0; s < P; s++) {
            float *a = h + s * 2 * I;                   /* silu(gate) * up in place of the gates */
            grp_swiglu(a, a + I, I);
            grp_prepare(&ah, s);
        }
#if GRP_AMX
        grp_amx_sides(&ah, gstart, gnp, ngroups);
#endif
        #pragma omp for schedule(dynamic, dchunk)
        for (int64_t i = 0; i < nd; i++) {             /* down rows: o[s, r .. r + m) */
            const int64_t e = dtask[3 * i], r = dtask[3 * i + 1], m = dtask[3 * i + 2];
            grp_task(dq, down + e * d_estride + r * d_rstride, d_rstride, m, &ah, start[e], start[e + 1], o, D, r);
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {              /* y[t] = sum_j w[t, j] o[pos(t, j)], j in order */
            float *yt = y + t * D;
            for (int64_t d = 0; d < D; d++) yt[d] = 0.f;
            for (int64_t j = 0; j < k; j++) {
                const float wj = w[t * k + j], *ot = o + pos[t * k + j] * D;
                for (int64_t d = 0; d < D; d++) yt[d] += wj * ot[d];
            }
        }
    }
#if GRP_AMX
    free(gof), free(bx), free(bh);
#endif
    grp_ws_give(mem);
    return 0;
}

/* y [T, N] = x [T, K] . the N rows of w (GGML rows of qtype, stride rs): the experts' tile above with one "expert"
 * that every token uses, for a dense projection over many tokens (prefill). q8: int8 activations where the type has
 * them (moe_q8_type), else float. Each task's GRP_ROWS rows are read once for all T tokens. Returns 0, -1 for an
 * unsupported type or shape, -2 if out of memory. */
int moetier_qgemm(int qtype, const uint8_t *w, int64_t rs, int64_t N, int64_t K, int64_t T, const float *x, float *y,
                  int q8, int nthreads) {
    if (!moetier_supported(qtype) || K % block_elems(qtype) || K % 32 || N < 1 || T < 1) return -1;
    char *mem = grp_ws_take(sizeof(int64_t) * T + sizeof(float) * 5 * T * (K / 32) + T * K + 128);
    if (!mem) return -2;
    int64_t *row = (int64_t *)mem;                  /* token t's activation row: t */
    for (int64_t t = 0; t < T; t++) row[t] = t;
    char *cur = (char *)(((uintptr_t)(row + T) + 63) & ~(uintptr_t)63);
    grp_side a;
    grp_side_init(&a, qtype, q8, K, x, K, row, &cur, T);
#if GRP_AMX
    const int64_t ngroups = (T + 15) / 16;            /* AMX: the tokens in groups of 16 */
    int64_t *gof = NULL;
    void *buf = NULL;
    if (a.q8 && !a.q8k && grp_amx_type(qtype) && (gof = malloc(sizeof(int64_t) * T))) {
        for (int64_t t = 0; t < T; t++) gof[t] = t / 16;
        grp_amx_alloc(&a, ngroups, gof, &buf);
    }
#endif
    const int64_t tasks = (N + GRP_ROWS - 1) / GRP_ROWS, bytes = N * (K / block_elems(qtype)) * block_bytes(qtype);
    if (nthreads > 1 + bytes / MIN_BYTES_PER_THREAD) nthreads = (int)(1 + bytes / MIN_BYTES_PER_THREAD);
    const int chunk = grp_chunk(tasks, nthreads);
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) grp_prepare(&a, t);
#if GRP_AMX
        if (a.qt) {
            #pragma omp for schedule(dynamic, 4)
            for (int64_t G = 0; G < ngroups; G++) grp_amx_side(&a, 16 * G, (int)(T - 16 * G < 16 ? T - 16 * G : 16), G);
        }
#endif
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t i = 0; i < tasks; i++) {      /* rows [r, r + m) for all tokens: y[t, r .. r + m) */
            const int64_t r = i * GRP_ROWS, m = N - r < GRP_ROWS ? N - r : GRP_ROWS;
            grp_task(qtype, w + r * rs, rs, m, &a, 0, T, y, N, r);
        }
    }
#if GRP_AMX
    free(gof), free(buf);
#endif
    grp_ws_give(mem);
    return 0;
}
