/* Quantized matvec y[N] = W[N, K] @ x[K] straight from GGML blocks (moetier/kernels/cpu.py).
 *
 * Built on first use with the system C compiler (-O3 -march=native -fopenmp) and called
 * through ctypes, which releases the GIL. Rows are split over OpenMP threads; each row is
 * one pass over its blocks, so weight bytes are read exactly once (streaming).
 * Offsets (-8 for Q4_0, -min for Q4_K / Q5_K) are folded out with per-block sums of x:
 *   sum_j d (q_j - 8) x_j = d (sum_j q_j x_j - 8 sum_j x_j).
 * Accumulation is float32; results match dequantize-then-matmul to float32 rounding.
 * One compile unit in four files: this one (vocabulary, Q8_0 / Q4_0, entry points, dequantizer),
 * cpu_kquants.c (Q2_K / Q3_K / Q4_K / Q5_K / Q6_K), cpu_iquants.c (MXFP4 / IQ3_XXS, tables from the generated
 * cpu_iq_tables.h), cpu_iq2.c (IQ2_XXS / IQ2_XS / IQ2_S) and cpu_moe.c (one MoE layer per call, int8 activations),
 * each #included here, as are
 * cpu_grouped.c (the prefill's expert-major tiles) and cpu_small.c (a decode token's attention and router).
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

/* 256-bit u8 x s8 dot products without maddubs' int16 saturation: AVX-512 VNNI's (EVEX) or AVX-VNNI's (VEX: Intel
 * 12th-generation and later client CPUs, which have no AVX-512) vpdpbusd; VNNI256 gates every path that needs it */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI256 1
#define DPBUSD256(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define VNNI256 1
#define DPBUSD256(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#else
#define VNNI256 0
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline float hsum8(__m256 v) {                /* sum of 8 float lanes */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
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
#ifndef PREFETCH_AHEAD                  /* MOETIER_PREFETCH_AHEAD=N at build time (kernels.cpu.build_library): A/B only */
#define PREFETCH_AHEAD 4096
#endif
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

/* ---- Q5_1: 24-byte blocks {fp16 d, fp16 m, u32 qh, u8 qs[16]}; q_j = nibble j (as Q4_0) | bit j of qh << 4,
 * value d q + m (llama.cpp's K-quant mixes store rows not a multiple of 256 as Q5_1 in Q5_K_M) ---- */
static float row_q5_1(const uint8_t *w, const float *x, const float *xs, int64_t nb) {
    float acc = 0.f, off = 0.f;
    for (int64_t b = 0; b < nb; b++, w += 24, x += 32) {
        PREFETCH(w);
        uint32_t qh;
        memcpy(&qh, w + 4, 4);
        float s = 0.f;
        for (int j = 0; j < 16; j++)
            s += (float)((w[8 + j] & 0x0F) | ((qh >> j) & 1) << 4) * x[j]
                 + (float)((w[8 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) * x[j + 16];
        acc += fp16_to_f32(w) * s;
        off += fp16_to_f32(w + 2) * xs[b];
    }
    return acc + off;
}

static void dequant_q5_1(const uint8_t *blk, float *o) {
    const float d = fp16_to_f32(blk), m = fp16_to_f32(blk + 2);
    uint32_t qh;
    memcpy(&qh, blk + 4, 4);
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)((blk[8 + j] & 0x0F) | ((qh >> j) & 1) << 4) + m;
        o[j + 16] = d * (float)((blk[8 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
    }
}

/* ---- IQ4_XS: 136-byte super-blocks of 256 {fp16 d, u16 scales_h, u8 scales_l[4], u8 qs[128]}; sub-block ib (32
 * values) has the 6-bit scale ls = scales_l nibble ib | 2 bits of scales_h << 4 and the nibble layout of Q4_0, value
 * d (ls - 32) iq4nl[q] (llama.cpp's non-linear 4-bit codebook) ---- */
static const int8_t iq4nl_values[16] __attribute__((aligned(16))) = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13,
                                                                     25, 38, 53, 69, 89, 113};

static inline float iq4_xs_scale(const uint8_t *w, int ib) {        /* d (ls - 32) of sub-block ib */
    uint16_t sh;
    memcpy(&sh, w + 2, 2);
    return fp16_to_f32(w) * (float)((((w[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4)) - 32);
}

/* IQ4_NL: 18-byte blocks of 32 {fp16 d, u8 qs[16]} (IQ4_XS's sub-block with its own scale; llama.cpp's fallback for
 * IQ4_XS rows not a multiple of 256) */
static float row_iq4_nl(const uint8_t *w, const float *x, int64_t nb) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++, w += 18, x += 32) {
        PREFETCH(w);
        float s = 0.f;
        for (int j = 0; j < 16; j++) s += iq4nl_values[w[2 + j] & 0x0F] * x[j] + iq4nl_values[w[2 + j] >> 4] * x[j + 16];
        acc += fp16_to_f32(w) * s;
    }
    return acc;
}

static float row_iq4_xs(const uint8_t *w, const float *x, int64_t nsb) {
    float acc = 0.f;
    for (int64_t b = 0; b < nsb; b++, w += 136) {
        PREFETCH(w);
        for (int ib = 0; ib < 8; ib++, x += 32) {
            const uint8_t *q = w + 8 + 16 * ib;
            float s = 0.f;
            for (int j = 0; j < 16; j++) s += iq4nl_values[q[j] & 0x0F] * x[j] + iq4nl_values[q[j] >> 4] * x[j + 16];
            acc += iq4_xs_scale(w, ib) * s;
        }
    }
    return acc;
}

static void dequant_iq4_nl(const uint8_t *blk, float *o) {
    const float d = fp16_to_f32(blk);
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)iq4nl_values[blk[2 + j] & 0x0F];
        o[j + 16] = d * (float)iq4nl_values[blk[2 + j] >> 4];
    }
}

/* SIMD: the same products dl * (float)iq4nl_values[nibble], the nibble's value through a 16-entry float permute
 * (AVX-512) or an int8 byte shuffle (AVX2) */
static void dequant_iq4_xs(const uint8_t *blk, float *o) {
#if defined(VW) && VW == 16
    const __m512 values = _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
#elif defined(VW)
    const __m128i values = _mm_load_si128((const __m128i *)iq4nl_values), m4 = _mm_set1_epi8(0x0F);
#endif
    for (int ib = 0; ib < 8; ib++, o += 32) {
        const float dl = iq4_xs_scale(blk, ib);
        const uint8_t *q = blk + 8 + 16 * ib;
#if defined(VW) && VW == 16
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));   /* permutexvar reads bits 0-3 */
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_set1_ps(dl), _mm512_permutexvar_ps(b, values)));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_set1_ps(dl), _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values)));
#elif defined(VW)
        const __m128i b = _mm_loadu_si128((const __m128i *)q);
        const __m128i lo = _mm_shuffle_epi8(values, _mm_and_si128(b, m4)), hi = _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(b, 4), m4));
        const __m256 vd = _mm256_set1_ps(dl);
        _mm256_storeu_ps(o, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo))));
        _mm256_storeu_ps(o + 8, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
        _mm256_storeu_ps(o + 16, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))));
        _mm256_storeu_ps(o + 24, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
#else
        for (int j = 0; j < 16; j++) {
            o[j] = dl * (float)iq4nl_values[q[j] & 0x0F];
            o[j + 16] = dl * (float)iq4nl_values[q[j] >> 4];
        }
#endif
    }
}

