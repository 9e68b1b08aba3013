/* Quantized matvec y[N] = W[N, K] @ x[K] straight from GGML blocks (moetier/kernels/cpu.py).
 *
 * Built on first use with the system C compiler (-O3 -march=native -fopenmp) and called
 * through ctypes, which releases the GIL. Rows are split over OpenMP threads; each row is
 * one pass over its blocks, so weight bytes are read exactly once (streaming).
 * Offsets (-8 for Q4_0, -min for Q4_K / Q5_K) are folded out with per-block sums of x:
 *   sum_j d (q_j - 8) x_j = d (sum_j q_j x_j - 8 sum_j x_j).
 * Accumulation is float32; results match dequantize-then-matmul to float32 rounding.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

/* SIMD vocabulary: VW float lanes; vbytes_*(p) widens VW bytes at p to int32 lanes;
 * vlo4f / vhi4f: the low / high nibble of each such lane as a float; vq5f / vq6f: Q5_K / Q6_K values. */
#if defined(__AVX512F__) && defined(__F16C__)
#define VW 16
typedef __m512 vf;
typedef __m512i vi;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vset1(float f) { return _mm512_set1_ps(f); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vcvt(vi v) { return _mm512_cvtepi32_ps(v); }
static inline vi vbytes_i8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vbytes_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
/* nibble -> float through a 16-entry permute (vpermps reads only the index's low 4 bits):
 * measured 12-15% faster than and + convert (docs/perf-log.md) */
static inline vf vnib(vi idx) {
    return _mm512_permutexvar_ps(idx, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
static inline vf vlo4f(vi v) { return vnib(v); }
static inline vf vhi4f(vi v) { return vnib(_mm512_srli_epi32(v, 4)); }
/* K-quant values as floats: vq6f = ((lo >> ls) & 15 | ((hi >> hs) & 3) << 4) - 32 (Q6_K), vq5f =
 * (lo >> ls) & 15 | ((hi >> hs) & 1) << 4 (Q5_K); ls 0 or 4. Each part through a 16-entry permute
 * (the nibble, and a table of 16 (high bits) - offset), as vnib: fewer uops than integer and/or/shift. */
static inline vf vq6f(vi lo, int ls, vi hi, int hs) {
    const vf t = _mm512_setr_ps(-32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16);
    return _mm512_add_ps(ls ? vhi4f(lo) : vlo4f(lo),
                         _mm512_permutexvar_ps(hs ? _mm512_srl_epi32(hi, _mm_cvtsi32_si128(hs)) : hi, t));
}
static inline vf vq5f(vi lo, int ls, vi hi, int hs) {
    const vf t = _mm512_setr_ps(0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16);
    return _mm512_add_ps(ls ? vhi4f(lo) : vlo4f(lo),
                         _mm512_permutexvar_ps(hs ? _mm512_srl_epi32(hi, _mm_cvtsi32_si128(hs)) : hi, t));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VW 8
typedef __m256 vf;
typedef __m256i vi;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vset1(float f) { return _mm256_set1_ps(f); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vcvt(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vi vbytes_i8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi vbytes_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vf vlo4f(vi v) { return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F))); }
static inline vf vhi4f(vi v) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)); }
static inline vf vq56f(vi lo, int ls, vi hi, int hs, int hm, int off) {
    vi q = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi32(lo, _mm_cvtsi32_si128(ls)), _mm256_set1_epi32(15)),
                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(hi, _mm_cvtsi32_si128(hs)),
                                                              _mm256_set1_epi32(hm)), 4));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(off)));
}
static inline vf vq6f(vi lo, int ls, vi hi, int hs) { return vq56f(lo, ls, hi, hs, 3, 32); }
static inline vf vq5f(vi lo, int ls, vi hi, int hs) { return vq56f(lo, ls, hi, hs, 1, 0); }
#endif

