/* IQ2_XXS / IQ2_XS / IQ2_S float-activation row kernels and block dequantizers: part of cpu_kernels.c, which
 * #includes this file after cpu_iquants.c (its tables header, i8_to_f32, IQ_AVX2); not compiled on its own.
 * All three store 256 values a super-block as 32 groups of 8: a grid row (8 values of 8, 25 or 43: iq2*_grid, one
 * u64 each, from moetier.quant.iquants via cpu_iq_tables.h), 8 sign bits, and a 4-bit scale ls per 32 (IQ2_XXS) or
 * 16 (IQ2_XS / IQ2_S) values: value d (0.5 + ls) / 4 grid[j], negated where sign bit j is set.
 *   IQ2_XXS 66 bytes {fp16 d, u32 pairs[16]}: sub-block s (32 values) = pair (a, b) at 2 + 8 s: byte l of a the
 *           grid row (256 entries) of group l, bits 7 l .. 7 l + 6 of b its sign pattern (iq_ksigns), b >> 28 ls.
 *   IQ2_XS  74 bytes {fp16 d, u16 qs[32], u8 scales[8]}: group g = qs[g] & 511 (512 rows), qs[g] >> 9 its sign
 *           pattern; ls of values 16 h .. 16 h + 15 = nibble h of scales (low first).
 *   IQ2_S   82 bytes {fp16 d, u8 qs[32], u8 signs[32], u8 qh[8], u8 scales[8]}: group g = qs[g] | bits 2 (g % 4)
 *           of qh[g / 4] << 8 (1024 rows), signs[g] its 8 sign bits as they are; scales as IQ2_XS. */
enum { IQ2_KIND_XXS, IQ2_KIND_XS, IQ2_KIND_S };
static const int iq2_bytes[3] = {66, 74, 82};

/* group g of super-block w: its grid row (values as u64 bytes) and sign bits */
static inline __attribute__((always_inline)) uint64_t iq2_group(int kind, const uint8_t *w, int g, uint32_t *signs) {
    if (kind == IQ2_KIND_XXS) {
        uint32_t b;
        memcpy(&b, w + 6 + 8 * (g / 4), 4);
        *signs = iq_ksigns[(b >> (7 * (g % 4))) & 127];
        return iq2xxs_grid[w[2 + 8 * (g / 4) + g % 4]];
    }
    if (kind == IQ2_KIND_XS) {
        uint16_t q;
        memcpy(&q, w + 2 + 2 * g, 2);
        *signs = iq_ksigns[q >> 9];
        return iq2xs_grid[q & 511];
    }
    *signs = w[34 + g];
    return iq2s_grid[w[2 + g] | ((w[66 + g / 4] >> (2 * (g % 4))) & 3) << 8];
}

/* ls of values 16 h .. 16 h + 15 (h < 16) */
static inline __attribute__((always_inline)) int iq2_ls(int kind, const uint8_t *w, int h) {
    if (kind == IQ2_KIND_XXS) return w[9 + 8 * (h / 2)] >> 4;                   /* the top nibble of pair word b */
    return (w[iq2_bytes[kind] - 8 + h / 2] >> (4 * (h % 2))) & 15;
}

#ifdef IQ_AVX2
/* 8 signed floats of group g */
static inline __attribute__((always_inline)) __m256 iq2_vals8(int kind, const uint8_t *w, int g) {
    uint32_t s;
    const uint64_t q = iq2_group(kind, w, g, &s);
    const __m256i bit = _mm256_sllv_epi32(_mm256_set1_epi32((int)s), _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24));
    return _mm256_xor_ps(i8_to_f32(_mm_cvtsi64_si128((int64_t)q)),
                         _mm256_castsi256_ps(_mm256_and_si256(bit, _mm256_set1_epi32((int)0x80000000u))));
}
#endif

