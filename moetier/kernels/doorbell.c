/* CPU side of the graph-safe tiered decode step (moetier/kernels/doorbell.py).
 *
 * Inside the CUDA graph each MoE layer `li` writes its request to host-mapped (pinned) memory:
 * x[li] (float32 [D]), ids / slots / w [li] ([k]), then rings bell[li] = seq. Slot < 0 marks an
 * expert the GPU cache does not hold (a miss). The GPU computes the hits meanwhile, then spins on
 * done[li] == seq and adds y[li] (float32 [D]) when the layer had misses.
 *
 * moetier_serve_step answers all layers of one step: one OpenMP team for the whole step;
 * thread 0 polls the bell, all threads compute the layer's misses (rows of gate_up, the gated
 * activation, rows of down, summed over the missed experts with their routing weights), thread 0
 * raises done. No Python, no GIL (ctypes releases it) between the replay and the logits.
 * Expert weights are read where they live in the RAM bank: pointer tables [L * E]. gate_up is of
 * type `qtype`, down of `dn_qtype` (they differ in llama.cpp's Q4_K_M: Q4_K and Q6_K), or per layer
 * `layer_types` [L, 2] with `layer_row_bytes` [L, 2] (Q4_K_M's down is Q6_K in some layers only).
 */
#include "cpu_kernels.c"
#include <math.h>
#include <omp.h>
#include <time.h>

enum { F32 = 0, F16 = 1, BF16 = 30 };
enum { ACT_SWIGLU = 0, ACT_CLAMPED = 1 };
#define BELL_STRIDE 16   /* int64 per layer: bells and done flags on their own 128-byte lines */
#define MAX_K 64

/* int8 activations (llama.cpp's Q8_0 for x) use cpu_kernels.c's integer dot products (MOE_Q8) */
/* activations of one projection: float x, its per-32 sums (Q4_0 / Q4_K offsets), and with
 * q8 activations the int8 copy */
typedef struct { const float *x, *xs; const int8_t *qx; const float *dx; const float *sx; } act_vec;

static float act_row(int qtype, int q8, const uint8_t *w, act_vec a, int64_t K);

typedef struct {
    int32_t L, E, D, I, k, qtype, act, nthreads;
    float alpha, limit;
    int64_t gu_row_bytes, dn_row_bytes;   /* bytes between rows of gate_up [2I, D] / down [D, I] */
    int64_t timeout_ns;
    const uint8_t *const *gate_up;        /* [L * E] (NULL: not in RAM -> error) */
    const uint8_t *const *down;           /* [L * E] */
    volatile int64_t *bell;               /* [L * BELL_STRIDE] */
    volatile int64_t *done;               /* [L * BELL_STRIDE] */
    const float *x;                       /* [L, D] */
    const int32_t *ids, *slots;           /* [L, k] */
    const float *w;                       /* [L, k] */
    float *y;                             /* [L, D] */
    float *scratch;                       /* >= k * 2I + k * I + (D + k * I) / 32 + 64 floats */
    double *timing;                       /* out: [0] compute s, [1] wait-for-bell s, [2] misses */
    int32_t q8_act;                       /* Q4_0 / Q8_0 / MXFP4 / IQ3_XXS: int8 activations, integer dots */
    int32_t dn_qtype;                     /* type of down (qtype: of gate_up) */
    const int32_t *layer_types;           /* [L, 2] gate_up, down type per layer; NULL: qtype, dn_qtype */
    const int64_t *layer_row_bytes;       /* [L, 2] gate_up, down row bytes per layer; NULL: the above */
    const float *const *gu_bias;          /* NULL, or [L * E] float32 [2I] (gpt-oss), added before the activation */
    const float *const *dn_bias;          /* NULL, or [L * E] float32 [D], added to each expert's output */
} serve_ctx;