static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef VW
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) bits = sign | 0x7F800000 | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {  /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Software prefetch this many bytes ahead of the block being read: measured (docs/perf-log.md)
 * to lift single-thread Q8_0 streaming from 6 to 11.5 GB/s per core; 2-6 KB all work. */
#define PREFETCH_AHEAD 4096
#define PREFETCH(p) __builtin_prefetch((const char *)(p) + PREFETCH_AHEAD, 0, 3)

/* per-32 sums of x: xs[b] = sum x[32 b .. 32 b + 31] */
static void block_sums(const float *x, int64_t K, float *xs) {
    for (int64_t b = 0; b < K / 32; b++) {
        float s = 0.f;
        for (int j = 0; j < 32; j++) s += x[32 * b + j];
        xs[b] = s;
    }
}

/* ---- Q8_0: 34-byte blocks {fp16 d, int8 q[32]} ---- */
static float row_q8_0(const uint8_t *w, const float *x, int64_t nb) {
#ifdef VW
    vf acc = vzero();
    for (int64_t b = 0; b < nb; b++, w += 34, x += 32) {
        PREFETCH(w);
        vf s = vzero();
        for (int j = 0; j < 32; j += VW) s = vfma(vcvt(vbytes_i8(w + 2 + j)), vload(x + j), s);
        acc = vfma(vset1(fp16_to_f32(w)), s, acc);
    }
    return vsum(acc);
#else
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++, w += 34, x += 32) {
        const int8_t *q = (const int8_t *)(w + 2);
        float s = 0.f;
        for (int j = 0; j < 32; j++) s += q[j] * x[j];
        acc += fp16_to_f32(w) * s;
    }
    return acc;
#endif
}

/* ---- Q4_0: 18-byte blocks {fp16 d, u8 qs[16]}; byte j = element j | element j+16 << 4 ---- */
static float row_q4_0(const uint8_t *w, const float *x, const float *xs, int64_t nb) {
    float off = 0.f;
#ifdef VW
    vf acc = vzero();
    for (int64_t b = 0; b < nb; b++, w += 18, x += 32) {
        PREFETCH(w);
        vf s = vzero();
        for (int j = 0; j < 16; j += VW) {
            vi q = vbytes_u8(w + 2 + j);
            s = vfma(vlo4f(q), vload(x + j), s);
            s = vfma(vhi4f(q), vload(x + 16 + j), s);
        }
        float d = fp16_to_f32(w);
        acc = vfma(vset1(d), s, acc);
        off += d * xs[b];
    }
    return vsum(acc) - 8.f * off;
#else
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++, w += 18, x += 32) {
        float s = 0.f;
        for (int j = 0; j < 16; j++) s += (w[2 + j] & 0x0F) * x[j] + (w[2 + j] >> 4) * x[j + 16];
        float d = fp16_to_f32(w);
        acc += d * s;
        off += d * xs[b];
    }
    return acc - 8.f * off;
#endif
}

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

static float row_q4_k(const uint8_t *w, const float *x, const float *xs, int64_t nsb) {
#ifdef VW
    vf acc = vzero();
    __m256 off = _mm256_setzero_ps();                   /* sum_j dmin mn[j] xs[j], 8 lanes */
    for (int64_t b = 0; b < nsb; b++, w += 144, x += 256, xs += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        PREFETCH(w + 128);
        uint64_t sc, mn;
        scale_min_k4(w + 4, &sc, &mn);
        __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc)));
        __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mn)));
        float dsc[8];                                   /* d * sc[j] */
        _mm256_storeu_ps(dsc, _mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(w)), scf));
        off = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(w + 2)), mnf), _mm256_loadu_ps(xs), off);
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
    __m128 o = _mm_add_ps(_mm256_castps256_ps128(off), _mm256_extractf128_ps(off, 1));
    o = _mm_add_ps(o, _mm_movehl_ps(o, o));
    return vsum(acc) - _mm_cvtss_f32(_mm_add_ss(o, _mm_movehdup_ps(o)));
