/* One CPU decode token's small ops in C, #included by cpu_kernels.c; kernels/small_ops.py calls them for an eager
 * CPU step (no compiled step) in place of the torch twins in models/layers.py, whose ~40 ops a layer cost more than
 * the layer's GEMVs on a 16-core Xeon (docs/perf-log.md, session 25). float32 throughout.
 *
 *   moetier_decode_attn        q/k RMSNorm + RoPE of one token's qkv, k/v into the cache row `pos`, attention of
 *                              every q head over keys [0, pos] (Attention.forward's twin path); a KV group's
 *                              heads together (up to cpu.ATTN_C_MAX_WORK: keys x h x dh)
 *   moetier_decode_attn_prep   its first part (norm, RoPE, cache write): longer contexts attend with torch's GEMMs
 *   moetier_router_add_norm    s = h + a, x = RMSNorm(s) * nw, softmax(W x) top-k (renormalised if asked)
 *                              (Block's residual add + post-attention norm, then SoftmaxRouter)
 *   moetier_attn_block         x = RMSNorm(h) * nw, qkv = W x, the attention above, out = O att: a decode block's
 *                              attention half in one call (Attention.norm_token)
 *   moetier_moe_block          the router's call, then the k experts (moetier_moe_tokens) and the residual add: a
 *                              decode block's MoE half in one call (SoftmaxMoE.add_norm_forward)
 *   moetier_rms_norm           rows of x -> RMSNorm(x) * w (RMSNorm.forward: a block's input norm, the final norm;
 *                              F.rms_norm took 22 us on 384 values there, dev box; a prompt's rows over threads)
 *   moetier_qk_norm_rope       a prompt's q / k heads normed and rotated in one pass (Attention._fused_qkv)
 */
#include <math.h>

static float small_sumsq(const float *x, int n) {
    float ss = 0.0f;
    #pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    return ss;
}

static float small_dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    #pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* Threads for `work` multiply-adds: 16K a thread at least (a parallel region costs a few microseconds). The
 * router's 1 MB of weights on one thread took 120 us a layer on the Xeon (session 25): RAM-bound work wants threads. */
static int small_threads(int64_t work, int nthreads) {
    int64_t nt = work / 16384;
    return nt < 1 ? 1 : (nt < nthreads ? (int)nt : nthreads);
}

/* y = RMSNorm(x) * w over n values: the twin's F.rms_norm (x times rsqrt of the mean square + eps), times w */
static void small_rms_norm(const float *x, const float *w, float eps, int n, float *y) {
    float r = 1.0f / sqrtf(small_sumsq(x, n) / (float)n + eps);
    for (int i = 0; i < n; i++)
        y[i] = (x[i] * r) * w[i];
}

/* rows x [rows, n] -> y [rows, n] = RMSNorm(x) * w (w [n]); a prompt's rows over threads */
void moetier_rms_norm(const float *x, const float *w, float eps, int64_t rows, int n, float *y, int nthreads) {
    const int nt = small_threads(rows * n, nthreads);
    #pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; r++)
        small_rms_norm(x + r * n, w, eps, n, y + r * n);
}

/* y = RMSNorm(x) over dh values (times w when given), then RoPE on its first rot values (halves: pairs i, i + rot/2;
 * cos / sin [rot] with the scale folded in, as Rope.forward makes them). y may not alias x. */
static void small_norm_rope(const float *x, const float *w, float eps, int dh, const float *cs, const float *sn,
                            int rot, float *y) {
    if (w) {
        small_rms_norm(x, w, eps, dh, y);
    } else {
        memcpy(y, x, (size_t)dh * sizeof(float));
    }
    int half = rot / 2;
    for (int i = 0; i < half; i++) {
        float a = y[i], b = y[i + half];
        y[i] = a * cs[i] - b * sn[i];
        y[i + half] = b * cs[i + half] + a * sn[i + half];
    }
}

/* A prompt's q and k: T rows of qkv (stride ld: h q heads, then hkv k heads of dh values) -> y [T, h + hkv, dh],
 * each head RMSNorm'd (qw for q heads, kw for k heads; NULL: none) and rotated (cs / sn [T, rot]: token t's), as
 * Attention._fused_qkv's torch ops (rms_norm, apply_rope) compute it: one pass, the tokens over threads. */
void moetier_qk_norm_rope(const float *qkv, int64_t ld, int64_t T, int h, int hkv, int dh, const float *qw,
                          const float *kw, float eps, const float *cs, const float *sn, int rot, float *y,
                          int nthreads) {
    const int nt = small_threads(T * (h + hkv) * dh, nthreads);
    #pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < h + hkv; i++)
            small_norm_rope(qkv + t * ld + (int64_t)i * dh, i < h ? qw : kw, eps, dh, cs + t * rot, sn + t * rot, rot,
                            y + (t * (h + hkv) + i) * dh);
}

