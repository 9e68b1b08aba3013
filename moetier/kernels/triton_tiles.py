"""Weight tiles in element order for the grouped (prefill) GEMM, formats without a dedicated path
(Q5_K, Q6_K, MXFP4, IQ3_XXS, IQ2_XXS, Q2_K, Q3_K): each element gathered from the byte planes of moetier.quant.repack
(q = qs / ql, h = qh / sg / hm; see its doc for the layouts) and dequantized, as `dequantize_repacked`; the formats
read as stored (the other i-quants: triton_rawq) from their GGML rows in the q plane.
Gathers, not wide loads: prefill is bound by the tensor-core work, the tile is reused BM times.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_rawq import FIRST_RAW, deq_raw

Q5_K, Q6_K, MXFP4, IQ3_XXS, IQ2_XXS, Q2_K, Q3_K = (tl.constexpr(c) for c in range(4, 11))


@triton.jit
def e8m0_half(e):
    """MXFP4's scale byte e (int32) -> 2^(e - 128) as float32, exactly (the reference's e8m0_half: half the e8m0
    scale, which the doubled E2M1 codebook takes back; subnormal bit patterns for e < 2)."""
    return tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_scaled(n):
    """An E2M1 code (int32 0..15) -> its doubled value * 2^-15 as float32 (built as fp16 bits: times 32768.0 gives the
    doubled value exactly)."""
    hb = ((n & 7) << 9) | ((n & 8) << 12)
    return hb.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _ld(ptr, rows, idx, m):
    return tl.load(ptr + rows[:, None] + idx, mask=m, other=0)


@triton.jit
def deq_tile(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, lut_ptr, rq, rd, rm, rsc, rmn, rh, mask, k0, K,
             FMT: tl.constexpr, BK: tl.constexpr):
    """-> [BN, BK] float32: W[rows, k0 .. k0+BK] (rows: offsets r* into each plane, mask [BN])."""
    e = k0 + tl.arange(0, BK)
    m = mask[:, None] & (e < K)[None, :]
    e = e[None, :]
    if FMT >= FIRST_RAW:
        return deq_raw(q_ptr, lut_ptr, rq[:, None], e, m, FMT)
    elif FMT == Q5_K or FMT == Q6_K:
        sb = e // 256
        r = e % 256
        if FMT == Q5_K:        # byte 32 (r // 64) + r % 32 of the sb's 128 (nibble r // 32 % 2), qh bit r // 32
            b = _ld(q_ptr, rq, sb * 128 + r // 64 * 32 + r % 32, m).to(tl.int32)
            q = (b >> (4 * (r // 32 % 2))) & 15
            q = q | (((_ld(h_ptr, rh, sb * 32 + r % 32, m).to(tl.int32) >> (r // 32)) & 1) << 4)
            s = e // 64 * 4 + e // 32 % 2      # sc, mn: chunk e // 64's 4 bytes; d, dmin at 2 sb (triton_weights)
            sc = _ld(sc_ptr, rsc, s, m).to(tl.float32)
            mn = _ld(mn_ptr, rmn, s, m).to(tl.float32)
            d = _ld(d_ptr, rd, 2 * sb, m).to(tl.float32)
            return d * sc * q.to(tl.float32) - _ld(m_ptr, rm, 2 * sb, m).to(tl.float32) * mn
        else:                  # half r // 128, quarter qm = r // 32 % 4, l = r % 32
            d = _ld(d_ptr, rd, sb, m).to(tl.float32)
            half, qm, l = r // 128, r // 32 % 4, r % 32
            b = _ld(q_ptr, rq, sb * 128 + half * 64 + l + 32 * (qm % 2), m).to(tl.int32)
            q = (b >> (4 * (qm // 2))) & 15
            q = q | (((_ld(h_ptr, rh, sb * 64 + half * 32 + l, m).to(tl.int32) >> (2 * qm)) & 3) << 4)
            sc = _ld(sc_ptr, rsc, e // 16, m).to(tl.float32)
            return d * sc * (q - 32).to(tl.float32)
    elif FMT == Q2_K or FMT == Q3_K:    # 2 low bits: bits 2 (e // 32 % 4), + 1 of qs byte 32 (e // 128) + e % 32
        q = (_ld(q_ptr, rq, e // 128 * 32 + e % 32, m).to(tl.int32) >> (2 * (e // 32 % 4))) & 3
        if FMT == Q2_K:        # d, dmin at 2 sb, 2 sb + 1 of the d plane; sc byte e // 16: scale | min << 4
            s = _ld(sc_ptr, rsc, e // 16, m).to(tl.int32)
            d = _ld(d_ptr, rd, e // 256 * 2, m).to(tl.float32)
            dmin = _ld(d_ptr, rd, e // 256 * 2 + 1, m).to(tl.float32)
            return d * (s & 15).to(tl.float32) * q.to(tl.float32) - dmin * (s >> 4).to(tl.float32)
        else:                  # high bit e % 256 // 32 of hm byte 32 sb + e % 32 (clear: q - 4); sc int8 e // 16
            hb = (_ld(h_ptr, rh, e // 256 * 32 + e % 32, m).to(tl.int32) >> (e % 256 // 32)) & 1
            sc = _ld(sc_ptr, rsc, e // 16, m).to(tl.float32)
            return _ld(d_ptr, rd, e // 256, m).to(tl.float32) * sc * (q - 4 + 4 * hb).to(tl.float32)
    elif FMT == MXFP4:         # byte 16 (e // 32) + e % 16, high nibble for e % 32 >= 16
        b = _ld(q_ptr, rq, e // 32 * 16 + e % 16, m).to(tl.int32)
        n = (b >> (4 * (e % 32 // 16))) & 15
        v = e2m1_scaled(n)
        x = _ld(d_ptr, rd, e // 32, m).to(tl.int32)
        return e8m0_half(x) * (v * 32768.0)
    else:                      # IQ3_XXS / IQ2_XXS: grid byte e // G, value e % G (rows of G = 4 / 8 values), sign
        G: tl.constexpr = 8 if FMT == IQ2_XXS else 4              # bit e % 32 of sg[e // 32]
        HALF: tl.constexpr = 0.25 if FMT == IQ2_XXS else 0.5
        idx = _ld(q_ptr, rq, e // G, m).to(tl.int32)
        gv = tl.load(lut_ptr + idx * G + e % G)
        sg = (_ld(h_ptr, rh, e // 32, m) >> (e % 32)) & 1
        sc = _ld(sc_ptr, rsc, e // 32, m).to(tl.float32)
        db = _ld(d_ptr, rd, e // 256, m).to(tl.float32) * (0.5 + sc) * HALF
        return tl.where(m, db * tl.where(sg != 0, -gv, gv), 0.0)