#else
    float acc = 0.f, off = 0.f;
    for (int64_t b = 0; b < nsb; b++, w += 144, x += 256, xs += 8) {
        uint64_t sc64, mn64;
        scale_min_k4(w + 4, &sc64, &mn64);
        uint8_t sc[8], mn[8];
        memcpy(sc, &sc64, 8);                           /* little-endian: byte j = value j */
        memcpy(mn, &mn64, 8);
        const float d = fp16_to_f32(w), dmin = fp16_to_f32(w + 2);
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
static float row_q5_k(const uint8_t *w, const float *x, const float *xs, int64_t nsb) {
    float acc_s = 0.f, off = 0.f;
#ifdef VW
    vf acc = vzero();
#endif
    for (int64_t b = 0; b < nsb; b++, w += 176, x += 256, xs += 8) {
        PREFETCH(w);
        PREFETCH(w + 64);
        PREFETCH(w + 128);
        uint64_t sc64, mn64;
        scale_min_k4(w + 4, &sc64, &mn64);
        uint8_t sc[8], mn[8];
        memcpy(sc, &sc64, 8);
        memcpy(mn, &mn64, 8);
        const float d = fp16_to_f32(w), dmin = fp16_to_f32(w + 2);
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

/* ---- Q6_K: 210-byte super-blocks {u8 ql[128], u8 qh[64], i8 scales[16], fp16 d}; per half h (128
 * elements, ql + 64 h, qh + 32 h) element 32 g + l (g < 4, l < 32) is (ql[l + 32 (g & 1)] nibble g >> 1
 * | bits 2g..2g+1 of qh[l] << 4) - 32, scaled by d * scales[8 h + 2 g + l / 16] ---- */
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

/* ---- entry points: W rows at w + n * row_stride; y[n] for n in [0, N) ---- */
enum { Q8_0 = 8, Q4_0 = 2, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static int64_t block_elems(int qtype) { return qtype == Q8_0 || qtype == Q4_0 ? 32 : 256; }
static int64_t block_bytes(int qtype) {
    switch (qtype) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_K: return 144;
    case Q5_K: return 176;
    default: return 210;
    }
}

/* Each thread gets at least this many weight bytes (~10 us of streaming): below it a fork /
 * join costs more than it saves, and on a busy machine the join waits for a descheduled
 * thread (measured: 0.6-1 ms per tiny call with 2 threads at load 5 on 2 cores). */
#define MIN_BYTES_PER_THREAD (128 * 1024)

static float row_dot(int qtype, const uint8_t *w, const float *x, const float *xs, int64_t K) {
    switch (qtype) {
    case Q8_0: return row_q8_0(w, x, K / 32);
    case Q4_0: return row_q4_0(w, x, xs, K / 32);
    case Q4_K: return row_q4_k(w, x, xs, K / 256);
    case Q5_K: return row_q5_k(w, x, xs, K / 256);
    default: return row_q6_k(w, x, K / 256);
    }
}

int moetier_supported(int qtype) {
    return qtype == Q8_0 || qtype == Q4_0 || qtype == Q4_K || qtype == Q5_K || qtype == Q6_K;
}

/* M independent matvecs of one type and shape in one parallel region (e.g. the missed
 * experts of a layer): W_m at ws[m], x_m at x + m K, y_m at y + m N.
 * Returns 0, -1 if the type or K is unsupported, -2 if out of memory. */
int moetier_matvec_batch(int qtype, const uint8_t *const *ws, int64_t row_stride, int64_t M,
                         int64_t N, int64_t K, const float *x, float *y, int nthreads) {
    if (!moetier_supported(qtype) || K % block_elems(qtype)) return -1;
    const int64_t nb = K / 32;
    float stack_xs[1024], *xs = M * nb <= 1024 ? stack_xs : malloc(sizeof(float) * M * nb);
    if (!xs) return -2;
    for (int64_t m = 0; m < M; m++) block_sums(x + m * K, K, xs + m * nb);
    const int64_t bytes = M * N * (K / block_elems(qtype)) * block_bytes(qtype);
    if (nthreads > 1 + bytes / MIN_BYTES_PER_THREAD) nthreads = (int)(1 + bytes / MIN_BYTES_PER_THREAD);
    #pragma omp parallel for schedule(dynamic, 32) num_threads(nthreads)
    for (int64_t i = 0; i < M * N; i++) {
        int64_t m = i / N, n = i % N;
        y[i] = row_dot(qtype, ws[m] + n * row_stride, x + m * K, xs + m * nb, K);
    }
    if (xs != stack_xs) free(xs);
    return 0;
}

/* One matvec: W at w. */
int moetier_matvec(int qtype, const uint8_t *w, int64_t row_stride, int64_t N, int64_t K,
                   const float *x, float *y, int nthreads) {
    const uint8_t *ws[1] = {w};
    return moetier_matvec_batch(qtype, ws, row_stride, 1, N, K, x, y, nthreads);
}

/* Sum of n floats (n a multiple of 64) with `nthreads` threads: a pure streaming read, used
 * to measure the RAM read bandwidth the kernels above are compared against. */
float moetier_sum_f32(const float *a, int64_t n, int nthreads) {
    float total = 0.f;
    #pragma omp parallel for schedule(static) reduction(+ : total) num_threads(nthreads)
    for (int64_t i = 0; i < n / 64; i++) {
        const float *p = a + 64 * i;
#ifdef VW
        vf s0 = vload(p), s1 = vload(p + VW);
        for (int j = 2 * VW; j < 64; j += 2 * VW) { s0 = vadd(s0, vload(p + j)); s1 = vadd(s1, vload(p + j + VW)); }
        total += vsum(vadd(s0, s1));
#else
        float s[8] = {0};
        for (int j = 0; j < 64; j++) s[j % 8] += p[j];
        total += s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
#endif
    }
    return total;
}

/* ---- one MoE layer for T tokens in one call (decode): y[t] = sum_j w[t, j] down_e(silu(gate_e x_t) * up_e x_t),
 * e = ids[t, j]. gate / up: expert e's rows at gate + e * g_estride (row r at + r * g_rstride), down likewise.
 * q8: Q4_0 / Q8_0 rows dot an int8 copy of the activations (llama.cpp's Q8_0 for x: integer dot products,
 * per-32 scales); else float activations as moetier_matvec. Its own names: doorbell.c has private twins. ---- */
#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#define MOE_Q8 1
/* x [K] -> qx [K] int8, dx [K/32] scales, sx [K/32] dx times the sum of qx per block (Q4_0's offset) */
static void moe_quantize_q8(const float *x, int64_t K, int8_t *qx, float *dx, float *sx) {
    for (int64_t b = 0; b < K / 32; b++) {
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[32 * b + j]));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) {
            int q = (int)lrintf(x[32 * b + j] * id);
            qx[32 * b + j] = (int8_t)q;
            sum += q;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
    }
}

static inline __m256i moe_dot_u8s8(__m256i a, __m256i b) {     /* 8 int32 partial sums of a (u8) * b (s8) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

static inline float moe_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Q4_0 row . q8 x: sum_b d_b (dx_b sum_j nib_j qx_j - 8 sx_b) */
static float moe_row_q4_0_q8(const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f;
    const __m256i lo = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++, w += 18, qx += 32) {
        const __m128i t = _mm_loadu_si128((const __m128i *)(w + 2));
        const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), lo);
        const __m256i p = moe_dot_u8s8(nib, _mm256_loadu_si256((const __m256i *)qx));
        const float d = fp16_to_f32(w);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx[b]), acc);
        off += d * sx[b];
    }
    return moe_hsum8(acc) - 8.f * off;
}