/* The prep: qkv [(h + 2 hkv) dh] (q heads, k heads, v heads) -> q heads normed and rotated into q [h dh], k heads
 * normed and rotated and v heads into the caches' row `pos` (caches [S, hkv, dh]: rows of hkv * dh floats). qw / kw
 * [dh] or NULL (no q/k norm). */
void moetier_decode_attn_prep(const float *qkv, const float *qw, const float *kw, float eps, const float *cs,
                              const float *sn, int rot, int64_t pos, float *kc, float *vc, int h, int hkv, int dh,
                              float *q) {
    int64_t row = (int64_t)hkv * dh;
    for (int i = 0; i < h; i++)
        small_norm_rope(qkv + (size_t)i * dh, qw, eps, dh, cs, sn, rot, q + (size_t)i * dh);
    for (int g = 0; g < hkv; g++) {
        small_norm_rope(qkv + (size_t)(h + g) * dh, kw, eps, dh, cs, sn, rot, kc + pos * row + (int64_t)g * dh);
        memcpy(vc + pos * row + (int64_t)g * dh, qkv + (size_t)(h + hkv + g) * dh, (size_t)dh * sizeof(float));
    }
}

/* s[0 .. n) -> softmax(s) in place. AVX2: the exponentials 8 at a time (libm's expf is a call a value: a third of
 * the attention at 300 keys, dev box): x = k ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative
 * error < 2e-7 there) times 2^k built in the exponent bits; shifted scores below -87 give 0. */
static void small_softmax(float *s, int64_t n) {
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++)
        m = s[j] > m ? s[j] : m;
    int64_t j = 0;
    float l = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.0f), log2e = _mm256_set1_ps(1.44269504f);
    const __m256 ln2hi = _mm256_set1_ps(0.693145752f), ln2lo = _mm256_set1_ps(1.42860677e-6f);
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + j), vm);
        const __m256 t = _mm256_max_ps(x, lo);
        const __m256 k = _mm256_round_ps(_mm256_mul_ps(t, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 r = _mm256_fnmadd_ps(k, ln2lo, _mm256_fnmadd_ps(k, ln2hi, t));
        __m256 p = _mm256_set1_ps(1.0f / 720);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        y = _mm256_and_ps(y, _mm256_cmp_ps(x, lo, _CMP_GE_OQ));
        _mm256_storeu_ps(s + j, y);
        acc = _mm256_add_ps(acc, y);
    }
    float part[8];
    _mm256_storeu_ps(part, acc);
    for (int i = 0; i < 8; i++)
        l += part[i];
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        l += s[j];
    }
    const float inv = 1.0f / l;
    for (j = 0; j < n; j++)
        s[j] *= inv;
}

/* s[r n + j] = scale * (q_r . k_j) for nr heads q_r (rows of dh) and n keys k_j = kg + j row. AVX2 with dh % 8 == 0:
 * four keys at a time, each head's four dots reduced together (the scalar loop's horizontal sum a key was most of
 * the attention's time: 37 us at 300 keys, 6 heads of 64, dev box). */
static void small_scores(const float *q, const float *kg, int64_t row, int64_t n, int dh, int nr, float scale,
                         float *s) {
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (dh % 8 == 0) {
        for (; j + 4 <= n; j += 4) {
            const float *k0 = kg + j * row, *k1 = k0 + row, *k2 = k1 + row, *k3 = k2 + row;
            for (int r = 0; r < nr; r++) {
                const float *qr = q + (size_t)r * dh;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int d = 0; d < dh; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qr + d);
                    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
                    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
                    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
                }
                const __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
                const __m256 h = _mm256_hadd_ps(h01, h23);  /* lanes: k0 k1 k2 k3 of the low half, then the high */
                const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                _mm_storeu_ps(s + (size_t)r * n + j, _mm_mul_ps(sum, _mm_set1_ps(scale)));
            }
        }
    }
#endif
    for (; j < n; j++)
        for (int r = 0; r < nr; r++)
            s[(size_t)r * n + j] = small_dot(q + (size_t)r * dh, kg + j * row, dh) * scale;
}

/* o_r = sum_j p[r n + j] v_j for nr heads (o rows of dh), v_j = vg + j row. AVX2 with dh % 8 == 0: 8 values of up
 * to 4 heads in registers over a block of 32 keys (each value loaded once for the 4; the block's values stay in L1
 * for the head dim's other 8-value pieces: without blocks 2,048 keys of 32 heads of 128 ran 1.3x slower than torch). */
