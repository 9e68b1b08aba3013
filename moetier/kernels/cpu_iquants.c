/* Codebook row kernels (MXFP4, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) and their block dequantizers: part of cpu_kernels.c, which
 * #includes this file after its SIMD vocabulary, fp16_to_f32 and PREFETCH; not compiled on its own.
 * The value tables come from cpu_iq_tables.h, which kernels/cpu.py writes at build time from
 * moetier.quant.iquants (gguf-py's tables): mxfp4_values[16] (int8; and as float32), iq3xxs_grid[256][4],
 * iq3s_grid[512][4], iq1s_grid[2048][8], iq_ksigns[128]
 * and iq_sign_bits[128][8] (iq_ksigns expanded to float sign-bit masks for the SIMD path).
 * Float activations; the per-block scale multiplies each block's partial sum, as the K-quants. */
#include "cpu_iq_tables.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define IQ_AVX2 1
/* the low 8 int8 lanes of v as 8 floats */
static inline __m256 i8_to_f32(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
#endif

/* ---- MXFP4: 17-byte blocks {u8 e (E8M0), u8 qs[16]}; byte j = element j | element j+16 << 4; value =
 * 2^(e-128) * mxfp4_values[nibble] (the table holds doubled E2M1 values, hence the halved scale) ---- */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;    /* e < 2: subnormal */
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float row_mxfp4(const uint8_t *w, const float *x, int64_t nb) {
#if defined(VW) && VW == 16
    /* 16 nibbles -> floats through one 16-entry permute of the value table (as vnib) */
    const __m512 values = _mm512_load_ps(mxfp4_values_f32);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 17, x += 32) {
        PREFETCH(w);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 1)));
        __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(q, values), _mm512_loadu_ps(x));
        s = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), values), _mm512_loadu_ps(x + 16), s);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(e8m0_half(w[0])), s, acc);
    }
    return _mm512_reduce_add_ps(acc);
#elif defined(IQ_AVX2)
    const __m128i values = _mm_loadu_si128((const __m128i *)mxfp4_values), m4 = _mm_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 17, x += 32) {
        PREFETCH(w);
        const __m128i q = _mm_loadu_si128((const __m128i *)(w + 1));
        const __m128i lo = _mm_shuffle_epi8(values, _mm_and_si128(q, m4));                    /* elements 0-15 */
        const __m128i hi = _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(q, 4), m4)); /* 16-31 */
        __m256 s0 = _mm256_mul_ps(i8_to_f32(lo), _mm256_loadu_ps(x));
        __m256 s1 = _mm256_mul_ps(i8_to_f32(hi), _mm256_loadu_ps(x + 16));
        s0 = _mm256_fmadd_ps(i8_to_f32(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(x + 8), s0);
        s1 = _mm256_fmadd_ps(i8_to_f32(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(x + 24), s1);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(e8m0_half(w[0])), _mm256_add_ps(s0, s1), acc);
    }
    return hsum8(acc);
#else
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++, w += 17, x += 32) {
        float s = 0.f;
        for (int j = 0; j < 16; j++) s += mxfp4_values[w[1 + j] & 0x0F] * x[j] + mxfp4_values[w[1 + j] >> 4] * x[j + 16];
        acc += e8m0_half(w[0]) * s;
    }
    return acc;
#endif
}

static void dequant_mxfp4(const uint8_t *blk, float *o) {
    const float d = e8m0_half(blk[0]);
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)mxfp4_values[blk[1 + j] & 0x0F];
        o[j + 16] = d * (float)mxfp4_values[blk[1 + j] >> 4];
    }
}

/* ---- IQ3_XXS: 98-byte super-blocks of 256 {fp16 d, u8 qs[64], u32 aux[8]}; sub-block s (32 elements)
 * reads qs[8 s .. 8 s + 8) (grid rows of 4 values each) and aux[s]: bits 7 l .. 7 l + 6 pick the sign
 * pattern of elements 8 l .. 8 l + 7 (l < 4), bits 28-31 the scale: d * (0.5 + aux >> 28) * 0.5 ---- */
static inline float iq3_xxs_scale(float d, uint32_t aux) { return d * (0.5f + (float)(aux >> 28)) * 0.5f; }