#include "cpu_kquants.c"
#include "cpu_iquants.c"
#include "cpu_iq2.c"

/* ---- 16-bit float rows (GGML F16 / BF16): dense weights whose float32 values are exactly 16-bit floats (a bf16
 * checkpoint run in float32) multiply on their 16-bit copy, half the bytes (cpu_compile._quantized_copies) ---- */
enum { F32 = 0, F16 = 1, BF16 = 30 };
static int half_type(int qtype) { return qtype == F16 || qtype == BF16; }

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

/* ---- entry points: W rows at w + n * row_stride; y[n] for n in [0, N). Type ids: GGML's ---- */
enum { Q4_0 = 2, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ2_XXS = 16,
       IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29,
       MXFP4 = 39 };

int moetier_supported(int qtype) {
    switch (qtype) {
    case Q8_0: case Q4_0: case Q5_1: case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: case IQ3_XXS:
    case IQ4_NL: case IQ4_XS: case MXFP4: case IQ2_XXS: case IQ2_XS: case IQ2_S: case IQ3_S: case IQ1_S:
    case IQ1_M: return 1;
    default: return 0;
    }
}

static int64_t block_elems(int qtype) {
    return qtype == Q8_0 || qtype == Q4_0 || qtype == Q5_1 || qtype == IQ4_NL || qtype == MXFP4 || half_type(qtype)
        ? 32 : 256;
}
static int64_t block_bytes(int qtype) {
    switch (qtype) {
    case F16: case BF16: return 64;         /* 32 16-bit values: the unit moe_tokens' x sums need */
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q5_1: return 24;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case IQ3_XXS: return 98;
    case IQ2_XXS: return 66;
    case IQ2_XS: return 74;
    case IQ2_S: return 82;
    case IQ3_S: return 110;
    case IQ1_S: return 50;
    case IQ1_M: return 56;
    case IQ4_XS: return 136;
    case IQ4_NL: return 18;
    case MXFP4: return 17;
    default: return 0;
    }
}