static void small_weighted_values(const float *p, const float *vg, int64_t row, int64_t n, int dh, int nr,
                                  float *o) {
#if defined(__AVX2__) && defined(__FMA__)
    if (dh % 8 == 0) {
        for (int64_t j0 = 0; j0 < n; j0 += 32) {
            const int64_t j1 = n - j0 < 32 ? n : j0 + 32;
            for (int r0 = 0; r0 < nr; r0 += 4) {
                const int m = nr - r0 < 4 ? nr - r0 : 4;
                const float *p0 = p + (size_t)r0 * n, *p1 = p0 + (m > 1 ? n : 0), *p2 = p0 + (m > 2 ? 2 * n : 0),
                            *p3 = p0 + (m > 3 ? 3 * n : 0);
                for (int d = 0; d < dh; d += 8) {
                    float *o0 = o + (size_t)r0 * dh + d;
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    if (j0) {
                        a0 = _mm256_loadu_ps(o0);
                        a1 = m > 1 ? _mm256_loadu_ps(o0 + dh) : a1;
                        a2 = m > 2 ? _mm256_loadu_ps(o0 + 2 * dh) : a2;
                        a3 = m > 3 ? _mm256_loadu_ps(o0 + 3 * dh) : a3;
                    }
                    for (int64_t j = j0; j < j1; j++) {
                        const __m256 v = _mm256_loadu_ps(vg + j * row + d);
                        a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + j), v, a0);
                        a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(p1 + j), v, a1);
                        a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(p2 + j), v, a2);
                        a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(p3 + j), v, a3);
                    }
                    _mm256_storeu_ps(o0, a0);
                    if (m > 1) _mm256_storeu_ps(o0 + dh, a1);
                    if (m > 2) _mm256_storeu_ps(o0 + 2 * dh, a2);
                    if (m > 3) _mm256_storeu_ps(o0 + 3 * dh, a3);
                }
            }
        }
        return;
    }
#endif
    for (int i = 0; i < nr * dh; i++)
        o[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const float *vj = vg + j * row;
        for (int r = 0; r < nr; r++) {
            const float pj = p[(size_t)r * n + j];
            float *orow = o + (size_t)r * dh;
            #pragma omp simd
            for (int d = 0; d < dh; d++)
                orow[d] += pj * vj[d];
        }
    }
}

/* The prep, then attention of every q head over keys [0, pos] -> out [h dh]. A KV group's heads go together (each key
 * and value loaded once for all of them), in runs of rb heads so that there are runs enough for the threads; a run a
 * thread. Returns 0, or -1 when memory ran out. */
int moetier_decode_attn(const float *qkv, const float *qw, const float *kw, float eps, const float *cs,
                        const float *sn, int rot, int64_t pos, float *kc, float *vc, int h, int hkv, int dh,
                        float scale, float *out, int nthreads) {
    int64_t n = pos + 1, row = (int64_t)hkv * dh;
    float *q = malloc(sizeof(float) * ((size_t)h * dh + (size_t)h * n));
    if (!q)
        return -1;
    float *scores = q + (size_t)h * dh;
    moetier_decode_attn_prep(qkv, qw, kw, eps, cs, sn, rot, pos, kc, vc, h, hkv, dh, q);
    int rep = h / hkv;
    int nt = small_threads((int64_t)h * n * dh, nthreads);
    int rb = rep;
    while (rb > 1 && hkv * ((rep + rb - 1) / rb) < nt)
        rb = (rb + 1) / 2;
    int per = (rep + rb - 1) / rb, runs = hkv * per;
    nt = nt < runs ? nt : runs;
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (int u = 0; u < runs; u++) {
        const int g = u / per, r0 = (u % per) * rb, nr = rep - r0 < rb ? rep - r0 : rb;
        const int h0 = g * rep + r0;                        /* the run's first head */
        const float *kg = kc + (int64_t)g * dh, *vg = vc + (int64_t)g * dh;
        const float *qg = q + (size_t)h0 * dh;
        float *sg = scores + (size_t)h0 * n, *og = out + (size_t)h0 * dh;
        small_scores(qg, kg, row, n, dh, nr, scale, sg);
        for (int r = 0; r < nr; r++)
            small_softmax(sg + (size_t)r * n, n);
        small_weighted_values(sg, vg, row, n, dh, nr, og);
    }
    free(q);
    return 0;
}

