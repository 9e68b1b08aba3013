"""Decode GEMV kernels, variant "v5": int8 activations and integer dot products (dp4a) for Q8_0 / Q4_0.

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

from .triton_decode import STEP_BLOCK, Tile, _act, _v3_load, v3_pieces

Q8_0, Q4_0 = tl.constexpr(1), tl.constexpr(2)
FORMATS = ("Q8_0", "Q4_0")
MAGIC = tl.constexpr(0x4B400000)      # bits of 1.5 * 2^23: an int32 added to them is read as 12582912 + int
MAGIC_F = tl.constexpr(12582912.0)
ROUND = {torch.bfloat16: 1, torch.float16: 2}      # h rounded to x's dtype (gate_up's ROUND)


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
    programmatic dependent (wait for the primary's grid); TRIGGER: let a dependent be scheduled now."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT:
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NBP)
    j = tl.arange(0, 32)
    mb = b < K // 32
    x = tl.load(x_ptr + r * stride_x + b[:, None] * 32 + j[None, :], mask=mb[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    dx = amax / 127.0
    y = tl.math.div_rn(x, tl.where(amax > 0, dx, 1.0)[:, None])
    q = (y + MAGIC_F) - MAGIC_F                                   # round half to even (|y| <= 127)
    tl.store(q_ptr + r * K + b[:, None] * 32 + j[None, :], q.to(tl.int8), mask=mb[:, None])
    tl.store(d_ptr + r * (K // 32) + b, dx, mask=mb)
    tl.store(s_ptr + r * (K // 32) + b, dx * tl.sum(q, axis=1), mask=mb)


def quantize(x: torch.Tensor, wait: bool = False, trigger: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, K] (K a multiple of 32, unit last stride) -> (q int8 [R, K], dx f32 [R, K/32], xs f32 [R, K/32]).
    One launch, no host sync. wait: launched as a programmatic dependent of the previous kernel (CUDA);
    trigger: the next kernel may be one."""
    r, k = x.shape
    q = torch.empty(r, k, dtype=torch.int8, device=x.device)
    dx = torch.empty(r, k // 32, dtype=torch.float32, device=x.device)
    xs = torch.empty_like(dx)
    _quantize_kernel[(r,)](x, x.stride(0), q, dx, xs, K=k, NBP=triton.next_power_of_2(k // 32), WAIT=wait,
                           TRIGGER=trigger, num_warps=4, **({"launch_pdl": True} if wait else {}))
    return q, dx, xs


def quantize_native(x: torch.Tensor) -> torch.Tensor:
    """The twin of `quantize`, dequantized: x [R, K] -> float32 q * dx (what the kernels multiply by)."""
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(dx > 0, torch.round(xb / torch.where(dx > 0, dx, 1.0)), 0.0)
    return (q * dx).reshape(x.shape)


# ------------------------------------------------------------------ one step of whole rows
@triton.jit
def _v5_math(words, d, g0, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT: tl.constexpr, NB: tl.constexpr,
             EMU: tl.constexpr):
    """Row dot products [A, B] of _v3_load's words [NB*W, A, B] and block scales d (same shape) with the
    int8 activation words at xw_ptr + xwo [XA, XB] (broadcast over the rows), scales dx / xs at xd_ptr /
    xs_ptr + xdo. Word e of the step: Q8_0 elements 4e..4e+3 (x word e); Q4_0 block e // 4, low nibbles
    elements 4 (e % 4)..+3 (x word 8 (e // 4) + e % 4), high ones + 16 (x word + 4)."""
    W: tl.constexpr = 4 if FMT == Q4_0 else 8
    e = g0 * W + tl.arange(0, NB * W)
    me = tl.broadcast_to((e < NBK * W)[:, None, None], words.shape)
    blk = e // W
    xe = blk * 8 + (e % 4) if FMT == Q4_0 else e
    xp = tl.broadcast_to(xw_ptr + xwo[None, :, :] + xe[:, None, None], words.shape)
    dp = tl.broadcast_to(xdo[None, :, :] + blk[:, None, None], words.shape)
    dx = tl.load(xd_ptr + dp, mask=me, other=0.0)
    if FMT == Q4_0:
        xl = tl.load(xp, mask=me, other=0)
        xh = tl.load(xp + 4, mask=me, other=0)
        r = _dp4a((words >> 4) & 0x0F0F0F0F, xh, _dp4a(words & 0x0F0F0F0F, xl, MAGIC, EMU), EMU)
        xs = tl.load(xs_ptr + dp, mask=me, other=0.0)
        v = (r.to(tl.float32, bitcast=True) - MAGIC_F) * dx - 2.0 * xs       # 8 * xs over the block's 4 words
    else:
        xw = tl.load(xp, mask=me, other=0)
        v = (_dp4a(words, xw, MAGIC, EMU).to(tl.float32, bitcast=True) - MAGIC_F) * dx
    return tl.sum(d.to(tl.float32) * v, axis=0)


@triton.jit
def _v5_dot(q_ptr, d_ptr, rq, rd, mask, NBK: tl.constexpr, xw_ptr, xwo, xd_ptr, xs_ptr, xdo,
            FMT: tl.constexpr, NB1: tl.constexpr, NB2: tl.constexpr, PDL_WAIT: tl.constexpr, EMU: tl.constexpr):
    """[A, B] dot products of whole rows: the weight loads of both pieces, (PDL_WAIT: the wait for the
    activations' grid), then the math."""
    a0, a1, _, _, _, _, _ = _v3_load(q_ptr, d_ptr, d_ptr, d_ptr, d_ptr, rq, rd, rd, rd, rd, mask, 0, NBK, FMT, NB1)
    if NB2 > 0:
        b0, b1, _, _, _, _, _ = _v3_load(q_ptr, d_ptr, d_ptr, d_ptr, d_ptr, rq, rd, rd, rd, rd, mask, NB1, NBK,
                                         FMT, NB2)
    if PDL_WAIT:
        tl.extra.cuda.gdc_wait()
    acc = _v5_math(a0, a1, 0, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB1, EMU)
    if NB2 > 0:
        acc += _v5_math(b0, b1, NB1, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB2, EMU)
    return acc


@triton.jit
def _gate_up_kernel(xw_ptr, xd_ptr, xs_ptr, ids_ptr, q_ptr, d_ptr, sq_s, sq_n, sd_s, sd_n,
                    b_ptr, sb_s, out_ptr, alpha, limit,
                    I: tl.constexpr, D: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr, ACT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, NB1: tl.constexpr,
                    NB2: tl.constexpr, PDL: tl.constexpr, EMU: tl.constexpr, ROUND: tl.constexpr):
    """grid (T*k pairs, I/BN): h[pair, n] = act(gate row n . x[t], up row n . x[t]) (+ bias), x as int8 words;
    tile [K, BN, 2] (gate rows, up rows), every weight load issued first (v3's)."""
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
        acc = _v5_dot(q_ptr, d_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n, r >= 0, D // BS,
                      xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB1, NB2, PDL, EMU)
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


@triton.jit
def _down_kernel(hw_ptr, hd_ptr, hs_ptr, ids_ptr, w_ptr, q_ptr, d_ptr, sq_s, sq_n, sd_s, sd_n,
                 b_ptr, sb_s, out_ptr, stride_o,
                 D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, KP: tl.constexpr, FMT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, NB1: tl.constexpr,
                 NB2: tl.constexpr, PDL: tl.constexpr, EMU: tl.constexpr):
    """grid (T, D/BN): out[t, n] = sum_j w[t, j] * (down_j row n . h[t, j] (+ bias)), h as int8 words; tile
    [I, k, BN] (v3's), no atomics."""
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
    acc = _v5_dot(q_ptr, d_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n, mask, I // BS,
                  hw_ptr, pj * (I // 4), hd_ptr, hs_ptr, pj * (I // 32), FMT, NB1, NB2, PDL, EMU)
    if HAS_BIAS:
        acc += tl.load(b_ptr + s * sb_s + r, mask=mask, other=0.0).to(tl.float32)
    wj = tl.load(w_ptr + t * KTOP + j, mask=jm, other=0.0).to(tl.float32)
    y = tl.sum(tl.where(mask, acc, 0.0) * wj[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=nm)


# Tiles (Tile.bn rows, warps). Timed on the H200 (session 8, bench --variants, graph replays, per call with
# its quantize launch, Qwen3-30B-A3B T=1): gate_up Q4_0 (4, 0, 2) 7.73 us vs (8, 0, 4) 8.16, (16, 0, 8) 8.04;
# Q8_0 10.57 vs 10.8, 10.73; down Q4_0 (4, 0, 4) 6.34 vs (8, 0, 4) 6.64; Q8_0 (16, 0, 8) 8.22 vs (8, 0, 4) 8.82.
GATE_UP5 = {"Q8_0": Tile(4, 0, 2), "Q4_0": Tile(4, 0, 2)}
DOWN5 = {"Q8_0": Tile(16, 0, 8), "Q4_0": Tile(4, 0, 4)}


def _planes(w):
    """(q as int32 words, d) and their slot / row strides in elements (v2_args' first planes)."""
    a = w.v2_args()
    return a[0], a[1], a[7], a[8], a[9], a[10]


def gate_up_v5(x, ids, w, act: int, alpha: float, limit: float, bias, h, cfg=None, pdl: bool = False):
    """As triton_decode.gate_up (h float32 [T*k, I], values rounded to x's dtype), x quantized to int8 per
    32-block first (one more launch). Q8_0 / Q4_0; D a multiple of 32."""
    t, d = x.shape
    k, i = ids.numel() // t, w.n // 2
    tile = Tile(*(cfg or GATE_UP5[w.fmt])[:4])
    xq, xd, xs = quantize(x, trigger=pdl)
    q, dp, sq_s, sq_n, sd_s, sd_n = _planes(w)
    b, sb = (bias, bias.stride(0)) if bias is not None else (h, 0)
    nb1, nb2 = v3_pieces(d, w.fmt)
    _gate_up_kernel[(t * k, triton.cdiv(i, tile.bn))](
        xq.view(torch.int32), xd, xs, ids, q, dp, sq_s, sq_n, sd_s, sd_n, b, sb, h, alpha, limit,
        I=i, D=d, KTOP=k, FMT=w.code, ACT=act, HAS_BIAS=bias is not None, BS=STEP_BLOCK[w.fmt], BN=tile.bn,
        NB1=nb1, NB2=nb2, PDL=pdl, EMU=_emulate(), ROUND=ROUND.get(x.dtype, 0),
        num_warps=tile.warps, **({"launch_pdl": True} if pdl else {}))
    return h


def down_v5(hx, ids, wt, w, bias, out, cfg=None, pdl: bool = False):
    """As triton_decode.down, h quantized to int8 per 32-block first (one more launch); I a multiple of 32."""
    t, d = out.shape
    k, i = ids.numel() // t, w.k
    tile = Tile(*(cfg or DOWN5[w.fmt])[:4])
    hq, hd, hs = quantize(hx, wait=pdl, trigger=pdl)
    q, dp, sq_s, sq_n, sd_s, sd_n = _planes(w)
    b, sb = (bias, bias.stride(0)) if bias is not None else (out, 0)
    nb1, nb2 = v3_pieces(i, w.fmt)
    _down_kernel[(t, triton.cdiv(d, tile.bn))](
        hq.view(torch.int32), hd, hs, ids, wt, q, dp, sq_s, sq_n, sd_s, sd_n, b, sb, out, out.stride(0),
        D=d, I=i, KTOP=k, KP=triton.next_power_of_2(k), FMT=w.code, HAS_BIAS=bias is not None,
        BS=STEP_BLOCK[w.fmt], BN=tile.bn, NB1=nb1, NB2=nb2, PDL=pdl, EMU=_emulate(), num_warps=tile.warps,
        **({"launch_pdl": True} if pdl else {}))
    return out


def supports(w, k: int) -> bool:
    """v5 reads Q8_0 / Q4_0 rows whose length is a multiple of 32 (every block whole)."""
    return w.fmt in FORMATS and k % 32 == 0
