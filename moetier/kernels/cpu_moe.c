/* One MoE layer per call (decode) and int8 activations (llama.cpp's Q8_0 for x): part of cpu_kernels.c,
 * which #includes this file after its row kernels and entry points; not compiled on its own. */

/* ---- one MoE layer for T tokens in one call (decode): y[t] = sum_j w[t, j] down_e(silu(gate_e x_t) * up_e x_t),
 * e = ids[t, j]. gate / up: expert e's rows at gate + e * g_estride (row r at + r * g_rstride), down likewise.
 * q8: moe_q8_type rows (Q4_0 / Q8_0 / MXFP4 / IQ3_XXS / IQ3_S / IQ1_S / IQ1_M ...) dot an int8 copy of the
 * activations (llama.cpp's Q8_0 for x: integer dot products, per-32 scales); else float activations as moetier_matvec. Its own names: doorbell.c has private
 * twins. ---- */
#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#define MOE_Q8 1
/* x [K] -> qx [K] int8, dx [K/32] scales, sx [K/32] dx times the sum of qx per block (Q4_0's offset).
 * q = round-to-nearest-even(x / d), d = max |x| / 127, as lrintf; 8 lanes (the scalar loop took ~4.4 ns
 * per value, 9 us for K = 2048: 7% of an IQ3_XXS matvec of 768 rows) */
static void moe_quantize_q8(const float *x, int64_t K, int8_t *qx, float *dx, float *sx) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);    /* undoes packs' 128-bit lanes */
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, abs), _mm256_and_ps(v1, abs)),
                                       _mm256_max_ps(_mm256_and_ps(v2, abs), _mm256_and_ps(v3, abs)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        const __m256 s = _mm256_set1_ps(id);
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, s)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, s));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, s)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, s));
        const __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(qx + 32 * b), _mm256_permutevar8x32_epi32(q, order));
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
        dx[b] = d;
        sx[b] = d * (float)_mm_cvtsi128_si32(u);
    }
}

static inline __m256i moe_dot_u8s8(__m256i a, __m256i b) {     /* 8 int32 partial sums of a (u8) * b (s8) */
#if VNNI256
    return DPBUSD256(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

/* Q4_0 x q8 arithmetic (every Q4_0 kernel below, bit-identical to each other): per block and int32 lane l (weights
 * 4l..4l+3: bytes 0-15 of the block are the low nibbles, weights 0-15, then the high ones) p = sum (nib - 8) qx, exact
 * (the offset 8 taken off in the integer sum); acc_l += float(p) * (d_b dx_b) into 8 lanes for even blocks and 8 for
 * odd ones (an odd last block: the even lanes); the row's value is hsum8(even + odd). */
static inline __m256i moe_dot_u8s8_acc(__m256i acc, __m256i a, __m256i b) {    /* acc + moe_dot_u8s8(a, b) */
#if VNNI256
    return DPBUSD256(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i moe_q4_0_nibbles(const uint8_t *blk) {   /* the block's 32 weights + 8, in element order */
    const __m128i t = _mm_loadu_si128((const __m128i *)(blk + 2));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

static inline __m256i moe_minus8(__m256i y) {                 /* per lane -8 sum of its 4 int8 values */
    return _mm256_sub_epi32(_mm256_setzero_si256(), moe_dot_u8s8(_mm256_set1_epi8(8), y));
}

static float moe_row_q4_0_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nb) {
    __m256 ae = _mm256_setzero_ps(), ao = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 36) {
        const __m256i y0 = _mm256_loadu_si256((const __m256i *)(qx + 32 * b));
        const __m256i y1 = _mm256_loadu_si256((const __m256i *)(qx + 32 * b + 32));
        const __m256i p0 = moe_dot_u8s8_acc(moe_minus8(y0), moe_q4_0_nibbles(w), y0);
        const __m256i p1 = moe_dot_u8s8_acc(moe_minus8(y1), moe_q4_0_nibbles(w + 18), y1);
        ae = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(fp16_to_f32(w) * dx[b]), ae);
        ao = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(fp16_to_f32(w + 18) * dx[b + 1]), ao);
    }
    if (b < nb) {
        const __m256i y = _mm256_loadu_si256((const __m256i *)(qx + 32 * b));
        const __m256i p = moe_dot_u8s8_acc(moe_minus8(y), moe_q4_0_nibbles(w), y);
        ae = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(fp16_to_f32(w) * dx[b]), ae);
    }
    return hsum8(_mm256_add_ps(ae, ao));
}

/* bit j of the little-endian u32 at p -> byte j of the result: 0xFF where set, else 0 */
static inline __m256i moe_bits_to_bytes(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v),      /* byte j <- byte j / 8 of v */
                                               _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                                  0x0303030303030303LL));
    const __m256i others = _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFELL);            /* byte j: all bits but j % 8 */
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
}

/* Q5_1 row . q8 x: sum_b d_b dx_b sum_j q_j qx_j + m_b sx_b (q 0..31, unsigned against int8 x) */
static float moe_row_q5_1_q8(const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f;
    const __m256i lo = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
    for (int64_t b = 0; b < nb; b++, w += 24, qx += 32) {
        const __m128i t = _mm_loadu_si128((const __m128i *)(w + 8));
        const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), lo),
                                          _mm256_and_si256(moe_bits_to_bytes(w + 4), b4));
        const __m256i p = moe_dot_u8s8(q, _mm256_loadu_si256((const __m256i *)qx));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(fp16_to_f32(w) * dx[b]), acc);
        off += fp16_to_f32(w + 2) * sx[b];
    }
    return hsum8(acc) + off;
}

/* The 32 codebook values (int8) of 16 IQ4 nibble bytes at q . 32 int8 x: one byte shuffle, the sign trick */
static inline __m256i moe_iq4_dot(const uint8_t *q, const int8_t *qx) {
    const __m256i book = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)iq4nl_values));
    const __m128i t = _mm_loadu_si128((const __m128i *)q);
    const __m256i v = _mm256_shuffle_epi8(book, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t),
                                                                  _mm256_set1_epi8(0x0F)));
    const __m256i y = _mm256_loadu_si256((const __m256i *)qx);
    return moe_dot_u8s8(_mm256_sign_epi8(v, v), _mm256_sign_epi8(y, v));
}

/* IQ4_XS row . q8 x: per sub-block moe_iq4_dot times d (ls - 32) dx */
static float moe_row_iq4_xs_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nsb) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 136)
        for (int ib = 0; ib < 8; ib++, qx += 32, dx++)
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(moe_iq4_dot(w + 8 + 16 * ib, qx)),
                                  _mm256_set1_ps(iq4_xs_scale(w, ib) * dx[0]), acc);
    return hsum8(acc);
}

/* IQ4_NL row . q8 x: per block moe_iq4_dot times d dx */
static float moe_row_iq4_nl_q8(const uint8_t *w, const int8_t *qx, const float *dx, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 18, qx += 32)
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(moe_iq4_dot(w + 2, qx)), _mm256_set1_ps(fp16_to_f32(w) * dx[b]), acc);
    return hsum8(acc);
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
    return hsum8(acc);
}

#include "cpu_iq_q8.c"
#include "cpu_iq2_q8.c"
#include "cpu_kq_q8.c"
#include "cpu_kq23_q8.c"

/* types with an int8-activation row kernel (moe_row_q8) */
static inline int moe_q8_type(int qtype) {
    return qtype == Q4_0 || qtype == Q8_0 || qtype == MXFP4 || qtype == IQ3_XXS || qtype == Q4_K || qtype == Q5_K
           || qtype == Q6_K || qtype == Q5_1 || qtype == IQ4_XS || qtype == IQ4_NL || qtype == Q2_K || qtype == Q3_K
           || qtype == IQ2_XXS || qtype == IQ2_XS || qtype == IQ2_S || qtype == IQ3_S || qtype == IQ1_S
           || qtype == IQ1_M;
}