static int is_quant(int qtype) { return qtype != F32 && qtype != BF16 && qtype != F16; }
static int layer_type(const serve_ctx *c, int li, int proj) {
    return c->layer_types ? c->layer_types[2 * li + proj] : proj ? c->dn_qtype : c->qtype;
}
static int64_t layer_row_bytes(const serve_ctx *c, int li, int proj) {
    return c->layer_row_bytes ? c->layer_row_bytes[2 * li + proj] : proj ? c->dn_row_bytes : c->gu_row_bytes;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static float row_f32(const float *w, const float *x, int64_t K) {
#ifdef VW
    vf a0 = vzero(), a1 = vzero();
    int64_t j = 0;
    for (; j + 2 * VW <= K; j += 2 * VW) {
        PREFETCH(w + j);
        a0 = vfma(vload(w + j), vload(x + j), a0);
        a1 = vfma(vload(w + j + VW), vload(x + j + VW), a1);
    }
    float s = vsum(vadd(a0, a1));
#else
    float s = 0.f;
    int64_t j = 0;
#endif
    for (; j < K; j++) s += w[j] * x[j];
    return s;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(VW) && VW == 16
static inline vf vbf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif defined(VW)
static inline vf vbf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

static float row_half(int bf, const uint16_t *w, const float *x, int64_t K) {
    float s = 0.f;
    int64_t j = 0;
#ifdef VW
    vf a0 = vzero(), a1 = vzero();
    for (; j + 2 * VW <= K; j += 2 * VW) {
        PREFETCH(w + j);
        vf w0 = bf ? vbf16(w + j) : vf16(w + j), w1 = bf ? vbf16(w + j + VW) : vf16(w + j + VW);
        a0 = vfma(w0, vload(x + j), a0);
        a1 = vfma(w1, vload(x + j + VW), a1);
    }
    s = vsum(vadd(a0, a1));
#endif
    for (; j < K; j++) s += (bf ? bf16_to_f32(w[j]) : fp16_to_f32((const uint8_t *)(w + j))) * x[j];
    return s;
}

static float any_row(int qtype, const uint8_t *w, const float *x, const float *xs, int64_t K) {
    switch (qtype) {
    case F32: return row_f32((const float *)w, x, K);
    case BF16: return row_half(1, (const uint16_t *)w, x, K);
    case F16: return row_half(0, (const uint16_t *)w, x, K);
    default: return row_dot(qtype, w, x, xs, K);
    }
}

static float act_row(int qtype, int q8, const uint8_t *w, act_vec a, int64_t K) {
#ifdef MOE_Q8
    if (q8 && moe_q8_type(qtype)) return moe_row_q8(qtype, w, a.qx, a.dx, a.sx, K);
#else
    (void)q8;
#endif
    return any_row(qtype, w, a.x, a.xs, K);
}

static int q8_ok(int qtype) {
#ifdef MOE_Q8
    return moe_q8_type(qtype);
#else
    (void)qtype;
    return 0;
#endif
}

int moetier_serve_supported(int qtype) {
    return qtype == F32 || qtype == BF16 || qtype == F16 || moetier_supported(qtype);
}

static float act_one(const serve_ctx *c, float g, float u) {
    if (c->act == ACT_SWIGLU) return g / (1.f + expf(-g)) * u;
    g = fminf(g, c->limit);
    u = fmaxf(fminf(u, c->limit), -c->limit);
    return (u + 1.f) * (g / (1.f + expf(-g * c->alpha)));
}

/* Wait until bell[li] == seq. 0, or -1 on timeout. */
static int wait_bell(const serve_ctx *c, int li, int64_t seq, double t_start) {
    volatile int64_t *b = c->bell + (int64_t)li * BELL_STRIDE;
    for (uint64_t n = 0;; n++) {
        if (__atomic_load_n(b, __ATOMIC_ACQUIRE) == seq) return 0;
        if ((n & 1023) == 1023 && (now_s() - t_start) * 1e9 > (double)c->timeout_ns) return -1;
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    }
}

/* Serve every MoE layer of decode step `seq`. 0, or -(1 + li) if layer li's bell never rang
 * (timeout), -100 - li if a missed expert has no RAM pointer, -200 on bad arguments. */
int moetier_serve_step(const serve_ctx *c, int64_t seq) {
    const int L = c->L, D = c->D, I = c->I, k = c->k;
    if (k > MAX_K || k < 1) return -200;
    for (int li = 0; li < L; li++) {
        const int gq = layer_type(c, li, 0), dq = layer_type(c, li, 1);
        if (!moetier_serve_supported(gq) || !moetier_serve_supported(dq)) return -200;
        if ((is_quant(gq) && D % block_elems(gq)) || (is_quant(dq) && I % block_elems(dq))) return -200;
    }
    float *hpre = c->scratch;                       /* [k, 2I] */
    float *h = hpre + (int64_t)k * 2 * I;           /* [k, I] */
    float *xs = h + (int64_t)k * I;                 /* [D / 32] */
    float *hs = xs + D / 32 + 16;                   /* [k, I / 32] */
    float *dx = hs + (int64_t)k * (I / 32) + 16;    /* q8: x scales [D / 32], h scales [k, I / 32] */
    float *dh = dx + D / 32;
    float *sxv = dh + (int64_t)k * (I / 32);           /* sums of the int8 values [D / 32], [k, I / 32] */
    float *shv = sxv + D / 32;
    int8_t *qxv = (int8_t *)(shv + (int64_t)k * (I / 32) + 16);  /* [D], then [k, I] */
    int8_t *qhv = qxv + D;
    int n_miss[L > 0 ? L : 1];
    int32_t miss_e[L > 0 ? L : 1][MAX_K];
    float miss_w[L > 0 ? L : 1][MAX_K];
    int status = 0, total = 0;
    double t_wait = 0.0, t_busy = 0.0, t0 = now_s();
    #pragma omp parallel num_threads(c->nthreads)
    {
        const int tid = omp_get_thread_num();
        for (int li = 0; li < L; li++) {
            const int gq = layer_type(c, li, 0), dq = layer_type(c, li, 1);    /* per projection */
            const int gquant = is_quant(gq), dquant = is_quant(dq);
            const int q8g = c->q8_act && q8_ok(gq), q8d = c->q8_act && q8_ok(dq);
            const int64_t gu_rb = layer_row_bytes(c, li, 0), dn_rb = layer_row_bytes(c, li, 1);
            if (tid == 0) {
                double tw = now_s();
                if (wait_bell(c, li, seq, t0)) {
                    status = -(1 + li);
                } else {
                    const int32_t *ids = c->ids + (int64_t)li * k, *sl = c->slots + (int64_t)li * k;
                    const float *w = c->w + (int64_t)li * k;
                    int m = 0;
                    for (int j = 0; j < k; j++) {
                        if (sl[j] >= 0) continue;
                        int64_t e = ids[j];
                        const int64_t at = li * (int64_t)c->E + e;
                        if (e < 0 || e >= c->E || !c->gate_up[at] || (c->gu_bias && !c->gu_bias[at])
                            || (c->dn_bias && !c->dn_bias[at])) { status = -100 - li; break; }
                        miss_e[li][m] = (int32_t)e;
                        miss_w[li][m++] = w[j];
                    }
                    n_miss[li] = m;
                    total += m;
                    if (m && gquant) block_sums(c->x + (int64_t)li * D, D, xs);
#ifdef MOE_Q8
                    if (m && q8g) moe_quantize_q8(c->x + (int64_t)li * D, D, qxv, dx, sxv);
#endif
                }
                t_wait += now_s() - tw;
            }
            #pragma omp barrier
            if (status) break;
            const int m = n_miss[li];
            if (m == 0) continue;
            double tb = tid == 0 ? now_s() : 0.0;
            const float *x = c->x + (int64_t)li * D;
            const uint8_t *const *gu = c->gate_up + li * (int64_t)c->E, *const *dn = c->down + li * (int64_t)c->E;
            const float *const *gub = c->gu_bias ? c->gu_bias + li * (int64_t)c->E : NULL;
            const float *const *dnb = c->dn_bias ? c->dn_bias + li * (int64_t)c->E : NULL;
            const act_vec ax = {x, xs, qxv, dx, sxv};
            #pragma omp for schedule(dynamic, 16)
            for (int64_t r = 0; r < (int64_t)m * 2 * I; r++) {
                int64_t j = r / (2 * I), row = r % (2 * I);
                hpre[r] = act_row(gq, q8g, gu[miss_e[li][j]] + row * gu_rb, ax, D)
                          + (gub ? gub[miss_e[li][j]][row] : 0.f);
            }
            #pragma omp for schedule(static)
            for (int j = 0; j < m; j++) {
                for (int i = 0; i < I; i++)
                    h[(int64_t)j * I + i] = act_one(c, hpre[(int64_t)j * 2 * I + i], hpre[(int64_t)j * 2 * I + I + i]);
                if (dquant) block_sums(h + (int64_t)j * I, I, hs + (int64_t)j * (I / 32));
#ifdef MOE_Q8
                if (q8d) moe_quantize_q8(h + (int64_t)j * I, I, qhv + (int64_t)j * I, dh + (int64_t)j * (I / 32),
                                    shv + (int64_t)j * (I / 32));
#endif
            }
            float *y = c->y + (int64_t)li * D;
            #pragma omp for schedule(dynamic, 32)
            for (int64_t d = 0; d < D; d++) {
                float s = 0.f;
                for (int j = 0; j < m; j++) {
                    const act_vec ah = {h + (int64_t)j * I, hs + (int64_t)j * (I / 32), qhv + (int64_t)j * I,
                                        dh + (int64_t)j * (I / 32), shv + (int64_t)j * (I / 32)};
                    s += miss_w[li][j] * (act_row(dq, q8d, dn[miss_e[li][j]] + d * dn_rb, ah, I)
                                          + (dnb ? dnb[miss_e[li][j]][d] : 0.f));
                }
                y[d] = s;
            }
            if (tid == 0) {
                __atomic_store_n(c->done + (int64_t)li * BELL_STRIDE, seq, __ATOMIC_RELEASE);
                t_busy += now_s() - tb;
            }
        }
    }
    if (c->timing) {
        c->timing[0] = t_busy;
        c->timing[1] = t_wait;
        c->timing[2] = total;
    }
    return status;
}
