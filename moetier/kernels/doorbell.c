/* CPU side of the graph-safe tiered decode step (moetier/kernels/doorbell.py).
 *
 * Inside the CUDA graph each MoE layer `li` writes its request to host-mapped (pinned) memory:
 * x[li] (float32 [D]), ids / slots / w [li] ([k]), then rings bell[li] = seq. Slot < 0 marks an
 * expert the GPU cache does not hold (a miss). The GPU computes the hits meanwhile, then spins on
 * done[li] == seq and adds y[li] (float32 [D]) when the layer had misses. With ring_qx the request
 * also holds x's int8 copy per 32-block (what thread 0 would make of x: moe_quantize_q8's bits), so
 * where gate_up meets int8 activations thread 0 reads nothing of x after the bell.
 *
 * moetier_serve_step answers all layers of one step: one OpenMP team for the whole step;
 * thread 0 polls the bell, all threads compute the layer's misses (rows of gate_up, the gated
 * activation, rows of down, summed over the missed experts with their routing weights; layer_flow (the default,
 * variant 6) and layer_runs: contiguous per-thread chunks, 4 rows per kernel call), and the last thread to finish
 * raises done.
 * No Python, no GIL (ctypes releases it) between the replay and the logits.
 * Expert weights are read where they live in the RAM bank: pointer tables [L * E]. gate_up is of
 * type `qtype`, down of `dn_qtype` (they differ in llama.cpp's Q4_K_M: Q4_K and Q6_K), or per layer
 * `layer_types` [L, 2] with `layer_row_bytes` [L, 2] (Q4_K_M's down is Q6_K in some layers only).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE                     /* sched_getcpu */
#endif
#include "cpu_kernels.c"
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

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
    double *timing;                       /* out [16 + 3 TIMED_THREADS]: [0] compute s, [1] bell wait s, [2] misses ...
                                           * [11..15] phases; per thread t < TIMED_THREADS: [16 + t] its work s
                                           * (bell barrier to its finish, summed over layers), [16 + T + t] layers it
                                           * finished last, [16 + 2 T + t] the CPU it ended the step on */
    int32_t q8_act;                       /* Q4_0 / Q8_0 / MXFP4 / IQ3_XXS: int8 activations, integer dots */
    int32_t dn_qtype;                     /* type of down (qtype: of gate_up) */
    const int32_t *layer_types;           /* [L, 2] gate_up, down type per layer; NULL: qtype, dn_qtype */
    const int64_t *layer_row_bytes;       /* [L, 2] gate_up, down row bytes per layer; NULL: the above */
    const float *const *gu_bias;          /* NULL, or [L * E] float32 [2I] (gpt-oss), added before the activation */
    const float *const *dn_bias;          /* NULL, or [L * E] float32 [D], added to each expert's output */
    int32_t variant;                      /* 0; 1: the old per-row loops; 2: down over the experts' rows (layer_runs;
                                           * A/B in bench/bench_miss_server.py --variants); 3: variant 0's reads
                                           * without the math (y is not the product: a bandwidth ceiling only);
                                           * 4: variant 0 with guided chunks (chunk_of); 5: variant 0, phase 3's
                                           * down rows prefetched during phase 1 (down_cursor); 6: variant 0
                                           * without barriers (layer_flow; kernels/doorbell.py's default) */
    const int32_t *hint;                  /* NULL, or [L, k]: the GPU's guess of layer li's misses (-1: none) */
    volatile int64_t *hint_flag;          /* [L * BELL_STRIDE]: hint row li belongs to step seq when == seq */
    int32_t *log_ids, *log_slots;         /* NULL, or [L, k]: each layer's request row as served (the GPU rewrites */
    float *log_w;                         /* ids / slots / w at the next step's bell) */
    const int8_t *ring_qx;                /* NULL, or [L, D]: x's int8 copy, written by the GPU's ring before the bell
                                           * (moe_quantize_q8's bits), with its scales ring_dx and sums ring_sx
                                           * [L, D / 32]: gate_up's int8 activations, so tid 0 reads nothing of x */
    const float *ring_dx, *ring_sx;
    double *trace;                        /* NULL, or [L, TRACE_COLS]: the step's timeline in s from its start
                                           * (diagnosis): [0] tid 0 saw the bell, [1] the layer began (after tid 0's
                                           * prep), [2] its last thread finished; per thread t < TIMED_THREADS:
                                           * [3 + 3t] its start, [4 + 3t] its gate_up claims ran out (variants 6 / 8),
                                           * [5 + 3t] its finish (0: no misses, or the thread did not run it) */
} serve_ctx;

static int is_quant(int qtype) { return qtype != F32 && qtype != BF16 && qtype != F16; }
/* rows interleaved by 8 (Q4_0_X8 ...: kernels.cpu.interleave_rows; the RAM bank interleaved by memory/doorbell.py):
 * read by moe_x8_rows with int8 activations, in runs of whole 16-row units */
static int is_x8(int qtype) {
#ifdef MOE_Q8
    return x8_kind(qtype) >= 0;
#else
    (void)qtype;
    return 0;
#endif
}
static int base_type(int qtype) { return is_x8(qtype) ? qtype & 0xFF : qtype; }
/* rows per unit of a phase's split over threads: whole kernel calls (4 rows; interleaved: 2 groups of 8) */
static int64_t unit_of(int qtype) { return is_x8(qtype) ? 16 : 4; }
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
    return moe_q8_type(qtype) || is_x8(qtype);
#else
    (void)qtype;
    return 0;
#endif
}

int moetier_serve_supported(int qtype) {
    return qtype == F32 || qtype == BF16 || qtype == F16 || moetier_supported(qtype) || is_x8(qtype);
}

/* 1 if gate_up rows of this type meet int8 activations (with q8_act): only then does the server read ring_qx */
int moetier_serve_q8(int qtype) { return q8_ok(qtype); }

/* The prep's int8 copy of x [K] (K % 32 == 0): qx [K], scales dx and sums sx [K / 32], as tid 0 makes it (the ring
 * kernel's twin, for tests). 0, or -1 in a build without int8 activations. */