/* one row of a moe_q8_type . q8 x (qx [K], dx / sx [K/32]) */
static inline float moe_row_q8(int qtype, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx,
                               int64_t K) {
    switch (qtype) {
    case Q4_0: return moe_row_q4_0_q8(w, qx, dx, K / 32);
    case Q5_1: return moe_row_q5_1_q8(w, qx, dx, sx, K / 32);
    case IQ4_XS: return moe_row_iq4_xs_q8(w, qx, dx, K / 256);
    case IQ4_NL: return moe_row_iq4_nl_q8(w, qx, dx, K / 32);
    case Q8_0: return moe_row_q8_0_q8(w, qx, dx, K / 32);
    case MXFP4: return moe_row_mxfp4_q8(w, qx, dx, K / 32);
    case Q4_K: return moe_row_q4_k_q8(w, qx, dx, sx, K / 256);
    case Q5_K: return moe_row_q5_k_q8(w, qx, dx, sx, K / 256);
    case Q6_K: return moe_row_q6_k_q8(w, qx, dx, K / 256);
    case Q2_K: return moe_row_q2_k_q8(w, qx, dx, K / 256);
    case Q3_K: return moe_row_q3_k_q8(w, qx, dx, K / 256);
    case IQ2_XXS: return moe_row_iq2_xxs_q8(w, qx, dx, K / 256);
    case IQ2_XS: return moe_row_iq2_xs_q8(w, qx, dx, K / 256);
    case IQ2_S: return moe_row_iq2_s_q8(w, qx, dx, K / 256);
    case IQ3_S: return moe_row_iq3_s_q8(w, qx, dx, K / 256);
    case IQ1_S: return moe_row_iq1_s_q8_sx(w, qx, dx, sx, K / 256);
    case IQ1_M: return moe_row_iq1_m_q8(w, qx, dx, K / 256);
    default: return moe_row_iq3_xxs_q8(w, qx, dx, K / 256);
    }
}

/* 4 rows (at w + r rs, r < 4) . q8 x at once, 4 independent accumulator chains (one row is latency-bound), for a
 * run of contiguous rows (doorbell.c's miss server; moetier_moe_tokens, moetier_matvec_q8): Q8_0 rows, each row the
 * same arithmetic as moe_row_q8_0_q8 (bit-identical results). The software prefetch stops at pf_end, the end of the
 * caller's run: past it, it would fetch bytes another thread reads (or nobody does), and the miss server's
 * per-thread runs are short (down: ~55 KB per expert on 16 threads, so 4 KB beyond is 7% more traffic). */
static inline __attribute__((always_inline)) void moe_rows4_run_q8(const uint8_t *w, int64_t rs, const int8_t *qx,
                                                                   const float *dx, int64_t nb,
                                                                   const uint8_t *pf_end, float *out) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
           acc3 = _mm256_setzero_ps();
    const uint8_t *w0 = w, *w1 = w + rs, *w2 = w + 2 * rs, *w3 = w + 3 * rs;
#define MOE_RUN_ROW(wr, acc)                                                                                 \
    do {                                                                                                     \
        const uint8_t *pf = (wr) + PREFETCH_AHEAD;                                                            \
        if (pf < pf_end) __builtin_prefetch(pf, 0, 3);                                                       \
        const __m256i q = _mm256_loadu_si256((const __m256i *)((wr) + 2));                                   \
        const __m256i p = moe_dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q));                      \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(fp16_to_f32(wr) * dx[b]), acc);          \
    } while (0)
    for (int64_t b = 0; b < nb; b++, w0 += 34, w1 += 34, w2 += 34, w3 += 34) {
        const __m256i y = _mm256_loadu_si256((const __m256i *)(qx + 32 * b));
        MOE_RUN_ROW(w0, acc0);
        MOE_RUN_ROW(w1, acc1);
        MOE_RUN_ROW(w2, acc2);
        MOE_RUN_ROW(w3, acc3);
    }
#undef MOE_RUN_ROW
    out[0] = hsum8(acc0);
    out[1] = hsum8(acc1);
    out[2] = hsum8(acc2);
    out[3] = hsum8(acc3);
}

/* 4 Q4_0 rows . q8 x, moe_row_q4_0_q8's arithmetic (bit-identical), the x loads and offsets shared by the rows */
static inline __attribute__((always_inline)) void moe_rows4_run_q4_0_q8(const uint8_t *w, int64_t rs,
                                                                        const int8_t *qx, const float *dx, int64_t nb,
                                                                        const uint8_t *pf_end, float *out) {
    __m256 ae[4], ao[4];
    for (int r = 0; r < 4; r++) ae[r] = ao[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m256i y0 = _mm256_loadu_si256((const __m256i *)(qx + 32 * b));
        const __m256i y1 = _mm256_loadu_si256((const __m256i *)(qx + 32 * b + 32));
        const __m256i m0 = moe_minus8(y0), m1 = moe_minus8(y1);
        for (int r = 0; r < 4; r++) {
            const uint8_t *wr = w + r * rs + 18 * b;
            if (wr + PREFETCH_AHEAD < pf_end) __builtin_prefetch(wr + PREFETCH_AHEAD, 0, 3);
            const __m256i p0 = moe_dot_u8s8_acc(m0, moe_q4_0_nibbles(wr), y0);
            const __m256i p1 = moe_dot_u8s8_acc(m1, moe_q4_0_nibbles(wr + 18), y1);
            ae[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(fp16_to_f32(wr) * dx[b]), ae[r]);
            ao[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(fp16_to_f32(wr + 18) * dx[b + 1]), ao[r]);
        }
    }
    if (b < nb) {
        const __m256i y = _mm256_loadu_si256((const __m256i *)(qx + 32 * b));
        const __m256i m = moe_minus8(y);
        for (int r = 0; r < 4; r++) {
            const uint8_t *wr = w + r * rs + 18 * b;
            const __m256i p = moe_dot_u8s8_acc(m, moe_q4_0_nibbles(wr), y);
            ae[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(fp16_to_f32(wr) * dx[b]), ae[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = hsum8(_mm256_add_ps(ae[r], ao[r]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define MOE_RUN_512 1
/* moe_rows4_run_q8 with two rows per 512-bit register: lanes 0-7 row r, 8-15 row r + 1, each half the 8-lane
 * accumulator of the AVX2 kernel (same bytes per int32 lane, same scale, same fma order: bit-identical per
 * row), and the four rows' fp16 scales converted and multiplied in one 4-lane op (lane r: the scalar kernel's
 * d dx, the same IEEE operations). Q8_0: no sign_epi8 in AVX-512, so |q| and y negated where q < 0 (same
 * products). On the dev box (1 thread, weights in L3) the two-rows-per-register form took Q4_0 from 12.6 GB/s
 * (the AVX2 kernel, VNNI) to 13.8 (before moe_rows4_run_q4_0_vbmi). */
static inline __attribute__((always_inline)) void moe_rows4_run_q8_512(const uint8_t *w, int64_t rs,
                                                                       const int8_t *qx, const float *dx, int64_t nb,
                                                                       const uint8_t *pf_end, float *out) {
    __m512 acc01 = _mm512_setzero_ps(), acc23 = _mm512_setzero_ps();
    const __m512i s01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i s23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const uint8_t *w0 = w, *w1 = w + rs, *w2 = w + 2 * rs, *w3 = w + 3 * rs;
    for (int64_t b = 0; b < nb; b++, w0 += 34, w1 += 34, w2 += 34, w3 += 34) {
        if (w0 + PREFETCH_AHEAD < pf_end) __builtin_prefetch(w0 + PREFETCH_AHEAD, 0, 3);
        if (w1 + PREFETCH_AHEAD < pf_end) __builtin_prefetch(w1 + PREFETCH_AHEAD, 0, 3);
        if (w2 + PREFETCH_AHEAD < pf_end) __builtin_prefetch(w2 + PREFETCH_AHEAD, 0, 3);
        if (w3 + PREFETCH_AHEAD < pf_end) __builtin_prefetch(w3 + PREFETCH_AHEAD, 0, 3);
        const __m512i y = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qx + 32 * b)));
        uint16_t h0, h1, h2, h3;
        memcpy(&h0, w0, 2);
        memcpy(&h1, w1, 2);
        memcpy(&h2, w2, 2);
        memcpy(&h3, w3, 2);
        const __m128 d = _mm_cvtph_ps(_mm_setr_epi16((short)h0, (short)h1, (short)h2, (short)h3, 0, 0, 0, 0));
        const __m512 sc = _mm512_castps128_ps512(_mm_mul_ps(d, _mm_set1_ps(dx[b])));
        const __m512i q01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w0 + 2))),
                                               _mm256_loadu_si256((const __m256i *)(w1 + 2)), 1);
        const __m512i q23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w2 + 2))),
                                               _mm256_loadu_si256((const __m256i *)(w3 + 2)), 1);
        const __m512i y01 = _mm512_mask_sub_epi8(y, _mm512_movepi8_mask(q01), _mm512_setzero_si512(), y);
        const __m512i y23 = _mm512_mask_sub_epi8(y, _mm512_movepi8_mask(q23), _mm512_setzero_si512(), y);
        const __m512i p01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(q01), y01);
        const __m512i p23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(q23), y23);
        acc01 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p01), _mm512_permutexvar_ps(s01, sc), acc01);
        acc23 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p23), _mm512_permutexvar_ps(s23, sc), acc23);
    }
    out[0] = hsum8(_mm512_castps512_ps256(acc01));
    out[1] = hsum8(_mm512_extractf32x8_ps(acc01, 1));
    out[2] = hsum8(_mm512_castps512_ps256(acc23));
    out[3] = hsum8(_mm512_extractf32x8_ps(acc23, 1));
}
#define MOE_ROWS4_RUN moe_rows4_run_q8_512
#else
#define MOE_ROWS4_RUN moe_rows4_run_q8
#endif