#ifdef IQ_AVX2
/* 8 signed values: grid rows q[0], q[1] with sign pattern `signs` (low 7 bits) */
static inline __m256 iq3_xxs_vals8(const uint8_t *q, uint32_t signs) {
    uint32_t g0, g1;
    memcpy(&g0, iq3xxs_grid[q[0]], 4);
    memcpy(&g1, iq3xxs_grid[q[1]], 4);
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)((uint64_t)g1 << 32 | g0))));
    return _mm256_xor_ps(v, _mm256_load_ps((const float *)iq_sign_bits[signs & 127]));
}
#endif

static float row_iq3_xxs(const uint8_t *w, const float *x, int64_t nsb) {
#ifdef IQ_AVX2
    __m256 acc = _mm256_setzero_ps();
#else
    float acc = 0.f;
#endif
    for (int64_t b = 0; b < nsb; b++, w += 98, x += 256) {
        PREFETCH(w);
        PREFETCH(w + 64);
        const float d = fp16_to_f32(w);
        const uint8_t *qs = w + 2;
        for (int s = 0; s < 8; s++, qs += 8) {
            uint32_t aux;
            memcpy(&aux, w + 66 + 4 * s, 4);
            const float *xs = x + 32 * s;
#ifdef IQ_AVX2
            __m256 s0 = _mm256_mul_ps(iq3_xxs_vals8(qs, aux), _mm256_loadu_ps(xs));
            __m256 s1 = _mm256_mul_ps(iq3_xxs_vals8(qs + 2, aux >> 7), _mm256_loadu_ps(xs + 8));
            s0 = _mm256_fmadd_ps(iq3_xxs_vals8(qs + 4, aux >> 14), _mm256_loadu_ps(xs + 16), s0);
            s1 = _mm256_fmadd_ps(iq3_xxs_vals8(qs + 6, aux >> 21), _mm256_loadu_ps(xs + 24), s1);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(iq3_xxs_scale(d, aux)), _mm256_add_ps(s0, s1), acc);
#else
            float sum = 0.f;
            for (int l = 0; l < 4; l++) {
                const uint8_t signs = iq_ksigns[(aux >> (7 * l)) & 127];
                for (int j = 0; j < 8; j++) {
                    const float v = iq3xxs_grid[qs[2 * l + j / 4]][j % 4];
                    sum += (signs >> j & 1 ? -v : v) * xs[8 * l + j];
                }
            }
            acc += iq3_xxs_scale(d, aux) * sum;
#endif
        }
    }
#ifdef IQ_AVX2
    return hsum8(acc);
#else
    return acc;
#endif
}

/* the SIMD paths multiply db by the signed level (db (-v) = -(db v) exactly, as the scalar's negation) */
static void dequant_iq3_xxs(const uint8_t *blk, float *o) {
    const float d = fp16_to_f32(blk);
    for (int s = 0; s < 8; s++) {
        uint32_t aux;
        memcpy(&aux, blk + 66 + 4 * s, 4);
        const float db = iq3_xxs_scale(d, aux);
        const uint8_t *qs = blk + 2 + 8 * s;
#if defined(VW) && VW == 16
        const __m512 vd = _mm512_set1_ps(db);
        for (int l = 0; l < 4; l += 2) {            /* 16 values: grid rows qs[2 l .. 2 l + 4), sign masks as a k-mask */
            uint32_t g[4];
            for (int i = 0; i < 4; i++) memcpy(g + i, iq3xxs_grid[qs[2 * l + i]], 4);
            const __m512 v = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)g))));
            const __mmask16 neg = (__mmask16)(iq_ksigns[(aux >> (7 * l)) & 127] | iq_ksigns[(aux >> (7 * l + 7)) & 127] << 8);
            _mm512_storeu_si512(o + 32 * s + 8 * l, _mm512_mask_xor_epi32(_mm512_castps_si512(v), neg, _mm512_castps_si512(v),
                                                                          _mm512_set1_epi32((int)0x80000000u)));
        }
#elif defined(IQ_AVX2)
        const __m256 vd = _mm256_set1_ps(db);
        for (int l = 0; l < 4; l++) _mm256_storeu_ps(o + 32 * s + 8 * l, _mm256_mul_ps(vd, iq3_xxs_vals8(qs + 2 * l, aux >> (7 * l))));
#else
        for (int l = 0; l < 4; l++) {
            const uint8_t signs = iq_ksigns[(aux >> (7 * l)) & 127];
            for (int j = 0; j < 8; j++) {
                const float v = db * (float)iq3xxs_grid[blk[2 + 8 * s + 2 * l + j / 4]][j % 4];
                o[32 * s + 8 * l + j] = signs >> j & 1 ? -v : v;
            }
        }
