/* One SwiGLU MoE layer for many tokens (prefill), expert-major: part of cpu_kernels.c, which #includes this file
 * after cpu_moe.c; not compiled on its own. llama.cpp's way: the T k (token, expert) pairs are bucketed by expert,
 * and each weight row is read once per call and dotted with every pair routed to its expert (row-outer,
 * pair-inner), instead of once per pair (moetier_moe_tokens, token-major).
 *   1. x quantized once per token (int8 per 32 values, q8 and an int8 row type) or its block sums;
 *   2. tasks (expert, block of GRP_ROWS gate/up rows) over OpenMP: h[s] = [gate_e x, up_e x] for sorted pair s;
 *   3. a[s] = silu(gate) * up, quantized per pair;
 *   4. tasks (expert, block of down rows): o[s] = down_e a[s];
 *   5. y[t] = sum_j w[t, j] o[pos(t, j)] in j order (results do not depend on the thread count).
 * Row kernels, 4 rows x GRP_PAIRS pairs at a time: int8 activations: Q4_0 / Q8_0 an integer tile (each block's
 * weights widened to int8 once for all pairs), other moe_q8_type rows the q8 row dot per (row, pair); float
 * activations: the 4 rows dequantized to float (GRP_KC values at a time, in L1) and a float FMA tile, so the
 * products are the dequantized model's (max relative error ~1e-6, the summation order); an expert with one pair:
 * the row dot. */

#define GRP_ROWS 32           /* rows per task: 2 I / 32 x used experts tasks (thousands at prefill sizes) */
#if defined(__AVX512F__)
#define GRP_PAIRS 4           /* 16 accumulators + 4 weight + 4 scale registers of the 32 */
#else
#define GRP_PAIRS 2           /* 16 registers */
#endif

#ifdef MOE_Q8
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GRP_VNNI 1
#else
#define GRP_VNNI 0
#endif
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
            corr[r] = _mm256_sub_epi32(z, _mm256_dpbusd_epi32(z, bias, wq[r]));
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
                s = _mm256_dpbusd_epi32(corr[r], yu, wq[r]);
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