/* Q8_0 row . q8 x (signed x signed through the sign trick) */
static float moe_row_q8_0_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 34, qx += 32) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2));
        const __m256i y = _mm256_loadu_si256((const __m256i *)qx);
        const __m256i p = moe_dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(fp16_to_f32(w) * dx[b]), acc);
    }
    return moe_hsum8(acc);
}

/* 4 rows (at w + r * rs) . q8 x at once: 4 independent accumulator chains (one row is latency-bound) */
static void moe_rows4_q8(int qtype, const uint8_t *w, int64_t rs, const int8_t *qx, const float *dx,
                         const float *sx, int64_t nb, float *out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float off[4] = {0.f, 0.f, 0.f, 0.f};
    const __m256i lo = _mm256_set1_epi8(0x0F);
    const int64_t bb = qtype == Q4_0 ? 18 : 34;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i y = _mm256_loadu_si256((const __m256i *)(qx + 32 * b));
        for (int r = 0; r < 4; r++) {
            const uint8_t *wb = w + r * rs + b * bb;
            PREFETCH(wb);
            const float d = fp16_to_f32(wb), s = d * dx[b];
            __m256i p;
            if (qtype == Q4_0) {
                const __m128i t = _mm_loadu_si128((const __m128i *)(wb + 2));
                p = moe_dot_u8s8(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), lo), y);
                off[r] += d * sx[b];
            } else {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(wb + 2));
                p = moe_dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = moe_hsum8(acc[r]) - 8.f * off[r];
}
#endif

/* an activation vector in every form a row kernel may read */
typedef struct { const float *x, *xs; const int8_t *qx; const float *dx, *sx; int q8; } moe_vec;

