"""Decode GEMV kernels, variant "v2" (all quantized formats): quant planes read as int32 words.

Why (H200 Qwen3-30B-A3B decode, v1 measured 16-38% of HBM copy for Q4/Q8): at full bandwidth an
SM gets ~16.5 B/clk for 128 lanes/clk, ~4 thread-instructions per 4-bit weight. v1 spent 6-8 per
weight in gate_up and 9-13 in down (sm_90 SASS, bench --compile-sm90); v2 4.9-5.5 and 5.4-6.5:
  - each program streams BN rows x NB blocks per K step as [BN, NB, words] int32 tiles (16-byte
    vector loads); x is gathered per field position (L1) and reused over the rows a thread holds;
  - a field becomes a float by one shift + one LOP3 ((w >> s) & mask | one: 1.0's bits, passed as
    the runtime argument `one` so that mask and OR fuse) + one FFMA with x: f = 1 + q / 2^bits,
    exact. For 4-bit fields one shift per byte serves both nibbles (low at 1 + q/256, high at
    1 + q/16). The offset (f - 1, the zero point) is taken out per block with sums of x;
  - one scale (and min) per block per row, applied to the block's partial sum; the token weight of
    the down projection multiplies the per-block sums, not every x element;
  - h between the projections is kept in float32 (values rounded to x's dtype first, as the twin
    does): the down kernel's x loads need no conversion.
Blocks of a step: Q8_0 / Q4_0 / MXFP4 / IQ3_XXS / IQ2_XXS 32 elements, Q4_K / Q5_K 64 (two 32-sub-blocks),
Q6_K / Q2_K / Q3_K 128 (half a super-block). Each `_dot_*` returns [BN, NB] scaled partial dot products.
Planes (moetier.quant.repack; word planes as int32 views): q (qs / ql), d, dmin, sc, mn, h (qh / sg / hm).
Q4_K / Q5_K read d and sc as words too (triton_weights): a super-block's (d, dmin) in one (`k_dmin`), a
64-chunk's sc_lo, sc_hi, mn_lo, mn_hi in another (`k_byte`), where six loads were.
"""
from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from .triton_rawq import FIRST_RAW, deq_raw
from .triton_tiles import e8m0_half
from .triton_weights import RAW_FORMATS

Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ3_XXS, IQ2_XXS, Q2_K, Q3_K = (tl.constexpr(c) for c in range(1, 11))
STEP_BLOCK = {"Q8_0": 32, "Q4_0": 32, "Q4_K": 64, "Q5_K": 64, "Q6_K": 128, "MXFP4": 32, "IQ3_XXS": 32, "IQ2_XXS": 32,
              "Q2_K": 128, "Q3_K": 128, **{f: 32 for f in RAW_FORMATS}}
ONE_BITS = 0x3F800000                  # bits of 1.0f: the kernels' `one` argument (module doc)
SWIGLU = tl.constexpr(0)


@triton.jit
def _act(g, u, ACT: tl.constexpr, alpha, limit):
    if ACT == SWIGLU:                         # SwiGLU: silu(gate) * up
        return g * tl.sigmoid(g) * u
    else:                                     # GPT-OSS: clamped, (up + 1) * gate * sigmoid(alpha * gate)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return (u + 1.0) * (g * tl.sigmoid(g * alpha))


@triton.jit
def _field(w, SH: tl.constexpr, M: tl.constexpr):
    """(w << SH) & M, a right shift when SH < 0 (arithmetic; the mask drops the sign copies)."""
    if SH >= 0:
        return (w << SH) & M
    else:
        return (w >> (-SH)) & M


@triton.jit
def _f(bits, one):
    """bits | one (the bits of 1.0f, a runtime argument so that mask and OR fuse into one LOP3)."""
    return (bits | one).to(tl.float32, bitcast=True)