int moetier_quantize_q8(const float *x, int64_t K, int8_t *qx, float *dx, float *sx) {
#ifdef MOE_Q8
    if (K % 32) return -1;
    moe_quantize_q8(x, K, qx, dx, sx);
    return 0;
#else
    (void)x, (void)K, (void)qx, (void)dx, (void)sx;
    return -1;
#endif
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

/* Spin until *n >= want (acquire); -1 after the server's timeout from t_start */
static int wait_count(const serve_ctx *c, int *n, int want, double t_start) {
    for (uint64_t i = 0; __atomic_load_n(n, __ATOMIC_ACQUIRE) < want; i++) {
        if ((i & 1023) == 1023 && (now_s() - t_start) * 1e9 > (double)c->timeout_ns) return -1;
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    }
    return 0;
}

/* [lo, hi): part t of nt of [0, n), contiguous, in units of g items (the last unit may be short) */
static void split(int64_t n, int64_t g, int64_t t, int64_t nt, int64_t *lo, int64_t *hi) {
    const int64_t units = (n + g - 1) / g;
    *lo = g * (units * t / nt);
    *hi = g * (units * (t + 1) / nt);
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

/* [p, hi) over experts' R rows each, flattened (expert j's row r at j R + r): the run at p within one expert, its
 * expert index *j, first row *r0 and length *n */
static inline void flat_run(int64_t p, int64_t hi, int64_t R, int64_t *j, int64_t *r0, int64_t *n) {
    *j = p / R;
    *r0 = p % R;
    *n = (hi - p < R - *r0) ? hi - p : R - *r0;
}

/* The software-prefetch bound (a row of expert j) of a run whose owner's home ends at flattened row home_hi */
static inline int64_t flat_bound(int64_t home_hi, int64_t j, int64_t R) {
    return home_hi - j * R < R ? home_hi - j * R : R;
}

/* out[i] = row w + i rs . the activation a, i < n: a run of contiguous rows of one matrix; pf_end bounds the
 * software prefetch of the int8 kernels (the end of the thread's run) */
static void run_rows(int qtype, int q8, const uint8_t *w, int64_t rs, int64_t n, act_vec a, int64_t K,
                     const uint8_t *pf_end, float *out) {
#ifdef MOE_Q8
    if (is_x8(qtype)) { moe_x8_rows(x8_kind(qtype), w, rs, n, a.qx, a.dx, a.sx, NULL, K, pf_end, out); return; }
    if (q8 && moe_q8_type(qtype)) { moe_rows_run_q8(qtype, w, rs, n, a.qx, a.dx, a.sx, K, pf_end, out); return; }
#else
    (void)pf_end;
#endif
    for (int64_t i = 0; i < n; i++) out[i] = act_row(qtype, q8, w + i * rs, a, K);
}

/* Variant 3: the bytes of n rows read as run_rows would (one stream, software prefetch to pf_end), no math; out[i] a
 * checksum of row i (so the loads stay). What the access pattern alone allows: bench/bench_miss_server.py's
 * ceiling next to the RAM read. */
static void read_rows(const uint8_t *w, int64_t rs, int64_t n, const uint8_t *pf_end, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = w + i * rs;
        uint64_t acc[8] = {0};
        int64_t o = 0;
        for (; o + 64 <= rs; o += 64) {
            if (r + o + PREFETCH_AHEAD < pf_end) __builtin_prefetch(r + o + PREFETCH_AHEAD, 0, 3);
            uint64_t v[8];
            memcpy(v, r + o, 64);
            for (int j = 0; j < 8; j++) acc[j] ^= v[j];
        }
        for (; o < rs; o++) acc[0] += r[o];
        uint64_t a = 0;
        for (int j = 0; j < 8; j++) a ^= acc[j];
        out[i] = (float)(a & 0xFFFF);
    }
}

/* One layer's misses, as computed by every thread of the team. The scratch of moetier_serve_step. */
typedef struct {
    float *hpre, *h, *xs, *hs, *dx, *dh, *sxv, *shv;
    float *part;                            /* variant 2: [k, D] each missed expert's weighted down rows */
    int8_t *qxv, *qhv;
} serve_scratch;

/* A scratch's layout from base (scratch_floats(k, D, I) floats) */
static void scratch_of(float *base, int64_t k, int64_t D, int64_t I, serve_scratch *s) {
    s->hpre = base;                                 /* [k, 2I] */
    s->h = s->hpre + k * 2 * I;                     /* [k, I] */
    s->xs = s->h + k * I;                           /* [D / 32] */
    s->hs = s->xs + D / 32 + 16;                    /* [k, I / 32] */
    s->dx = s->hs + k * (I / 32) + 16;              /* q8: x scales [D / 32], h scales [k, I / 32] */
    s->dh = s->dx + D / 32;
    s->sxv = s->dh + k * (I / 32);                  /* sums of the int8 values [D / 32], [k, I / 32] */
    s->shv = s->sxv + D / 32;
    s->part = s->shv + k * (I / 32) + 16;           /* [k, D] */
    s->qxv = (int8_t *)(s->part + k * D + 16);      /* [D], then [k, I] */
    s->qhv = s->qxv + D;
}

static int64_t scratch_floats(int64_t k, int64_t D, int64_t I) {
    return k * 3 * I + 16 + D / 32 + 16 + k * (I / 32) + 16 + D / 32 + k * (I / 32) + D / 32 + k * (I / 32) + 16
           + k * D + 16 + (D + k * I + 3) / 4 + 16;
}

/* Floats of moetier_serve_step's scratch (serve_ctx.scratch): two of scratch_floats */
int64_t moetier_serve_scratch_floats(int64_t k, int64_t D, int64_t I) { return 2 * scratch_floats(k, D, I); }

/* Missed expert j's activation h in every form the down rows may read */
static inline act_vec h_of(const serve_scratch *s, int64_t j, int64_t I) {
    const act_vec a = {s->h + j * I, s->hs + j * (I / 32), s->qhv + j * I, s->dh + j * (I / 32), s->shv + j * (I / 32)};
    return a;
}

typedef struct {
    int gq, dq, q8g, q8d, m;
    int ro;                                /* variant 3: read the rows only (read_rows) */
    int64_t gu_rb, dn_rb;
    const int32_t *e;                      /* [m] missed experts */
    const int32_t *ord;                    /* [m] their indices by expert id: the order phase 1 splits over threads */
    const float *wt;                       /* [m] their routing weights */
    const uint8_t *const *gu, *const *dn;  /* [E] this layer's pointers */
    const float *const *gub, *const *dnb;  /* NULL or [E] */
    act_vec ax;                            /* x in the forms gate_up's rows read */
    float *y;
} serve_layer;

/* run_rows over n rows of the layer's gate_up (proj 0, K = D) or down (proj 1, K = I) at w; read_rows in variant 3 */
static inline void ly_rows(const serve_layer *ly, int proj, const uint8_t *w, int64_t n, act_vec a, int64_t K,
                           const uint8_t *pf_end, float *out) {
    const int64_t rb = proj ? ly->dn_rb : ly->gu_rb;
    if (ly->ro) read_rows(w, rb, n, pf_end, out);
    else run_rows(proj ? ly->dq : ly->gq, proj ? ly->q8d : ly->q8g, w, rb, n, a, K, pf_end, out);
}

/* The old loops (variant 1, kept for A/B): dynamic 16-row chunks of gate_up, the activation over m threads,
 * dynamic 32-row chunks of down with m one-row calls per row. Worksharing constructs (implicit barriers). */
static void layer_rows(const serve_ctx *c, const serve_layer *ly, const serve_scratch *s) {
    const int64_t I = c->I, D = c->D;
    const int m = ly->m, dquant = is_quant(ly->dq);
    #pragma omp for schedule(dynamic, 16)
    for (int64_t r = 0; r < (int64_t)m * 2 * I; r++) {
        int64_t j = r / (2 * I), row = r % (2 * I);
        s->hpre[r] = act_row(ly->gq, ly->q8g, ly->gu[ly->e[j]] + row * ly->gu_rb, ly->ax, D)
                     + (ly->gub ? ly->gub[ly->e[j]][row] : 0.f);
    }
    #pragma omp for schedule(static)
    for (int j = 0; j < m; j++) {
        for (int64_t i = 0; i < I; i++)
            s->h[j * I + i] = act_one(c, s->hpre[j * 2 * I + i], s->hpre[j * 2 * I + I + i]);
        if (dquant) block_sums(s->h + j * I, I, s->hs + j * (I / 32));
#ifdef MOE_Q8
        if (ly->q8d) moe_quantize_q8(s->h + j * I, I, s->qhv + j * I, s->dh + j * (I / 32), s->shv + j * (I / 32));
#endif
    }
    #pragma omp for schedule(dynamic, 32)
    for (int64_t d = 0; d < D; d++) {
        float acc = 0.f;
        for (int j = 0; j < m; j++) {
            const act_vec ah = h_of(s, j, I);
            acc += ly->wt[j] * (act_row(ly->dq, ly->q8d, ly->dn[ly->e[j]] + d * ly->dn_rb, ah, I)
                                + (ly->dnb ? ly->dnb[ly->e[j]][d] : 0.f));
        }
        ly->y[d] = acc;
    }
}

/* Rows per run call of the down projection: the partial sums of one expert's rows wait on the stack */
#define DOWN_RUN 64
/* Each phase's work is split in nt * CHUNKS contiguous chunks; thread t's home is chunks [t CHUNKS, (t + 1) CHUNKS),
 * one contiguous range, taken in order. A thread done with its home takes the next untaken chunk of the others:
 * the static partition's long streams, without its weakness (one slow or descheduled thread holding up the
 * layer while the others wait at the barrier). On the quiet dev box CHUNKS 1 (static) and 4 measured the same
 * (21.7 and 21.5 GB/s, 2 threads); the stealing is insurance for the 16-thread box, where the GPU-feeding
 * threads share the cores. Claims are per-owner counters on their own cache lines; a phase's counters end at
 * exactly CHUNKS past its start (compare-and-swap, never overshooting), so phase `ph` owns counts
 * [ph CHUNKS, (ph + 1) CHUNKS) and nothing is reset between phases. */
#ifndef CHUNKS                          /* MOETIER_MISS_CHUNKS=N at build time (kernels.cpu.build_library): A/B only */
#define CHUNKS 8                        /* H200 box, 8 GiB, one process each (session 16): CHUNKS 4 waited 27 and 44 us
                                         * a layer at the barriers (gate_up's + the tail) with CPU busy 6.29 / 7.72 ms a
                                         * token; 8 waited 21 and 13 us, busy 6.10 / 5.85; 16 waited 17, busy 6.37 (its
                                         * shorter streams read slower) */
#endif
typedef struct { int64_t n; char pad[56]; } __attribute__((aligned(64))) claim_ctr;

/* The next chunk (global index) for thread t in phase ph, its owner in *owner; -1 when all are taken. */
static int64_t claim(claim_ctr *cl, int nt, int t, int64_t ph, int *owner) {
    for (int o = 0; o < nt; o++) {
        const int u = (t + o) % nt;
        int64_t cur = __atomic_load_n(&cl[u].n, __ATOMIC_RELAXED);
        while (cur < (ph + 1) * CHUNKS)
            if (__atomic_compare_exchange_n(&cl[u].n, &cur, cur + 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *owner = u;
                return (int64_t)u * CHUNKS + cur - ph * CHUNKS;
            }
    }
    return -1;
}

/* [lo, hi): thread t's home in a phase over [0, n) in units of g: its chunks t CHUNKS .. (t + 1) CHUNKS - 1 */
static void home(int64_t n, int64_t g, int t, int nt, int64_t *lo, int64_t *hi) {
    int64_t a, b;
    split(n, g, (int64_t)t * CHUNKS, (int64_t)nt * CHUNKS, lo, &a);
    split(n, g, (int64_t)(t + 1) * CHUNKS - 1, (int64_t)nt * CHUNKS, &b, hi);
}

/* [lo, hi): chunk ch (its owner ch / CHUNKS's k = ch % CHUNKS-th) of a phase over [0, n) in units of g. The owner's
 * home is split in CHUNKS equal parts, or (guided: variant 4) in halving ones, 1/2, 1/4, ... and the last two equal
 * (long streams first, a short last chunk to steal, so the threads reach the barrier closer together: with 4 equal
 * chunks of ~130 KB of gate_up rows a thread that just began its last one holds the others ~19 us at the H200
 * box's ~7 GB/s a thread). The homes are the same either way (prefetch_guess reads them). */
static void chunk_of(int64_t n, int64_t g, int64_t ch, int nt, int guided, int64_t *lo, int64_t *hi) {
    if (!guided) {
        split(n, g, ch, (int64_t)nt * CHUNKS, lo, hi);
        return;
    }
    int64_t a, b;
    split(n, g, ch / CHUNKS, nt, &a, &b);
    const int64_t u = (b - a + g - 1) / g, k = ch % CHUNKS;
    const int64_t lo_u = u - (u >> k), hi_u = k + 1 == CHUNKS ? u : u - (u >> (k + 1));
    *lo = a + g * lo_u < b ? a + g * lo_u : b;
    *hi = a + g * hi_u < b ? a + g * hi_u : b;
}

/* Thread t of nt's share of a layer (variant 0). Three phases, each over chunks as above (*ph: the phase count):
 *  1. gate_up: (gate row i, up row i) pairs of all m experts (taken in expert-id order, so a guess of the set
 *     alone tells each thread its rows: prefetch_guess), in units of 4; per chunk a thread streams its gate
 *     rows then its up rows (one contiguous run each per expert, 4 rows per kernel call: the x loads shared, 4
 *     independent accumulator chains) and applies the activation to its own pairs (no serial activation step,
 *     which ran on m of the threads). Barrier.
 *  2. h per 32-value block (int8 copy, scales, sums), all threads. Barrier.
 *  3. down: D rows in units of 4; per chunk and expert one contiguous run of rows, the routing-weighted sums
 *     accumulated in the chunk's slice of y in expert order (the additions of the old per-row loop: y is
 *     bit-identical). No barrier after: the caller counts finished threads.
 * Software prefetch stops at the end of the chunk owner's home range (past it: another thread's rows).
 * Versus the old loops (dynamic 16 / 32-row chunks, one-row calls of 432 bytes for down, the activation on m
 * threads, 4 barriers): fewer, longer streams for the hardware prefetcher, less call overhead. Measured with
 * bench/bench_miss_server.py (Qwen3-30B-A3B shapes, Q4_0, 5 misses of 8, 48 layers, 2 GiB pool) on the 2-core
 * dev box: 12.9 -> 22.6 GB/s with 2 threads (RAM read 26 GB/s), 7.3 -> 11.5 with 1 (RAM read 13.3). */
/* Variant 5: while phase 1 runs, the thread prefetches its phase-3 home (down rows [lo, hi) of D of every missed
 * expert), paced with its gate_up work so the last line is asked for when about two thirds of its gate_up home are
 * done. The guessed-miss prefetch puts most of a layer's gate_up rows in L2 before the bell (6.3-6.4 MB of ~11.7 a
 * layer at 8 GiB, H200 box), so phase 1 then computes from L2 and the RAM idles until phase 3 streams down; this
 * keeps the RAM busy meanwhile. */
typedef struct {
    const serve_layer *ly;
    int64_t lo, hi;                        /* rows of D */
    int j;                                 /* expert (index into ly->e) and byte offset in its run */
    int64_t off;
    double per_byte, owed;                 /* down bytes to ask for per gate_up byte done; asked for, not yet issued */
} down_cursor;

static void down_cursor_init(down_cursor *dc, const serve_layer *ly, int64_t D, int64_t ud, int t, int nt,
                             int64_t gu_bytes) {
    dc->ly = ly;
    home(D, ud, t, nt, &dc->lo, &dc->hi);
    dc->j = 0;
    dc->off = 0;
    dc->owed = 0.0;
    const int64_t dn_bytes = (int64_t)ly->m * (dc->hi - dc->lo) * ly->dn_rb;
    dc->per_byte = gu_bytes > 0 ? 1.5 * (double)dn_bytes / (double)gu_bytes : 0.0;
}

/* after `done` bytes of gate_up rows: prefetch the next share of the down rows */
static void down_cursor_step(down_cursor *dc, int64_t done) {
    const serve_layer *ly = dc->ly;
    const int64_t run = (dc->hi - dc->lo) * ly->dn_rb;
    dc->owed += dc->per_byte * (double)done;
    while (dc->owed >= 64.0 && dc->j < ly->m) {
        const uint8_t *p = ly->dn[ly->e[dc->j]] + dc->lo * ly->dn_rb;
        int64_t n = (int64_t)dc->owed & ~(int64_t)63;
        if (n > run - dc->off) n = run - dc->off;
        for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + dc->off + o, 0, 2);
        dc->off += n;
        dc->owed -= (double)n;
        if (dc->off >= run) {
            dc->j++;
            dc->off = 0;
        }
    }
}

/* h's copies for the down rows of 32-value blocks [lo, hi) (all missed experts' blocks, one index): int8 values,
 * scales and sums with int8 activations, else the per-32 sums */
static void h_blocks(const serve_layer *ly, const serve_scratch *s, int64_t lo, int64_t hi) {
    for (int64_t bk = lo; bk < hi; bk++) {
#ifdef MOE_Q8
        if (ly->q8d) {
            moe_quantize_q8(s->h + 32 * bk, 32, s->qhv + 32 * bk, s->dh + bk, s->shv + bk);
            continue;
        }
#endif
        block_sums(s->h + 32 * bk, 32, s->hs + bk);
    }
}

/* y[d], d in [lo, hi): the m experts' weighted down rows part[j, d] summed in routing order (the additions of
 * layer_runs' loop over experts: bit-identical) */
static void y_from_parts(const serve_layer *ly, const serve_scratch *s, int64_t D, int64_t lo, int64_t hi) {
    for (int64_t d = lo; d < hi; d++) {
        float acc = 0.f + s->part[d];
        for (int j = 1; j < ly->m; j++) acc = acc + s->part[j * D + d];
        ly->y[d] = acc;
    }
}

/* Phase 1's run of rows [i0, i0 + n) of the r-th missed expert in expert-id order (its gate and up rows, then the
 * activation into h), the software prefetch bounded by the chunk owner's home (flattened row home_hi). -> the
 * expert's index j (routing order: h, weights). */
static int64_t gate_up_run(const serve_ctx *c, const serve_layer *ly, const serve_scratch *s, int64_t r, int64_t i0,
                           int64_t n, int64_t home_hi) {
    const int64_t I = c->I, D = c->D;
    const int64_t pf = flat_bound(home_hi, r, I);     /* prefetch bound (row) */
    const int64_t j = ly->ord[r];
    const int e = ly->e[j];
    const uint8_t *g = ly->gu[e];
    const float *b = ly->gub ? ly->gub[e] : NULL;
    float *hp = s->hpre + j * 2 * I, *hj = s->h + j * I;
    ly_rows(ly, 0, g + i0 * ly->gu_rb, n, ly->ax, D, g + pf * ly->gu_rb, hp + i0);
    ly_rows(ly, 0, g + (I + i0) * ly->gu_rb, n, ly->ax, D, g + (I + pf) * ly->gu_rb, hp + I + i0);
    for (int64_t i = i0; i < i0 + n; i++)
        hj[i] = act_one(c, hp[i] + (b ? b[i] : 0.f), hp[I + i] + (b ? b[I + i] : 0.f));
    return j;
}

/* pt (NULL: not timed) accumulates this thread's seconds of a layer's phases: [0] phase 1's work, [1] its wait at the
 * barrier after, [2] phase 2 with its barrier, [3] phase 3's work (serve_step adds [4]: its finish to the layer's) */
static void layer_runs(const serve_ctx *c, const serve_layer *ly, const serve_scratch *s, claim_ctr *cl, int t,
                       int nt, int64_t *ph, double *pt) {
    double t0 = pt ? now_s() : 0.0, t1 = 0.0;
    const int64_t I = c->I, D = c->D;
    const int guided = c->variant == 4;
    const int m = ly->m;
    const int64_t ug = unit_of(ly->gq), ud = unit_of(ly->dq);      /* rows per unit: gate_up, down */
    int64_t lo, hi, home_lo, home_hi, ch;
    int v;
    down_cursor dc;
    const int pf_down = c->variant == 5;
    if (pf_down) {
        home((int64_t)m * I, ug, t, nt, &home_lo, &home_hi);
        down_cursor_init(&dc, ly, D, ud, t, nt, (home_hi - home_lo) * 2 * ly->gu_rb);
    }
    while ((ch = claim(cl, nt, t, *ph, &v)) >= 0) {
        chunk_of((int64_t)m * I, ug, ch, nt, guided, &lo, &hi);
        home((int64_t)m * I, ug, v, nt, &home_lo, &home_hi);
        for (int64_t p = lo; p < hi;) {
            int64_t r, i0, n;
            flat_run(p, hi, I, &r, &i0, &n);
            gate_up_run(c, ly, s, r, i0, n, home_hi);
            if (pf_down) down_cursor_step(&dc, n * 2 * ly->gu_rb);
            p += n;
        }
    }
    ++*ph;
    if (pt) {
        t1 = now_s();
        pt[0] += t1 - t0;
    }
    #pragma omp barrier
    if (pt) {
        t0 = now_s();
        pt[1] += t0 - t1;
    }
    if (is_quant(ly->dq)) {                 /* I % 32 == 0 (checked): blocks of all experts, one index */
        while ((ch = claim(cl, nt, t, *ph, &v)) >= 0) {
            chunk_of((int64_t)m * (I / 32), 1, ch, nt, guided, &lo, &hi);
            h_blocks(ly, s, lo, hi);
        }
        ++*ph;
        #pragma omp barrier
    }
    if (pt) {
        t1 = now_s();
        pt[2] += t1 - t0;
    }
    float r[DOWN_RUN];
    if (c->variant == 2) {
        /* down over the m x D rows of all missed experts (one expert's rows in a run: ~m times longer streams than
         * below at many threads), each row's weighted result to part[j, d]; then, after a barrier, y[d] summed in
         * expert order over a static slice of D per thread: the additions of the loop below, bit-identical */
        while ((ch = claim(cl, nt, t, *ph, &v)) >= 0) {
            chunk_of((int64_t)m * D, ud, ch, nt, guided, &lo, &hi);
            home((int64_t)m * D, ud, v, nt, &home_lo, &home_hi);
            for (int64_t p = lo; p < hi;) {
                int64_t j, d0, n_run;
                flat_run(p, hi, D, &j, &d0, &n_run);
                const int64_t pf = flat_bound(home_hi, j, D);     /* prefetch bound (row) */
                const int e = ly->e[j];
                const float wj = ly->wt[j], *b = ly->dnb ? ly->dnb[e] : NULL;
                const act_vec ah = h_of(s, j, I);
                const uint8_t *dn = ly->dn[e];
                for (int64_t d = d0; d < d0 + n_run; d += DOWN_RUN) {
                    const int64_t n = d0 + n_run - d < DOWN_RUN ? d0 + n_run - d : DOWN_RUN;
                    ly_rows(ly, 1, dn + d * ly->dn_rb, n, ah, I, dn + pf * ly->dn_rb, r);
                    for (int64_t i = 0; i < n; i++) s->part[j * D + d + i] = wj * (r[i] + (b ? b[d + i] : 0.f));
                }
                p += n_run;
            }
        }
        ++*ph;
        #pragma omp barrier
        split(D, ud, t, nt, &lo, &hi);
        y_from_parts(ly, s, D, lo, hi);
        if (pt) pt[3] += now_s() - t1;
        return;
    }
    while ((ch = claim(cl, nt, t, *ph, &v)) >= 0) {
        chunk_of(D, ud, ch, nt, guided, &lo, &hi);
        home(D, ud, v, nt, &home_lo, &home_hi);
        for (int j = 0; j < m; j++) {
            const int e = ly->e[j];
            const float wj = ly->wt[j], *b = ly->dnb ? ly->dnb[e] : NULL;
            const act_vec ah = h_of(s, j, I);
            const uint8_t *dn = ly->dn[e];
            for (int64_t d = lo; d < hi; d += DOWN_RUN) {
                const int64_t n = hi - d < DOWN_RUN ? hi - d : DOWN_RUN;
                ly_rows(ly, 1, dn + d * ly->dn_rb, n, ah, I, dn + home_hi * ly->dn_rb, r);
                for (int64_t i = 0; i < n; i++)
                    ly->y[d + i] = (j ? ly->y[d + i] : 0.f) + wj * (r[i] + (b ? b[d + i] : 0.f));
            }
        }
    }
    ++*ph;
    if (pt) pt[3] += now_s() - t1;
}

/* Variant 6 (dataflow): variant 0's chunks without its two barriers. Phase 1 as variant 0, and each run adds its
 * rows to its expert's count; the thread that completes an expert's I rows makes that expert's h copy (phase 2's
 * work, per expert) and marks it ready (release). A thread out of phase-1 chunks goes straight to phase 3, over
 * variant 0's chunks of D: in a chunk it computes the ready experts' weighted rows into part[j, d] (phase 1's expert
 * order, the first ready), sets the chunk aside while an expert is still in flight and claims the next one (two
 * aside at most: then it finishes them first, waiting for their experts); y[d] is then summed over j in routing
 * order (variant 0's additions: bit-identical). Barrier waits become work on whatever is ready: at 8 GiB on the
 * H200 box a layer waited ~17 us at phase 1's barrier, ~7 in phase 2 and ~15 at the end, of ~140 (session 16). */
typedef struct { int64_t rows[MAX_K]; int32_t ready[MAX_K]; } flow_ctr;      /* one layer's; zero before it */
#define FLOW_ASIDE 2
typedef struct { int64_t lo, hi, home_hi; uint64_t done; } flow_chunk;       /* a phase-3 chunk set aside */

/* n more rows of missed expert j's h written: the expert's h copy and its ready flag by the thread that ends it */
static void flow_rows_done(const serve_layer *ly, const serve_scratch *s, flow_ctr *f, int64_t I, int64_t j,
                           int64_t n) {
    if (__atomic_add_fetch(&f->rows[j], n, __ATOMIC_ACQ_REL) != I) return;
    if (is_quant(ly->dq)) h_blocks(ly, s, j * (I / 32), (j + 1) * (I / 32));
    __atomic_store_n(&f->ready[j], 1, __ATOMIC_RELEASE);
}

/* Phase-3 chunk q: the ready experts not yet in q->done (all of them, waiting, when `wait`) into part, then, once
 * all m are in, y over the chunk. -> 1 when the chunk is finished. */
static int flow_down(const serve_layer *ly, const serve_scratch *s, flow_ctr *f, int64_t D, int64_t I,
                     flow_chunk *q, int wait) {
    const int m = ly->m;
    float r[DOWN_RUN];
    for (int o = 0; o < m; o++) {
        const int j = ly->ord[o];
        if (q->done >> j & 1) continue;
        if (!__atomic_load_n(&f->ready[j], __ATOMIC_ACQUIRE)) {
            if (!wait) continue;
            for (unsigned n = 1; !__atomic_load_n(&f->ready[j], __ATOMIC_ACQUIRE); n++) {
#if defined(__x86_64__)
                __builtin_ia32_pause();
#endif
                if (!(n & 4095)) sched_yield();     /* the expert's writer may share this core (more threads than
                                                     * free cores): let it run */
            }
        }
        const int e = ly->e[j];
        const float wj = ly->wt[j], *b = ly->dnb ? ly->dnb[e] : NULL;
        const act_vec ah = h_of(s, j, I);
        const uint8_t *dn = ly->dn[e];
        for (int64_t d = q->lo; d < q->hi; d += DOWN_RUN) {
            const int64_t n = q->hi - d < DOWN_RUN ? q->hi - d : DOWN_RUN;
            ly_rows(ly, 1, dn + d * ly->dn_rb, n, ah, I, dn + q->home_hi * ly->dn_rb, r);
            for (int64_t i = 0; i < n; i++) s->part[j * D + d + i] = wj * (r[i] + (b ? b[d + i] : 0.f));
        }
        q->done |= (uint64_t)1 << j;
    }
    if (q->done != ((m == 64 ? 0 : (uint64_t)1 << m) - 1)) return 0;
    y_from_parts(ly, s, D, q->lo, q->hi);
    return 1;
}

/* chunk i out of the n set aside, the order of the others kept */
static void aside_drop(flow_chunk *a, int *n, int i) {
    for (int u = i + 1; u < *n; u++) a[u - 1] = a[u];
    --*n;
}

/* Thread t of nt's share of a layer in variant 6 (pt as layer_runs': [1] the time spent waiting for experts; gu_end:
 * NULL, or out: when its gate_up claims ran out) */
static void layer_flow(const serve_ctx *c, const serve_layer *ly, const serve_scratch *s, claim_ctr *cl,
                       flow_ctr *f, int t, int nt, int64_t *ph, double *pt, double *gu_end) {
    double t0 = pt ? now_s() : 0.0, t1;
    const int64_t I = c->I, D = c->D;
    const int m = ly->m;
    const int64_t ug = unit_of(ly->gq), ud = unit_of(ly->dq);
    int64_t lo, hi, home_lo, home_hi, ch;
    int v;
    while ((ch = claim(cl, nt, t, *ph, &v)) >= 0) {
        chunk_of((int64_t)m * I, ug, ch, nt, 0, &lo, &hi);
        home((int64_t)m * I, ug, v, nt, &home_lo, &home_hi);
        for (int64_t p = lo; p < hi;) {
            int64_t r, i0, n;
            flat_run(p, hi, I, &r, &i0, &n);
            flow_rows_done(ly, s, f, I, gate_up_run(c, ly, s, r, i0, n, home_hi), n);
            p += n;
        }
    }
    ++*ph;
    if (gu_end) *gu_end = now_s();
    if (pt) {
        t1 = now_s();
        pt[0] += t1 - t0;
        t0 = t1;
    }
    /* at most FLOW_ASIDE chunks set aside: a thread that claimed every chunk while the last experts were in flight
     * (the first version) then computed them all while the others, out of chunks, waited ~60 us a layer */
    flow_chunk aside[FLOW_ASIDE];
    int n_aside = 0, more = 1;
    double waited = 0.0;
    while (more || n_aside) {
        if (more && n_aside < FLOW_ASIDE) {
            if ((ch = claim(cl, nt, t, *ph, &v)) < 0) {
                more = 0;
                ++*ph;
                continue;
            }
            flow_chunk q = {0, 0, 0, 0};
            chunk_of(D, ud, ch, nt, 0, &q.lo, &q.hi);
            home(D, ud, v, nt, &home_lo, &q.home_hi);
            if (q.lo < q.hi && !flow_down(ly, s, f, D, I, &q, 0)) aside[n_aside++] = q;
            continue;
        }
        int progressed = 0, i = 0;          /* the chunks aside: whatever became ready, else wait for the oldest */
        while (i < n_aside) {
            const uint64_t before = aside[i].done;
            const int finished = flow_down(ly, s, f, D, I, &aside[i], 0);
            progressed |= finished || aside[i].done != before;
            if (finished) aside_drop(aside, &n_aside, i);
            else i++;
        }
        if (!progressed && n_aside) {
            const double w0 = pt ? now_s() : 0.0;
            flow_down(ly, s, f, D, I, &aside[0], 1);
            aside_drop(aside, &n_aside, 0);
            if (pt) waited += now_s() - w0;
        }
    }
    if (pt) {
        pt[1] += waited;
        pt[3] += now_s() - t0 - waited;
    }
}

/* Touch [p, p + n) toward this core's L2 (software prefetch per 64-byte line), at most *budget bytes (lowered by what
 * was touched); 1 if `bell` rang (== seq) meanwhile or the budget ran out. Loads of one word per line instead (they
 * won on the 2-core EPYC dev box) lost on the H200 box: 8 GiB 103.5 vs 109.2 tok/s, --cpu-moe 69.3 vs 73.1 with
 * the CPU busy 11.4 vs 9.1 ms a token (docs/perf-log.md, session 11). */
static int touch(const uint8_t *p, int64_t n, volatile int64_t *bell, int64_t seq, int64_t *budget) {
    if (n > *budget) n = *budget;
    for (int64_t o = 0; o < n; o += 64) {
        if ((o & 4095) == 0 && __atomic_load_n(bell, __ATOMIC_RELAXED) == seq) {
            *budget -= o;
            return 1;
        }
        __builtin_prefetch(p + o, 0, 2);
    }
    *budget -= n;
    return *budget <= 0;
}

/* touch the gate rows i0 .. i0 + n of an expert's gate_up matrix g (rows of rb bytes, I gate rows), then its up rows */
static int touch_gate_up(const uint8_t *g, int64_t I, int64_t rb, int64_t i0, int64_t n, volatile int64_t *bell,
                         int64_t seq, int64_t *budget) {
    return touch(g + i0 * rb, n * rb, bell, seq, budget) || touch(g + (I + i0) * rb, n * rb, bell, seq, budget);
}

/* Bytes a thread prefetches per layer at most: 3/4 of this core's L2 (gate/up rows come first and must still be there
 * when the layer starts), 1 MiB where the size is unknown. */
static int64_t prefetch_budget(void) {
    static int64_t cached = 0;
    if (!cached) {
        long l2 = -1;
#ifdef _SC_LEVEL2_CACHE_SIZE
        l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
        cached = l2 > 0 ? (int64_t)l2 * 3 / 4 : (int64_t)1 << 20;
    }
    return cached;
}

/* The guessed misses of layer li (the GPU applied li's router to layer li - 1's input: c->hint), valid ones, unique,
 * sorted by expert id, in e; -> how many. */
static int guess_of(const serve_ctx *c, int li, int32_t *e) {
    const int k = c->k;
    int m = 0;
    for (int j = 0; j < k; j++) {
        const int32_t x = c->hint[(int64_t)li * k + j];
        const int64_t at = li * (int64_t)c->E + x;
        if (x < 0 || x >= c->E || !c->gate_up[at] || !c->down[at]) continue;
        int i = m;
        while (i > 0 && e[i - 1] > x) i--;
        if (i > 0 && e[i - 1] == x) continue;
        memmove(e + i + 1, e + i, (size_t)(m - i) * sizeof *e);
        e[i] = x;
        m++;
    }
    return m;
}

/* While the GPU runs the kernels between layer li - 1's answer and layer li's bell (~50-70 us on the H200 box), thread
 * t loads the rows it will compute in layer li if the guess is right: layer_runs' home ranges for the guessed set
 * (phase 1 splits in expert-id order, phase 3 by rows of D: the set decides both, not the routing order). The CPU's
 * RAM stream then overlaps the GPU's part instead of following it. Stops when layer li's bell rings. */
static void prefetch_rows(const serve_ctx *c, int li, int64_t seq, int t, int nt, double t_start, int64_t *budget) {
    if (!c->hint || !c->hint_flag) return;
    volatile int64_t *bell = c->bell + (int64_t)li * BELL_STRIDE;
    volatile int64_t *flag = c->hint_flag + (int64_t)li * BELL_STRIDE;
    /* after a layer the CPU had little or nothing to do for, the GPU may not have written the guess yet: wait for it
     * (or for the bell, which follows it; on a timeout thread 0's wait for the bell reports the stall) */
    for (uint64_t n = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) != seq; n++) {
        if (__atomic_load_n(bell, __ATOMIC_RELAXED) == seq) return;
        if ((n & 1023) == 1023 && (now_s() - t_start) * 1e9 > (double)c->timeout_ns) return;
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    }
    int32_t e[MAX_K];
    const int m = guess_of(c, li, e);
    if (!m) return;
    const int64_t I = c->I, D = c->D;
    const int64_t gu_rb = layer_row_bytes(c, li, 0), dn_rb = layer_row_bytes(c, li, 1);
    int64_t lo, hi;
    const int64_t ug = unit_of(layer_type(c, li, 0)), ud = unit_of(layer_type(c, li, 1));   /* as layer_runs' */
    const uint8_t *const *gu = c->gate_up + li * (int64_t)c->E;
    home((int64_t)m * I, ug, t, nt, &lo, &hi);
    for (int64_t p = lo; p < hi;) {
        int64_t r, i0, n;
        flat_run(p, hi, I, &r, &i0, &n);
        if (touch_gate_up(gu[e[r]], I, gu_rb, i0, n, bell, seq, budget)) return;
        p += n;
    }
    if (c->variant == 2) {      /* layer_runs' down homes over the m x D rows */
        home((int64_t)m * D, ud, t, nt, &lo, &hi);
        for (int64_t p = lo; p < hi;) {
            int64_t j, d0, n;
            flat_run(p, hi, D, &j, &d0, &n);
            if (touch(c->down[li * (int64_t)c->E + e[j]] + d0 * dn_rb, n * dn_rb, bell, seq, budget)) return;
            p += n;
        }
        return;
    }
    home(D, ud, t, nt, &lo, &hi);
    for (int j = 0; j < m; j++)
        if (touch(c->down[li * (int64_t)c->E + e[j]] + lo * dn_rb, (hi - lo) * dn_rb, bell, seq, budget)) return;
}

/* prefetch_rows within this core's budget (prefetch_budget), adding the bytes whose prefetches were issued before the
 * bell to *issued */
static void prefetch_guess(const serve_ctx *c, int li, int64_t seq, int t, int nt, double t_start, int64_t *issued) {
    const int64_t full = prefetch_budget();
    int64_t budget = full;
    prefetch_rows(c, li, seq, t, nt, t_start, &budget);
    __atomic_add_fetch(issued, full - (budget > 0 ? budget : 0), __ATOMIC_RELAXED);
}

/* Layer li's misses (slot -1) from the ring: expert ids e, routing weights w in routing order, ord phase 1's order
 * (by expert id); -> how many, or -1 where a missed expert has no RAM pointer (or bias). Every thread that reads it
 * gets the same list. */
static int miss_list(const serve_ctx *c, int li, int32_t *e, int32_t *ord, float *w) {
    const int k = c->k;
    const int32_t *ids = c->ids + (int64_t)li * k, *sl = c->slots + (int64_t)li * k;
    const float *rw = c->w + (int64_t)li * k;
    int m = 0;
    for (int j = 0; j < k; j++) {
        if (sl[j] >= 0) continue;
        const int64_t x = ids[j], at = li * (int64_t)c->E + x;
        if (x < 0 || x >= c->E || !c->gate_up[at] || (c->gu_bias && !c->gu_bias[at]) || (c->dn_bias && !c->dn_bias[at]))
            return -1;
        e[m] = (int32_t)x;
        w[m++] = rw[j];
    }
    for (int j = 0; j < m; j++) {       /* phase 1's order: by expert id */
        int i = j;
        while (i > 0 && e[ord[i - 1]] > e[j]) {
            ord[i] = ord[i - 1];
            i--;
        }
        ord[i] = j;
    }
    return m;
}

#define TIMED_THREADS 64                /* threads with timings of their own (serve_ctx.timing) */
#define TRACE_COLS (3 + 3 * TIMED_THREADS)      /* serve_ctx.trace's row: a layer */
int moetier_serve_trace_cols(void) { return TRACE_COLS; }

/* Serve every MoE layer of decode step `seq`. 0, or -(1 + li) if layer li's bell never rang
 * (timeout), -100 - li if a missed expert has no RAM pointer, -200 on bad arguments. */
int moetier_serve_step(const serve_ctx *c, int64_t seq) {
    const int L = c->L, D = c->D, I = c->I, k = c->k;
    if (k > MAX_K || k < 1 || (c->ring_qx && D % 32)) return -200;
    for (int li = 0; li < L; li++) {
        const int gq = layer_type(c, li, 0), dq = layer_type(c, li, 1);
        if (!moetier_serve_supported(gq) || !moetier_serve_supported(dq)) return -200;
        if ((is_quant(gq) && D % block_elems(base_type(gq))) || (is_quant(dq) && I % block_elems(base_type(dq))))
            return -200;
        /* interleaved rows: int8 activations, whole 16-row units of gate_up (I rows) and down (D), no per-row loops */
        if ((is_x8(gq) || is_x8(dq)) && (!c->q8_act || I % 16 || D % 16 || c->variant == 1)) return -200;
    }
    /* two scratches, one per layer parity: where threads start a layer without a barrier (own below), the fastest
     * may be a layer ahead of the slowest (in a decode step never two: a layer's bell follows the GPU's answer of the
     * one before, which follows every thread's part of it; with bells rung ahead wait_count holds it) */
    serve_scratch sc[2];
    scratch_of(c->scratch, k, D, I, &sc[0]);
    scratch_of(c->scratch + scratch_floats(k, D, I), k, D, I, &sc[1]);
    const int Ln = L > 0 ? L : 1;
    int n_miss[Ln], finished[Ln];
    int32_t miss_e[Ln][MAX_K], miss_ord[Ln][MAX_K];
    int64_t guessed = 0, guessed_right = 0, guessed_misses = 0;   /* layers with a fresh guess */
    int64_t prefetched = 0;                 /* bytes of guessed rows prefetched before their bells, all threads */
    float miss_w[Ln][MAX_K];
    double t_begin[Ln], t_end[Ln], t_seen[Ln];
    int status = 0, total = 0;
    double t_wait = 0.0, t0 = now_s();
    for (int li = 0; li < L; li++) {
        n_miss[li] = finished[li] = 0;
        t_begin[li] = t_end[li] = t_seen[li] = 0.0;
    }
    if (c->trace) memset(c->trace, 0, (size_t)L * TRACE_COLS * sizeof *c->trace);
    /* variant 8 (variant 6 with the ring's int8 copy of x in every layer): no shared prep, so every thread reads the
     * bell and the miss list itself and starts at once (the claims and flow counters need no barrier between layers:
     * a thread leaves a layer only once all its chunks are claimed; the scratches alternate by layer parity); else
     * thread 0 does and a barrier follows. For the whole step: a thread that broke out of a barrier-free layer (a
     * timeout) must not leave the others waiting at a barrier later. H200 box, 8 GiB, two calls of 6 / 8 / 6 in one process:
     * serve 9.31 / 8.41 / 9.81 and 7.10 / 7.78 / 6.71 ms a token: no gain shown (docs/perf-log.md, session 28). */
    int own = c->variant == 8 && c->ring_qx;        /* variant 8: variant 6 without the bell's barrier */
    for (int li = 0; li < L && own; li++) own = c->q8_act && q8_ok(layer_type(c, li, 0));
    claim_ctr cl[c->nthreads > 0 ? c->nthreads : 1];
    for (int t = 0; t < c->nthreads; t++) cl[t].n = 0;
    const int flows = c->variant == 6 || c->variant == 8;
    flow_ctr flow[flows ? Ln : 1];                  /* variant 6's per-layer expert counts and ready flags */
    memset(flow, 0, sizeof flow);
    double phase_sum[5] = {0.0, 0.0, 0.0, 0.0, 0.0};    /* layer_runs' pt, summed over threads and layers */
    double th_work[TIMED_THREADS], th_last[TIMED_THREADS], th_cpu[TIMED_THREADS];     /* timing's per-thread part */
    for (int t = 0; t < TIMED_THREADS; t++) th_work[t] = th_last[t] = 0.0, th_cpu[t] = -1.0;
    #pragma omp parallel num_threads(c->nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t ph = 0;                                 /* phases done (layer_runs' chunk counters) */
        double ptv[5] = {0.0, 0.0, 0.0, 0.0, 0.0}, mine[Ln];      /* mine: when this thread finished layer li */
        char had[Ln];                                   /* layers with misses, as this thread read them */
        double *pt = c->timing ? ptv : NULL;
        for (int li = 0; li < L; li++) mine[li] = 0.0;
        for (int li = 0; li < L; li++) {
            const int gq = layer_type(c, li, 0), dq = layer_type(c, li, 1);    /* per projection */
            const int q8g = c->q8_act && q8_ok(gq), q8d = c->q8_act && q8_ok(dq);
            int32_t own_e[MAX_K], own_ord[MAX_K];      /* variant 8: this thread's read of the request */
            float own_w[MAX_K];
            const int32_t *lst_e = own_e, *lst_ord = own_ord;    /* the list this thread computes */
            const float *lst_w = own_w;
            int own_m = 0;
            double own_begin = 0.0;
            if (own && tid != 0) {
                if (wait_bell(c, li, seq, t0)) break;           /* thread 0 reports the timeout */
                own_m = miss_list(c, li, own_e, own_ord, own_w);
                if (own_m < 0) break;
                own_begin = now_s();
            }
            if (own) {
                /* this parity's scratch free: the last earlier layer of it with misses finished by every thread. A
                 * decode step's bells ensure it (layer li rings after the answer of li - 1, or li - 1 had no misses
                 * and li - 2 was answered); bells rung ahead (tests, bench_miss_server) do not */
                int j = li - 2;
                while (j >= 0 && !had[j]) j -= 2;
                if (j >= 0 && wait_count(c, &finished[j], nt, t0)) break;   /* a thread broke out of layer j */
            }
            if (tid == 0) {
                double tw = now_s();
                if (wait_bell(c, li, seq, t0)) {
                    status = -(1 + li);
                } else {
                    t_seen[li] = now_s();
                    const int32_t *ids = c->ids + (int64_t)li * k, *sl = c->slots + (int64_t)li * k;
                    const float *w = c->w + (int64_t)li * k;
                    if (c->log_ids) {
                        memcpy(c->log_ids + (int64_t)li * k, ids, k * sizeof *ids);
                        memcpy(c->log_slots + (int64_t)li * k, sl, k * sizeof *sl);
                        memcpy(c->log_w + (int64_t)li * k, w, k * sizeof *w);
                    }
                    const int m = miss_list(c, li, miss_e[li], miss_ord[li], miss_w[li]);
                    if (m < 0) {
                        status = -100 - li;
                    } else {
                        n_miss[li] = m;
                        total += m;
                        if (c->hint && c->hint_flag
                            && __atomic_load_n(c->hint_flag + (int64_t)li * BELL_STRIDE, __ATOMIC_ACQUIRE) == seq) {
                            int32_t g[MAX_K];
                            const int ng = guess_of(c, li, g);
                            guessed += ng;
                            guessed_misses += m;
                            for (int j = 0; j < m; j++)
                                for (int i = 0; i < ng; i++) guessed_right += g[i] == miss_e[li][j];
                        }
                        if (m && !(q8g && c->ring_qx)) {       /* x's forms for gate_up, unless the ring wrote them */
                            if (is_quant(gq)) block_sums(c->x + (int64_t)li * D, D, sc[li & 1].xs);
#ifdef MOE_Q8
                            if (q8g) {
                                const serve_scratch *q = &sc[li & 1];
                                moe_quantize_q8(c->x + (int64_t)li * D, D, q->qxv, q->dx, q->sxv);
                            }
#endif
                        }
                    }
                }
                t_wait += now_s() - tw;
                t_begin[li] = now_s();
            }
            if (!own) {
                #pragma omp barrier
            }
            if (!own || tid == 0) {             /* thread 0's list (its own in the barrier-free layers) */
                if (status) break;
                own_m = n_miss[li];
                lst_e = miss_e[li], lst_ord = miss_ord[li], lst_w = miss_w[li];
                own_begin = t_begin[li];
            }
            if (pt && li > 0 && mine[li - 1] > 0.0 && t_end[li - 1] > 0.0) pt[4] += t_end[li - 1] - mine[li - 1];
            const int m = own_m;
            had[li] = m > 0;
            if (m == 0) {
                if (li + 1 < L) prefetch_guess(c, li + 1, seq, tid, nt, t0, &prefetched);
                continue;
            }
            double *tr = c->trace && tid < TIMED_THREADS ? c->trace + (int64_t)li * TRACE_COLS + 3 + 3 * tid : NULL;
            if (tr) tr[0] = now_s() - t0;
            const int64_t nb = D / 32;      /* x's 32-blocks (their scales and sums: int8 activations only) */
            const serve_scratch s = sc[li & 1];
            const act_vec ax = q8g && c->ring_qx
                ? (act_vec){c->x + (int64_t)li * D, s.xs, c->ring_qx + li * (int64_t)D, c->ring_dx + li * nb,
                            c->ring_sx + li * nb}
                : (act_vec){c->x + (int64_t)li * D, s.xs, s.qxv, s.dx, s.sxv};
            const serve_layer ly = {gq, dq, q8g, q8d, m, c->variant == 3, layer_row_bytes(c, li, 0),
                                    layer_row_bytes(c, li, 1),
                                    lst_e, lst_ord, lst_w, c->gate_up + li * (int64_t)c->E,
                                    c->down + li * (int64_t)c->E,
                                    c->gu_bias ? c->gu_bias + li * (int64_t)c->E : NULL,
                                    c->dn_bias ? c->dn_bias + li * (int64_t)c->E : NULL,
                                    ax, c->y + (int64_t)li * D};
            if (c->variant == 1) {
                layer_rows(c, &ly, &sc[li & 1]);            /* ends in a barrier: all rows of y written */
                if (tid == 0) {
                    t_end[li] = now_s();
                    __atomic_store_n(c->done + (int64_t)li * BELL_STRIDE, seq, __ATOMIC_RELEASE);
                }
            } else {
                /* the last thread to finish its rows of y raises done: no barrier before the next bell (the
                 * next layer's phases start after its bell barrier, which every thread reaches after this) */
                double gu_end = 0.0;
                if (flows) layer_flow(c, &ly, &sc[li & 1], cl, &flow[li], tid, nt, &ph, pt, tr ? &gu_end : NULL);
                else layer_runs(c, &ly, &sc[li & 1], cl, tid, nt, &ph, pt);
                mine[li] = now_s();
                if (tr) {
                    tr[1] = gu_end > 0.0 ? gu_end - t0 : 0.0;
                    tr[2] = mine[li] - t0;
                }
                const int last = __atomic_add_fetch(&finished[li], 1, __ATOMIC_ACQ_REL) == nt;
                if (last) {
                    t_end[li] = mine[li];
                    __atomic_store_n(c->done + (int64_t)li * BELL_STRIDE, seq, __ATOMIC_RELEASE);
                }
                if (pt && tid < TIMED_THREADS) {     /* from this thread's start of the layer */
                    th_work[tid] += mine[li] - own_begin;
                    th_last[tid] += last;
                }
            }
            if (li + 1 < L) prefetch_guess(c, li + 1, seq, tid, nt, t0, &prefetched);   /* after its answer is in */
        }
        for (int i = 0; i < 5; i++) {
            #pragma omp atomic
            phase_sum[i] += ptv[i];
        }
#ifdef __linux__
        if (pt && tid < TIMED_THREADS) th_cpu[tid] = sched_getcpu();     /* the CPU it ends the step on */
#endif
    }
    for (int li = 0; li < L && c->trace; li++) {
        double *tr = c->trace + (int64_t)li * TRACE_COLS;
        tr[0] = t_seen[li] > 0.0 ? t_seen[li] - t0 : 0.0;
        tr[1] = t_begin[li] > 0.0 ? t_begin[li] - t0 : 0.0;
        tr[2] = t_end[li] > 0.0 ? t_end[li] - t0 : 0.0;
    }
    double t_busy = 0.0;
    for (int li = 0; li < L; li++)          /* layers that ran to their end */
        if (t_end[li] > 0.0) t_busy += t_end[li] - t_begin[li];
    /* the GPU's part between two answered layers: the last answer of layer li - 1 -> layer li's bell seen
     * (flag and bell over PCIe, the GPU's post-MoE / attention / router kernels); and tid 0's bell work */
    double t_round = 0.0, t_prep = 0.0;
    int pairs = 0;
    for (int li = 1; li < L; li++)
        if (t_end[li - 1] > 0.0 && t_seen[li] > 0.0) {
            t_round += t_seen[li] - t_end[li - 1];
            pairs++;
        }
    for (int li = 0; li < L; li++)
        if (t_seen[li] > 0.0 && t_begin[li] > 0.0) t_prep += t_begin[li] - t_seen[li];
    if (c->timing) {            /* [16] */
        c->timing[6] = (double)guessed;
        c->timing[7] = (double)guessed_right;
        c->timing[8] = (double)guessed_misses;
        c->timing[9] = (double)prefetched;
        c->timing[10] = t_seen[0] > 0.0 ? t_seen[0] - t0 : 0.0;
        for (int i = 0; i < 5; i++) c->timing[11 + i] = phase_sum[i];
        for (int t = 0; t < TIMED_THREADS; t++) {
            c->timing[16 + t] = th_work[t];
            c->timing[16 + TIMED_THREADS + t] = th_last[t];
            c->timing[16 + 2 * TIMED_THREADS + t] = th_cpu[t];
        }
        c->timing[0] = t_busy;
        c->timing[1] = t_wait;
        c->timing[2] = total;
        c->timing[3] = t_round;
        c->timing[4] = pairs;
        c->timing[5] = t_prep;
    }
    return status;
}