static void moe_vec_fill(moe_vec *v, int qtype, const float *x, int64_t K, float *xs, int8_t *qx, float *dx,
                         float *sx, int q8) {
    v->x = x;
    v->xs = xs;
    v->qx = qx;
    v->dx = dx;
    v->sx = sx;
    v->q8 = 0;
#ifdef MOE_Q8
    if (q8 && (qtype == Q4_0 || qtype == Q8_0)) {
        moe_quantize_q8(x, K, qx, dx, sx);
        v->q8 = 1;
        return;
    }
#else
    (void)qx; (void)dx; (void)sx; (void)q8;
#endif
    block_sums(x, K, xs);
}

static inline float moe_row(int qtype, const uint8_t *w, const moe_vec *v, int64_t K) {
#ifdef MOE_Q8
    if (v->q8) return qtype == Q4_0 ? moe_row_q4_0_q8(w, v->qx, v->dx, v->sx, K / 32)
                                    : moe_row_q8_0_q8(w, v->qx, v->dx, K / 32);
#endif
    return row_dot(qtype, w, v->x, v->xs, K);
}

/* rows per call of moe_rows over n rows: 4 with int8 activations (n a multiple of 4), else 1 */
static inline int64_t moe_step(const moe_vec *v, int64_t n) { return v->q8 && n % 4 == 0 ? 4 : 1; }

/* out[0 .. n) = rows w + i * rs (i < n <= 4) . v */
static inline void moe_rows(int qtype, const uint8_t *w, int64_t rs, int64_t n, const moe_vec *v, int64_t K,
                            float *out) {
#ifdef MOE_Q8
    if (n == 4 && v->q8) { moe_rows4_q8(qtype, w, rs, v->qx, v->dx, v->sx, K / 32, out); return; }
#endif
    for (int64_t i = 0; i < n; i++) out[i] = moe_row(qtype, w + i * rs, v, K);
}

/* Returns 0, -1 for an unsupported type / shape / expert id, -2 if out of memory. */
int moetier_moe_tokens(int gq, int dq, const uint8_t *gate, const uint8_t *up, int64_t g_estride, int64_t g_rstride,
                       const uint8_t *down, int64_t d_estride, int64_t d_rstride, int64_t E, int64_t D, int64_t I,
                       int64_t T, int64_t k, const int64_t *ids, const float *w, const float *x, float *y,
                       int q8, int nthreads) {
    if (!moetier_supported(gq) || !moetier_supported(dq) || D % block_elems(gq) || I % block_elems(dq)) return -1;
    for (int64_t i = 0; i < T * k; i++)
        if (ids[i] < 0 || ids[i] >= E) return -1;
    /* scratch: h [k, 2I] floats, x sums [D/32], h sums [k, I/32], int8 copies and their scales / sums */
    const int64_t nf = k * 2 * I + D / 32 + k * (I / 32) + D / 32 + k * (I / 32);
    char *mem = malloc(sizeof(float) * nf + sizeof(int32_t) * (D / 32 + k * (I / 32)) + D + k * I + 64);
    if (!mem) return -2;
    float *h = (float *)mem, *xs = h + k * 2 * I, *hs = xs + D / 32, *dx = hs + k * (I / 32), *dh = dx + D / 32;
    float *sx = dh + k * (I / 32), *sh = sx + D / 32;
    int8_t *qx = (int8_t *)(sh + k * (I / 32)), *qh = qx + D;
    const int64_t gbytes = 2 * k * I * (D / block_elems(gq)) * block_bytes(gq);
    const int64_t dbytes = k * D * (I / block_elems(dq)) * block_bytes(dq);
    if (nthreads > 1 + (gbytes + dbytes) / MIN_BYTES_PER_THREAD) nthreads = (int)(1 + (gbytes + dbytes) / MIN_BYTES_PER_THREAD);
    for (int64_t t = 0; t < T; t++) {
        const int64_t *e = ids + t * k;
        moe_vec vx;
        moe_vec_fill(&vx, gq, x + t * D, D, xs, qx, dx, sx, q8);
        /* rows r < k I: gate of pair r / I; the rest: up */
        const int64_t step = moe_step(&vx, I);       /* rows per task: 4 share x loads (q8) */
        #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
        for (int64_t r = 0; r < 2 * k * I; r += step) {
            const int64_t j = (r / I) % k, row = r % I;
            const uint8_t *base = r < k * I ? gate : up;
            moe_rows(gq, base + e[j] * g_estride + row * g_rstride, g_rstride, step, &vx, D, h + r);
        }
        moe_vec vh[k > 0 ? k : 1];
        for (int64_t j = 0; j < k; j++) {
            float *a = h + j * I;                         /* silu(gate) * up, in place of the gates */
            const float *u = h + k * I + j * I;
            for (int64_t i = 0; i < I; i++) a[i] = a[i] / (1.f + expf(-a[i])) * u[i];
            moe_vec_fill(&vh[j], dq, a, I, hs + j * (I / 32), qh + j * I, dh + j * (I / 32), sh + j * (I / 32), q8);
        }
        float *yt = y + t * D;
        const float *wt = w + t * k;
        const int64_t dstep = moe_step(&vh[0], D);
        #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
        for (int64_t d = 0; d < D; d += dstep) {
            float s[4] = {0.f, 0.f, 0.f, 0.f}, r[4];
            for (int64_t j = 0; j < k; j++) {
                moe_rows(dq, down + e[j] * d_estride + d * d_rstride, d_rstride, dstep, &vh[j], I, r);
                for (int64_t i = 0; i < dstep; i++) s[i] += wt[j] * r[i];
            }
            for (int64_t i = 0; i < dstep; i++) yt[d + i] = s[i];
        }
    }
    free(mem);
    return 0;
}