/* h, a [d] -> s = h + a, x = RMSNorm(s) * nw [d]; logits = rw [e, d] x; softmax; the k largest probabilities (ids
 * int64 [k] in descending order, ties to the lower id; w [k]), divided by their sum when `normalize`. Returns 0, -1
 * for k outside [1, e] or memory, -2 for NaN logits. */
int moetier_router_add_norm(const float *hv, const float *av, const float *nw, float eps, int d, const float *rw,
                            int e, int k, int normalize, float *s, float *x, int64_t *ids, float *w, int nthreads) {
    if (k < 1 || k > e)
        return -1;
    float *p = malloc(sizeof(float) * (size_t)e);
    if (!p)
        return -1;
    for (int i = 0; i < d; i++)
        s[i] = hv[i] + av[i];
    small_rms_norm(s, nw, eps, d, x);
    int nt = small_threads((int64_t)e * d, nthreads);
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (int j = 0; j < e; j++)
        p[j] = small_dot(rw + (int64_t)j * d, x, d);
    float m = -INFINITY, l = 0.0f;
    for (int j = 0; j < e; j++)
        m = p[j] > m ? p[j] : m;
    for (int j = 0; j < e; j++) {
        p[j] = expf(p[j] - m);
        l += p[j];
    }
    float total = 0.0f;
    for (int t = 0; t < k; t++) {      /* k passes of a max: k <= 8-16 of e <= a few hundred */
        int best = -1;
        for (int j = 0; j < e; j++)
            if (p[j] >= 0.0f && (best < 0 || p[j] > p[best]))
                best = j;
        if (best < 0) {                /* NaN logits: the caller takes the torch twin */
            free(p);
            return -2;
        }
        ids[t] = best;
        w[t] = p[best] / l;
        total += w[t];
        p[best] = -1.0f;
    }
    if (normalize)
        for (int t = 0; t < k; t++)
            w[t] /= total;
    free(p);
    return 0;
}

/* A decode block's MoE half for one token: s = h + a, x = RMSNorm(s) * nw, the softmax router's top k
 * (moetier_router_add_norm), y = those experts' SwiGLU sum (moetier_moe_tokens: gq / dq, the planes and their strides
 * as there), out = s + y [d]: the same sums as the three calls, one call instead of three (their tensors and Python
 * cost ~25 us a layer on the dev box, the arithmetic ~17). Returns 0; -2 for NaN logits (out not written: the
 * caller's ops decide), -3 out of memory, else moetier_moe_tokens' error. */
int moetier_moe_block(const float *hv, const float *av, const float *nw, float eps, int d, const float *rw, int e,
                      int k, int normalize, int gq, int dq, const uint8_t *gate, const uint8_t *up, int64_t g_estride,
                      int64_t g_rstride, const uint8_t *down, int64_t d_estride, int64_t d_rstride, int64_t I,
                      int q8, float *out, int nthreads) {
    if (k < 1 || k > e)
        return -1;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)k + sizeof(float) * (3 * (size_t)d + (size_t)k));
    if (!ids)
        return -3;
    float *s = (float *)(ids + k), *x = s + d, *y = x + d, *w = y + d;
    int rc = moetier_router_add_norm(hv, av, nw, eps, d, rw, e, k, normalize, s, x, ids, w, nthreads);
    if (rc == 0)
        rc = moetier_moe_tokens(gq, dq, gate, up, g_estride, g_rstride, down, d_estride, d_rstride, e, d, I, 1, k, ids,
                                w, x, y, q8, nthreads);
    if (rc == 0)
        for (int i = 0; i < d; i++)
            out[i] = s[i] + y[i];
    free(ids);
    return rc;
}

/* y = W x for one row x: the blocks' matvec with int8 activations (q8) or float32 ones, as kernels.cpu.qlinear_op */
static int small_matvec(int type, const uint8_t *w, int64_t stride, int64_t n, int64_t k, const float *x, float *y,
                        int q8, int nthreads) {
    return q8 ? moetier_matvec_q8(type, w, stride, n, k, x, y, nthreads)
              : moetier_matvec(type, w, stride, n, k, x, y, nthreads);
}

/* A decode block's attention half for one token: x = RMSNorm(h) * nw [d], qkv = W x in up to three parts (q, k, v
 * rows of their own GGML types; one stacked part: the other two 0 rows), moetier_decode_attn (q / k norm, RoPE, the
 * cache row `pos`, attention), out = Wo att ([d] rows of type ot): the arithmetic of the separate calls, one call (the
 * module path's Python and tensors cost ~20 us a layer on the dev box). Returns 0, -3 out of memory, -4 when the
 * parts' rows are not (nh + 2 hkv) dh, else the failing call's code (out not written; the cache row may be). */
