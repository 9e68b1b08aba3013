/* Codebook row kernels (MXFP4, IQ3_XXS) and their block dequantizers: part of cpu_kernels.c, which
 * #includes this file after its SIMD vocabulary, fp16_to_f32 and PREFETCH; not compiled on its own.
 * The value tables come from cpu_iq_tables.h, which kernels/cpu.py writes at build time from
 * moetier.quant.iquants (gguf-py's tables): mxfp4_values[16] (int8; and as float32), iq3xxs_grid[256][4], iq_ksigns[128]
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

static void dequant_iq3_xxs(const uint8_t *blk, float *o) {
    const float d = fp16_to_f32(blk);
    for (int s = 0; s < 8; s++) {
        uint32_t aux;
        memcpy(&aux, blk + 66 + 4 * s, 4);
        const float db = iq3_xxs_scale(d, aux);
        for (int l = 0; l < 4; l++) {
            const uint8_t signs = iq_ksigns[(aux >> (7 * l)) & 127];
            for (int j = 0; j < 8; j++) {
                const float v = db * (float)iq3xxs_grid[blk[2 + 8 * s + 2 * l + j / 4]][j % 4];
                o[32 * s + 8 * l + j] = signs >> j & 1 ? -v : v;
            }
        }
    }
}