/* Bytes of a row of K values of `qtype` (a GGML id, or 0x100 | id: the rows interleaved by 8 take as many); -1 for a
 * type the kernels do not read or K not a whole number of its blocks. The torch op's shape check (cpu_ops.cpp). */
int64_t moetier_row_bytes(int qtype, int64_t K) {
    if (half_type(qtype)) return 2 * K;
    const int base = qtype >= 0x100 ? qtype & 0xFF : qtype;
    if (!moetier_supported(base) || K % block_elems(base)) return -1;
    return K / block_elems(base) * block_bytes(base);
}

/* Each thread gets at least this many weight bytes (~10 us of streaming): below it a fork /
 * join costs more than it saves, and on a busy machine the join waits for a descheduled
 * thread (measured: 0.6-1 ms per tiny call with 2 threads at load 5 on 2 cores). */
#define MIN_BYTES_PER_THREAD (128 * 1024)

static float row_dot(int qtype, const uint8_t *w, const float *x, const float *xs, int64_t K) {
    switch (qtype) {
    case Q8_0: return row_q8_0(w, x, K / 32);
    case Q4_0: return row_q4_0(w, x, xs, K / 32);
    case Q5_1: return row_q5_1(w, x, xs, K / 32);
    case Q2_K: return row_q2_k(w, x, K / 256);
    case Q3_K: return row_q3_k(w, x, K / 256);
    case Q4_K: return row_q4_k(w, x, xs, K / 256);
    case Q5_K: return row_q5_k(w, x, xs, K / 256);
    case Q6_K: return row_q6_k(w, x, K / 256);
    case IQ3_XXS: return row_iq3_xxs(w, x, K / 256);
    case IQ2_XXS: return row_iq2_xxs(w, x, K / 256);
    case IQ2_XS: return row_iq2_xs(w, x, K / 256);
    case IQ2_S: return row_iq2_s(w, x, K / 256);
    case IQ3_S: return row_iq3_s(w, x, K / 256);
    case IQ1_S: return row_iq1_s(w, x, K / 256);
    case IQ1_M: return row_iq1_m(w, x, K / 256);
    case IQ4_XS: return row_iq4_xs(w, x, K / 256);
    case IQ4_NL: return row_iq4_nl(w, x, K / 32);
    case MXFP4: return row_mxfp4(w, x, K / 32);
    default: return 0.f;        /* unreachable: callers check moetier_supported */
    }
}

/* M independent matvecs of one type and shape in one parallel region (e.g. the missed
 * experts of a layer): W_m at ws[m], x_m at x + m K, y_m at y + m N.
 * Returns 0, -1 if the type or K is unsupported, -2 if out of memory. */
int moetier_matvec_batch(int qtype, const uint8_t *const *ws, int64_t row_stride, int64_t M,
                         int64_t N, int64_t K, const float *x, float *y, int nthreads) {
    if (half_type(qtype)) {               /* 16-bit float rows: float32 products, no block sums */
        const int64_t bytes = M * N * K * 2;
        if (nthreads > 1 + bytes / MIN_BYTES_PER_THREAD) nthreads = (int)(1 + bytes / MIN_BYTES_PER_THREAD);
        #pragma omp parallel for schedule(dynamic, 32) num_threads(nthreads)
        for (int64_t i = 0; i < M * N; i++)
            y[i] = row_half(qtype == BF16, (const uint16_t *)(ws[i / N] + (i % N) * row_stride), x + i / N * K, K);
        return 0;
    }
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

static void dequant_q8_0(const uint8_t *blk, float *o) {
    const float d = fp16_to_f32(blk);
    for (int j = 0; j < 32; j++) o[j] = d * (float)(int8_t)blk[2 + j];
}

static void dequant_q4_0(const uint8_t *blk, float *o) {
    const float d = fp16_to_f32(blk);
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)((blk[2 + j] & 0x0F) - 8);
        o[j + 16] = d * (float)((blk[2 + j] >> 4) - 8);
    }
}