#if defined(MOE_RUN_512) && defined(__AVX512VBMI__)
/* 4 Q4_0 rows . q8 x, two blocks of a row per 512-bit register: one masked load of the pair's 36 bytes, one byte
 * permute placing each block's 16 nibble bytes twice (bytes 0-31: block b, 32-63: block b + 1), a masked 16-bit
 * shift by 4 of the second copies and an AND give the 64 weights + 8 in element order; a word permute of the same
 * load places d_b in lanes 0-7 and d_b+1 in 8-15 for one fp16 conversion. Lanes 0-7 are moe_row_q4_0_q8's even
 * accumulator, 8-15 its odd one (same per-lane integers, scale, fma order): bit-identical. About 10 instructions
 * per row and block pair where the two-rows-per-register kernel took ~23 (its per-row scale gathers, lane
 * shuffles and prefetches), so the miss server's math (~7 GB/s a thread on the H200 box's Xeon, weights in cache:
 * 89-111 GB/s on 15 threads against a RAM read of 90-118) stops being the limit. The masked loads never read
 * past the row's last block. */
static inline __attribute__((always_inline)) void moe_rows4_run_q4_0_vbmi(const uint8_t *w, int64_t rs,
                                                                          const int8_t *qx, const float *dx,
                                                                          int64_t nb, const uint8_t *pf_end,
                                                                          float *out) {
    static const uint8_t nib_perm[64] = {
        2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,
        20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35,
        20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35};
    const __m512i perm = _mm512_loadu_si512(nib_perm);
    const __m512i dperm = _mm512_setr_epi32(0, 0, 0, 0, 0x00090009, 0x00090009, 0x00090009, 0x00090009,
                                            0, 0, 0, 0, 0, 0, 0, 0);     /* words 0-7: word 0 (d_b), 8-15: word 9 */
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i lo = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    const __mmask32 high_copies = 0xFF00FF00u;                               /* words 8-15, 24-31: bytes 16-31, 48-63 */
    __m512 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
        const int two = b + 1 < nb;                                          /* an odd last block: lanes 8-15 get 0 */
        const __mmask64 wm = two ? (((__mmask64)1 << 36) - 1) : (((__mmask64)1 << 18) - 1);
        const __m512i y = _mm512_maskz_loadu_epi8(two ? ~(__mmask64)0 : (((__mmask64)1 << 32) - 1), qx + 32 * b);
        const __m512i m8 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), eight, y));
        const __m512 dxx = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(
            _mm_setr_ps(dx[b], two ? dx[b + 1] : 0.f, 0.f, 0.f)));
        for (int r = 0; r < 4; r++) {
            const uint8_t *wr = w + r * rs + 18 * b;
            if (wr + PREFETCH_AHEAD < pf_end) __builtin_prefetch(wr + PREFETCH_AHEAD, 0, 3);
            const __m512i v = _mm512_maskz_loadu_epi8(wm, wr);
            __m512i nib = _mm512_permutexvar_epi8(perm, v);
            nib = _mm512_and_si512(_mm512_mask_srli_epi16(nib, high_copies, nib, 4), lo);
            const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(dperm, v)));
            const __m512i p = _mm512_dpbusd_epi32(m8, nib, y);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d, dxx), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++)
        out[r] = hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1)));
}
#define MOE_ROWS4_RUN_Q4_0 moe_rows4_run_q4_0_vbmi
#else
#define MOE_ROWS4_RUN_Q4_0 moe_rows4_run_q4_0_q8
#endif

/* 4 MXFP4 rows (at w + r rs) . q8 x, each row the arithmetic of moe_row_mxfp4_q8 (two accumulators: even and odd
 * blocks; an odd last block into the even one): bit-identical. The x loads and the table are shared, 8 independent
 * chains; prefetch bounded by pf_end as moe_rows4_run_q8. Compute-bound (table lookups, per-block scales): in
 * the miss server on the dev box (2 threads, from RAM) 18.0 -> 18.9 GB/s; one thread in L3 9.3 -> 10.3. */
static void moe_rows4_run_mxfp4_q8(const uint8_t *w, int64_t rs, const int8_t *qx, const float *dx, int64_t nb,
                                   const uint8_t *pf_end, float *out) {
    const __m128i values = _mm_loadu_si128((const __m128i *)mxfp4_values);
    __m256 a0[4], a1[4];
    for (int r = 0; r < 4; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m256i y0 = _mm256_loadu_si256((const __m256i *)(qx + 32 * b));
        const __m256i y1 = _mm256_loadu_si256((const __m256i *)(qx + 32 * b + 32));
        for (int r = 0; r < 4; r++) {
            const uint8_t *wb = w + r * rs + 17 * b;
            if (wb + PREFETCH_AHEAD < pf_end) __builtin_prefetch(wb + PREFETCH_AHEAD, 0, 3);
            const __m256i q0 = mxfp4_q8_weights(wb + 1, values), q1 = mxfp4_q8_weights(wb + 18, values);
            const __m256i p0 = moe_dot_u8s8(_mm256_sign_epi8(q0, q0), _mm256_sign_epi8(y0, q0));
            const __m256i p1 = moe_dot_u8s8(_mm256_sign_epi8(q1, q1), _mm256_sign_epi8(y1, q1));
            a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(e8m0_half(wb[0]) * dx[b]), a0[r]);
            a1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(e8m0_half(wb[17]) * dx[b + 1]), a1[r]);
        }
    }
    if (b < nb) {
        const __m256i y = _mm256_loadu_si256((const __m256i *)(qx + 32 * b));
        for (int r = 0; r < 4; r++) {
            const uint8_t *wb = w + r * rs + 17 * b;
            const __m256i q = mxfp4_q8_weights(wb + 1, values);
            const __m256i p = moe_dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q));
            a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(e8m0_half(wb[0]) * dx[b]), a0[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}

#ifdef MOE_KQ_512
#define MOE_ROWS4_RUN_Q45_K moe_rows4_run_q45_k_q8_512
#define MOE_ROWS4_RUN_Q6_K moe_rows4_run_q6_k_q8_512
#else
#define MOE_ROWS4_RUN_Q45_K moe_rows4_run_q45_k_q8
#define MOE_ROWS4_RUN_Q6_K moe_rows4_run_q6_k_q8
#endif

/* out[i] = row w + i rs . q8 x for i < n (a run of rows of one matrix, prefetch bounded by pf_end): Q4_0 / Q8_0 4
 * rows per call (moe_rows4_run_q8, or its AVX-512 twin), MXFP4 likewise (moe_rows4_run_mxfp4_q8), Q4_K / Q6_K (and
 * Q5_K with AVX-512) likewise (cpu_kq_q8.c, AVX2 or AVX-512 VNNI), Q2_K / Q3_K (cpu_kq23_q8.c), the tail and the other types one row per call
 * (moe_row_q8). Every path is bit-identical to moe_row_q8 row by row. */