#endif
    }
}

/* ---- IQ3_S: 110-byte super-blocks of 256 {fp16 d, u8 qs[64], u8 qh[8], u8 signs[32], u8 scales[4]}; sub-block s
 * (32 values) reads grid rows qs[8 s + l] | (bit l of qh[s]) << 8 of iq3s_grid (4 odd levels 1..15 each, l < 8),
 * negates value j where bit j % 8 of signs[4 s + j / 8] is set, and scales by d (1 + 2 sc), sc the nibble s % 2 of
 * scales[s / 2] ---- */
static inline float iq3_s_scale(const uint8_t *w, int s) {
    return fp16_to_f32(w) * (float)(1 + 2 * ((w[106 + s / 2] >> (4 * (s % 2))) & 15));
}

static inline uint32_t iq3_s_row(const uint8_t *w, int s, int l) {      /* grid row index of values 4 l .. 4 l + 3 */
    return w[2 + 8 * s + l] | (uint32_t)((w[66 + s] >> l) & 1) << 8;
}

#ifdef IQ_AVX2
/* the 32 unsigned levels of a sub-block (grid rows of qs[0 .. 8) and qh's bits): one gather of 8 u32 (the int8 row's
 * too, cpu_iq_q8.c) */
static inline __m256i iq3_s_grid32(const uint8_t *qs, uint32_t qh) {
    const __m256i hi = _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32((int)qh), _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1)),
                                        _mm256_set1_epi32(0x100));                   /* bit l of qh at bit 8 of lane l */
    const __m256i idx = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs)), hi);
    return _mm256_i32gather_epi32((const int *)iq3s_grid, idx, 4);
}

/* 0xff where a sub-block's sign bit (sg[j / 8] bit j % 8) is set, else 0 */
static inline __m256i iq3_s_neg32(const uint8_t *sg) {
    uint32_t s;
    memcpy(&s, sg, 4);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201LL);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)s),              /* byte j: sign byte j / 8 */
                                               _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

/* sum of 32 int8 weights (v) times x[0 .. 32), in two chains */
static inline __m256 i8x32_dot(__m256i v, const float *x) {
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    __m256 s0 = _mm256_mul_ps(i8_to_f32(lo), _mm256_loadu_ps(x));
    __m256 s1 = _mm256_mul_ps(i8_to_f32(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(x + 8));
    s0 = _mm256_fmadd_ps(i8_to_f32(hi), _mm256_loadu_ps(x + 16), s0);
    s1 = _mm256_fmadd_ps(i8_to_f32(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(x + 24), s1);
    return _mm256_add_ps(s0, s1);
}
#endif

static float row_iq3_s(const uint8_t *w, const float *x, int64_t nsb) {
#ifdef IQ_AVX2
    __m256 acc = _mm256_setzero_ps();
#else
    float acc = 0.f;
#endif
    for (int64_t b = 0; b < nsb; b++, w += 110, x += 256) {
        PREFETCH(w);
        PREFETCH(w + 64);
        for (int s = 0; s < 8; s++) {
            const float *xs = x + 32 * s;
            const uint8_t *sg = w + 74 + 4 * s;
#ifdef IQ_AVX2
            const __m256i neg = iq3_s_neg32(sg), g = iq3_s_grid32(w + 2 + 8 * s, w[66 + s]);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(iq3_s_scale(w, s)), i8x32_dot(_mm256_sub_epi8(_mm256_xor_si256(g, neg), neg), xs),
                                  acc);
#else
            float sum = 0.f;
            for (int j = 0; j < 32; j++) {
                const float v = iq3s_grid[iq3_s_row(w, s, j / 4)][j % 4];
                sum += (sg[j / 8] >> (j % 8) & 1 ? -v : v) * xs[j];
            }
            acc += iq3_s_scale(w, s) * sum;
#endif
        }
    }
#ifdef IQ_AVX2
    return hsum8(acc);
#else
    return acc;
#endif
}

/* the SIMD paths multiply db by the signed level (db (-v) = -(db v) exactly, as the scalar's negation) */
static void dequant_iq3_s(const uint8_t *blk, float *o) {
    for (int s = 0; s < 8; s++) {
        const float db = iq3_s_scale(blk, s);
#ifdef IQ_AVX2
        const __m256i neg = iq3_s_neg32(blk + 74 + 4 * s), g = iq3_s_grid32(blk + 2 + 8 * s, blk[66 + s]);
        const __m256i v = _mm256_sub_epi8(_mm256_xor_si256(g, neg), neg);          /* 32 signed int8 levels */
        const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
#if defined(VW) && VW == 16
        const __m512 vd = _mm512_set1_ps(db);
        _mm512_storeu_ps(o + 32 * s, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo))));
        _mm512_storeu_ps(o + 32 * s + 16, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi))));
