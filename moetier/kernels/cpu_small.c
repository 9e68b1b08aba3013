/* One CPU decode token's small ops in C, #included by cpu_kernels.c; kernels/small_ops.py calls them for an eager
 * CPU step (no compiled step) in place of the torch twins in models/layers.py, whose ~40 ops a layer cost more than
 * the layer's GEMVs on a 16-core Xeon (docs/perf-log.md, session 25). float32 throughout.
 *
 *   moetier_decode_attn        q/k RMSNorm + RoPE of one token's qkv, k/v into the cache row `pos`, attention of
 *                              every q head over keys [0, pos] (Attention.forward's twin path); a head a thread,
 *                              one key at a time: for short contexts only (cpu.ATTN_C_MAX_WORK: keys x h x dh)
 *   moetier_decode_attn_prep   its first part (norm, RoPE, cache write): longer contexts attend with torch's GEMMs
 *   moetier_router_add_norm    s = h + a, x = RMSNorm(s) * nw, softmax(W x) top-k (renormalised if asked)
 *                              (Block's residual add + post-attention norm, then SoftmaxRouter)
 *   moetier_rms_norm           rows of x -> RMSNorm(x) * w (RMSNorm.forward: a block's input norm, the final norm;
 *                              F.rms_norm took 22 us on 384 values there, dev box)
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

/* rows x [rows, n] -> y [rows, n] = RMSNorm(x) * w (w [n]) */
void moetier_rms_norm(const float *x, const float *w, float eps, int64_t rows, int n, float *y) {
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

/* The prep, then attention of every q head over keys [0, pos] -> out [h dh]. Returns 0, or -1 when memory ran out. */
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
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (int i = 0; i < h; i++) {
        const float *qi = q + (size_t)i * dh;
        const float *kg = kc + (int64_t)(i / rep) * dh, *vg = vc + (int64_t)(i / rep) * dh;
        float *s = scores + (size_t)i * n, *o = out + (size_t)i * dh;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            s[j] = small_dot(qi, kg + j * row, dh) * scale;
            m = s[j] > m ? s[j] : m;
        }
        float l = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf(s[j] - m);
            l += s[j];
        }
        for (int d = 0; d < dh; d++)
            o[d] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float p = s[j], *vj = vg + j * row;
            #pragma omp simd
            for (int d = 0; d < dh; d++)
                o[d] += p * vj[d];
        }
        const float inv = 1.0f / l;
        for (int d = 0; d < dh; d++)
            o[d] *= inv;
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