static void moe_rows_run_q8(int qtype, const uint8_t *w, int64_t rs, int64_t n, const int8_t *qx, const float *dx,
                            const float *sx, int64_t K, const uint8_t *pf_end, float *out) {
    int64_t i = 0;
    if (qtype == Q4_0)
        for (; i + 4 <= n; i += 4) MOE_ROWS4_RUN_Q4_0(w + i * rs, rs, qx, dx, K / 32, pf_end, out + i);
    else if (qtype == Q8_0)
        for (; i + 4 <= n; i += 4) MOE_ROWS4_RUN(w + i * rs, rs, qx, dx, K / 32, pf_end, out + i);
    else if (qtype == MXFP4)
        for (; i + 4 <= n; i += 4) moe_rows4_run_mxfp4_q8(w + i * rs, rs, qx, dx, K / 32, pf_end, out + i);
    else if (qtype == Q4_K)
        for (; i + 4 <= n; i += 4) MOE_ROWS4_RUN_Q45_K(0, w + i * rs, rs, qx, dx, sx, K / 256, pf_end, out + i);
#ifdef MOE_KQ_512
    else if (qtype == Q5_K)   /* the AVX2 4-row Q5_K kernel was slower than one row (cpu_kq_q8.c) */
        for (; i + 4 <= n; i += 4) MOE_ROWS4_RUN_Q45_K(1, w + i * rs, rs, qx, dx, sx, K / 256, pf_end, out + i);
#endif
    else if (qtype == Q6_K)
        for (; i + 4 <= n; i += 4) MOE_ROWS4_RUN_Q6_K(w + i * rs, rs, qx, dx, K / 256, pf_end, out + i);
    else if (qtype == Q3_K)
        for (; i + 4 <= n; i += 4) moe_rows4_run_q3_k_q8(w + i * rs, rs, qx, dx, K / 256, pf_end, out + i);
    else if (qtype == Q2_K)
        for (; i + 4 <= n; i += 4) moe_rows4_run_q2_k_q8(w + i * rs, rs, qx, dx, K / 256, pf_end, out + i);
    for (; i < n; i++) out[i] = moe_row_q8(qtype, w + i * rs, qx, dx, sx, K);
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
    if (q8 && moe_q8_type(qtype)) {
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
    if (half_type(qtype)) return row_half(qtype == BF16, (const uint16_t *)w, v->x, K);
#ifdef MOE_Q8
    if (v->q8) return moe_row_q8(qtype, w, v->qx, v->dx, v->sx, K);
#endif
    return row_dot(qtype, w, v->x, v->xs, K);
}

/* rows per call of moe_rows over n rows: 4 with int8 activations (n a multiple of 4), else 1 */
static inline int64_t moe_step(const moe_vec *v, int64_t n) { return v->q8 && n % 4 == 0 ? 4 : 1; }

/* out[0 .. n) = rows w + i * rs (i < n <= 4) . v */
static inline void moe_rows(int qtype, const uint8_t *w, int64_t rs, int64_t n, const moe_vec *v, int64_t K,
                            float *out) {
#ifdef MOE_Q8
    /* the miss server's 4-row kernels (bit-identical per row); prefetch up to the next group of 4, as the old
     * per-block prefetch 4 KB ahead did */
    if (n == 4 && v->q8) { moe_rows_run_q8(qtype, w, rs, 4, v->qx, v->dx, v->sx, K, w + 8 * rs, out); return; }
#endif
    for (int64_t i = 0; i < n; i++) out[i] = moe_row(qtype, w + i * rs, v, K);
}

int moetier_x8_supported(int qtype);
#ifdef MOE_Q8
static int moe_tokens_x8(int gq, int dq, const uint8_t *gate, const uint8_t *up, int64_t g_estride, int64_t g_rstride,
                         const uint8_t *down, int64_t d_estride, int64_t d_rstride, int64_t D, int64_t I, int64_t T,
                         int64_t k, const int64_t *ids, const float *w, const float *x, float *y, int nthreads);
#endif

/* Returns 0, -1 for an unsupported type / shape / expert id, -2 if out of memory. gq, dq both 0x100 | id (rows
 * interleaved by 8, kernels.cpu.interleave_rows, per expert): moe_tokens_x8, int8 activations. */
int moetier_moe_tokens(int gq, int dq, const uint8_t *gate, const uint8_t *up, int64_t g_estride, int64_t g_rstride,
                       const uint8_t *down, int64_t d_estride, int64_t d_rstride, int64_t E, int64_t D, int64_t I,
                       int64_t T, int64_t k, const int64_t *ids, const float *w, const float *x, float *y,
                       int q8, int nthreads) {
    if ((gq | dq) & 0x100) {
#ifdef MOE_Q8
        if (!moetier_x8_supported(gq & 0xFF) || !moetier_x8_supported(dq & 0xFF) || !(gq & dq & 0x100) || !q8
            || D % block_elems(gq & 0xFF) || I % block_elems(dq & 0xFF) || D % 8 || I % 8) return -1;
        for (int64_t i = 0; i < T * k; i++)
            if (ids[i] < 0 || ids[i] >= E) return -1;
        return moe_tokens_x8(gq, dq, gate, up, g_estride, g_rstride, down, d_estride, d_rstride, D, I, T, k, ids, w,
                             x, y, nthreads);
#else
        return -1;
#endif
    }
    /* also 16-bit float rows (F16 / BF16 experts of a 16-bit checkpoint: DenseExperts._half) */
    if (!(moetier_supported(gq) || half_type(gq)) || !(moetier_supported(dq) || half_type(dq))
        || D % block_elems(gq) || I % block_elems(dq)) return -1;
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

/* Q4_0 / Q8_0 rows interleaved by 8 (the compiled CPU step's dense weights, kernels.cpu.interleave_rows): rows
 * 8g..8g+7, block b, at w + (g nb + b) 8 bytes-per-block: the 8 rows' fp16 scales (16 bytes), then for each 4-byte
 * group j of the block's quants (Q4_0: 4 groups of nibble bytes; Q8_0: 8 groups of int8 values, stored + 128 as
 * unsigned bytes) the 8 rows' bytes (32 bytes, row r at 4r). With rows in the lanes a block costs one dot product per
 * group (a broadcast x word) for all 8 rows, where moe_rows4_run's one-row-per-register kernels unpack, dot, convert
 * and scale per row and block; the weights are interleaved once, at load. A one-token matvec was compute-bound from
 * cache (the default model's 8192 x 384 lm_head: Q4_0 ~121 us at 14.6 GB/s, Q8_0 ~109 us at 30 GB/s on the 2-core
 * Zen 4 box). The offsets (Q4_0's 8, Q8_0's stored 128 with VNNI) come off in the integer sum (m[b] = -offset x sum
 * of the block's int8 x); the float sums differ from the row kernels' (one lane per row). */
#define Q4_0_X8 (0x100 | Q4_0)
#define Q8_0_X8 (0x100 | Q8_0)
#define IQ4_NL_X8 (0x100 | IQ4_NL)
#define Q5_1_X8 (0x100 | Q5_1)
#define Q4_K_X8 (0x100 | Q4_K)
#define MXFP4_X8 (0x100 | MXFP4)
#define IQ4_XS_X8 (0x100 | IQ4_XS)

#ifdef MOE_Q8
#if VNNI256
#define X8_Q8_OFFSET 128        /* acc + sum (w + 128) x: the stored bytes straight into dpbusd, 128 sum x taken off */
static inline __m256i moe_x8_q8_dot(__m256i acc, __m256i stored, __m256i x) { return moe_dot_u8s8_acc(acc, stored, x); }
/* IQ4_NL / MXFP4: nibbles -> codebook value + 128 (one shuffle of `values`), into dpbusd; 128 sum x taken off
 * likewise */
static inline __m256i moe_x8_iq4_dot(__m256i acc, __m256i nib, __m256i x, const int8_t *values) {
    const __m256i book = _mm256_add_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)values)),
                                         _mm256_set1_epi8((char)0x80));
    return moe_dot_u8s8_acc(acc, _mm256_shuffle_epi8(book, nib), x);
}
#else
#define X8_Q8_OFFSET 0          /* acc + sum w x through the sign trick (maddubs' pair sums of (w + 128) x overflow) */
static inline __m256i moe_x8_q8_dot(__m256i acc, __m256i stored, __m256i x) {
    const __m256i w = _mm256_xor_si256(stored, _mm256_set1_epi8((char)0x80));
    return moe_dot_u8s8_acc(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
static inline __m256i moe_x8_iq4_dot(__m256i acc, __m256i nib, __m256i x, const int8_t *values) {
    const __m256i w = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)values)), nib);
    return moe_dot_u8s8_acc(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
#endif

/* Software prefetch of two groups' lines (at p and p + gs) from *pf up to `upto`, none past pf_end */
static inline void x8_prefetch2(const uint8_t **pf, const uint8_t *upto, int64_t gs, const uint8_t *pf_end) {
    for (; *pf < upto; *pf += 64) {
        if (*pf < pf_end) __builtin_prefetch(*pf, 0, 3);
        if (*pf + gs < pf_end) __builtin_prefetch(*pf + gs, 0, 3);
    }
}

/* the interleaved layouts' kernels (x8_kind) */
enum { X8_Q4_0, X8_Q8_0, X8_IQ4_NL, X8_Q5_1, X8_Q4_K, X8_MXFP4, X8_IQ4_XS };

/* MXFP4_X8: the 8 rows' e8m0 scales (8 bytes at e) as e8m0_half's floats (2^(e - 128); e < 2 subnormal) */
static inline __m256 moe_x8_e8m0_half(const uint8_t *e) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), v);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), v)));
}