#else
        const __m256 vd = _mm256_set1_ps(db);
        _mm256_storeu_ps(o + 32 * s, _mm256_mul_ps(vd, i8_to_f32(lo)));
        _mm256_storeu_ps(o + 32 * s + 8, _mm256_mul_ps(vd, i8_to_f32(_mm_srli_si128(lo, 8))));
        _mm256_storeu_ps(o + 32 * s + 16, _mm256_mul_ps(vd, i8_to_f32(hi)));
        _mm256_storeu_ps(o + 32 * s + 24, _mm256_mul_ps(vd, i8_to_f32(_mm_srli_si128(hi, 8))));
#endif
#else
        for (int j = 0; j < 32; j++) {
            const float v = db * (float)iq3s_grid[iq3_s_row(blk, s, j / 4)][j % 4];
            o[32 * s + j] = blk[74 + 4 * s + j / 8] >> (j % 8) & 1 ? -v : v;
        }
#endif
    }
}

/* ---- IQ1_S / IQ1_M: a grid row of iq1s_grid (8 values in -1, 0, 1) per 11-bit index, shifted by delta = +-1/8.
 * iq1_grid8[i | neg << 11]: row i as 8 int8 values 8 v + 1 (8 v - 1 where neg), so value 8 (v + delta) is one byte:
 * the float rows and the int8 ones (cpu_iq_q8.c) read 8 weights per index from it, scaled by 1/8 once. ---- */
static uint64_t iq1_grid8[4096] __attribute__((aligned(64)));

__attribute__((constructor)) static void iq1_grid8_init(void) {
    for (int i = 0; i < 4096; i++) {
        uint64_t r = 0;
        for (int j = 0; j < 8; j++) r |= (uint64_t)(uint8_t)(int8_t)(8 * iq1s_grid[i & 2047][j] + (i >> 11 ? -1 : 1)) << (8 * j);
        iq1_grid8[i] = r;
    }
}

/* IQ1_S: 50-byte super-blocks of 256 {fp16 d, u8 qs[32], u16 qh[8]}; sub-block s (32 values): rows qs[4 s + l] |
 * ((qh[s] >> 3 l) & 7) << 8 (l < 4), delta negative where bit 15 of qh[s] is set, scale d (2 ((qh[s] >> 12) & 7) + 1) */
static inline uint32_t iq1_s_row(uint32_t q, uint32_t h, int l) {    /* iq1_grid8 index: row | delta sign << 11 */
    return q | ((h >> (3 * l)) & 7) << 8 | (h & 0x8000) >> 4;
}

static inline float iq1_s_scale(float d, uint32_t h) { return d * (float)(2 * ((h >> 12) & 7) + 1); }

/* IQ1_M: 56-byte super-blocks of 256 {u8 qs[32], u8 qh[16], u16 sc[4]}; row l of 32 (8 values): qs[l] | (nibble
 * l % 2 of qh[l / 2] & 7) << 8, delta negative where its bit 3 is set (so the nibble << 8 is the iq1_grid8 index's
 * high part); values 16 t .. 16 t + 15 scaled by d (2 ((sc[t / 4] >> 3 (t % 4)) & 7) + 1), d the fp16 whose four
 * nibbles are the top nibbles of sc[0 .. 4) */
static inline float iq1_m_d(const uint8_t *w) {
    uint16_t sc[4];
    memcpy(sc, w + 48, 8);
    const uint16_t h = (uint16_t)(sc[0] >> 12 | (sc[1] >> 8 & 0xF0) | (sc[2] >> 4 & 0xF00) | (sc[3] & 0xF000));
    uint8_t b[2];
    memcpy(b, &h, 2);
    return fp16_to_f32(b);
}

static inline uint32_t iq1_m_row(const uint8_t *w, int l) { return w[l] | (uint32_t)((w[32 + l / 2] >> (4 * (l % 2))) & 15) << 8; }

static inline int iq1_m_ls(const uint8_t *w, int t) {        /* 2 ls + 1 of values 16 t .. 16 t + 15 */
    uint16_t s;
    memcpy(&s, w + 48 + 2 * (t / 4), 2);
    return 2 * ((s >> (3 * (t % 4))) & 7) + 1;
}