@triton.jit
def k_dmin(w):
    """A Q4_K / Q5_K d word (d in the low fp16 half, dmin in the high one) -> d, dmin as float32."""
    d = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return d, (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def k_byte(w, B: tl.constexpr):
    """Byte B of a Q4_K / Q5_K sc word (0 sc_lo, 1 sc_hi, 2 mn_lo, 3 mn_hi) as float32."""
    return ((w >> (8 * B)) & 0xFF).to(tl.float32)


@triton.jit
def _xload(x_ptr, xo, idx, mg):
    return tl.load(x_ptr + xo + idx, mask=mg, other=0.0).to(tl.float32)


@triton.jit
def _dot_q8_0(q_ptr, d_ptr, rq, rd, mask, g0, NBK, x_ptr, xo, one, NB: tl.constexpr):
    """32-blocks of 8 words; byte b of word w = element 4w + b. f = 1 + (q + 128) / 256."""
    g = g0 + tl.arange(0, NB)
    mg = g < NBK
    wi = tl.arange(0, 8)
    words = tl.load(q_ptr + rq[:, None, None] + (g[:, None] * 8 + wi[None, :])[None, :, :],
                    mask=(mask[:, None] & mg[None, :])[:, :, None], other=0)
    p = tl.zeros(words.shape, dtype=tl.float32)
    sx = tl.zeros([NB, 8], dtype=tl.float32)
    one8 = one | 0x400000                                  # 1.0 with the byte's top bit flipped: q + 128
    for b in tl.static_range(4):
        x = _xload(x_ptr, xo, g[:, None] * 32 + wi[None, :] * 4 + b, mg[:, None])
        f = (_field(words, 15 - 8 * b, 0x7F8000) ^ one8).to(tl.float32, bitcast=True)
        p += f * x[None, :, :]
        sx += x
    d = tl.load(d_ptr + rd[:, None] + g[None, :], mask=mask[:, None] & mg[None, :], other=0.0).to(tl.float32)
    return d * (256.0 * tl.sum(p, axis=2) - 384.0 * tl.sum(sx, axis=1)[None, :])


@triton.jit
def _shift(w, SH: tl.constexpr):
    if SH >= 0:
        return w << SH
    else:
        return w >> (-SH)


@triton.jit
def _dot_q4_0(q_ptr, d_ptr, rq, rd, mask, g0, NBK, x_ptr, xo, one, NB: tl.constexpr, MX: tl.constexpr):
    """32-blocks of 4 words; byte b of word w holds elements 4w + b (low nibble), + 16 (high).
    Q4_0: one shift per byte puts the low nibble at bits 15-18 (f = 1 + q / 256) and the high one at
    19-22 (f = 1 + q / 16); value q - 8. MXFP4: the nibble (sign, 2-bit exponent, 1-bit mantissa,
    doubled E2M1) placed into fp16 bits = value * 2^-15 (fp16 subnormals convert exactly)."""
    g = g0 + tl.arange(0, NB)
    mg = g < NBK
    m2 = mask[:, None] & mg[None, :]
    wi = tl.arange(0, 4)
    words = tl.load(q_ptr + rq[:, None, None] + (g[:, None] * 4 + wi[None, :])[None, :, :],
                    mask=m2[:, :, None], other=0)
    p_lo = tl.zeros(words.shape, dtype=tl.float32)
    p_hi = tl.zeros(words.shape, dtype=tl.float32)
    sx_lo = tl.zeros([NB, 4], dtype=tl.float32)
    sx_hi = tl.zeros([NB, 4], dtype=tl.float32)
    for b in tl.static_range(4):
        x_lo = _xload(x_ptr, xo, g[:, None] * 32 + wi[None, :] * 4 + b, mg[:, None])
        x_hi = _xload(x_ptr, xo, g[:, None] * 32 + wi[None, :] * 4 + b + 16, mg[:, None])
        if MX:
            for h in tl.static_range(2):
                hb = _field(words, 9 - 8 * b - 4 * h, 0x0E00) | _field(words, 12 - 8 * b - 4 * h, 0x8000)
                v = hb.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                if h == 0:
                    p_lo += v * x_lo[None, :, :]
                else:
                    p_hi += v * x_hi[None, :, :]
        else:
            t = _shift(words, 15 - 8 * b)
            p_lo += _f(t & 0x78000, one) * x_lo[None, :, :]
            p_hi += _f(t & 0x780000, one) * x_hi[None, :, :]
            sx_lo += x_lo
            sx_hi += x_hi
    if MX:                                             # d = 2^(e - 128) (e8m0_half) * 2^15
        e = tl.load(d_ptr + rd[:, None] + g[None, :], mask=m2, other=0).to(tl.int32)
        d = e8m0_half(e) * 32768.0
        return d * tl.sum(p_lo + p_hi, axis=2)
    else:
        d = tl.load(d_ptr + rd[:, None] + g[None, :], mask=m2, other=0.0).to(tl.float32)
        s_lo = tl.sum(sx_lo, axis=1)[None, :]
        s_hi = tl.sum(sx_hi, axis=1)[None, :]
        return d * (256.0 * (tl.sum(p_lo, axis=2) - s_lo) + 16.0 * (tl.sum(p_hi, axis=2) - s_hi) - 8.0 * (s_lo + s_hi))


@triton.jit
def _dot_q45_k(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, c0, NCK, x_ptr, xo, one, NB: tl.constexpr,
               Q5: tl.constexpr):
    """64-chunks c of 8 words; byte b of word w holds elements 64c + 4w + b (low nibble, sub-block 2c)
    and + 32 (high, sub-block 2c + 1). Q4_K: one shift per byte, the low nibble to bits 15-18
    (f = 1 + q / 256), the high one to 19-22 (1 + q / 16). Q5_K: the 5th bit is bit 8b + 2 (c % 4) + h
    of qh word 8 (c // 4) + w; q at bits 18-22 (f = 1 + q / 32). Value d * sc * q - dmin * mn: (d, dmin)
    from d word c // 4, the sub-blocks' sc and mn from sc word c."""
    c = c0 + tl.arange(0, NB)
    mc = c < NCK
    m2 = mask[:, None] & mc[None, :]
    wi = tl.arange(0, 8)
    words = tl.load(q_ptr + rq[:, None, None] + (c[:, None] * 8 + wi[None, :])[None, :, :],
                    mask=m2[:, :, None], other=0)
    if Q5:
        hw = tl.load(h_ptr + rh[:, None, None] + ((c // 4)[:, None] * 8 + wi[None, :])[None, :, :],
                     mask=m2[:, :, None], other=0)
        hw = hw >> (2 * (c % 4))[None, :, None]            # bit 8b + h: high bit of nibble (b, h)
    p_lo = tl.zeros(words.shape, dtype=tl.float32)
    p_hi = tl.zeros(words.shape, dtype=tl.float32)
    sx_lo = tl.zeros([NB, 8], dtype=tl.float32)
    sx_hi = tl.zeros([NB, 8], dtype=tl.float32)
    for b in tl.static_range(4):
        x_lo = _xload(x_ptr, xo, c[:, None] * 64 + wi[None, :] * 4 + b, mc[:, None])
        x_hi = _xload(x_ptr, xo, c[:, None] * 64 + wi[None, :] * 4 + b + 32, mc[:, None])
        if Q5:
            f_lo = _f(_field(words, 18 - 8 * b, 0x3C0000) | _field(hw, 22 - 8 * b, 0x400000), one)
            f_hi = _f(_field(words, 14 - 8 * b, 0x3C0000) | _field(hw, 21 - 8 * b, 0x400000), one)
        else:
            t = _shift(words, 15 - 8 * b)
            f_lo = _f(t & 0x78000, one)
            f_hi = _f(t & 0x780000, one)
        p_lo += f_lo * x_lo[None, :, :]
        p_hi += f_hi * x_hi[None, :, :]
        sx_lo += x_lo
        sx_hi += x_hi
    d, dm = k_dmin(tl.load(d_ptr + rd[:, None] + (c // 4)[None, :], mask=m2, other=0))
    sw = tl.load(sc_ptr + rsc[:, None] + c[None, :], mask=m2, other=0)
    sc_lo, sc_hi, mn_lo, mn_hi = k_byte(sw, 0), k_byte(sw, 1), k_byte(sw, 2), k_byte(sw, 3)
    s_lo = tl.sum(sx_lo, axis=1)[None, :]
    s_hi = tl.sum(sx_hi, axis=1)[None, :]
    u_lo = 32.0 if Q5 else 256.0                        # sum q x = u * (sum f x - sum x)
    u_hi = 32.0 if Q5 else 16.0
    return (d * (sc_lo * (u_lo * (tl.sum(p_lo, axis=2) - s_lo)) + sc_hi * (u_hi * (tl.sum(p_hi, axis=2) - s_hi)))
            - dm * (mn_lo * s_lo + mn_hi * s_hi))


@triton.jit
def _dot_q6_k(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, c0, NCK, x_ptr, xo, one, NB: tl.constexpr):
    """128-chunks c (half a super-block): ql words a = 16c + w, b = 16c + 8 + w, qh word 8c + w,
    w < 8. Byte j of word w (l = 4w + j) gives element 128c + l + 32m, m = 0..3: the low (m = 0, 1) or
    high (m = 2, 3) nibble of ql word a (m even) or b (m odd), 2 high bits at 8j + 2m of the qh word.
    Scale sc[8c + 2m + (w >= 4)]; f = 1 + q / 64, value d * sc * (q - 32)."""
    c = c0 + tl.arange(0, NB)
    mc = c < NCK
    m2 = mask[:, None] & mc[None, :]
    m3 = m2[:, :, None]
    wi = tl.arange(0, 8)
    wa = tl.load(q_ptr + rq[:, None, None] + (c[:, None] * 16 + wi[None, :])[None, :, :], mask=m3, other=0)
    wb = tl.load(q_ptr + rq[:, None, None] + (c[:, None] * 16 + 8 + wi[None, :])[None, :, :], mask=m3, other=0)
    wh = tl.load(h_ptr + rh[:, None, None] + (c[:, None] * 8 + wi[None, :])[None, :, :], mask=m3, other=0)
    d = tl.load(d_ptr + rd[:, None] + (c // 2)[None, :], mask=m2, other=0.0).to(tl.float32)
    acc = tl.zeros(wa.shape, dtype=tl.float32)
    for m in tl.static_range(4):
        p = tl.zeros(wa.shape, dtype=tl.float32)
        sx = tl.zeros([NB, 8], dtype=tl.float32)
        for j in tl.static_range(4):
            x = _xload(x_ptr, xo, c[:, None] * 128 + wi[None, :] * 4 + (j + 32 * m), mc[:, None])
            lo = _field(wa if m % 2 == 0 else wb, 17 - 8 * j - 4 * (m // 2), 0x1E0000)
            p += _f(lo | _field(wh, 21 - 8 * j - 2 * m, 0x600000), one) * x[None, :, :]
            sx += x
        sc = tl.load(sc_ptr + rsc[:, None, None] + (c[:, None] * 8 + 2 * m + wi[None, :] // 4)[None, :, :],
                     mask=m3, other=0).to(tl.float32)
        acc += sc * (64.0 * p - 96.0 * sx[None, :, :])
    return d * tl.sum(acc, axis=2)


@triton.jit
def _dot_q23_k(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, c0, NCK, x_ptr, xo, one, NB: tl.constexpr,
               Q3: tl.constexpr):
    """128-chunks c (half a super-block) of q words 8c + w, w < 8: bits 2m, 2m + 1 of byte j of word w (l = 4w + j)
    are the 2 low bits of element 128c + 32m + l, m = 0..3; its 16-sub-block 8c + 2m + (w >= 4). Q2_K: q at bits
    21-22 (f = 1 + q / 4), value d * sc * q - dmin * mn: (d, dmin) from d word c // 2, (sc | mn << 4) bytes from sc
    words 2c, 2c + 1. Q3_K: the high bit h, bit 4 (c % 2) + m of byte j of hm word 8 (c // 2) + w, at bit 22 over the
    2 low bits at 20-21 (f = 1 + u / 8, u = q + 4h), value d * sc * (u - 4), sc int8 bytes, d per super-block."""
    c = c0 + tl.arange(0, NB)
    mc = c < NCK
    m2 = mask[:, None] & mc[None, :]
    m3 = m2[:, :, None]
    wi = tl.arange(0, 8)
    words = tl.load(q_ptr + rq[:, None, None] + (c[:, None] * 8 + wi[None, :])[None, :, :], mask=m3, other=0)
    if Q3:
        hw = tl.load(h_ptr + rh[:, None, None] + ((c // 2)[:, None] * 8 + wi[None, :])[None, :, :], mask=m3, other=0)
        hw = hw >> (4 * (c % 2))[None, :, None]            # bit 8j + m: high bit of element (m, 4w + j)
    else:
        s0 = tl.load(sc_ptr + rsc[:, None] + (2 * c)[None, :], mask=m2, other=0)[:, :, None]
        s1 = tl.load(sc_ptr + rsc[:, None] + (2 * c + 1)[None, :], mask=m2, other=0)[:, :, None]
    acc = tl.zeros(words.shape, dtype=tl.float32)
    acc_m = tl.zeros(words.shape, dtype=tl.float32)
    for m in tl.static_range(4):
        p = tl.zeros(words.shape, dtype=tl.float32)
        sx = tl.zeros([NB, 8], dtype=tl.float32)
        for j in tl.static_range(4):
            x = _xload(x_ptr, xo, c[:, None] * 128 + wi[None, :] * 4 + (j + 32 * m), mc[:, None])
            if Q3:
                f = _f(_field(words, 20 - 8 * j - 2 * m, 0x300000) | _field(hw, 22 - 8 * j - m, 0x400000), one)
            else:
                f = _f(_field(words, 21 - 8 * j - 2 * m, 0x600000), one)
            p += f * x[None, :, :]
            sx += x
        if Q3:                 # sum (u - 4) x = 8 (p - sum x) - 4 sum x
            sc = tl.load(sc_ptr + rsc[:, None, None] + (c[:, None] * 8 + 2 * m + wi[None, :] // 4)[None, :, :],
                         mask=m3, other=0).to(tl.float32)
            acc += sc * (8.0 * p - 12.0 * sx[None, :, :])
        else:                  # the sub-block's byte: 2 (m % 2) + (w >= 4) of sc word 2c + m // 2
            b = ((s0 if m < 2 else s1) >> (8 * (2 * (m % 2) + wi // 4))[None, None, :]) & 0xFF
            acc += (b & 15).to(tl.float32) * (4.0 * p - 4.0 * sx[None, :, :])
            acc_m += (b >> 4).to(tl.float32) * sx[None, :, :]
    if Q3:
        d = tl.load(d_ptr + rd[:, None] + (c // 2)[None, :], mask=m2, other=0.0).to(tl.float32)
        res = d * tl.sum(acc, axis=2)
    else:
        d, dm = k_dmin(tl.load(d_ptr + rd[:, None] + (c // 2)[None, :], mask=m2, other=0))
        res = d * tl.sum(acc, axis=2) - dm * tl.sum(acc_m, axis=2)
    return res


@triton.jit
def _dot_iq_xxs(q_ptr, d_ptr, sc_ptr, h_ptr, lut_ptr, rq, rd, rsc, rh, mask, g0, NBK, x_ptr, xo,
                FMT: tl.constexpr, NB: tl.constexpr):
    """IQ3_XXS: 32-blocks of 2 grid-index words; byte j of word w -> grid row (4 values, float table lut) of
    elements 16w + 4j .. + 3. IQ2_XXS: one word; byte j -> grid row (8 values) of elements 8j .. + 7. Sign of
    element e = bit e of the sg word (h plane); scale d * (0.5 + sc) * 0.5 (IQ2_XXS: * 0.25)."""
    W: tl.constexpr = 1 if FMT == IQ2_XXS else 2           # words a block
    G: tl.constexpr = 8 if FMT == IQ2_XXS else 4           # grid values a byte
    HALF: tl.constexpr = 0.25 if FMT == IQ2_XXS else 0.5
    g = g0 + tl.arange(0, NB)
    mg = g < NBK
    m2 = mask[:, None] & mg[None, :]
    wi = tl.arange(0, W)
    words = tl.load(q_ptr + rq[:, None, None] + (g[:, None] * W + wi[None, :])[None, :, :],
                    mask=m2[:, :, None], other=0)
    sg = tl.load(h_ptr + rh[:, None] + g[None, :], mask=m2, other=0)[:, :, None]
    p = tl.zeros(words.shape, dtype=tl.float32)
    for j in tl.static_range(4):
        row = _field(words, -8 * j, 0xFF) * G
        for v in tl.static_range(G):
            e = wi * (4 * G) + (G * j + v)                                # [W]
            gv = tl.load(lut_ptr + row + v).to(tl.int32, bitcast=True)
            sign = (sg << (31 - e)[None, None, :]) & -2147483648
            x = _xload(x_ptr, xo, g[:, None] * 32 + e[None, :], mg[:, None])
            p += (gv ^ sign).to(tl.float32, bitcast=True) * x[None, :, :]
    d = tl.load(d_ptr + rd[:, None] + (g // 8)[None, :], mask=m2, other=0.0).to(tl.float32)
    sc = tl.load(sc_ptr + rsc[:, None] + g[None, :], mask=m2, other=0).to(tl.float32)
    return (d * (0.5 + sc) * HALF) * tl.sum(p, axis=2)


@triton.jit
def _dot_raw(q_ptr, lut_ptr, rq, mask, g0, NBK, x_ptr, xo, FMT: tl.constexpr, NB: tl.constexpr):
    """Formats read as stored (triton_rawq): 32-element steps, each element gathered and dequantized."""
    g = g0 + tl.arange(0, NB)
    mg = g < NBK
    e = g[:, None] * 32 + tl.arange(0, 32)[None, :]                      # [NB, 32]
    w = deq_raw(q_ptr, lut_ptr, rq[:, None, None], e[None, :, :], (mask[:, None] & mg[None, :])[:, :, None], FMT)
    x = _xload(x_ptr, xo, e, mg[:, None])
    return tl.sum(w * x[None, :, :], axis=2)


@triton.jit
def _dot(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, lut_ptr, rq, rd, rm, rsc, rmn, rh, mask, g0, NBK,
         x_ptr, xo, one, FMT: tl.constexpr, NB: tl.constexpr):
    """[BN, NB] scaled partial dot products of step blocks g0 .. g0+NB (of NBK) of rows (offsets r*)."""
    if FMT >= FIRST_RAW:
        return _dot_raw(q_ptr, lut_ptr, rq, mask, g0, NBK, x_ptr, xo, FMT, NB)
    elif FMT == Q8_0:
        return _dot_q8_0(q_ptr, d_ptr, rq, rd, mask, g0, NBK, x_ptr, xo, one, NB)
    elif FMT == Q4_0 or FMT == MXFP4:
        return _dot_q4_0(q_ptr, d_ptr, rq, rd, mask, g0, NBK, x_ptr, xo, one, NB, FMT == MXFP4)
    elif FMT == Q4_K or FMT == Q5_K:
        return _dot_q45_k(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, g0, NBK, x_ptr, xo, one, NB,
                          FMT == Q5_K)
    elif FMT == Q6_K:
        return _dot_q6_k(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, g0, NBK, x_ptr, xo, one, NB)
    elif FMT == Q2_K or FMT == Q3_K:
        return _dot_q23_k(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, g0, NBK, x_ptr, xo, one, NB,
                          FMT == Q3_K)
    else:
        return _dot_iq_xxs(q_ptr, d_ptr, sc_ptr, h_ptr, lut_ptr, rq, rd, rsc, rh, mask, g0, NBK, x_ptr, xo, FMT, NB)


@triton.jit
def _rows(s, n, sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n):
    """Element offsets of rows n of slot s in the six planes (q, d, dmin, sc, mn, h)."""
    return (s * sq_s + n * sq_n, s * sd_s + n * sd_n, s * sm_s + n * sm_n, s * ssc_s + n * ssc_n,
            s * smn_s + n * smn_n, s * sh_s + n * sh_n)


@triton.jit
def pair_rows(ids_ptr, I, BN: tl.constexpr):
    """A decode gate_up program (grid: pairs x I/BN): its pair p, rows n, slot s (0 for a skipped pair,
    -1 in ids; then masked), the mask, and the int64 rows of gate (ng) and up (nu = ng + I)."""
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    s = tl.load(ids_ptr + p).to(tl.int64)
    mask = (n < I) & (s >= 0)
    s = tl.maximum(s, 0)
    ng = n.to(tl.int64)
    return p, n, s, mask, ng, ng + I


@triton.jit
def gate_up_act(acc_g, acc_u, b_ptr, sb_s, s, ng, nu, mask, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, alpha, limit):
    """The partial sums [BN, *] of gate and up rows -> act(gate (+ bias), up (+ bias)) [BN] (0 for a
    skipped pair: act(0, 0) == 0)."""
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if HAS_BIAS:
        gate += tl.load(b_ptr + s * sb_s + ng, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + s * sb_s + nu, mask=mask, other=0.0).to(tl.float32)
    return _act(gate, up, ACT, alpha, limit)


@triton.jit
def _gate_up_kernel(x_ptr, stride_x, ids_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, lut_ptr,
                    sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n,
                    b_ptr, sb_s, out_ptr, alpha, limit, one,
                    I: tl.constexpr, D: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr, ACT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                    NS: tl.constexpr, PDL: tl.constexpr):
    """grid (T*k pairs, I/BN): h[pair, n] = act(gate row n . x[t], up row n . x[t]) (+ bias).
    PDL: let the down kernel (launched as a programmatic dependent) be scheduled now."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    p, n, s, mask, ng, nu = pair_rows(ids_ptr, I, BN)
    gq, gd, gm, gsc, gmn, gh = _rows(s, ng, sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n)
    uq, ud, um, usc, umn, uh = _rows(s, nu, sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n)
    xo = (p // KTOP).to(tl.int64) * stride_x
    acc_g = tl.zeros([BN, NB], dtype=tl.float32)
    acc_u = tl.zeros([BN, NB], dtype=tl.float32)
    for g0 in tl.range(0, D // BS, NB, num_stages=NS):
        acc_g += _dot(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, lut_ptr, gq, gd, gm, gsc, gmn, gh, mask,
                      g0, D // BS, x_ptr, xo, one, FMT, NB)
        acc_u += _dot(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, lut_ptr, uq, ud, um, usc, umn, uh, mask,
                      g0, D // BS, x_ptr, xo, one, FMT, NB)
    h = gate_up_act(acc_g, acc_u, b_ptr, sb_s, s, ng, nu, mask, HAS_BIAS, ACT, alpha, limit)
    h = h.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)   # rounded to x's dtype, stored as out's
    tl.store(out_ptr + p.to(tl.int64) * I + n, h, mask=n < I)


@triton.jit
def _down_kernel(hx_ptr, ids_ptr, w_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, lut_ptr,
                 sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n,
                 b_ptr, sb_s, out_ptr, stride_o, one,
                 D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BS: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, NS: tl.constexpr, PDL: tl.constexpr):
    """grid (T, D/BN): out[t, n] = sum_j w[t, j] * (down_j row n . h[t, j] (+ bias)); the k experts'
    tiles of a K step are in flight together; no atomics. PDL: launched as a programmatic dependent
    of the gate_up kernel, it waits for that grid's h before any load."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < D
    nd = n.to(tl.int64)
    acc = tl.zeros([BN, NB], dtype=tl.float32)
    for g0 in tl.range(0, I // BS, NB, num_stages=NS):
        for j in tl.static_range(KTOP):
            s = tl.load(ids_ptr + t * KTOP + j).to(tl.int64)
            wj = tl.where(s >= 0, tl.load(w_ptr + t * KTOP + j).to(tl.float32), 0.0)
            rq, rd, rm, rsc, rmn, rh = _rows(tl.maximum(s, 0), nd, sq_s, sq_n, sd_s, sd_n, sm_s, sm_n,
                                             ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n)
            acc += wj * _dot(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, lut_ptr, rq, rd, rm, rsc, rmn, rh,
                             nm & (s >= 0), g0, I // BS, hx_ptr, (t * KTOP + j).to(tl.int64) * I, one, FMT, NB)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        for j in tl.static_range(KTOP):
            s = tl.load(ids_ptr + t * KTOP + j).to(tl.int64)
            wj = tl.load(w_ptr + t * KTOP + j).to(tl.float32)
            y += wj * tl.load(b_ptr + tl.maximum(s, 0) * sb_s + nd, mask=nm & (s >= 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=nm)


# ------------------------------------------------------------------ launchers
class Tile(NamedTuple):
    """v2 GEMV tile: BN rows (per expert) x BK elements per K step, warps, pipeline stages."""
    bn: int
    bk: int
    warps: int = 4
    stages: int = 1


# Qwen3-30B-A3B T=1, picked from sm_90 SASS (bench --compile-sm90: instructions per weight, registers)
# before any GPU run. gate_up: 384 programs of 2 x 16 rows x 512 elements per step (Q4: 8 KB, Q8:
# 16 KB), <= 128 registers so all fit in one wave (4 per SM); 1024-element steps cut instructions per
# weight ~10% but need ~240 registers (2 per SM: 1.5 waves). down: 256 programs of 8 experts x 8 rows
# x 1024 elements (I=768: one step, all of a program's bytes in flight at once). bench --variants
# times these against ALT_TILES and v1.
_GU, _DN = Tile(16, 512, 4), Tile(8, 1024, 4)
GATE_UP = {f: _GU for f in STEP_BLOCK}
DOWN = {f: _DN for f in STEP_BLOCK}
# the formats read as stored (element gathers): half the elements a gate_up step, half the rows a down program, so
# that the i-quants' gathers fit in registers (sm_90 build of IQ2_XXS: 255 registers and 144 / 128 bytes of spills at
# the tiles above; 168 / 148 registers, no spills at these)
GATE_UP.update({f: Tile(16, 256, 4) for f in RAW_FORMATS})
DOWN.update({f: Tile(4, 1024, 4) for f in RAW_FORMATS})


def _nb(bk: int, k: int, fmt: str) -> int:
    """Blocks per K step: BK elements, no more than the row (rounded up to a power of two)."""
    return max(1, min(bk, triton.next_power_of_2(k)) // STEP_BLOCK[fmt])


def gate_up(x, ids, w, act: int, alpha: float, limit: float, bias, h, cfg=None, pdl: bool = False):
    """h [T*k, I] = act(gate_up[ids] @ x) (+ bias) rounded to x's dtype; ids flat [T*k]; w a
    triton_moe.Weights. h may be float32 (moe_decode's choice: the down kernel then reads floats
    without converting them). One launch."""
    t, d = x.shape
    k, i = ids.numel() // t, w.n // 2
    tile = Tile(*(cfg or GATE_UP[w.fmt])[:4])
    b, sb = (bias, bias.stride(0)) if bias is not None else (x, 0)
    _gate_up_kernel[(t * k, triton.cdiv(i, tile.bn))](
        x, x.stride(0), ids, *w.v2_args(), b, sb, h, alpha, limit, ONE_BITS, I=i, D=d, KTOP=k, FMT=w.code, ACT=act,
        HAS_BIAS=bias is not None, BS=STEP_BLOCK[w.fmt], BN=tile.bn, NB=_nb(tile.bk, d, w.fmt), NS=tile.stages,
        PDL=pdl, num_warps=tile.warps)
    return h


def down(hx, ids, wt, w, bias, out, cfg=None, pdl: bool = False):
    """out [T, D] = sum_j wt[t, j] * (down[ids[t, j]] @ hx[t*k + j] (+ bias)); ids, wt flat. One launch."""
    t, d = out.shape
    k, i = ids.numel() // t, w.k
    tile = Tile(*(cfg or DOWN[w.fmt])[:4])
    b, sb = (bias, bias.stride(0)) if bias is not None else (out, 0)
    _down_kernel[(t, triton.cdiv(d, tile.bn))](
        hx, ids, wt, *w.v2_args(), b, sb, out, out.stride(0), ONE_BITS, D=d, I=i, KTOP=k, FMT=w.code,
        HAS_BIAS=bias is not None, BS=STEP_BLOCK[w.fmt], BN=tile.bn, NB=_nb(tile.bk, i, w.fmt), NS=tile.stages,
        PDL=pdl, num_warps=tile.warps, **({"launch_pdl": True} if pdl else {}))
    return out


# ================================================================== v3 (opt-in: variant="v3" / "v3pdl")
# v3: the T <= 8 decode kernels for Q8_0 / Q4_0 / Q4_K with all of a program's bytes in flight at once.
#
# v2 measured tile-insensitive on the H200 (Qwen3-30B-A3B T=1: gate_up ~950 GB/s, down ~440 GB/s): each
# program walks K in 2-4 dependent steps (load, wait a memory latency, math, next load) and the down grid
# has only D/BN programs. v3:
#   - one K step: each program loads the whole length of its rows (K in one or two power-of-two pieces,
#     e.g. I = 768 = 16 + 8 Q4_0 blocks) and issues every weight load (evict_first) before any math;
#   - small programs, many of them: gate_up grid (T*k pairs, I/BN) with tiles [K words, BN, 2 (gate, up)]
#     (x shared by the 2 BN rows a thread holds); down grid (T, D/BN) with tiles [K words, k, BN] (all k
#     experts of BN output rows in one program: no atomics, deterministic; h[t, j] shared by BN rows);
#     a skipped gate_up pair (-1) branches around every load;
#   - the weight math of v2 (same bit tricks), one accumulator per word that starts at its zero-point
#     term (x only), high nibbles read as f / 16 (the bits of 1/16 for 1: exact), the block scale
#     applied per word (one FFMA), sums over words and experts at the end;
#   - one register layout for everything: tiles are [words, rows...] with the word axis FIRST, and x,
#     the scales and the words are all loaded through pointer tensors of that shape (x and the scales
#     broadcast over rows / words). Triton's coalescing then gives every load the words' layout (same
#     shape and axis order: the x gather inherits the words' 4-per-thread), so no convert_layout (no
#     STS/LDS/BAR) between loads and math; ptxas merges a thread's equal x / scale loads (scale loads
#     unmasked, rows clamped in bounds, no cache hint), so the rows a thread holds share them. Old v3 had
#     the word axis last: x got another layout and the weight products went through shared memory;
#   - v3pdl: the down kernel, a programmatic dependent launch, issues its weight loads before waiting
#     for the gate_up grid (weights do not depend on h), then reads h.
# Other formats run v2 under variant "v3".

V3_FORMATS = ("Q8_0", "Q4_0", "Q4_K")


@triton.jit
def _v3_bload(ptr, r, g0, NB: tl.constexpr, W: tl.constexpr, K: tl.constexpr, M: tl.constexpr, NBK):
    """Per-block values [NB*W, A, B] of rows r [A, B], blocks g0 .. g0+NB (clamped to NBK - 1): word e of the
    step reads ptr + r + K * (g0 + e // W) + M. The pointers are a broadcast over each block's W words and
    the load is unmasked (rows r in bounds; callers mask the sums) and carries no cache hint: ptxas then
    keeps one load per block and row of a thread."""
    g = tl.minimum(g0 + tl.arange(0, NB), NBK - 1)
    pb = ptr + r[None, None, :, :] + (K * g + M)[:, None, None, None]                   # [NB, 1, A, B]
    return tl.load(tl.reshape(tl.broadcast_to(pb, [NB, W, r.shape[0], r.shape[1]]), [NB * W, r.shape[0], r.shape[1]]))


@triton.jit
def _v3_load(q_ptr, d_ptr, sc_ptr, rq, rd, rsc, mask, g0, NBK, FMT: tl.constexpr, NB: tl.constexpr):
    """Loads of step blocks g0 .. g0+NB (of NBK) of rows [A, B] (offsets r* [A, B], mask [A, B]): words
    [NB*W, A, B], the word axis first (16-byte loads, lanes along the row), and each word's block
    scales in the same shape, two of them (Q4_K: the (d, dmin) word and the 64-chunk's sc word; other
    formats d twice).
    Word axis first: every [NB*W, A, B] load here and in _v3_math gets the words' register layout
    (Triton's coalescing orders a gather's axes as the words' when the word axis is axis 0)."""
    W: tl.constexpr = 4 if FMT == Q4_0 else 8            # words per step block (Q4_K: 64-chunk)
    e = g0 * W + tl.arange(0, NB * W)
    m3 = (e < NBK * W)[:, None, None] & mask[None, :, :]
    words = tl.load(q_ptr + rq[None, :, :] + e[:, None, None], mask=m3, other=0, eviction_policy="evict_first")
    if FMT == Q4_K:                                       # a (d, dmin) word per 4 chunks, a sc word per chunk
        d = _v3_bload(d_ptr, rd, g0 // 4, NB // 4, 4 * W, 1, 0, NBK // 4)
        return words, d, _v3_bload(sc_ptr, rsc, g0, NB, W, 1, 0, NBK)
    else:
        d = _v3_bload(d_ptr, rd, g0, NB, W, 1, 0, NBK)
        return words, d, d


@triton.jit
def _v3_math(words, d, s, g0, NBK, x_ptr, xo, one, FMT: tl.constexpr, NB: tl.constexpr):
    """Row dot products [A, B] of _v3_load's blocks with x at offsets xo [XA, XB] (broadcast over the
    rows: [1, 1] one vector, [1, B] one per B index). The v2 bit tricks (module doc); word e of the
    step: Q8_0 element 4e + b, Q4_0 32 (e // 4) + 4 (e % 4) + b (and + 16), Q4_K 64 (e // 8) + 4 (e % 8) + b
    (and + 32). x is gathered with pointers of the words' shape (broadcast over the rows): the words'
    register layout, no layout conversion, and the rows a thread holds share its x loads. Each word's
    accumulator starts at its zero-point term (x only, shared by the rows); high nibbles are read as
    f / 16 (the bits of 1/16 instead of 1: exact), so no x is scaled."""
    W: tl.constexpr = 4 if FMT == Q4_0 else 8            # words per step block (Q4_K: 64-chunk)
    e = g0 * W + tl.arange(0, NB * W)
    if FMT == Q4_K:
        xe = (e // 8) * 64 + (e % 8) * 4
    elif FMT == Q4_0:
        xe = (e // 4) * 32 + (e % 4) * 4
    else:
        xe = e * 4
    xb = tl.broadcast_to(x_ptr + xo[None, :, :] + xe[:, None, None], words.shape)
    me = tl.broadcast_to((e < NBK * W)[:, None, None], words.shape)
    one16 = one - 0x2000000                              # bits of 1/16
    if FMT == Q4_0:         # 256 (f_lo - 1) = q_lo, 256 (f_hi/16 - 1/16) = q_hi: sum (q - 8) x = 256 (p - sum(33/32 x_lo + 3/32 x_hi))
        p = tl.zeros(words.shape, dtype=tl.float32)
        for b in tl.static_range(4):
            x_lo = tl.load(xb + b, mask=me, other=0.0).to(tl.float32)
            x_hi = tl.load(xb + (b + 16), mask=me, other=0.0).to(tl.float32)
            p -= 1.03125 * x_lo
            p -= 0.09375 * x_hi
        for b in tl.static_range(4):
            x_lo = tl.load(xb + b, mask=me, other=0.0).to(tl.float32)
            x_hi = tl.load(xb + (b + 16), mask=me, other=0.0).to(tl.float32)
            t = _shift(words, 15 - 8 * b)
            p += _f(t & 0x78000, one) * x_lo
            p += _f(t & 0x780000, one16) * x_hi
        return 256.0 * tl.sum(d.to(tl.float32) * p, axis=0)
    elif FMT == Q8_0:       # f = 1 + (q + 128) / 256: sum q x = 256 (p - 1.5 sum x)
        p = tl.zeros(words.shape, dtype=tl.float32)
        for b in tl.static_range(4):
            p -= 1.5 * tl.load(xb + b, mask=me, other=0.0).to(tl.float32)
        one8 = one | 0x400000
        for b in tl.static_range(4):
            x = tl.load(xb + b, mask=me, other=0.0).to(tl.float32)
            p += (_field(words, 15 - 8 * b, 0x7F8000) ^ one8).to(tl.float32, bitcast=True) * x
        return 256.0 * tl.sum(d.to(tl.float32) * p, axis=0)
    else:                   # Q4_K chunk c: low nibbles sub-block 2c (p_lo), high 2c + 1 (p_hi, read / 16)
        sx_lo = tl.zeros(words.shape, dtype=tl.float32)
        sx_hi = tl.zeros(words.shape, dtype=tl.float32)
        for b in tl.static_range(4):
            sx_lo += tl.load(xb + b, mask=me, other=0.0).to(tl.float32)
            sx_hi += tl.load(xb + (b + 32), mask=me, other=0.0).to(tl.float32)
        p_lo = -sx_lo
        p_hi = sx_hi * -0.0625
        for b in tl.static_range(4):
            x_lo = tl.load(xb + b, mask=me, other=0.0).to(tl.float32)
            x_hi = tl.load(xb + (b + 32), mask=me, other=0.0).to(tl.float32)
            t = _shift(words, 15 - 8 * b)
            p_lo += _f(t & 0x78000, one) * x_lo
            p_hi += _f(t & 0x780000, one16) * x_hi
        df, dmf = k_dmin(d)
        r = (df * (k_byte(s, 0) * p_lo + k_byte(s, 1) * p_hi) * 256.0
             - dmf * (k_byte(s, 2) * sx_lo + k_byte(s, 3) * sx_hi))
        return tl.sum(r, axis=0)


@triton.jit
def _v3_dot(q_ptr, d_ptr, sc_ptr, rq, rd, rsc, mask, NBK: tl.constexpr, x_ptr, xo, one, FMT: tl.constexpr,
            NB1: tl.constexpr, NB2: tl.constexpr, PDL_WAIT: tl.constexpr):
    """[A, B] dot products of whole rows: the loads of both pieces, (PDL_WAIT: the wait for the primary
    grid, before any x load), then the math."""
    a0, a1, a2 = _v3_load(q_ptr, d_ptr, sc_ptr, rq, rd, rsc, mask, 0, NBK, FMT, NB1)
    if NB2 > 0:
        b0, b1, b2 = _v3_load(q_ptr, d_ptr, sc_ptr, rq, rd, rsc, mask, NB1, NBK, FMT, NB2)
    if PDL_WAIT:
        tl.extra.cuda.gdc_wait()
    acc = _v3_math(a0, a1, a2, 0, NBK, x_ptr, xo, one, FMT, NB1)
    if NB2 > 0:
        acc += _v3_math(b0, b1, b2, NB1, NBK, x_ptr, xo, one, FMT, NB2)
    return acc


@triton.jit
def _gate_up_kernel_v3(x_ptr, stride_x, ids_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, lut_ptr,
                       sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n,
                       b_ptr, sb_s, out_ptr, alpha, limit, one,
                       I: tl.constexpr, D: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr, ACT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, NB1: tl.constexpr,
                       NB2: tl.constexpr, PDL: tl.constexpr):
    """grid (T*k pairs, I/BN): h[pair, n] = act(gate row n . x[t], up row n . x[t]) (+ bias); one tile
    [K, BN, 2] (gate rows, up rows; a thread's rows share its x loads), all loads issued first."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    s = tl.load(ids_ptr + p).to(tl.int64)
    gu = tl.arange(0, 2)[None, :]
    r = tl.minimum(n, I - 1).to(tl.int64)[:, None] + gu * I            # [BN, 2]: gate rows, up rows (in bounds)
    m2 = (n < I)[:, None] & (gu >= 0)
    acc = tl.zeros([BN, 2], dtype=tl.float32)
    if s >= 0:                      # a skipped pair (-1) reads nothing: act(0, 0) == 0; other loads unmasked
        xo = tl.zeros([1, 1], dtype=tl.int64) + (p // KTOP).to(tl.int64) * stride_x
        acc = _v3_dot(q_ptr, d_ptr, sc_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n, s * ssc_s + r * ssc_n,
                      r >= 0, D // BS, x_ptr, xo, one, FMT, NB1, NB2, False)
    m2 = m2 & (s >= 0)
    s = tl.maximum(s, 0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + s * sb_s + r, mask=m2, other=0.0).to(tl.float32)
    gate = tl.sum(tl.where(gu == 0, acc, 0.0), axis=1)
    up = tl.sum(tl.where(gu == 1, acc, 0.0), axis=1)
    h = _act(gate, up, ACT, alpha, limit)
    h = h.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)   # rounded to x's dtype, stored as out's
    tl.store(out_ptr + p.to(tl.int64) * I + n, h, mask=n < I)


@triton.jit
def _down_kernel_v3(hx_ptr, ids_ptr, w_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, lut_ptr,
                    sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n,
                    b_ptr, sb_s, out_ptr, stride_o, one,
                    D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, KP: tl.constexpr, FMT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, NB1: tl.constexpr,
                    NB2: tl.constexpr, PDL: tl.constexpr):
    """grid (T, D/BN): out[t, n] = sum_j w[t, j] * (down_j row n . h[t, j] (+ bias)); one tile [I, k, BN]
    (KP = k rounded up to a power of two, masked; the BN rows of an expert in one thread share its h
    loads), all weight loads issued first; no atomics. PDL: a
    programmatic dependent of the gate_up kernel; it waits for that grid after its weight loads."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < D
    j = tl.arange(0, KP)
    jm = j < KTOP
    s = tl.load(ids_ptr + t * KTOP + j, mask=jm, other=-1).to(tl.int64)                # [KP]
    mask = (jm & (s >= 0))[:, None] & nm[None, :]                                       # [KP, BN]
    s = tl.maximum(s, 0)[:, None]
    r = tl.minimum(n, D - 1).to(tl.int64)[None, :]                                      # (in bounds)
    xo = ((t * KTOP + tl.minimum(j, KTOP - 1)).to(tl.int64) * I)[:, None]   # h[t*k + j] (lanes past k: a real one)
    acc = _v3_dot(q_ptr, d_ptr, sc_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n, s * ssc_s + r * ssc_n, mask,
                  I // BS, hx_ptr, xo, one, FMT, NB1, NB2, PDL)                         # [KP, BN]
    if HAS_BIAS:
        acc += tl.load(b_ptr + s * sb_s + r, mask=mask, other=0.0).to(tl.float32)
    wj = tl.load(w_ptr + t * KTOP + j, mask=jm, other=0.0).to(tl.float32)
    y = tl.sum(tl.where(mask, acc, 0.0) * wj[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=nm)


# v3 tiles (Tile.bn rows per program, warps; bk and stages unused: one step of the whole row), picked
# from sm_90 SASS (bench --compile-sm90: instructions per weight, registers) before any GPU run.
# Qwen3-30B-A3B T=1: gate_up 8 x 384 = 3072 one-warp programs of 2 x 2 rows x 2048 (no barrier at all:
# the row sums are warp shuffles); down 256 programs of 8 rows x 8 experts x 768 (Q8_0: 4 rows, 512
# programs, to stay under 128 registers).
# Timed on the H200 (session 7, bench --variants, graph replays, per call): gate_up Q4_0 (2, 0, 1) 16.9 us ->
# (8, 0, 4) 12.2; Q8_0 13.8 -> (8, 0, 8) 11.2; down Q8_0 (4, 0, 4) 11.3 -> (8, 0, 4) 8.2. Q4_K not timed yet.
GATE_UP3 = {"Q8_0": Tile(8, 0, 8), "Q4_0": Tile(8, 0, 4), "Q4_K": Tile(2, 0, 1)}
DOWN3 = {"Q8_0": Tile(8, 0, 4), "Q4_0": Tile(8, 0, 4), "Q4_K": Tile(8, 0, 4)}


def v3_pieces(k: int, fmt: str) -> tuple[int, int]:
    """Step blocks of a K-long row in two power-of-two pieces (NB1 + NB2 >= blocks; NB2 = 0 if NB1 covers
    them): e.g. 64 Q4_0 blocks -> (64, 0), 24 -> (16, 8), 90 -> (64, 32)."""
    nbk = k // STEP_BLOCK[fmt]
    nb1 = 1 << (nbk.bit_length() - 1)
    return nb1, (triton.next_power_of_2(nbk - nb1) if nbk > nb1 else 0)


def gate_up_v3(x, ids, w, act: int, alpha: float, limit: float, bias, h, cfg=None, pdl: bool = False):
    """As gate_up, v3 kernel (Q8_0 / Q4_0 / Q4_K; other formats run v2)."""
    if w.fmt not in V3_FORMATS:
        return gate_up(x, ids, w, act, alpha, limit, bias, h, None, pdl)
    t, d = x.shape
    k, i = ids.numel() // t, w.n // 2
    tile = Tile(*(cfg or GATE_UP3[w.fmt])[:4])
    b, sb = (bias, bias.stride(0)) if bias is not None else (x, 0)
    nb1, nb2 = v3_pieces(d, w.fmt)
    _gate_up_kernel_v3[(t * k, triton.cdiv(i, tile.bn))](
        x, x.stride(0), ids, *w.v2_args(), b, sb, h, alpha, limit, ONE_BITS, I=i, D=d, KTOP=k, FMT=w.code,
        ACT=act, HAS_BIAS=bias is not None, BS=STEP_BLOCK[w.fmt], BN=tile.bn, NB1=nb1, NB2=nb2, PDL=pdl,
        num_warps=tile.warps)
    return h


def down_v3(hx, ids, wt, w, bias, out, cfg=None, pdl: bool = False):
    """As down, v3 kernel (Q8_0 / Q4_0 / Q4_K; other formats run v2)."""
    if w.fmt not in V3_FORMATS:
        return down(hx, ids, wt, w, bias, out, None, pdl)
    t, d = out.shape
    k, i = ids.numel() // t, w.k
    tile = Tile(*(cfg or DOWN3[w.fmt])[:4])
    b, sb = (bias, bias.stride(0)) if bias is not None else (out, 0)
    nb1, nb2 = v3_pieces(i, w.fmt)
    _down_kernel_v3[(t, triton.cdiv(d, tile.bn))](
        hx, ids, wt, *w.v2_args(), b, sb, out, out.stride(0), ONE_BITS, D=d, I=i, KTOP=k,
        KP=triton.next_power_of_2(k), FMT=w.code, HAS_BIAS=bias is not None, BS=STEP_BLOCK[w.fmt], BN=tile.bn,
        NB1=nb1, NB2=nb2, PDL=pdl, num_warps=tile.warps, **({"launch_pdl": True} if pdl else {}))
    return out