/* Q5_1_X8: bit 4 of the 4 values of each lane's nibble group j (low nibbles: qh bits 4j..4j+3 of the lane's row; high:
 * 16 + 4j..) as bytes 0x10 / 0: the 4 bits spread to bytes by one multiply ((t & 15) 0x204081: copies 7 bits apart,
 * bit k lands at 8k) */
static inline __m256i moe_x8_q5_bits(__m256i qh, int shift) {
    const __m256i t = _mm256_and_si256(_mm256_srli_epi32(qh, shift), _mm256_set1_epi32(0x0F));
    return _mm256_slli_epi32(_mm256_and_si256(_mm256_mullo_epi32(t, _mm256_set1_epi32(0x204081)),
                                              _mm256_set1_epi32(0x01010101)), 4);
}

/* groups at w and w + gs (16 rows) of 32-value blocks at once, the x broadcasts shared; kind: X8_Q4_0, X8_Q8_0,
 * X8_IQ4_NL, X8_Q5_1 or X8_MXFP4 */
static inline __attribute__((always_inline)) void moe_x8_group2(int kind, const uint8_t *w, int64_t gs,
                                                                const int8_t *qx, const float *dx, const float *sxs,
                                                                const int32_t *m, int64_t nb, const uint8_t *pf_end,
                                                                int64_t ahead, float *out) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const __m256i lo = _mm256_set1_epi8(0x0F);
    const int q8 = kind == X8_Q8_0, q5 = kind == X8_Q5_1, fp4 = kind == X8_MXFP4;
    /* block bytes (8 rows), the quants' offset (after the 8 rows' scales: fp16, MXFP4 one e8m0 byte) */
    const int64_t bb = q8 ? 272 : q5 ? 192 : fp4 ? 136 : 144, qo = q5 ? 64 : fp4 ? 8 : 16;
    /* every line of both groups `ahead` bytes ahead (one prefetch per block covered a 144-byte Q4_0 block's
     * first line only: from RAM 0.70-0.86x the row kernels on the dev box, now 1.12-1.5x), not past pf_end */
    const uint8_t *pf = w + ahead;
    for (int64_t b = 0; b < nb; b++, w += bb) {
        x8_prefetch2(&pf, w + bb + ahead, gs, pf_end);
        int32_t xv[8];
        memcpy(xv, qx + 32 * b, 32);
        __m256i s0 = _mm256_set1_epi32(m[b]), s1 = _mm256_setzero_si256(), t0 = s0, t1 = s1;
        if (q8) {
            for (int j = 0; j < 8; j += 2) {
                const __m256i xa = _mm256_set1_epi32(xv[j]), xb = _mm256_set1_epi32(xv[j + 1]);
                s0 = moe_x8_q8_dot(s0, _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j)), xa);
                s1 = moe_x8_q8_dot(s1, _mm256_loadu_si256((const __m256i *)(w + 48 + 32 * j)), xb);
                t0 = moe_x8_q8_dot(t0, _mm256_loadu_si256((const __m256i *)(w + gs + 16 + 32 * j)), xa);
                t1 = moe_x8_q8_dot(t1, _mm256_loadu_si256((const __m256i *)(w + gs + 48 + 32 * j)), xb);
            }
        } else {
            const __m256i hc = q5 ? _mm256_loadu_si256((const __m256i *)(w + 32)) : lo;     /* Q5_1: 5th bits */
            const __m256i he = q5 ? _mm256_loadu_si256((const __m256i *)(w + gs + 32)) : lo;
            for (int j = 0; j < 4; j++) {
                const __m256i c = _mm256_loadu_si256((const __m256i *)(w + qo + 32 * j));
                const __m256i e = _mm256_loadu_si256((const __m256i *)(w + gs + qo + 32 * j));
                const __m256i xl = _mm256_set1_epi32(xv[j]), xh = _mm256_set1_epi32(xv[j + 4]);
                __m256i cl = _mm256_and_si256(c, lo), ch = _mm256_and_si256(_mm256_srli_epi16(c, 4), lo);
                __m256i el = _mm256_and_si256(e, lo), eh = _mm256_and_si256(_mm256_srli_epi16(e, 4), lo);
                if (q5) {
                    cl = _mm256_or_si256(cl, moe_x8_q5_bits(hc, 4 * j));
                    ch = _mm256_or_si256(ch, moe_x8_q5_bits(hc, 16 + 4 * j));
                    el = _mm256_or_si256(el, moe_x8_q5_bits(he, 4 * j));
                    eh = _mm256_or_si256(eh, moe_x8_q5_bits(he, 16 + 4 * j));
                }
                if (kind == X8_IQ4_NL || fp4) {
                    const int8_t *book = fp4 ? mxfp4_values : iq4nl_values;
                    s0 = moe_x8_iq4_dot(s0, cl, xl, book);
                    s1 = moe_x8_iq4_dot(s1, ch, xh, book);
                    t0 = moe_x8_iq4_dot(t0, el, xl, book);
                    t1 = moe_x8_iq4_dot(t1, eh, xh, book);
                } else {
                    s0 = moe_dot_u8s8_acc(s0, cl, xl);
                    s1 = moe_dot_u8s8_acc(s1, ch, xh);
                    t0 = moe_dot_u8s8_acc(t0, el, xl);
                    t1 = moe_dot_u8s8_acc(t1, eh, xh);
                }
            }
        }
        const __m256 dxv = _mm256_set1_ps(dx[b]);
        const __m256 d0 = fp4 ? moe_x8_e8m0_half(w) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        const __m256 d1 = fp4 ? moe_x8_e8m0_half(w + gs) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + gs)));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), _mm256_mul_ps(d0, dxv), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(t0, t1)), _mm256_mul_ps(d1, dxv), acc1);
        if (q5) {                                       /* + m sx: the rows' mins times the block's scaled sum */
            const __m256 sb = _mm256_set1_ps(sxs[b]);
            acc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16))), sb, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + gs + 16))), sb, acc1);
        }
    }
    _mm256_storeu_ps(out, acc0);
    _mm256_storeu_ps(out + 8, acc1);
}

/* The x8 kind of an interleaved type id, -1 for any other id */
static inline int x8_kind(int qtype) {
    return qtype == Q4_0_X8 ? X8_Q4_0 : qtype == Q8_0_X8 ? X8_Q8_0 : qtype == IQ4_NL_X8 ? X8_IQ4_NL
           : qtype == Q5_1_X8 ? X8_Q5_1 : qtype == Q4_K_X8 ? X8_Q4_K : qtype == MXFP4_X8 ? X8_MXFP4
           : qtype == IQ4_XS_X8 ? X8_IQ4_XS : -1;
}

/* Q4_K_X8's 6-bit scale (sc) and min (mn) of sub-block j in each lane (row), from the lanes' 12 scale bytes as three
 * words s0, s1, s2 (bytes 0-3, 4-7, 8-11): GGML's get_scale_min_k4 */
static inline __m256i x8_q4k_sc(__m256i s0, __m256i s2, int j) {
    if (j < 4) return _mm256_and_si256(_mm256_srli_epi32(s0, 8 * j), _mm256_set1_epi32(63));
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(s2, 8 * (j - 4)), _mm256_set1_epi32(15)),
                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(s0, 8 * (j - 4) + 6),
                                                              _mm256_set1_epi32(3)), 4));
}
static inline __m256i x8_q4k_mn(__m256i s1, __m256i s2, int j) {
    if (j < 4) return _mm256_and_si256(_mm256_srli_epi32(s1, 8 * j), _mm256_set1_epi32(63));
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(s2, 8 * (j - 4) + 4), _mm256_set1_epi32(15)),
                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(s1, 8 * (j - 4) + 6),
                                                              _mm256_set1_epi32(3)), 4));
}