int moetier_attn_block(const float *hv, const float *nw, float eps, int d, int t0, const uint8_t *w0, int64_t s0,
                       int64_t n0, int t1, const uint8_t *w1, int64_t s1, int64_t n1, int t2, const uint8_t *w2,
                       int64_t s2, int64_t n2, int ot, const uint8_t *wo, int64_t o_stride, int q8, const float *qw,
                       const float *kw, float qk_eps, const float *cs, const float *sn, int rot, int64_t pos, float *kc,
                       float *vc, int nh, int hkv, int dh, float scale, float *out, int nthreads) {
    const int64_t rows = (int64_t)(nh + 2 * hkv) * dh;
    if (n0 + n1 + n2 != rows)
        return -4;
    float *x = malloc(sizeof(float) * ((size_t)d + (size_t)rows + (size_t)nh * dh));
    if (!x)
        return -3;
    float *qkv = x + d, *att = qkv + rows;
    small_rms_norm(hv, nw, eps, d, x);
    int rc = small_matvec(t0, w0, s0, n0, d, x, qkv, q8, nthreads);
    if (rc == 0 && n1)
        rc = small_matvec(t1, w1, s1, n1, d, x, qkv + n0, q8, nthreads);
    if (rc == 0 && n2)
        rc = small_matvec(t2, w2, s2, n2, d, x, qkv + n0 + n1, q8, nthreads);
    if (rc == 0)
        rc = moetier_decode_attn(qkv, qw, kw, qk_eps, cs, sn, rot, pos, kc, vc, nh, hkv, dh, scale, att, nthreads);
    if (rc == 0)
        rc = small_matvec(ot, wo, o_stride, d, (int64_t)nh * dh, att, out, q8, nthreads);
    free(x);
    return rc;
}

/* One decoder layer's two block calls' arguments, fixed for a session (runtime.cpu_step builds them once): the
 * attention half's (moetier_attn_block's, without h, the rope tables, the position and the output) and the MoE half's
 * (moetier_moe_block's, without h, a and the output). Field order and types: cpu_step.AttnArgs / MoeArgs. */
typedef struct {
    const float *nw; const uint8_t *w[3]; const uint8_t *wo; const float *qw, *kw; float *kc, *vc;
    int64_t s[3], n[3], o_stride;
    int t[3], ot, q8, nh, hkv, dh;
    float eps, qk_eps, scale;
} attn_args;
typedef struct {
    const float *nw, *rw; const uint8_t *gate, *up, *down;
    int64_t g_estride, g_rstride, d_estride, d_rstride, I;
    int e, k, normalize, gq, dq, q8;
    float eps;
} moe_args;

/* The decoder layers of one eager CPU token (every layer an attention half and an MoE half that take one C call
 * each): h [d] in, the last layer's output out (h is overwritten: the layers' residual stream). a [d] and tmp [d]:
 * scratch. Returns 0, or 1 + 2 i + half at the first half that did not complete (the layer's h in h, its attention
 * output in a when half = 1), its code in *rc: the caller finishes that layer and the rest with its modules. The
 * same arithmetic as the calls one by one (the module path's Python costs ~45 us a layer on the dev box). */
int moetier_layers(int n, const attn_args *A, const moe_args *M, float *h, float *a, float *tmp, int d,
                   const float *cs, const float *sn, int rot, int64_t pos, int nthreads, int *rc) {
    for (int i = 0; i < n; i++) {
        const attn_args *p = &A[i];
        *rc = moetier_attn_block(h, p->nw, p->eps, d, p->t[0], p->w[0], p->s[0], p->n[0], p->t[1], p->w[1], p->s[1],
                                 p->n[1], p->t[2], p->w[2], p->s[2], p->n[2], p->ot, p->wo, p->o_stride, p->q8, p->qw,
                                 p->kw, p->qk_eps, cs, sn, rot, pos, p->kc, p->vc, p->nh, p->hkv, p->dh, p->scale, a,
                                 nthreads);
        if (*rc)
            return 1 + 2 * i;
        const moe_args *m = &M[i];
        *rc = moetier_moe_block(h, a, m->nw, m->eps, d, m->rw, m->e, m->k, m->normalize, m->gq, m->dq, m->gate, m->up,
                                m->g_estride, m->g_rstride, m->down, m->d_estride, m->d_rstride, m->I, m->q8, tmp,
                                nthreads);
        if (*rc)
            return 2 + 2 * i;
        memcpy(h, tmp, sizeof(float) * (size_t)d);
    }
    return 0;
}