/* y[N] = W[N, K] @ x[K] for Q4_0 / Q8_0 W with x rounded to int8 per 32 values (llama.cpp's Q8_0
 * activations; ~1% relative error): integer dot products. Other types: as moetier_matvec.
 * Returns 0, -1 for an unsupported type / K, -2 if out of memory. */
int moetier_matvec_q8(int qtype, const uint8_t *w, int64_t row_stride, int64_t N, int64_t K,
                      const float *x, float *y, int nthreads) {
#ifdef MOE_Q8
    if (qtype != Q4_0 && qtype != Q8_0) return moetier_matvec(qtype, w, row_stride, N, K, x, y, nthreads);
    if (K % 32) return -1;
    char *mem = malloc((sizeof(float) + sizeof(int32_t)) * (K / 32) + K + 64);
    if (!mem) return -2;
    float *dx = (float *)mem;
    float *sx = dx + K / 32;
    int8_t *qx = (int8_t *)(sx + K / 32);
    moe_quantize_q8(x, K, qx, dx, sx);
    const int64_t bytes = N * (K / 32) * block_bytes(qtype);
    if (nthreads > 1 + bytes / MIN_BYTES_PER_THREAD) nthreads = (int)(1 + bytes / MIN_BYTES_PER_THREAD);
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n += 4) {
        if (n + 4 <= N) { moe_rows4_q8(qtype, w + n * row_stride, row_stride, qx, dx, sx, K / 32, y + n); continue; }
        for (int64_t r = n; r < N; r++)
            y[r] = qtype == Q4_0 ? moe_row_q4_0_q8(w + r * row_stride, qx, dx, sx, K / 32)
                                 : moe_row_q8_0_q8(w + r * row_stride, qx, dx, K / 32);
    }
    free(mem);
    return 0;
#else
    return moetier_matvec(qtype, w, row_stride, N, K, x, y, nthreads);
#endif
}

/* Rows of GGML blocks -> float32, bit-exact with the torch dequantizer (one multiply per value):
 * the CPU prefill dequantizes each used expert once per call. Q8_0, Q4_0. 0, or -1 (type / K). */
int moetier_dequant(int qtype, const uint8_t *w, int64_t row_stride, int64_t N, int64_t K, float *out,
                    int nthreads) {
    if ((qtype != Q8_0 && qtype != Q4_0) || K % 32) return -1;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *r = w + n * row_stride;
        float *o = out + n * K;
        for (int64_t b = 0; b < K / 32; b++, o += 32) {
            if (qtype == Q8_0) {
                const uint8_t *blk = r + 34 * b;
                const float d = fp16_to_f32(blk);
                for (int j = 0; j < 32; j++) o[j] = d * (float)(int8_t)blk[2 + j];
            } else {
                const uint8_t *blk = r + 18 * b;
                const float d = fp16_to_f32(blk);
                for (int j = 0; j < 16; j++) {
                    o[j] = d * (float)((blk[2 + j] & 0x0F) - 8);
                    o[j + 16] = d * (float)((blk[2 + j] >> 4) - 8);
                }
            }
        }
    }
    return 0;
}