/* acc + one chunk of a Q4_K_X8 group: sub-blocks j, j + 1 with integer sums lo, hi; d, dmin and the scale words s0-s2
 * of the group's rows; dx, sx at the chunk's first 32-block */
static inline __m256 x8_q4k_chunk(__m256 acc, __m256i lo, __m256i hi, __m256 d, __m256 dmin, __m256i s0, __m256i s1,
                                  __m256i s2, int j, const float *dx, const float *sx) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(d, _mm256_mul_ps(
        _mm256_cvtepi32_ps(x8_q4k_sc(s0, s2, j)), _mm256_set1_ps(dx[0]))), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(d, _mm256_mul_ps(
        _mm256_cvtepi32_ps(x8_q4k_sc(s0, s2, j + 1)), _mm256_set1_ps(dx[1]))), acc);
    acc = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(x8_q4k_mn(s1, s2, j))), _mm256_set1_ps(sx[0]), acc);
    return _mm256_fnmadd_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(x8_q4k_mn(s1, s2, j + 1))), _mm256_set1_ps(sx[1]),
                            acc);
}

/* IQ4_XS rows interleaved by 8 (IQ4_XS_X8), groups at w and w + gs (16 rows), nsb super-blocks: per group and
 * super-block (1088 bytes) the 8 rows' d (16 bytes) and scales_h (16), then 33 4-byte groups of the 8 rows (32 bytes
 * each, row r at 4r): the 4 scales_l bytes, then sub-block ib's 16 quant bytes as words 1 + 4ib .. 4 + 4ib (IQ4_NL's
 * nibble layout). Per sub-block 8 dot products per group of the codebook values + 128 (m: -128 x the 32-block's sum of
 * int8 x, as IQ4_NL_X8), then d (ls - 32) dx in float, the 6-bit ls decoded in the lanes. The prefetch runs an eighth
 * of a block per sub-block (all of a block's lines at its start read slower from RAM than the row kernel). */
static inline __attribute__((always_inline)) void moe_x8_iq4xs_group2(const uint8_t *w, int64_t gs, const int8_t *qx,
                                                                      const float *dx, const int32_t *m, int64_t nsb,
                                                                      const uint8_t *pf_end, int64_t ahead,
                                                                      float *out) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const __m256i lo = _mm256_set1_epi8(0x0F), m4 = _mm256_set1_epi32(0x0F), m2 = _mm256_set1_epi32(3);
    const uint8_t *pf = w + ahead;
    for (int64_t b = 0; b < nsb; b++, w += 1088) {
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + gs)));
        const __m256i h0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 16)));
        const __m256i h1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + gs + 16)));
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(w + 32));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(w + gs + 32));
        const uint8_t *q = w + 64, *r = w + gs + 64;        /* sub-block ib's words at q + 128 ib */
        int32_t xv[64];
        memcpy(xv, qx + 256 * b, 256);
        for (int ib = 0; ib < 8; ib++) {
            x8_prefetch2(&pf, w + 136 * (ib + 1) + ahead, gs, pf_end);
            __m256i s = _mm256_set1_epi32(m[8 * b + ib]), t = s;
            for (int j = 0; j < 4; j++) {
                const __m256i u = _mm256_loadu_si256((const __m256i *)(q + 128 * ib + 32 * j));
                const __m256i v = _mm256_loadu_si256((const __m256i *)(r + 128 * ib + 32 * j));
                const __m256i xl = _mm256_set1_epi32(xv[8 * ib + j]), xh = _mm256_set1_epi32(xv[8 * ib + 4 + j]);
                s = moe_x8_iq4_dot(s, _mm256_and_si256(u, lo), xl, iq4nl_values);
                s = moe_x8_iq4_dot(s, _mm256_and_si256(_mm256_srli_epi16(u, 4), lo), xh, iq4nl_values);
                t = moe_x8_iq4_dot(t, _mm256_and_si256(v, lo), xl, iq4nl_values);
                t = moe_x8_iq4_dot(t, _mm256_and_si256(_mm256_srli_epi16(v, 4), lo), xh, iq4nl_values);
            }
            const int sh = 8 * (ib / 2) + 4 * (ib % 2);     /* ls = scales_l nibble ib | 2 bits of scales_h << 4 */
            const __m256i ls0 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi32(l0, sh), m4),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h0, 2 * ib), m2), 4));
            const __m256i ls1 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi32(l1, sh), m4),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h1, 2 * ib), m2), 4));
            const __m256 dxb = _mm256_set1_ps(dx[8 * b + ib]), k32 = _mm256_set1_ps(32.f);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(
                _mm256_mul_ps(d0, _mm256_sub_ps(_mm256_cvtepi32_ps(ls0), k32)), dxb), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(
                _mm256_mul_ps(d1, _mm256_sub_ps(_mm256_cvtepi32_ps(ls1), k32)), dxb), acc1);
        }
    }
    _mm256_storeu_ps(out, acc0);
    _mm256_storeu_ps(out + 8, acc1);
}

/* Q4_K rows interleaved by 8 (Q4_K_X8), groups at w and w + gs (16 rows), nsb super-blocks: per group and super-block
 * (1152 bytes) the 8 rows' d (16 bytes), dmin (16), then 35 4-byte groups of the 8 rows (32 bytes each, row r at 4r):
 * the 12 scale bytes (3), the 128 quant bytes (32: chunk c's 8 words at 3 + 8c, low nibbles sub-block 2c, high ones
 * 2c + 1). Per chunk 16 dot products per group (a broadcast x word each) for all 8 rows, then per sub-block
 * d sc dx isum - dmin mn sx in float (sx = dx sum qx). The row kernels (cpu_kq_q8.c) unpack and scale per row. The
 * prefetch runs a quarter of a block per chunk: all of a block's lines at its start read slower from RAM than the row
 * kernel (dev box: gate_up 9.0 -> 12.6 GB/s on 1 thread; docs/perf-log.md, session 14). */
static inline __attribute__((always_inline)) void moe_x8_q4k_group2(const uint8_t *w, int64_t gs, const int8_t *qx,
                                                                    const float *dx, const float *sx, int64_t nsb,
                                                                    const uint8_t *pf_end, int64_t ahead, float *out) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const __m256i lo = _mm256_set1_epi8(0x0F);
    const uint8_t *pf = w + ahead;
    for (int64_t b = 0; b < nsb; b++, w += 1152) {
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + gs)));
        const __m256 n0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16)));
        const __m256 n1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + gs + 16)));
        const __m256i a0 = _mm256_loadu_si256((const __m256i *)(w + 32));
        const __m256i a1 = _mm256_loadu_si256((const __m256i *)(w + 64));
        const __m256i a2 = _mm256_loadu_si256((const __m256i *)(w + 96));
        const __m256i e0 = _mm256_loadu_si256((const __m256i *)(w + gs + 32));
        const __m256i e1 = _mm256_loadu_si256((const __m256i *)(w + gs + 64));
        const __m256i e2 = _mm256_loadu_si256((const __m256i *)(w + gs + 96));
        int32_t xv[64];
        memcpy(xv, qx + 256 * b, 256);
        for (int c = 0; c < 4; c++) {
            x8_prefetch2(&pf, w + 288 * (c + 1) + ahead, gs, pf_end);   /* a quarter of the block per chunk */
            __m256i s0 = _mm256_setzero_si256(), s1 = s0, t0 = s0, t1 = s0;     /* sub-blocks 2c, 2c + 1 */
            for (int g = 0; g < 8; g++) {
                const __m256i u = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * (8 * c + g)));
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + gs + 128 + 32 * (8 * c + g)));
                const __m256i xl = _mm256_set1_epi32(xv[16 * c + g]), xh = _mm256_set1_epi32(xv[16 * c + 8 + g]);
                s0 = moe_dot_u8s8_acc(s0, _mm256_and_si256(u, lo), xl);
                s1 = moe_dot_u8s8_acc(s1, _mm256_and_si256(_mm256_srli_epi16(u, 4), lo), xh);
                t0 = moe_dot_u8s8_acc(t0, _mm256_and_si256(v, lo), xl);
                t1 = moe_dot_u8s8_acc(t1, _mm256_and_si256(_mm256_srli_epi16(v, 4), lo), xh);
            }
            const int64_t j = 8 * b + 2 * c;        /* the 32-block of sub-block 2c */
            acc0 = x8_q4k_chunk(acc0, s0, s1, d0, n0, a0, a1, a2, 2 * c, dx + j, sx + j);
            acc1 = x8_q4k_chunk(acc1, t0, t1, d1, n1, e0, e1, e2, 2 * c, dx + j, sx + j);
        }
    }
    _mm256_storeu_ps(out, acc0);
    _mm256_storeu_ps(out + 8, acc1);
}