/* K-quant super-blocks (256 values) -> float, layouts as cpu_kquants.c's row kernels (d sc q - dmin mn) */
static void grp_dequant_q45_k(const uint8_t *w, float *o, int q5) {
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
            vstore(o + j, vfma(vset1(d0), lo, vset1(-m0)));
            vstore(o + 32 + j, vfma(vset1(d1), hi, vset1(-m1)));
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

static void grp_dequant_q6_k(const uint8_t *w, float *o) {
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
            vstore(o + l, vmul(vset1(d * sg[u]), vq6f(a, 0, hb, 0)));
            vstore(o + 32 + l, vmul(vset1(d * sg[2 + u]), vq6f(b, 0, hb, 2)));
            vstore(o + 64 + l, vmul(vset1(d * sg[4 + u]), vq6f(a, 4, hb, 4)));
            vstore(o + 96 + l, vmul(vset1(d * sg[6 + u]), vq6f(b, 4, hb, 6)));
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

/* n values of a row from its blocks at w -> o (Q4_0 / Q8_0 vectorised, as dequant_row; K-quants above) */
static void grp_dequant(int qtype, const uint8_t *w, int64_t n, float *o) {
    switch (qtype) {
    case Q4_K: case Q5_K:
        for (int64_t b = 0; b < n / 256; b++) grp_dequant_q45_k(w + b * block_bytes(qtype), o + 256 * b, qtype == Q5_K);
        return;
    case Q6_K:
        for (int64_t b = 0; b < n / 256; b++) grp_dequant_q6_k(w + 210 * b, o + 256 * b);
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

/* Activations of one side (x: K = D, or a: K = I) for all pairs in sorted order, in the form its row kernel reads. */
typedef struct {
    int q8;                   /* int8 activations (moe_q8_type and q8 requested) */
    int64_t K, ldx;
    const float *x;           /* float: row of pair s at x + row[s] ldx, block sums at xs + row[s] (K / 32) */
    float *xs;
    int8_t *qx;               /* int8 copies, scales dx, scaled sums sx: same row indexing */
    float *dx, *sx;
    const int64_t *row;       /* sorted pair s -> its activation row (token t for x, s itself for a) */
} grp_side;

static inline const float *grp_x(const grp_side *a, int64_t s) { return a->x + a->row[s] * a->ldx; }

/* out[(r0 + r) * ldo + (s - s0)] = row r0 + r (w + r * rs, r < nr) . activation of sorted pair s in [s0, s1) */
static void grp_rows_pairs(int qtype, const uint8_t *w, int64_t rs, int64_t nr, const grp_side *a,
                           int64_t s0, int64_t s1, float *out, int64_t ldo) {
    const int64_t K = a->K, nb = K / 32;
    int64_t r = 0;
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
    a->xs = (float *)*mem;
    a->dx = a->xs + n * (K / 32);
    a->sx = a->dx + n * (K / 32);
    a->qx = (int8_t *)(a->sx + n * (K / 32));
    *mem += sizeof(float) * 3 * n * (K / 32) + n * K;
}

/* out rows [r, r + m) of expert e's matrix (rows at w, stride rs) for all its pairs [s0, s1), scattered to
 * dst[s ld + r + j] (pairs in chunks of 64: a tile on the stack) */
static void grp_task(int qtype, const uint8_t *w, int64_t rs, int64_t m, const grp_side *a, int64_t s0, int64_t s1,
                     float *dst, int64_t ld, int64_t r) {
    float tile[GRP_ROWS * 64];
    for (int64_t c0 = s0; c0 < s1; c0 += 64) {
        const int64_t c1 = s1 - c0 < 64 ? s1 : c0 + 64, n = c1 - c0;
        grp_rows_pairs(qtype, w, rs, m, a, c0, c1, tile, n);
        for (int64_t j = 0; j < m; j++)
            for (int64_t s = c0; s < c1; s++) dst[s * ld + r + j] = tile[j * n + (s - c0)];
    }
}

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
    const int64_t sides = sizeof(float) * 3 * (T * (D / 32) + P * (I / 32)) + T * D + P * I;
    char *mem = malloc(sizeof(int64_t) * ni + sizeof(float) * P * (2 * I + D) + sides + 256);
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
    const int64_t gbytes = 2 * I * (D / block_elems(gq)) * block_bytes(gq);
    const int64_t dbytes = D * (I / block_elems(dq)) * block_bytes(dq);
    int64_t used = 0;
    for (int64_t e = 0; e < E; e++) used += start[e + 1] > start[e];
    const int64_t bytes = used * (gbytes + dbytes);
    if (nthreads > 1 + bytes / MIN_BYTES_PER_THREAD) nthreads = (int)(1 + bytes / MIN_BYTES_PER_THREAD);

    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) grp_prepare(&ax, t);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < ng; i++) {             /* gate / up rows: h[s, r .. r + m) */
            const int64_t e = gtask[3 * i], r = gtask[3 * i + 1], m = gtask[3 * i + 2];
            const uint8_t *base = (r < I ? gate + r * g_rstride : up + (r - I) * g_rstride) + e * g_estride;
            grp_task(gq, base, g_rstride, m, &ax, start[e], start[e + 1], h, 2 * I, r);
        }
        #pragma omp for schedule(static)
        for (int64_t s = 0; s < P; s++) {
            float *a = h + s * 2 * I;                   /* silu(gate) * up in place of the gates */
            const float *u = a + I;
            for (int64_t i = 0; i < I; i++) a[i] = a[i] / (1.f + expf(-a[i])) * u[i];
            grp_prepare(&ah, s);
        }
        #pragma omp for schedule(dynamic, 1)
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
    free(mem);
    return 0;
}