static void dequant_row(int qtype, const uint8_t *r, float *o, int64_t K) {   /* each loop inlines its block */
    switch (qtype) {
    case Q8_0: for (int64_t b = 0; b < K / 32; b++) dequant_q8_0(r + 34 * b, o + 32 * b); break;
    case Q4_0: for (int64_t b = 0; b < K / 32; b++) dequant_q4_0(r + 18 * b, o + 32 * b); break;
    case Q5_1: for (int64_t b = 0; b < K / 32; b++) dequant_q5_1(r + 24 * b, o + 32 * b); break;
    case MXFP4: for (int64_t b = 0; b < K / 32; b++) dequant_mxfp4(r + 17 * b, o + 32 * b); break;
    case IQ3_XXS: for (int64_t b = 0; b < K / 256; b++) dequant_iq3_xxs(r + 98 * b, o + 256 * b); break;
    case IQ2_XXS: for (int64_t b = 0; b < K / 256; b++) dequant_iq2_xxs(r + 66 * b, o + 256 * b); break;
    case IQ2_XS: for (int64_t b = 0; b < K / 256; b++) dequant_iq2_xs(r + 74 * b, o + 256 * b); break;
    case IQ2_S: for (int64_t b = 0; b < K / 256; b++) dequant_iq2_s(r + 82 * b, o + 256 * b); break;
    case IQ3_S: for (int64_t b = 0; b < K / 256; b++) dequant_iq3_s(r + 110 * b, o + 256 * b); break;
    case IQ1_S: for (int64_t b = 0; b < K / 256; b++) dequant_iq1_s(r + 50 * b, o + 256 * b); break;
    case IQ1_M: for (int64_t b = 0; b < K / 256; b++) dequant_iq1_m(r + 56 * b, o + 256 * b); break;
    case IQ4_XS: for (int64_t b = 0; b < K / 256; b++) dequant_iq4_xs(r + 136 * b, o + 256 * b); break;
    case IQ4_NL: for (int64_t b = 0; b < K / 32; b++) dequant_iq4_nl(r + 18 * b, o + 32 * b); break;
    case Q2_K: for (int64_t b = 0; b < K / 256; b++) dequant_q2_k(r + 84 * b, o + 256 * b); break;
    case Q3_K: for (int64_t b = 0; b < K / 256; b++) dequant_q3_k(r + 110 * b, o + 256 * b); break;
    case Q4_K: for (int64_t b = 0; b < K / 256; b++) dequant_q45_k(r + 144 * b, o + 256 * b, 0); break;
    case Q5_K: for (int64_t b = 0; b < K / 256; b++) dequant_q45_k(r + 176 * b, o + 256 * b, 1); break;
    case Q6_K: for (int64_t b = 0; b < K / 256; b++) dequant_q6_k(r + 210 * b, o + 256 * b); break;
    case F16: for (int64_t k = 0; k < K; k++) o[k] = fp16_to_f32(r + 2 * k); break;
    case BF16:
        for (int64_t k = 0; k < K; k++) {
            uint16_t h;
            memcpy(&h, r + 2 * k, 2);
            const uint32_t u = (uint32_t)h << 16;
            memcpy(o + k, &u, 4);
        }
        break;
    default: break;
    }
}

/* Rows of GGML blocks -> float32, bit-exact with the torch dequantizer (one multiply per value):
 * the CPU prefill dequantizes each used expert once per call. Every FAST_TYPES format and F16 / BF16
 * (kernels.cpu.DEQUANT_TYPES).
 * 0, or -1 (type / K). */
static int dequant_ok(int qtype, int64_t K) {
    return !((qtype != Q8_0 && qtype != Q4_0 && qtype != MXFP4 && qtype != IQ3_XXS && qtype != IQ3_S && qtype != Q2_K
         && qtype != Q3_K && qtype != Q4_K && qtype != Q5_K && qtype != Q6_K && qtype != IQ2_XXS && qtype != IQ2_XS
         && qtype != IQ2_S && qtype != IQ1_S && qtype != IQ1_M && qtype != IQ4_XS && qtype != Q5_1 && qtype != IQ4_NL
         && !half_type(qtype))
        || K % block_elems(qtype));
}

int moetier_dequant(int qtype, const uint8_t *w, int64_t row_stride, int64_t N, int64_t K, float *out,
                    int nthreads) {
    if (!dequant_ok(qtype, K)) return -1;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) dequant_row(qtype, w + n * row_stride, out + n * K, K);
    return 0;
}

/* Rows `tokens` [T] of a table of V GGML rows (K values each) -> out [T, K] float32, as moetier_dequant: the CPU's
 * token embeddings kept in their blocks (models.quant_linear.QuantEmbedding). 0, -1 (type / K), -3 (a token outside
 * [0, V)). */
int moetier_embed_rows(int qtype, const uint8_t *w, int64_t row_stride, int64_t V, int64_t K, const int64_t *tokens,
                       int64_t T, float *out, int nthreads) {
    if (!dequant_ok(qtype, K)) return -1;
    for (int64_t t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= V) return -3;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 16)
    for (int64_t t = 0; t < T; t++) dequant_row(qtype, w + tokens[t] * row_stride, out + t * K, K);
    return 0;
}

#include "cpu_moe.c"
#include "cpu_grouped.c"
#include "cpu_small.c"