/* m[b] = -offset x the sum of block b's int8 x: the stored offset (Q4_0's 8, Q8_0's and IQ4_NL's 128 with VNNI)
 * taken off in the integer sum */
static void x8_offsets(int kind, const int8_t *qx, int64_t nb, int32_t *m) {
    const int off = kind == X8_Q4_0 ? 8 : kind == X8_Q5_1 || kind == X8_Q4_K ? 0 : X8_Q8_OFFSET;
    for (int64_t b = 0; b < nb; b++) {
        int32_t t = 0;
        for (int i = 0; i < 32; i++) t += qx[32 * b + i];
        m[b] = -off * t;
    }
}

/* out[i] = row i . q8 x for n rows (a multiple of 8) of an interleaved matrix of x8 kind `kind` (x8_kind), w at the
 * first byte of a group of 8 (row 8g of the GGML matrix: interleaving keeps each group's bytes in place), rs a row's
 * bytes; 16 rows per kernel call, an odd last group twice and kept once. m: x8_offsets of x, or NULL (computed here
 * where the kind takes them). Prefetch not past pf_end. The miss server's rows of an interleaved RAM bank, and the
 * compiled CPU step's copies (moe_matvec_x8). */
static void moe_x8_rows_at(int kind, const uint8_t *w, int64_t rs, int64_t n, const int8_t *qx, const float *dx,
                           const float *sx, const int32_t *m, int64_t K, const uint8_t *pf_end, int64_t ahead,
                           float *out) {
    const int64_t nb = K / 32, gb = 8 * rs;
    int32_t mine[m || kind == X8_Q4_K ? 1 : nb];    /* Q4_K: no offsets (its mins come off in float) */
    if (!m && kind != X8_Q4_K) {
        x8_offsets(kind, qx, nb, mine);
        m = mine;
    }
    for (int64_t g = 0; g < n / 8; g += 2) {
        float two[16];
        const int pair = g + 1 < n / 8;
        const uint8_t *wg = w + g * gb;
        float *o = pair ? out + 8 * g : two;
        const int64_t gs = pair ? gb : 0;
        if (kind == X8_Q4_K) moe_x8_q4k_group2(wg, gs, qx, dx, sx, K / 256, pf_end, ahead, o);
        else if (kind == X8_IQ4_XS) moe_x8_iq4xs_group2(wg, gs, qx, dx, m, K / 256, pf_end, ahead, o);
        else if (kind == X8_Q8_0) moe_x8_group2(X8_Q8_0, wg, gs, qx, dx, sx, m, nb, pf_end, ahead, o);
        else if (kind == X8_IQ4_NL) moe_x8_group2(X8_IQ4_NL, wg, gs, qx, dx, sx, m, nb, pf_end, ahead, o);
        else if (kind == X8_Q5_1) moe_x8_group2(X8_Q5_1, wg, gs, qx, dx, sx, m, nb, pf_end, ahead, o);
        else if (kind == X8_MXFP4) moe_x8_group2(X8_MXFP4, wg, gs, qx, dx, sx, m, nb, pf_end, ahead, o);
        else moe_x8_group2(X8_Q4_0, wg, gs, qx, dx, sx, m, nb, pf_end, ahead, o);
        if (!pair) memcpy(out + 8 * g, two, sizeof(float) * 8);
    }
}

/* moe_x8_rows_at PREFETCH_AHEAD bytes ahead: the experts and the miss server */
static void moe_x8_rows(int kind, const uint8_t *w, int64_t rs, int64_t n, const int8_t *qx, const float *dx,
                        const float *sx, const int32_t *m, int64_t K, const uint8_t *pf_end, float *out) {
    moe_x8_rows_at(kind, w, rs, n, qx, dx, sx, m, K, pf_end, PREFETCH_AHEAD, out);
}

#ifndef X8_DENSE_AHEAD          /* MOETIER_X8_DENSE_AHEAD=N at build time (kernels.cpu.build_library): A/B only */
#define X8_DENSE_AHEAD 0        /* 0: the next pair of groups (2 x 8 rows) */
#endif
/* The dense one-token matvec's prefetch distance (moe_matvec_x8). On 1-2 threads a core streams a big matrix alone,
 * and PREFETCH_AHEAD (inside the pair of groups at hand) left it waiting on RAM. The 2-core Zen 4 dev box, 1 thread,
 * a 151936 x 2048 Q4_0 lm_head (175 MB), median of 6 processes each: 4 KB ahead 11.6 GB/s, 12 KB 12.4, 16 KB 12.9,
 * the next pair of groups (18 KB) 13.2; a 2-layer 30B-A3B file's eager decode 45-50 -> 56-61 tok/s (docs/perf-log.md,
 * session 33). The experts' x8 rows at that distance: no difference there. More threads keep PREFETCH_AHEAD (not
 * timed). */
static inline int64_t x8_dense_ahead(int64_t gb, int nthreads) {
    const int64_t next = X8_DENSE_AHEAD ? X8_DENSE_AHEAD : 2 * gb;
    return nthreads <= 2 && next > PREFETCH_AHEAD ? next : PREFETCH_AHEAD;
}

/* y[N] = W x for W rows interleaved by 8 of type `qtype` (an INTERLEAVED id; N a multiple of 8), x rounded to int8
 * per 32 values */
static int moe_matvec_x8(int qtype, const uint8_t *w, int64_t N, int64_t K, const float *x, float *y, int nthreads) {
    const int kind = x8_kind(qtype), base = qtype & 0xFF;
    if (N % 8 || K % block_elems(base)) return -1;
    const int64_t nb = K / 32, gb = 8 * (K / block_elems(base) * block_bytes(base));    /* bytes per 8 rows */
    char *mem = malloc((2 * sizeof(float) + sizeof(int32_t)) * nb + K + 64);
    if (!mem) return -2;
    float *dx = (float *)mem, *sx = dx + nb;
    int32_t *m = (int32_t *)(sx + nb);
    int8_t *qx = (int8_t *)(m + nb);
    moe_quantize_q8(x, K, qx, dx, sx);
    x8_offsets(kind, qx, nb, m);                    /* IQ4_NL's codebook + 128: as Q8_0's */
    if (nthreads > 1 + N / 8 * gb / MIN_BYTES_PER_THREAD) nthreads = (int)(1 + N / 8 * gb / MIN_BYTES_PER_THREAD);
    const int64_t ahead = x8_dense_ahead(gb, nthreads);
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t g = 0; g < N / 8; g += 2)          /* 16 rows a step (moe_x8_rows: an odd last group once) */
        moe_x8_rows_at(kind, w + g * gb, gb / 8, N / 8 - g < 2 ? 8 : 16, qx, dx, sx, m, K, w + N / 8 * gb, ahead,
                       y + 8 * g);
    free(mem);
    return 0;
}

/* moetier_moe_tokens on experts whose gate / up / down rows are interleaved by 8 (x8 ids, checked there): x and each
 * pair's h rounded to int8 per 32 values once (with x8_offsets), then 16 rows a task (moe_x8_rows) where the rows
 * divide by 16, else 8. Rows in lanes, as the dense copies (12.7 against 9.6 GB/s for a Q4_0 lm_head on one Zen 4
 * thread, session 23); the sums per row are the x8 kernels' (not bit-equal to the row kernels'). */
