"""Decode GEMV kernels, variant "v5": int8 activations and integer dot products (dp4a) for Q8_0 / Q4_0 / Q4_K /
Q6_K.

Why (H200, Qwen3-30B-A3B layer, T=1, session 8): v3 reads Q4_0 at 21% of HBM (gate_up 12.2 us, down 12.2 us
for half of Q8_0's bytes) and Q8_0 at 49%: the float math is the limit, not the memory. v3 spends per 4-bit
weight a shift share, a LOP3 and an FFMA plus one 4-byte x gather from L1 per element; Q4_0 down (x = h in
float32, 8 experts per program) is the worst. As llama.cpp's MMVQ does, x is quantized to int8 per 32-block
(scale dx = max|x| / 127, q = round(x / dx), like its q8_1), and a weight word meets an x word in one
`dp4a` (4 int8 products summed into an int32):
  - Q8_0 word (4 weights): r = dp4a(w, xw, MAGIC); v = float(r) - 1.5 * 2^23 (MAGIC: the bits of 1.5 * 2^23, so
    the int32 sum lands in the mantissa: no I2F); acc += d * (v * dx);
  - Q4_0 word (8 weights: the low nibbles are elements 4w..4w+3 of the block, the high ones + 16): lo = w &
    0x0F0F0F0F, hi = (w >> 4) & 0x0F0F0F0F, r = dp4a(hi, xh, dp4a(lo, xl, MAGIC)); the zero point 8 comes off
    per block with the block's sum of q (xs = dx * sum(q), a quarter per word);
  - Q4_K word (8 weights of a 64-chunk c: low nibbles elements 64c + 4w..+3, sub-block 2c, the high ones
    + 32, sub-block 2c + 1): the sub-blocks have their own sc, mn and x scales, so two dp4a into two
    sums, v = d * (sc_lo * dx_lo * v_lo + sc_hi * dx_hi * v_hi) - dmin * (mn_lo * xs_lo + mn_hi * xs_hi) / 8
    (the min term per sub-block, an eighth per word);
  - Q6_K (v3 has no loader: `_q6_load`): per ql word pair a, b and qh word of a 128-chunk 16 weights, 4 parts
    of 4 (nibble of a or b | 2 qh bits: q 0..63), each its own x word, 32-block and 16-sub-block scale;
    q - 32 in the integer sum: r = dp4a(q, xw, dp4a(-32 bytes, xw, MAGIC)), v = d * sc * dx * r;
  - x per token (gate_up) and h per pair (down) are quantized by `quantize`, a separate small launch each
    (grid: rows), into int8 words, dx and xs. `pdl`: every launch after the first a programmatic dependent:
    gate_up and down issue their weight loads before waiting for the quantized activations.
Loads and tiles are v3's (triton_decode._v3_load: every weight load of a program issued first, word axis
first); the words' register layout carries the x-word gathers (4x fewer than v3's element gathers).
Exactness: the integer dots are exact; the twin (ops.moe_native with act_q8) quantizes x and h the same way
and computes in float32. Under TRITON_INTERPRET the dp4a is emulated with shifts (same integers).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_decode import STEP_BLOCK, Tile, _act, _v3_bload, _v3_load, v3_pieces
from .triton_weights import BLOCK

Q8_0, Q4_0, Q4_K, Q6_K = (tl.constexpr(c) for c in (1, 2, 3, 5))    # triton_weights.FMT_CODES
FORMATS = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")
MAGIC = tl.constexpr(0x4B400000)      # bits of 1.5 * 2^23: an int32 added to them is read as 12582912 + int
MAGIC_F = tl.constexpr(12582912.0)
ROUND = {torch.bfloat16: 1, torch.float16: 2}      # h rounded to x's dtype (gate_up's ROUND)
# With pdl, the x quantizer is itself a programmatic dependent of the kernel before it (the router, the previous
# layer's down) and down lets its dependents be scheduled from its start: no launch of the pair waits for a whole
# predecessor grid to drain before being scheduled (session 13, H200: Q4_0 pair 11.81 -> 11.0 us, Q8_0 15.67 ->
# 14.28). The x quantizer lets gate_up be scheduled only after its own wait: gate_up (and down) read the routed ids
# before they wait, so the kernel that wrote the ids must have finished when they start. MOETIER_PDL_CHAIN=0: off.
PDL_CHAIN = os.environ.get("MOETIER_PDL_CHAIN", "1") != "0"


def _emulate() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dp4a(a, b, c, EMU: tl.constexpr):
    """c + sum_j a_j * b_j over the 4 signed bytes of int32 a, b (PTX dp4a.s32.s32; shifts under EMU)."""
    if EMU:
        r = c
        for j in tl.static_range(4):
            r += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return r
    else:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


# ------------------------------------------------------------------ activations -> int8 per 32-block
@triton.jit
def _quantize_kernel(x_ptr, stride_x, q_ptr, d_ptr, s_ptr, K: tl.constexpr, NBP: tl.constexpr,
                     WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    """grid (rows,): row r of x [R, K] -> q int8 [R, K], dx = max|x| / 127 and xs = dx * sum(q) f32 [R, K/32]
    per 32-block (q = round-half-even(x / dx); 0 where the block is all zero). WAIT: launched as a
    programmatic dependent (wait for the primary's grid); TRIGGER 1: let a dependent be scheduled now, 2: once
    the wait is over (the dependent may then read what the primary wrote before its own wait)."""
    if TRIGGER == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if TRIGGER == 2:
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NBP)
    j = tl.arange(0, 32)
    mb = b < K // 32
    x = tl.load(x_ptr + r * stride_x + b[:, None] * 32 + j[None, :], mask=mb[:, None], other=0.0).to(tl.float32)
    q, dx, xs = _q8_blocks(x)
    tl.store(q_ptr + r * K + b[:, None] * 32 + j[None, :], q.to(tl.int8), mask=mb[:, None])
    tl.store(d_ptr + r * (K // 32) + b, dx, mask=mb)
    tl.store(s_ptr + r * (K // 32) + b, xs, mask=mb)


@triton.jit
def _q8_blocks(x):
    """x float32 [NB, 32] -> (q float32 [NB, 32] integral, dx [NB], xs [NB]): dx = max|x| / 127, q = round-half-even(x /
    dx) (0 where the block is all zero), xs = dx * sum(q). The one definition: `quantize` and gate_up's fused h."""
    amax = tl.max(tl.abs(x), axis=1)
    dx = amax / 127.0
    y = tl.math.div_rn(x, tl.where(amax > 0, dx, 1.0)[:, None])
    q = (y + MAGIC_F) - MAGIC_F                                   # round half to even (|y| <= 127)
    return q, dx, dx * tl.sum(q, axis=1)


def quantize(x: torch.Tensor, wait: bool = False, trigger: bool | int = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, K] (K a multiple of 32, unit last stride) -> (q int8 [R, K], dx f32 [R, K/32], xs f32 [R, K/32]).
    One launch, no host sync. wait: launched as a programmatic dependent of the previous kernel (CUDA);
    trigger: the next kernel may be one, scheduled from this one's start (True / 1) or after its wait (2)."""
    r, k = x.shape
    q = torch.empty(r, k, dtype=torch.int8, device=x.device)
    dx = torch.empty(r, k // 32, dtype=torch.float32, device=x.device)
    xs = torch.empty_like(dx)
    _quantize_kernel[(r,)](x, x.stride(0), q, dx, xs, K=k, NBP=triton.next_power_of_2(k // 32), WAIT=wait,
                           TRIGGER=int(trigger), num_warps=4, **({"launch_pdl": True} if wait else {}))
    return q, dx, xs


def quantize_native(x: torch.Tensor) -> torch.Tensor:
    """The twin of `quantize`, dequantized: x [R, K] -> float32 q * dx (what the kernels multiply by)."""
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(dx > 0, torch.round(xb / torch.where(dx > 0, dx, 1.0)), 0.0)
    return (q * dx).reshape(x.shape)


# ------------------------------------------------------------------ one step of whole rows
@triton.jit
def _v5_math(words, d, dm, sc_lo, sc_hi, mn_lo, mn_hi, g0, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo,
             FMT: tl.constexpr, NB: tl.constexpr, EMU: tl.constexpr):
    """Row dot products [A, B] of _v3_load's words [NB*W, A, B] and block scales (same shape; Q4_K: d,
    dmin, sc / mn of the low and high sub-block, other formats d only) with the int8 activation words at
    xw_ptr + xwo [XA, XB] (broadcast over the rows), scales dx / xs at xd_ptr / xs_ptr + xdo. Word e of the
    step: Q8_0 elements 4e..4e+3 (x word e); Q4_0 block e // 4, low nibbles elements 4 (e % 4)..+3 (x word
    8 (e // 4) + e % 4), high ones + 16 (x word + 4); Q4_K chunk c = e // 8, low nibbles elements
    64c + 4 (e % 8)..+3 (x word 16c + e % 8, 32-block 2c), high ones + 32 (x word + 8, block 2c + 1)."""
    W: tl.constexpr = 4 if FMT == Q4_0 else 8
    e = g0 * W + tl.arange(0, NB * W)
    me = tl.broadcast_to((e < NBK * W)[:, None, None], words.shape)
    if FMT == Q4_K:
        blk = 2 * (e // 8)                                    # the low nibbles' 32-block; the high ones' + 1
        xe = 16 * (e // 8) + e % 8
    elif FMT == Q4_0:
        blk = e // 4
        xe = blk * 8 + (e % 4)
    else:
        blk = e // 8
        xe = e
    xp = tl.broadcast_to(xw_ptr + xwo[None, :, :] + xe[:, None, None], words.shape)
    dp = tl.broadcast_to(xdo[None, :, :] + blk[:, None, None], words.shape)
    dx = tl.load(xd_ptr + dp, mask=me, other=0.0)
    if FMT == Q4_K:         # two sub-blocks (own sc, mn) per word: two dp4a, no shared accumulator
        xl = tl.load(xp, mask=me, other=0)
        xh = tl.load(xp + 8, mask=me, other=0)
        v_lo = _dp4a(words & 0x0F0F0F0F, xl, MAGIC, EMU).to(tl.float32, bitcast=True) - MAGIC_F
        v_hi = _dp4a((words >> 4) & 0x0F0F0F0F, xh, MAGIC, EMU).to(tl.float32, bitcast=True) - MAGIC_F
        dx_hi = tl.load(xd_ptr + dp + 1, mask=me, other=0.0)
        xs_lo = tl.load(xs_ptr + dp, mask=me, other=0.0)
        xs_hi = tl.load(xs_ptr + dp + 1, mask=me, other=0.0)
        r = (d.to(tl.float32) * (sc_lo.to(tl.float32) * (v_lo * dx) + sc_hi.to(tl.float32) * (v_hi * dx_hi))
             - dm.to(tl.float32) * (0.125 * (mn_lo.to(tl.float32) * xs_lo + mn_hi.to(tl.float32) * xs_hi)))
        res = tl.sum(r, axis=0)                           # the min term: 1/8 per word of its sub-blocks' 8
    elif FMT == Q4_0:
        xl = tl.load(xp, mask=me, other=0)
        xh = tl.load(xp + 4, mask=me, other=0)
        r = _dp4a((words >> 4) & 0x0F0F0F0F, xh, _dp4a(words & 0x0F0F0F0F, xl, MAGIC, EMU), EMU)
        xs = tl.load(xs_ptr + dp, mask=me, other=0.0)
        v = (r.to(tl.float32, bitcast=True) - MAGIC_F) * dx - 2.0 * xs       # 8 * xs over the block's 4 words
        res = tl.sum(d.to(tl.float32) * v, axis=0)
    else:
        xw = tl.load(xp, mask=me, other=0)
        v = (_dp4a(words, xw, MAGIC, EMU).to(tl.float32, bitcast=True) - MAGIC_F) * dx
        res = tl.sum(d.to(tl.float32) * v, axis=0)
    return res                  # one return: compiled Triton refuses a return inside a branch (the interpreter not)


@triton.jit
def _q6_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, g0, NBK, NB: tl.constexpr):
    """Q6_K loads of 128-chunks g0 .. g0+NB (of NBK) of rows [A, B], word axis first as _v3_load's: word e of
    the step (chunk c = e // 8, w = e % 8) gets ql words a = 16c + w, b = a + 8, qh word 8c + w, d (per 2
    chunks) and the scales sc[8c + 2m + w // 4] of its 4 parts m (16-sub-blocks; clamped, unmasked)."""
    e = g0 * 8 + tl.arange(0, NB * 8)
    m3 = (e < NBK * 8)[:, None, None] & mask[None, :, :]
    pa = q_ptr + rq[None, :, :] + (16 * (e // 8) + e % 8)[:, None, None]
    wa = tl.load(pa, mask=m3, other=0, eviction_policy="evict_first")
    wb = tl.load(pa + 8, mask=m3, other=0, eviction_policy="evict_first")
    wh = tl.load(h_ptr + rh[None, :, :] + e[:, None, None], mask=m3, other=0, eviction_policy="evict_first")
    d = _v3_bload(d_ptr, rd, g0 // 2, NB // 2, 16, 1, 0, NBK // 2)
    ps = sc_ptr + rsc[None, :, :] + (8 * tl.minimum(e // 8, NBK - 1) + (e % 8) // 4)[:, None, None]
    return wa, wb, wh, d, tl.load(ps), tl.load(ps + 2), tl.load(ps + 4), tl.load(ps + 6)


@triton.jit
def _q6_part(src, wh, sc, me, c, w, xw_ptr, xwo, xd_ptr, xdo, M: tl.constexpr, EMU: tl.constexpr):
    """sc * dx * sum (q - 32) x of part M of the words (elements 128c + 4w + 32M .. + 3: a nibble of ql word
    a (M even) or b (odd), low for M < 2, and bits 2M, 2M + 1 of each qh byte on top; x word 32c + 8M + w,
    32-block 4c + M). q - 32 by a second dp4a with -32 in every byte (q alone is unsigned 6-bit)."""
    if M < 2:
        q = src & 0x0F0F0F0F
    else:
        q = (src >> 4) & 0x0F0F0F0F
    q = q | (((wh >> (2 * M)) & 0x03030303) << 4)
    xw = tl.load(tl.broadcast_to(xw_ptr + xwo[None, :, :] + (32 * c + 8 * M + w)[:, None, None], q.shape),
                 mask=me, other=0)
    dx = tl.load(xd_ptr + tl.broadcast_to(xdo[None, :, :] + (4 * c + M)[:, None, None], q.shape), mask=me,
                 other=0.0)
    r = _dp4a(q, xw, _dp4a(tl.full(q.shape, -522133280, tl.int32), xw, MAGIC, EMU), EMU)   # 0xE0E0E0E0
    return sc.to(tl.float32) * ((r.to(tl.float32, bitcast=True) - MAGIC_F) * dx)


@triton.jit
def _q6_math(wa, wb, wh, d, s0, s1, s2, s3, g0, NBK, xw_ptr, xwo, xd_ptr, xdo, NB: tl.constexpr,
             EMU: tl.constexpr):
    """Row dot products [A, B] of _q6_load's words with the int8 activations (as _v5_math's)."""
    e = g0 * 8 + tl.arange(0, NB * 8)
    me = tl.broadcast_to((e < NBK * 8)[:, None, None], wa.shape)
    c = e // 8
    w = e % 8
    v = _q6_part(wa, wh, s0, me, c, w, xw_ptr, xwo, xd_ptr, xdo, 0, EMU)
    v += _q6_part(wb, wh, s1, me, c, w, xw_ptr, xwo, xd_ptr, xdo, 1, EMU)
    v += _q6_part(wa, wh, s2, me, c, w, xw_ptr, xwo, xd_ptr, xdo, 2, EMU)
    v += _q6_part(wb, wh, s3, me, c, w, xw_ptr, xwo, xd_ptr, xdo, 3, EMU)
    return tl.sum(d.to(tl.float32) * v, axis=0)


@triton.jit
def _v5_dot(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, rq, rd, rm, rsc, rmn, rh, mask, NBK: tl.constexpr,
            xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT: tl.constexpr, NB1: tl.constexpr, NB2: tl.constexpr,
            PDL_WAIT: tl.constexpr, EMU: tl.constexpr):
    """[A, B] dot products of whole rows: the weight loads of both pieces, (PDL_WAIT: the wait for the
    activations' grid), then the math. Planes beyond q, d: dmin, sc, mn (Q4_K), sc, h (Q6_K)."""
    if FMT == Q6_K:
        a0, a1, a2, a3, a4, a5, a6, a7 = _q6_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, 0, NBK,
                                                  NB1)
        if NB2 > 0:
            b0, b1, b2, b3, b4, b5, b6, b7 = _q6_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, NB1,
                                                      NBK, NB2)
        if PDL_WAIT:
            tl.extra.cuda.gdc_wait()
        acc = _q6_math(a0, a1, a2, a3, a4, a5, a6, a7, 0, NBK, xw_ptr, xwo, xd_ptr, xdo, NB1, EMU)
        if NB2 > 0:
            acc += _q6_math(b0, b1, b2, b3, b4, b5, b6, b7, NB1, NBK, xw_ptr, xwo, xd_ptr, xdo, NB2, EMU)
    else:
        a0, a1, a2, a3, a4, a5, a6 = _v3_load(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rq, rd, rm, rsc, rmn, mask,
                                              0, NBK, FMT, NB1)
        if NB2 > 0:
            b0, b1, b2, b3, b4, b5, b6 = _v3_load(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rq, rd, rm, rsc, rmn,
                                                  mask, NB1, NBK, FMT, NB2)
        if PDL_WAIT:
            tl.extra.cuda.gdc_wait()
        acc = _v5_math(a0, a1, a2, a3, a4, a5, a6, 0, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB1, EMU)
        if NB2 > 0:
            acc += _v5_math(b0, b1, b2, b3, b4, b5, b6, NB1, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB2,
                            EMU)
    return acc


@triton.jit
def _gate_up_kernel(xw_ptr, xd_ptr, xs_ptr, ids_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr,
                    sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n,
                    b_ptr, sb_s, out_ptr, alpha, limit, hq_ptr, hd_ptr, hs_ptr, cnt_ptr,
                    I: tl.constexpr, D: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr, ACT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, NB1: tl.constexpr,
                    NB2: tl.constexpr, PDL: tl.constexpr, EMU: tl.constexpr, ROUND: tl.constexpr, QH: tl.constexpr):
    """grid (T*k pairs, I/BN): h[pair, n] = act(gate row n . x[t], up row n . x[t]) (+ bias), x as int8 words;
    tile [K, BN, 2] (gate rows, up rows), every weight load issued first (v3's). QH (BN divides 32): h also
    quantized for down (`quantize`'s q, dx, xs, bit-equal): the last of a 32-block's 32 / BN programs to finish
    (an acq_rel counter per block, reset by that program for the next launch) quantizes the block, so down
    needs no quantizer launch."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    s = tl.load(ids_ptr + p).to(tl.int64)
    gu = tl.arange(0, 2)[None, :]
    r = tl.minimum(n, I - 1).to(tl.int64)[:, None] + gu * I
    m2 = (n < I)[:, None] & (gu >= 0)
    acc = tl.zeros([BN, 2], dtype=tl.float32)
    if s >= 0:
        t = (p // KTOP).to(tl.int64)
        xwo = tl.zeros([1, 1], dtype=tl.int64) + t * (D // 4)
        xdo = tl.zeros([1, 1], dtype=tl.int64) + t * (D // 32)
        acc = _v5_dot(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n,
                      s * sm_s + r * sm_n, s * ssc_s + r * ssc_n, s * smn_s + r * smn_n, s * sh_s + r * sh_n,
                      r >= 0, D // BS, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB1, NB2, PDL, EMU)
    elif PDL:
        tl.extra.cuda.gdc_wait()
    m2 = m2 & (s >= 0)
    s = tl.maximum(s, 0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + s * sb_s + r, mask=m2, other=0.0).to(tl.float32)
    gate = tl.sum(tl.where(gu == 0, acc, 0.0), axis=1)
    up = tl.sum(tl.where(gu == 1, acc, 0.0), axis=1)
    h = _act(gate, up, ACT, alpha, limit)
    if ROUND == 1:                                               # rounded to x's dtype, as the twin does
        h = h.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        h = h.to(tl.float16).to(tl.float32)
    tl.store(out_ptr + p.to(tl.int64) * I + n, h, mask=n < I)
    if QH:
        tl.debug_barrier()                   # every thread's h stores happen before the release below
        cb = cnt_ptr + p.to(tl.int64) * (I // 32) + (tl.program_id(1) * BN) // 32
        if tl.atomic_add(cb, 1, sem="acq_rel") == 32 // BN - 1:     # the block's last program: all of it visible
            tl.atomic_xchg(cb, 0)
            o = p.to(tl.int64) * I + (tl.program_id(1) * BN) // 32 * 32 + tl.arange(0, 32)[None, :]
            q, dx, xs = _q8_blocks(tl.load(out_ptr + o, cache_modifier=".cg"))
            tl.store(hq_ptr + o, q.to(tl.int8))
            z = tl.zeros([1], dtype=tl.int64) + p.to(tl.int64) * (I // 32) + (tl.program_id(1) * BN) // 32
            tl.store(hd_ptr + z, dx)
            tl.store(hs_ptr + z, xs)


@triton.jit
def _down_kernel(hw_ptr, hd_ptr, hs_ptr, ids_ptr, w_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr,
                 sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n,
                 b_ptr, sb_s, out_ptr, stride_o,
                 D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, KP: tl.constexpr, FMT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, NB1: tl.constexpr,
                 NB2: tl.constexpr, PDL: tl.constexpr, EMU: tl.constexpr, TRIGGER: tl.constexpr):
    """grid (T, D/BN): out[t, n] = sum_j w[t, j] * (down_j row n . h[t, j] (+ bias)), h as int8 words; tile
    [I, k, BN] (v3's), no atomics. TRIGGER: a dependent launch may be scheduled from the start (it waits for this
    grid's writes before reading them)."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < D
    j = tl.arange(0, KP)
    jm = j < KTOP
    s = tl.load(ids_ptr + t * KTOP + j, mask=jm, other=-1).to(tl.int64)
    mask = (jm & (s >= 0))[:, None] & nm[None, :]
    s = tl.maximum(s, 0)[:, None]
    r = tl.minimum(n, D - 1).to(tl.int64)[None, :]
    pj = (t * KTOP + j).to(tl.int64)[:, None]                                         # pair of h
    acc = _v5_dot(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n,
                  s * sm_s + r * sm_n, s * ssc_s + r * ssc_n, s * smn_s + r * smn_n, s * sh_s + r * sh_n, mask,
                  I // BS, hw_ptr, pj * (I // 4), hd_ptr, hs_ptr, pj * (I // 32), FMT, NB1, NB2, PDL, EMU)
    if HAS_BIAS:
        acc += tl.load(b_ptr + s * sb_s + r, mask=mask, other=0.0).to(tl.float32)
    wj = tl.load(w_ptr + t * KTOP + j, mask=jm, other=0.0).to(tl.float32)
    y = tl.sum(tl.where(mask, acc, 0.0) * wj[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=nm)


# Tiles (Tile.bn rows, warps). Timed on the H200 (session 8, bench --variants, graph replays, per call with
# its quantize launch, Qwen3-30B-A3B T=1): gate_up Q4_0 (4, 0, 2) 7.73 us vs (8, 0, 4) 8.16, (16, 0, 8) 8.04;
# Q8_0 10.57 vs 10.8, 10.73; down Q4_0 (4, 0, 4) 6.34 vs (8, 0, 4) 6.64; Q8_0 (16, 0, 8) 8.22 vs (8, 0, 4) 8.82.
# Session 9, Q6_K (pair at (2, 0, 1) / (8, 0, 4): v5 21.1 us, v5pdl 15.6): gate_up (16, 0, 4) 11.13 us vs (4, 0, 2)
# 11.35, (8, 0, 4) 11.47, (16, 0, 8) 11.9; down (8, 0, 4) 8.61 vs (4, 0, 4) 8.63, (16, 0, 8) 8.95. Q4_K (pair at
# (2, 0, 1) / (8, 0, 4): v5 17.3 us, v5pdl 13.35): gate_up (8, 0, 4) 10.71 vs (4, 0, 2) 10.73, (16, 0, 4) 11.37;
# down (8, 0, 4) 7.40 vs (16, 0, 8) 7.62, (4, 0, 4) 7.81.
GATE_UP5 = {"Q8_0": Tile(4, 0, 2), "Q4_0": Tile(4, 0, 2), "Q4_K": Tile(8, 0, 4), "Q6_K": Tile(16, 0, 4)}
DOWN5 = {"Q8_0": Tile(16, 0, 8), "Q4_0": Tile(4, 0, 4), "Q4_K": Tile(8, 0, 4), "Q6_K": Tile(8, 0, 4)}


def _planes(w):
    """The 6 planes (q and h as int32 words) and their 12 slot / row strides in elements: v2_args without
    the table (dmin, mn read by Q4_K only, sc by Q4_K / Q6_K, h by Q6_K)."""
    a = w.v2_args()
    return a[0:6] + a[7:19]


def gate_up_v5(x, ids, w, act: int, alpha: float, limit: float, bias, h, cfg=None, pdl: bool = False,
               quantize_h: bool = False):
    """As triton_decode.gate_up (h float32 [T*k, I], values rounded to x's dtype), x quantized to int8 per
    32-block first (one more launch). FORMATS (supports). quantize_h (the tile's rows divide 32): -> (h, its int8
    copy (q, dx, xs) as `quantize` makes it) from the same launch (variant v5q), for down_v5's `pre`."""
    t, d = x.shape
    k, i = ids.numel() // t, w.n // 2
    tile = Tile(*(cfg or GATE_UP5[w.fmt])[:4])
    qh = quantize_h and 32 % tile.bn == 0
    chain = pdl and PDL_CHAIN
    xq, xd, xs = quantize(x, wait=chain, trigger=2 if chain else pdl)
    b, sb = (bias, bias.stride(0)) if bias is not None else (h, 0)
    nb1, nb2 = v3_pieces(d, w.fmt)
    if qh:
        hq = torch.empty(t * k, i, dtype=torch.int8, device=x.device)
        hd, hs = (torch.empty(t * k, i // 32, dtype=torch.float32, device=x.device) for _ in range(2))
        cnt = arrival_counters(x.device, t * k * (i // 32), "gate_up_h")
    else:
        hq, hd, hs, cnt = h, h, h, xd
    _gate_up_kernel[(t * k, triton.cdiv(i, tile.bn))](
        xq.view(torch.int32), xd, xs, ids, *_planes(w), b, sb, h, alpha, limit, hq, hd, hs, cnt,
        I=i, D=d, KTOP=k, FMT=w.code, ACT=act, HAS_BIAS=bias is not None, BS=STEP_BLOCK[w.fmt], BN=tile.bn,
        NB1=nb1, NB2=nb2, PDL=pdl, EMU=_emulate(), ROUND=ROUND.get(x.dtype, 0), QH=qh,
        num_warps=tile.warps, **({"launch_pdl": True} if pdl else {}))
    if quantize_h:
        return h, ((hq, hd, hs) if qh else None)
    return h


_counters: dict = {}
_kept: list = []


def arrival_counters(device, n: int, purpose: str) -> torch.Tensor:
    """int32 arrival counters for a kernel whose last program per group does the group's final step (the router's
    top-k, gate_up's fused h quantizer): zeroed once, reset to 0 by the programs that use them, so a CUDA graph
    replays with zeros. One buffer per (device, purpose), grown to a power of two when a launch needs more (warm-up
    calls come before a capture); an outgrown buffer is kept, since a captured graph may still point at it.
    Launches of one purpose on one device must not overlap (one decode stream)."""
    key = (device.type, device.index, purpose)
    c = _counters.get(key)
    if c is None or c.numel() < n:
        c = _counters[key] = torch.zeros(1 << max(0, n - 1).bit_length(), dtype=torch.int32, device=device)
        _kept.append(c)
    return c


def down_v5(hx, ids, wt, w, bias, out, cfg=None, pdl: bool = False, pre: tuple | None = None):
    """As triton_decode.down, h quantized to int8 per 32-block first (one more launch) (supports); pre: h's int8
    copy made already (gate_up_v5's quantize_h): no quantizer launch."""
    t, d = out.shape
    k, i = ids.numel() // t, w.k
    tile = Tile(*(cfg or DOWN5[w.fmt])[:4])
    hq, hd, hs = pre if pre is not None else quantize(hx, wait=pdl, trigger=pdl)
    b, sb = (bias, bias.stride(0)) if bias is not None else (out, 0)
    nb1, nb2 = v3_pieces(i, w.fmt)
    _down_kernel[(t, triton.cdiv(d, tile.bn))](
        hq.view(torch.int32), hd, hs, ids, wt, *_planes(w), b, sb, out, out.stride(0),
        D=d, I=i, KTOP=k, KP=triton.next_power_of_2(k), FMT=w.code, HAS_BIAS=bias is not None,
        BS=STEP_BLOCK[w.fmt], BN=tile.bn, NB1=nb1, NB2=nb2, PDL=pdl, EMU=_emulate(), TRIGGER=pdl and PDL_CHAIN,
        num_warps=tile.warps, **({"launch_pdl": True} if pdl else {}))
    return out


def supports(w, k: int) -> bool:
    """v5 reads FORMATS rows of whole blocks (32; Q4_K / Q6_K 256-super-blocks)."""
    return w.fmt in FORMATS and k % BLOCK[w.fmt] == 0