static inline __attribute__((always_inline)) float row_iq2(int kind, const uint8_t *w, const float *x, int64_t nsb) {
    const int bb = iq2_bytes[kind];
#ifdef IQ_AVX2
    __m256 acc = _mm256_setzero_ps();
#else
    float acc = 0.f;
#endif
    for (int64_t b = 0; b < nsb; b++, w += bb, x += 256) {
        PREFETCH(w);
        const float d = fp16_to_f32(w);
        for (int h = 0; h < 16; h++) {
            const float db = d * (0.5f + (float)iq2_ls(kind, w, h)) * 0.25f;
            const float *xh = x + 16 * h;
#ifdef IQ_AVX2
            const __m256 s = _mm256_fmadd_ps(iq2_vals8(kind, w, 2 * h + 1), _mm256_loadu_ps(xh + 8),
                                             _mm256_mul_ps(iq2_vals8(kind, w, 2 * h), _mm256_loadu_ps(xh)));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(db), s, acc);
#else
            float sum = 0.f;
            for (int l = 0; l < 2; l++) {
                uint32_t signs;
                const uint64_t q = iq2_group(kind, w, 2 * h + l, &signs);
                for (int j = 0; j < 8; j++) {
                    const float v = (float)(uint8_t)(q >> (8 * j));
                    sum += (signs >> j & 1 ? -v : v) * xh[8 * l + j];
                }
            }
            acc += db * sum;
#endif
        }
    }
#ifdef IQ_AVX2
    return hsum8(acc);
#else
    return acc;
#endif
}

static float row_iq2_xxs(const uint8_t *w, const float *x, int64_t nsb) { return row_iq2(IQ2_KIND_XXS, w, x, nsb); }
static float row_iq2_xs(const uint8_t *w, const float *x, int64_t nsb) { return row_iq2(IQ2_KIND_XS, w, x, nsb); }
static float row_iq2_s(const uint8_t *w, const float *x, int64_t nsb) { return row_iq2(IQ2_KIND_S, w, x, nsb); }

/* one super-block -> 256 floats, bit-exact with the torch dequantizer: (d (0.5 + ls) 0.25) grid, the sign exact.
 * SIMD: the same db * (float)grid products (a vector multiply), the sign as an xor of the float sign bit (= -v). */
static inline __attribute__((always_inline)) void dequant_iq2(int kind, const uint8_t *blk, float *o) {
    const float d = fp16_to_f32(blk);
    for (int h = 0; h < 16; h++) {
        const float db = d * (0.5f + (float)iq2_ls(kind, blk, h)) * 0.25f;
#if defined(VW) && VW == 16
        uint32_t s0, s1;                                 /* groups 2h, 2h + 1: 16 values, one zmm */
        const uint64_t q0 = iq2_group(kind, blk, 2 * h, &s0), q1 = iq2_group(kind, blk, 2 * h + 1, &s1);
        const __m512i v = _mm512_castps_si512(_mm512_mul_ps(
            _mm512_set1_ps(db), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x((int64_t)q1, (int64_t)q0)))));
        _mm512_storeu_ps(o + 16 * h, _mm512_castsi512_ps(_mm512_mask_xor_epi32(
            v, (__mmask16)((s0 & 0xFF) | (s1 & 0xFF) << 8), v, _mm512_set1_epi32((int)0x80000000u))));
#elif defined(IQ_AVX2)
        for (int l = 0; l < 2; l++) {
            uint32_t signs;
            const uint64_t q = iq2_group(kind, blk, 2 * h + l, &signs);
            const __m256i bit = _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32((int)signs),
                                                                   _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24)),
                                                 _mm256_set1_epi32((int)0x80000000u));  /* bit j -> lane j's sign */
            const __m256 v = _mm256_mul_ps(_mm256_set1_ps(db),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)q))));
            _mm256_storeu_ps(o + 16 * h + 8 * l, _mm256_xor_ps(v, _mm256_castsi256_ps(bit)));
        }
#else
        for (int l = 0; l < 2; l++) {
            uint32_t signs;
            const uint64_t q = iq2_group(kind, blk, 2 * h + l, &signs);
            for (int j = 0; j < 8; j++) {
                const float v = db * (float)(uint8_t)(q >> (8 * j));
                o[16 * h + 8 * l + j] = signs >> j & 1 ? -v : v;
            }
        }
#endif
    }
}

static void dequant_iq2_xxs(const uint8_t *blk, float *o) { dequant_iq2(IQ2_KIND_XXS, blk, o); }
static void dequant_iq2_xs(const uint8_t *blk, float *o) { dequant_iq2(IQ2_KIND_XS, blk, o); }
static void dequant_iq2_s(const uint8_t *blk, float *o) { dequant_iq2(IQ2_KIND_S, blk, o); }