static int moe_tokens_x8(int gq, int dq, const uint8_t *gate, const uint8_t *up, int64_t g_estride, int64_t g_rstride,
                         const uint8_t *down, int64_t d_estride, int64_t d_rstride, int64_t D, int64_t I, int64_t T,
                         int64_t k, const int64_t *ids, const float *w, const float *x, float *y, int nthreads) {
    const int gk = x8_kind(gq), dk = x8_kind(dq);
    const int64_t nbx = D / 32, nbh = I / 32;
    /* scratch: h [k, 2I]; x: q [D], dx, sx [D/32], m [D/32]; h: q [k I], dx, sx, m [k, I/32] */
    char *mem = malloc(sizeof(float) * (2 * k * I + 2 * nbx + 2 * k * nbh) + sizeof(int32_t) * (nbx + k * nbh)
                       + D + k * I + 64);
    if (!mem) return -2;
    float *h = (float *)mem, *dx = h + 2 * k * I, *sx = dx + nbx, *dh = sx + nbx, *sh = dh + k * nbh;
    int32_t *mx = (int32_t *)(sh + k * nbh), *mh = mx + nbx;
    int8_t *qx = (int8_t *)(mh + k * nbh), *qh = qx + D;
    const int64_t bytes = 2 * k * I * g_rstride + k * D * d_rstride;
    if (nthreads > 1 + bytes / MIN_BYTES_PER_THREAD) nthreads = (int)(1 + bytes / MIN_BYTES_PER_THREAD);
    const int64_t gstep = I % 16 ? 8 : 16, dstep = D % 16 ? 8 : 16;
    for (int64_t t = 0; t < T; t++) {
        const int64_t *e = ids + t * k;
        moe_quantize_q8(x + t * D, D, qx, dx, sx);
        x8_offsets(gk, qx, nbx, mx);
        /* rows r < k I: gate of pair r / I; the rest: up */
        #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
        for (int64_t r = 0; r < 2 * k * I; r += gstep) {
            const int64_t j = (r / I) % k, row = r % I;
            const uint8_t *wr = (r < k * I ? gate : up) + e[j] * g_estride + row * g_rstride;
            moe_x8_rows(gk, wr, g_rstride, gstep, qx, dx, sx, gk == X8_Q4_K ? NULL : mx, D,
                        wr + 2 * gstep * g_rstride, h + r);
        }
        for (int64_t j = 0; j < k; j++) {
            float *a = h + j * I;                         /* silu(gate) * up, in place of the gates */
            const float *u = h + k * I + j * I;
            for (int64_t i = 0; i < I; i++) a[i] = a[i] / (1.f + expf(-a[i])) * u[i];
            moe_quantize_q8(a, I, qh + j * I, dh + j * nbh, sh + j * nbh);
            x8_offsets(dk, qh + j * I, nbh, mh + j * nbh);
        }
        float *yt = y + t * D;
        const float *wt = w + t * k;
        #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
        for (int64_t d = 0; d < D; d += dstep) {
            float s[16] = {0.f}, r[16];
            for (int64_t j = 0; j < k; j++) {
                const uint8_t *wr = down + e[j] * d_estride + d * d_rstride;
                moe_x8_rows(dk, wr, d_rstride, dstep, qh + j * I, dh + j * nbh, sh + j * nbh,
                            dk == X8_Q4_K ? NULL : mh + j * nbh, I, wr + 2 * dstep * d_rstride, r);
                for (int64_t i = 0; i < dstep; i++) s[i] += wt[j] * r[i];
            }
            for (int64_t i = 0; i < dstep; i++) yt[d + i] = s[i];
        }
    }
    free(mem);
    return 0;
}
#endif

/* In place: n rows (a multiple of 8) of row_bytes bytes of GGML type qtype (moetier_x8_supported's) -> rows
 * interleaved by 8 as kernels.cpu.interleave_rows lays them out (inverse: back; its twin deinterleave_rows):
 * per group of 8 rows and block, each header field of the 8 rows, then each 4-byte group of the quants of the 8
 * rows (Q8_0's int8 values + 128). A group's bytes stay where they were. Threads over groups. The RAM bank's
 * experts for the miss server (memory/doorbell.py). 0, -1 for another type or n, -2 if out of memory. */
int moetier_interleave8(uint8_t *w, int64_t n, int64_t row_bytes, int qtype, int inverse, int nthreads) {
    static const int q4_0[] = {2, 0}, q5_1[] = {2, 2, 4, 0}, q4_k[] = {2, 2, 0}, fp4[] = {1, 0};   /* header bytes */
    const int *fields = qtype == Q5_1 ? q5_1 : qtype == Q4_K || qtype == IQ4_XS ? q4_k : qtype == MXFP4 ? fp4 : q4_0;
    if ((qtype != Q4_0 && qtype != Q8_0 && qtype != IQ4_NL && qtype != Q5_1 && qtype != Q4_K && qtype != MXFP4
         && qtype != IQ4_XS) || n % 8
        || row_bytes % block_bytes(qtype))
        return -1;
    const int64_t bb = block_bytes(qtype), nb = row_bytes / bb, gb = 8 * row_bytes;
    const uint8_t flip = qtype == Q8_0 ? 0x80 : 0;
    int bad = 0;
    #pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) reduction(|:bad)
    {
        uint8_t *tmp = malloc((size_t)gb);
        if (!tmp) bad = 1;
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < n / 8; g++) {
            if (!tmp) continue;
            uint8_t *grp = w + g * gb;
            for (int64_t b = 0; b < nb; b++) {
                uint8_t *x8 = (inverse ? grp : tmp) + b * 8 * bb;          /* the interleaved block */
                int64_t off = 0, out = 0;
                for (const int *f = fields; *f; out += 8 * *f, off += *f, f++)
                    for (int r = 0; r < 8; r++) {
                        uint8_t *row = (inverse ? tmp : grp) + r * row_bytes + b * bb + off;
                        if (inverse) memcpy(row, x8 + out + r * *f, *f);
                        else memcpy(x8 + out + r * *f, row, *f);
                    }
                for (int64_t j = 0; j < (bb - off) / 4; j++)
                    for (int r = 0; r < 8; r++) {
                        uint8_t *row = (inverse ? tmp : grp) + r * row_bytes + b * bb + off + 4 * j;
                        uint8_t *lane = x8 + out + 32 * j + 4 * r;
                        for (int i = 0; i < 4; i++) {
                            if (inverse) row[i] = lane[i] ^ flip;
                            else lane[i] = row[i] ^ flip;
                        }
                    }
            }
            memcpy(grp, tmp, (size_t)gb);
        }
        free(tmp);
    }
    return bad ? -2 : 0;
}

/* 1 where moetier_matvec_q8 reads GGML type `qtype`'s rows interleaved (0x100 | qtype): int8 activations built */
int moetier_x8_supported(int qtype) {
#ifdef MOE_Q8
    return qtype == Q4_0 || qtype == Q8_0 || qtype == IQ4_NL || qtype == Q5_1 || qtype == Q4_K || qtype == MXFP4
           || qtype == IQ4_XS;
#else
    (void)qtype;
    return 0;
#endif
}

/* y[N] = W[N, K] @ x[K] for Q4_0 / Q8_0 / MXFP4 / IQ3_XXS W with x rounded to int8 per 32 values (llama.cpp's Q8_0
 * activations; ~1% relative error): integer dot products; 0x100 | id: rows interleaved by 8 (row_stride unused).
 * Other types: as moetier_matvec. Returns 0, -1 for an unsupported type / K, -2 if out of memory. */
int moetier_matvec_q8(int qtype, const uint8_t *w, int64_t row_stride, int64_t N, int64_t K,
                      const float *x, float *y, int nthreads) {
#ifdef MOE_Q8
    if (x8_kind(qtype) >= 0) return moe_matvec_x8(qtype, w, N, K, x, y, nthreads);
    if (!moe_q8_type(qtype)) return moetier_matvec(qtype, w, row_stride, N, K, x, y, nthreads);
    if (K % block_elems(qtype)) return -1;
    char *mem = malloc((sizeof(float) + sizeof(int32_t)) * (K / 32) + K + 64);
    if (!mem) return -2;
    float *dx = (float *)mem;
    float *sx = dx + K / 32;
    int8_t *qx = (int8_t *)(sx + K / 32);
    moe_quantize_q8(x, K, qx, dx, sx);
    const int64_t bytes = N * (K / block_elems(qtype)) * block_bytes(qtype);
    if (nthreads > 1 + bytes / MIN_BYTES_PER_THREAD) nthreads = (int)(1 + bytes / MIN_BYTES_PER_THREAD);
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n += 4)      /* 4 rows share x loads (moe_rows_run_q8; a tail of 1-3 rows one by one) */
        moe_rows_run_q8(qtype, w + n * row_stride, row_stride, N - n < 4 ? N - n : 4, qx, dx, sx, K,
                        w + (N - n < 8 ? N : n + 8) * row_stride, y + n);
    free(mem);
    return 0;
#else
    return moetier_matvec(qtype, w, row_stride, N, K, x, y, nthreads);
#endif
}