/* sum over 8 values of (8 v + delta sign) x, row index r of iq1_grid8 */
static inline float iq1_dot8(uint32_t r, const float *x) {
    const int8_t *v = (const int8_t *)&iq1_grid8[r];
    float s = 0.f;
    for (int j = 0; j < 8; j++) s += (float)v[j] * x[j];
    return s;
}

#ifdef IQ_AVX2
/* iq1_grid8 indices of sub-blocks s, s + 1 (lanes 4 i + l: row l of sub-block s + i); h: lane s = qh[s] */
static inline __m256i iq1_s_idx8(const uint8_t *qs, __m256i h, int s) {
    const __m256i hv = _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(s, s, s, s, s + 1, s + 1, s + 1, s + 1));
    const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 4 * s)));
    const __m256i row = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(hv, _mm256_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9)),
                                                           _mm256_set1_epi32(7)), 8);
    return _mm256_or_si256(_mm256_or_si256(low, row), _mm256_srli_epi32(_mm256_and_si256(hv, _mm256_set1_epi32(0x8000)), 4));
}

/* iq1_grid8 indices of IQ1_M rows 4 s .. 4 s + 7 (sub-blocks s, s + 1): qs | qh nibble << 8 */
static inline __m256i iq1_m_idx8(const uint8_t *w, int s) {
    uint32_t h;
    memcpy(&h, w + 32 + 2 * s, 4);
    return _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 4 * s))),
                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)h),
                                                                                _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                                              _mm256_set1_epi32(15)), 8));
}

/* the 2 x 32 int8 weights of 8 indices (two sub-blocks) */
static inline void iq1_weights64(__m256i idx, __m256i *w0, __m256i *w1) {
    *w0 = _mm256_i32gather_epi64((const long long *)iq1_grid8, _mm256_castsi256_si128(idx), 8);
    *w1 = _mm256_i32gather_epi64((const long long *)iq1_grid8, _mm256_extracti128_si256(idx, 1), 8);
}
#endif

static float row_iq1_s(const uint8_t *w, const float *x, int64_t nsb) {
#ifdef IQ_AVX2
    __m256 acc = _mm256_setzero_ps();
#else
    float acc = 0.f;
#endif
    for (int64_t b = 0; b < nsb; b++, w += 50, x += 256) {
        PREFETCH(w);
        const float d = 0.125f * fp16_to_f32(w);
        for (int s = 0; s < 8; s++) {
            uint16_t h;
            memcpy(&h, w + 34 + 2 * s, 2);
            const uint8_t *q = w + 2 + 4 * s;
            const float *xs = x + 32 * s;
#ifdef IQ_AVX2          /* 4 scalar row loads: 168 us a 768 x 2048 matrix (hot) against 200 through iq1_weights64's gathers */
            const __m256i v = _mm256_set_epi64x((int64_t)iq1_grid8[iq1_s_row(q[3], h, 3)], (int64_t)iq1_grid8[iq1_s_row(q[2], h, 2)],
                                                (int64_t)iq1_grid8[iq1_s_row(q[1], h, 1)], (int64_t)iq1_grid8[iq1_s_row(q[0], h, 0)]);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(iq1_s_scale(d, h)), i8x32_dot(v, xs), acc);
#else
            float sum = 0.f;
            for (int l = 0; l < 4; l++) sum += iq1_dot8(iq1_s_row(q[l], h, l), xs + 8 * l);
            acc += iq1_s_scale(d, h) * sum;
#endif
        }
    }
#ifdef IQ_AVX2
    return hsum8(acc);
#else
    return acc;
#endif
}

static float row_iq1_m(const uint8_t *w, const float *x, int64_t nsb) {
#ifdef IQ_AVX2
    __m256 acc = _mm256_setzero_ps();
#else
    float acc = 0.f;
#endif
    for (int64_t b = 0; b < nsb; b++, w += 56, x += 256) {
        PREFETCH(w);
        const float d = 0.125f * iq1_m_d(w);
#ifdef IQ_AVX2
        for (int s = 0; s < 8; s += 2) {         /* values 32 s .. 32 s + 63: scales 2 s .. 2 s + 3 per 16 */
            __m256i wq[2];
            iq1_weights64(iq1_m_idx8(w, s), wq, wq + 1);
            for (int i = 0; i < 2; i++) {
                const float *xs = x + 32 * (s + i);
                const __m128i lo = _mm256_castsi256_si128(wq[i]), hi = _mm256_extracti128_si256(wq[i], 1);
                const __m256 a = _mm256_fmadd_ps(i8_to_f32(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(xs + 8),
                                                 _mm256_mul_ps(i8_to_f32(lo), _mm256_loadu_ps(xs)));
                const __m256 c = _mm256_fmadd_ps(i8_to_f32(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xs + 24),
                                                 _mm256_mul_ps(i8_to_f32(hi), _mm256_loadu_ps(xs + 16)));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)iq1_m_ls(w, 2 * (s + i))), a, acc);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)iq1_m_ls(w, 2 * (s + i) + 1)), c, acc);
            }
        }
#else
        for (int t = 0; t < 16; t++) {           /* 16 values: rows 2 t, 2 t + 1 */
            const float *xs = x + 16 * t;
            acc += d * (float)iq1_m_ls(w, t) * (iq1_dot8(iq1_m_row(w, 2 * t), xs) + iq1_dot8(iq1_m_row(w, 2 * t + 1), xs + 8));
        }
#endif
    }
#ifdef IQ_AVX2
    return hsum8(acc);
#else
    return acc;
#endif
}

#ifdef IQ_AVX2
/* 16 values dl (v + delta) from 16 int8 8 (v + delta) of iq1_grid8: (8 (v + delta)) / 8 is v + delta exactly, then the
 * scalar's product dl (v + delta) */
#if defined(VW) && VW == 16
static inline void iq1_store16(float *o, float dl, __m128i q) {
    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_set1_ps(dl), _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)),
                                                                         _mm512_set1_ps(0.125f))));
}
#else
static inline void iq1_store16(float *o, float dl, __m128i q) {
    const __m256 vd = _mm256_set1_ps(dl), e = _mm256_set1_ps(0.125f);
    _mm256_storeu_ps(o, _mm256_mul_ps(vd, _mm256_mul_ps(i8_to_f32(q), e)));
    _mm256_storeu_ps(o + 8, _mm256_mul_ps(vd, _mm256_mul_ps(i8_to_f32(_mm_srli_si128(q, 8)), e)));
}
#endif
#endif

/* value dl (v + delta), as gguf-py: dl = d (2 ls + 1), v + delta in float32 (exact) */
static void dequant_iq1_s(const uint8_t *blk, float *o) {
    const float d = fp16_to_f32(blk);
    for (int s = 0; s < 8; s++) {
        uint16_t h;
        memcpy(&h, blk + 34 + 2 * s, 2);
#ifdef IQ_AVX2
        const float dl = iq1_s_scale(d, h);
        const uint8_t *q = blk + 2 + 4 * s;
        iq1_store16(o + 32 * s, dl, _mm_set_epi64x((int64_t)iq1_grid8[iq1_s_row(q[1], h, 1)], (int64_t)iq1_grid8[iq1_s_row(q[0], h, 0)]));
        iq1_store16(o + 32 * s + 16, dl,
                    _mm_set_epi64x((int64_t)iq1_grid8[iq1_s_row(q[3], h, 3)], (int64_t)iq1_grid8[iq1_s_row(q[2], h, 2)]));
#else
        const float dl = iq1_s_scale(d, h), delta = h & 0x8000 ? -0.125f : 0.125f;
        for (int j = 0; j < 32; j++)
            o[32 * s + j] = dl * ((float)iq1s_grid[blk[2 + 4 * s + j / 8] | ((h >> (3 * (j / 8))) & 7) << 8][j % 8] + delta);
#endif
    }
}

static void dequant_iq1_m(const uint8_t *blk, float *o) {
    const float d = iq1_m_d(blk);
#ifdef IQ_AVX2
    for (int t = 0; t < 16; t++)                 /* 16 values: rows 2 t, 2 t + 1 */
        iq1_store16(o + 16 * t, d * (float)iq1_m_ls(blk, t),
                    _mm_set_epi64x((int64_t)iq1_grid8[iq1_m_row(blk, 2 * t + 1)], (int64_t)iq1_grid8[iq1_m_row(blk, 2 * t)]));
#else
    for (int l = 0; l < 32; l++) {
        const uint32_t r = iq1_m_row(blk, l);
        const float dl = d * (float)iq1_m_ls(blk, l / 2), delta = r & 0x800 ? -0.125f : 0.125f;
        for (int j = 0; j < 8; j++) o[8 * l + j] = dl * ((float)iq1s_grid[r & 2047][j] + delta);
    }
#endif
}
