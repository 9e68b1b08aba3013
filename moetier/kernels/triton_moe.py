"""Triton MoE expert kernels over a weight arena addressed by slot ids (GPU; CPU under TRITON_INTERPRET).

Weights: gate_up [S, 2I, D] (gate rows, then up rows) and down [S, D, I] per slot, either a float
tensor (bf16/fp16/fp32) or the planes of `quant.repack` with leading dims [S, N] (PLANE_DIV: Q8_0,
Q4_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ3_XXS, IQ2_XXS, Q2_K, Q3_K; RAW_FORMATS, e.g. IQ2_XS: the GGML rows as stored,
{"raw": rows}, read by triton_rawq). Any strides, unit stride on the last dim. A slot id < 0
means "not here" (a miss computed elsewhere): the pair adds nothing.

decode (T <= 8): two launches, no host sync, CUDA-graph capturable. Quantized formats run the "v2"
  kernels of triton_decode.py (int32-word loads, see there); dense, and v1 on request (variant=), the
  GEMV kernels here:
  1. gate_up: grid (T*k pairs, I/BN): each program streams BN gate rows and BN up rows of its slot
     against x[t] -> h[pair] = act(gate, up) in x's dtype.
  2. down: grid (T, D/BN): per K step, each program loads BN rows of each of its token's k experts
     (k independent tiles in flight) and writes out[t] = sum_j w[t, j] * (down_j @ h[t, j] + b_j)
     itself: no atomics, no partial sums in memory, deterministic.
  GEMV on CUDA cores, fp32 accumulation kept elementwise (dense) or per 32-block (quantized, scaled
  once per block) and reduced once at the end; integers become floats by the 2^23 bit trick, not
  I2F. Pairs of one slot in different tokens read the same rows at about the same time (the token /
  pair is the fastest grid axis), so L2 serves the repeats.
grouped (prefill): pairs sorted by slot and padded to BM per slot (`align_pairs`, device ops only),
  then two tensor-core GEMMs (tl.dot, fp32 accumulation): gate_up+act -> h, down * w -> y [T*k, D];
  quantized tiles are dequantized to x's dtype on the fly (Q5_K, Q6_K, MXFP4, IQ3_XXS, IQ2_XXS, Q2_K, Q3_K
  element-wise by triton_tiles.deq_tile). out = y.view(T, k, D).sum(1).
"""
from __future__ import annotations

import os

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import triton_decode as v2
from . import triton_decode_q8 as v5
from .pdl import supported as pdl_supported
from .triton_decode import _act, gate_up_act, pair_rows
from .triton_tiles import deq_tile
from .triton_weights import BLOCK, FMT_CODES, PLANE_DIV, RAW_FORMATS, Weights  # noqa: F401 (re-exported)

DENSE, Q8_0, Q4_0, Q4_K = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
SWIGLU = tl.constexpr(0)
Q5_K, Q6_K, MXFP4, IQ3_XXS = tl.constexpr(4), tl.constexpr(5), tl.constexpr(6), tl.constexpr(7)
V1_FORMATS = ("dense", "Q8_0", "Q4_0", "Q4_K")                  # formats the v1 kernels read
ACT_CODES = {"swiglu": 0, "clamped_swiglu": 1}

class DecodeTile(NamedTuple):
    """GEMV tiles: BN rows (per expert) x BK elements per K step, warps, software-pipeline stages of
    the K loop (cp.async, >1 needs shared memory), Q4 nibbles read as int32 words (else bytes)."""
    bn: int
    bk: int
    warps: int = 4
    stages: int = 1
    words: bool = True


class GroupedTile(NamedTuple):
    bn: int
    bk: int
    warps: int = 4
    stages: int = 3


# Decode: ~16 KB of weights per program per K step, one wave of programs at T=1 (Qwen3-30B-A3B:
# 384 gate_up and 512 down programs on 132 SMs), the next steps prefetched; Q4 gate_up reads words
# (x shared by many rows), down bytes (fewer x gathers). bench/bench_gpu_kernels.py --sweep re-measures.
DECODE_GATE_UP = {"dense": DecodeTile(16, 256, 4, 3), "Q8_0": DecodeTile(16, 512, 4, 3),
                  "Q4_0": DecodeTile(16, 1024, 8, 2), "Q4_K": DecodeTile(16, 1024, 8, 2)}
DECODE_DOWN = {"dense": DecodeTile(4, 256, 4, 3), "Q8_0": DecodeTile(4, 1024, 4),
               "Q4_0": DecodeTile(4, 1024, 4, words=False), "Q4_K": DecodeTile(4, 1024, 4, words=False)}
GROUPED = {"dense": GroupedTile(128, 64, 4, 4), "Q8_0": GroupedTile(128, 64, 4, 3),
           "Q4_0": GroupedTile(128, 64, 4, 3), "Q4_K": GroupedTile(128, 64, 4, 3),
           # element-gathered tiles (triton_tiles): no cp.async pipeline (its buffers would not fit)
           "Q5_K": GroupedTile(128, 64, 8, 1), "Q6_K": GroupedTile(128, 64, 8, 1),
           "MXFP4": GroupedTile(128, 64, 8, 1), "IQ3_XXS": GroupedTile(128, 64, 8, 1),
           "IQ2_XXS": GroupedTile(128, 64, 8, 1), "Q2_K": GroupedTile(128, 64, 8, 1),
           "Q3_K": GroupedTile(128, 64, 8, 1),
           **{f: GroupedTile(128, 64, 8, 1) for f in RAW_FORMATS}}


# ------------------------------------------------------------------ element helpers
@triton.jit
def _i8f(q):
    """int8 -> float32 without I2F (1/8 rate on sm_90): bits of 2^23 + 128 + q, minus that bias."""
    return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _u8f(v, bias: tl.constexpr = 0.0):
    """uint8 in [0, 255] -> float32 v - bias, same trick (one integer op, one FADD)."""
    return (v.to(tl.int32) + 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


# ------------------------------------------------------------------ block loads (all formats)
# rq/rd/rm/rsc/rmn: [R] element offsets of each row in the qs/d/dmin/sc/mn planes; mask: [R].
@triton.jit
def _q8_load(q_ptr, d_ptr, rq, rd, mask, k0, K, BK: tl.constexpr):
    """-> q [R, BK/32, 32] f32, d [R, BK/32] f32 for elements k0 .. k0+BK of each row."""
    NB: tl.constexpr = BK // 32
    g = k0 // 32 + tl.arange(0, NB)
    mg = mask[:, None] & (g < K // 32)[None, :]
    j = tl.arange(0, 32)
    q = tl.load(q_ptr + rq[:, None, None] + (g[:, None] * 32 + j[None, :])[None, :, :], mask=mg[:, :, None], other=0)
    d = tl.load(d_ptr + rd[:, None] + g[None, :], mask=mg, other=0.0)
    return _i8f(q), d.to(tl.float32)


@triton.jit
def _q4_0_load(q_ptr, d_ptr, rq, rd, mask, k0, K, BK: tl.constexpr):
    """-> lo, hi [R, BK/32, 16] f32 (q - 8; byte j of a block holds elements j and j + 16), d [R, BK/32]."""
    NB: tl.constexpr = BK // 32
    g = k0 // 32 + tl.arange(0, NB)
    mg = mask[:, None] & (g < K // 32)[None, :]
    j = tl.arange(0, 16)
    b = tl.load(q_ptr + rq[:, None, None] + (g[:, None] * 16 + j[None, :])[None, :, :], mask=mg[:, :, None], other=0)
    d = tl.load(d_ptr + rd[:, None] + g[None, :], mask=mg, other=0.0)
    return _u8f(b & 15, 8.0), _u8f(b >> 4, 8.0), d.to(tl.float32)


@triton.jit
def _q4_k_scales(d_ptr, m_ptr, sc_ptr, mn_ptr, rd, rm, rsc, rmn, mc, c):
    """Scale and min of the two sub-blocks (2c, 2c+1) of 64-element chunks c -> 4 x [R, NC] f32:
    d * sc_lo, dmin * mn_lo, d * sc_hi, dmin * mn_hi (super-block c // 4). d and dmin of super-block b sit at
    2b of their slots, sc and mn of chunk c at 4c, 4c + 1 (triton_weights: dmin, mn are views of d, sc)."""
    sb = 2 * (c // 4)
    d = tl.load(d_ptr + rd[:, None] + sb[None, :], mask=mc, other=0.0).to(tl.float32)
    dm = tl.load(m_ptr + rm[:, None] + sb[None, :], mask=mc, other=0.0).to(tl.float32)
    sc_lo = _u8f(tl.load(sc_ptr + rsc[:, None] + 4 * c[None, :], mask=mc, other=0))
    sc_hi = _u8f(tl.load(sc_ptr + rsc[:, None] + 4 * c[None, :] + 1, mask=mc, other=0))
    mn_lo = _u8f(tl.load(mn_ptr + rmn[:, None] + 4 * c[None, :], mask=mc, other=0))
    mn_hi = _u8f(tl.load(mn_ptr + rmn[:, None] + 4 * c[None, :] + 1, mask=mc, other=0))
    return d * sc_lo, dm * mn_lo, d * sc_hi, dm * mn_hi


@triton.jit
def _q4_k_load(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rq, rd, rm, rsc, rmn, mask, k0, K, BK: tl.constexpr):
    """Q4_K in 64-element chunks c (32 bytes: byte j = element 64c + j low, 64c + 32 + j high).
    -> lo, hi [R, BK/64, 32] f32 (raw 0..15) and _q4_k_scales' four [R, BK/64] tensors."""
    NC: tl.constexpr = BK // 64
    c = k0 // 64 + tl.arange(0, NC)
    mc = mask[:, None] & (c < K // 64)[None, :]
    j = tl.arange(0, 32)
    b = tl.load(q_ptr + rq[:, None, None] + (c[:, None] * 32 + j[None, :])[None, :, :], mask=mc[:, :, None], other=0)
    dl_lo, ml_lo, dl_hi, ml_hi = _q4_k_scales(d_ptr, m_ptr, sc_ptr, mn_ptr, rd, rm, rsc, rmn, mc, c)
    return _u8f(b & 15), _u8f(b >> 4), dl_lo, ml_lo, dl_hi, ml_hi


@triton.jit
def _kidx(k0, K, FMT: tl.constexpr, BK: tl.constexpr):
    """Element indices [NB, G] of the low (or only) half of a K step, the offset of the high half
    and the per-group mask: dense/Q8_0 [BK/32, 32], Q4_0 [BK/32, 16] (+16), Q4_K [BK/64, 32] (+32)."""
    if FMT == Q4_K:
        g = k0 // 64 + tl.arange(0, BK // 64)
        return g[:, None] * 64 + tl.arange(0, 32)[None, :], 32, (g < K // 64)[:, None]
    elif FMT == Q4_0:
        g = k0 // 32 + tl.arange(0, BK // 32)
        return g[:, None] * 32 + tl.arange(0, 16)[None, :], 16, (g < K // 32)[:, None]
    else:
        g = k0 // 32 + tl.arange(0, BK // 32)
        return g[:, None] * 32 + tl.arange(0, 32)[None, :], 0, (g < K // 32)[:, None]


# ------------------------------------------------------------------ decode: GEMV steps
@triton.jit
def _row_offsets(s, n, sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n):
    """Element offsets of rows n of slot s in the five planes (qs, d, dmin, sc, mn)."""
    return s * sq_s + n * sq_n, s * sd_s + n * sd_n, s * sm_s + n * sm_n, s * ssc_s + n * ssc_n, s * smn_s + n * smn_n


@triton.jit
def _gemv_acc(BN: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr):
    """Zero accumulator in the shape _gemv_step returns."""
    if FMT == DENSE:
        return tl.zeros([BN, BK], dtype=tl.float32)
    elif FMT == Q4_K:
        return tl.zeros([BN, BK // 64], dtype=tl.float32)
    else:
        return tl.zeros([BN, BK // 32], dtype=tl.float32)


@triton.jit
def _gemv_step(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rq, rd, rm, rsc, rmn, mask,
               x_ptr, xo, xscale, k0, K, FMT: tl.constexpr, BK: tl.constexpr, WORDS: tl.constexpr):
    """Products of rows [BN] (offsets rq.., mask) with xscale * x[xo + k], k in k0 .. k0+BK, kept
    elementwise ([BN, BK], dense) or per block ([BN, BK/32] Q8_0/Q4_0, [BN, BK/64] Q4_K); the caller
    accumulates over K and reduces once. x is one vector, broadcast over the rows. WORDS (Q4_*): read
    nibbles as int32 words (fewer integer ops, 4x more x gathers) or as bytes."""
    if FMT == DENSE:
        kk = k0 + tl.arange(0, BK)
        mk = kk < K
        w = tl.load(q_ptr + rq[:, None] + kk[None, :], mask=mask[:, None] & mk[None, :], other=0.0)
        x = tl.load(x_ptr + xo + kk, mask=mk, other=0.0).to(tl.float32) * xscale
        return w.to(tl.float32) * x[None, :]
    else:
        kx, hi_off, mg = _kidx(k0, K, FMT, BK)
        if FMT == Q8_0:
            q, d = _q8_load(q_ptr, d_ptr, rq, rd, mask, k0, K, BK)
            x = tl.load(x_ptr + xo + kx, mask=mg, other=0.0).to(tl.float32) * xscale
            return d * tl.sum(q * x[None, :, :], axis=2)
        elif WORDS:
            return _q4_words_step(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rq, rd, rm, rsc, rmn, mask,
                                  x_ptr, xo, xscale, k0, K, FMT, BK)
        else:                                          # bytes: fewer x gathers, more integer ops
            xlo = tl.load(x_ptr + xo + kx, mask=mg, other=0.0).to(tl.float32) * xscale
            xhi = tl.load(x_ptr + xo + kx + hi_off, mask=mg, other=0.0).to(tl.float32) * xscale
            if FMT == Q4_0:
                lo, hi, d = _q4_0_load(q_ptr, d_ptr, rq, rd, mask, k0, K, BK)
                return d * tl.sum(lo * xlo[None, :, :] + hi * xhi[None, :, :], axis=2)
            else:
                lo, hi, dl_lo, ml_lo, dl_hi, ml_hi = _q4_k_load(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rq, rd, rm,
                                                                rsc, rmn, mask, k0, K, BK)
                return (dl_lo * tl.sum(lo * xlo[None, :, :], axis=2) - ml_lo * tl.sum(xlo, axis=1)[None, :]
                        + dl_hi * tl.sum(hi * xhi[None, :, :], axis=2) - ml_hi * tl.sum(xhi, axis=1)[None, :])


@triton.jit
def _q4_words_step(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rq, rd, rm, rsc, rmn, mask,
                   x_ptr, xo, xscale, k0, K, FMT: tl.constexpr, BK: tl.constexpr):
    """_gemv_step for Q4_0 / Q4_K, reading the nibble plane as int32 words (byte offsets rq / 4)."""
    qw = q_ptr.to(tl.pointer_type(tl.int32))
    if FMT == Q4_0:                                    # block g: 4 words; byte j: elements j, j + 16
        NB: tl.constexpr = BK // 32
        g = k0 // 32 + tl.arange(0, NB)
        mg = mask[:, None] & (g < K // 32)[None, :]
        wi = tl.arange(0, 4)
        words = tl.load(qw + (rq // 4)[:, None, None] + (g[:, None] * 4 + wi[None, :])[None, :, :],
                        mask=mg[:, :, None], other=0)
        acc = tl.zeros(words.shape, dtype=tl.float32)
        for i in tl.static_range(8):                   # nibble i of each word: byte i // 2, high if odd
            q = (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            kx = g[:, None] * 32 + wi[None, :] * 4 + (i // 2 + 16 * (i % 2))
            x = tl.load(x_ptr + xo + kx, mask=(g < K // 32)[:, None], other=0.0).to(tl.float32) * xscale
            acc += q * x[None, :, :]
        d = tl.load(d_ptr + rd[:, None] + g[None, :], mask=mg, other=0.0).to(tl.float32)
        return d * tl.sum(acc, axis=2)
    else:                                              # chunk c: 8 words; byte j: elements 64c + j, + 32
        NC: tl.constexpr = BK // 64
        c = k0 // 64 + tl.arange(0, NC)
        mcv = c < K // 64
        mc = mask[:, None] & mcv[None, :]
        wi = tl.arange(0, 8)
        words = tl.load(qw + (rq // 4)[:, None, None] + (c[:, None] * 8 + wi[None, :])[None, :, :],
                        mask=mc[:, :, None], other=0)
        acc_lo = tl.zeros(words.shape, dtype=tl.float32)
        acc_hi = tl.zeros(words.shape, dtype=tl.float32)
        x_lo = tl.zeros([NC, 8], dtype=tl.float32)
        x_hi = tl.zeros([NC, 8], dtype=tl.float32)
        for i in tl.static_range(8):                   # even nibbles: sub-block 2c, odd: 2c + 1
            q = (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            kx = c[:, None] * 64 + wi[None, :] * 4 + (i // 2 + 32 * (i % 2))
            x = tl.load(x_ptr + xo + kx, mask=mcv[:, None], other=0.0).to(tl.float32) * xscale
            if i % 2 == 0:
                acc_lo += q * x[None, :, :]
                x_lo += x
            else:
                acc_hi += q * x[None, :, :]
                x_hi += x
        dl_lo, ml_lo, dl_hi, ml_hi = _q4_k_scales(d_ptr, m_ptr, sc_ptr, mn_ptr, rd, rm, rsc, rmn, mc, c)
        return (dl_lo * tl.sum(acc_lo, axis=2) - ml_lo * tl.sum(x_lo, axis=1)[None, :]
                + dl_hi * tl.sum(acc_hi, axis=2) - ml_hi * tl.sum(x_hi, axis=1)[None, :])


@triton.jit
def _decode_gate_up_kernel(x_ptr, stride_x, ids_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr,
                           sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n,
                           b_ptr, sb_s, h_ptr, alpha, limit,
                           I: tl.constexpr, D: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr, ACT: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WORDS: tl.constexpr,
                           NS: tl.constexpr):
    p, n, s, mask, ng, nu = pair_rows(ids_ptr, I, BN)  # pair t*k + j
    gq, gd, gm, gsc, gmn = _row_offsets(s, ng, sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n)
    uq, ud, um, usc, umn = _row_offsets(s, nu, sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n)
    xo = (p // KTOP).to(tl.int64) * stride_x
    acc_g = _gemv_acc(BN, BK, FMT)
    acc_u = _gemv_acc(BN, BK, FMT)
    for k0 in tl.range(0, D, BK, num_stages=NS):
        acc_g += _gemv_step(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, gq, gd, gm, gsc, gmn, mask,
                            x_ptr, xo, 1.0, k0, D, FMT, BK, WORDS)
        acc_u += _gemv_step(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, uq, ud, um, usc, umn, mask,
                            x_ptr, xo, 1.0, k0, D, FMT, BK, WORDS)
    h = gate_up_act(acc_g, acc_u, b_ptr, sb_s, s, ng, nu, mask, HAS_BIAS, ACT, alpha, limit)
    tl.store(h_ptr + p.to(tl.int64) * I + n, h.to(h_ptr.dtype.element_ty), mask=n < I)


@triton.jit
def _decode_down_kernel(h_ptr, ids_ptr, w_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr,
                        sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n,
                        b_ptr, sb_s, out_ptr, stride_o,
                        D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WORDS: tl.constexpr,
                        NS: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < D
    nd = n.to(tl.int64)
    acc = _gemv_acc(BN, BK, FMT)
    for k0 in tl.range(0, I, BK, num_stages=NS):
        for j in tl.static_range(KTOP):                # all k experts' tiles in flight at once
            s = tl.load(ids_ptr + t * KTOP + j).to(tl.int64)
            wj = tl.where(s >= 0, tl.load(w_ptr + t * KTOP + j).to(tl.float32), 0.0)
            rq, rd, rm, rsc, rmn = _row_offsets(tl.maximum(s, 0), nd, sq_s, sq_n, sd_s, sd_n, sm_s, sm_n,
                                                ssc_s, ssc_n, smn_s, smn_n)
            acc += _gemv_step(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rq, rd, rm, rsc, rmn, nm & (s >= 0),
                              h_ptr, (t * KTOP + j).to(tl.int64) * I, wj, k0, I, FMT, BK, WORDS)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        for j in tl.static_range(KTOP):
            s = tl.load(ids_ptr + t * KTOP + j).to(tl.int64)
            wj = tl.load(w_ptr + t * KTOP + j).to(tl.float32)
            y += wj * tl.load(b_ptr + s * sb_s + nd, mask=nm & (s >= 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=nm)


# ------------------------------------------------------------------ grouped: one K step of a GEMM
@triton.jit
def _x_tile(x_ptr, xo, xm, k0, K, FMT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Rows xo [BM] of x, columns of a K step in the order the weight tile uses -> (lo, hi):
    dense/Q8_0 [BM, BK] (twice); Q4_* the low- and high-nibble columns [BM, BK/2] each."""
    if FMT != Q4_0 and FMT != Q4_K:
        kk = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + xo[:, None] + kk[None, :], mask=xm[:, None] & (kk < K)[None, :], other=0.0)
        return a, a
    else:
        kx, hi_off, _ = _kidx(k0, K, FMT, BK)
        kx = tl.reshape(kx, (BK // 2,))
        m2 = xm[:, None] & (kx < K)[None, :]             # K is a multiple of the block
        lo = tl.load(x_ptr + xo[:, None] + kx[None, :], mask=m2, other=0.0)
        hi = tl.load(x_ptr + xo[:, None] + kx[None, :] + hi_off, mask=m2, other=0.0)
        return lo, hi


@triton.jit
def _mm_step(acc, a_lo, a_hi, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, lut_ptr, rq, rd, rm, rsc, rmn, rh,
             mask, k0, K, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """acc [BM, BN] += x tile @ W[rows, k0:k0+BK]^T, the weight tile dequantized to x's dtype."""
    if FMT >= Q5_K:
        w = deq_tile(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, lut_ptr, rq, rd, rm, rsc, rmn, rh, mask, k0, K,
                     FMT, BK)
        return tl.dot(a_lo, tl.trans(w.to(a_lo.dtype)), acc, input_precision=PREC)
    elif FMT == DENSE:
        kk = k0 + tl.arange(0, BK)
        w = tl.load(q_ptr + rq[None, :] + kk[:, None], mask=mask[None, :] & (kk < K)[:, None], other=0.0)
        return tl.dot(a_lo, w.to(a_lo.dtype), acc, input_precision=PREC)
    elif FMT == Q8_0:
        q, d = _q8_load(q_ptr, d_ptr, rq, rd, mask, k0, K, BK)
        w = tl.reshape(q * d[:, :, None], (BN, BK))
        return tl.dot(a_lo, tl.trans(w.to(a_lo.dtype)), acc, input_precision=PREC)
    else:
        if FMT == Q4_0:
            lo, hi, d = _q4_0_load(q_ptr, d_ptr, rq, rd, mask, k0, K, BK)
            lo = lo * d[:, :, None]
            hi = hi * d[:, :, None]
        else:
            lo, hi, dl_lo, ml_lo, dl_hi, ml_hi = _q4_k_load(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rq, rd, rm,
                                                            rsc, rmn, mask, k0, K, BK)
            lo = dl_lo[:, :, None] * lo - ml_lo[:, :, None]
            hi = dl_hi[:, :, None] * hi - ml_hi[:, :, None]
        lo = tl.reshape(lo, (BN, BK // 2)).to(a_lo.dtype)
        hi = tl.reshape(hi, (BN, BK // 2)).to(a_lo.dtype)
        acc = tl.dot(a_lo, tl.trans(lo), acc, input_precision=PREC)
        return tl.dot(a_hi, tl.trans(hi), acc, input_precision=PREC)


@triton.jit
def _grouped_gate_up_kernel(x_ptr, stride_x, sorted_ptr, bslot_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr,
                            sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, qh_ptr, lut_ptr, sh_s, sh_n,
                            b_ptr, sb_s, h_ptr, P, alpha, limit,
                            I: tl.constexpr, D: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr,
                            ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    mb = tl.program_id(0)
    s = tl.load(bslot_ptr + mb).to(tl.int64)
    if s >= 0:                                         # blocks past the last slot's rows have -1
        m = mb * BM + tl.arange(0, BM)
        pair = tl.load(sorted_ptr + m)                 # P marks a padding row
        xm = pair < P
        xo = (pair // KTOP).to(tl.int64) * stride_x
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = n < I
        ng, nu = n.to(tl.int64), n.to(tl.int64) + I
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, D, BK):
            a_lo, a_hi = _x_tile(x_ptr, xo, xm, k0, D, FMT, BM, BK)
            acc_g = _mm_step(acc_g, a_lo, a_hi, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, qh_ptr, lut_ptr,
                             s * sq_s + ng * sq_n, s * sd_s + ng * sd_n, s * sm_s + ng * sm_n, s * ssc_s + ng * ssc_n,
                             s * smn_s + ng * smn_n, s * sh_s + ng * sh_n, mask, k0, D, FMT, BN, BK, PREC)
            acc_u = _mm_step(acc_u, a_lo, a_hi, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, qh_ptr, lut_ptr,
                             s * sq_s + nu * sq_n, s * sd_s + nu * sd_n, s * sm_s + nu * sm_n, s * ssc_s + nu * ssc_n,
                             s * smn_s + nu * smn_n, s * sh_s + nu * sh_n, mask, k0, D, FMT, BN, BK, PREC)
        if HAS_BIAS:
            acc_g += tl.load(b_ptr + s * sb_s + ng, mask=mask, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_ptr + s * sb_s + nu, mask=mask, other=0.0).to(tl.float32)[None, :]
        h = _act(acc_g, acc_u, ACT, alpha, limit)
        tl.store(h_ptr + m.to(tl.int64)[:, None] * I + n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask[None, :])


@triton.jit
def _grouped_down_kernel(hx_ptr, sorted_ptr, bslot_ptr, w_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr,
                         sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, qh_ptr, lut_ptr, sh_s, sh_n,
                         b_ptr, sb_s, y_ptr, P,
                         D: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    mb = tl.program_id(0)
    s = tl.load(bslot_ptr + mb).to(tl.int64)
    if s >= 0:
        m = mb * BM + tl.arange(0, BM)
        pair = tl.load(sorted_ptr + m)
        pm = pair < P
        ho = m.to(tl.int64) * I                        # h rows are in the padded sorted order
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = n < D
        nd = n.to(tl.int64)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            a_lo, a_hi = _x_tile(hx_ptr, ho, pm, k0, I, FMT, BM, BK)
            acc = _mm_step(acc, a_lo, a_hi, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, qh_ptr, lut_ptr,
                           s * sq_s + nd * sq_n, s * sd_s + nd * sd_n, s * sm_s + nd * sm_n, s * ssc_s + nd * ssc_n,
                           s * smn_s + nd * smn_n, s * sh_s + nd * sh_n, mask, k0, I, FMT, BN, BK, PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + s * sb_s + nd, mask=mask, other=0.0).to(tl.float32)[None, :]
        acc *= tl.load(w_ptr + pair, mask=pm, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * D + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=pm[:, None] & mask[None, :])


# ------------------------------------------------------------------ launchers
def _bk(bk: int, k: int, fmt: str) -> int:
    """Largest useful K step: no wider than the row (rounded up to a power of two), at least a block pair."""
    return max(min(bk, triton.next_power_of_2(k)), 64 if fmt == "Q4_K" else 32 if fmt != "dense" else 16)


def _bias(b, like: torch.Tensor):
    return (b, b.stride(0)) if b is not None else (like, 0)


# the default decode variant per format where another than v2 was measured faster (H200, Qwen3-30B-A3B layer,
# T=1, graph replays): session 7 Q4_0 v3 24.0 us per gate_up + down vs v2 28.0, Q8_0 19.6 vs 28.6; session 8
# v5pdl (int8 activations, dp4a) Q4_0 11.65 us, Q8_0 16.67 (v5 14.77 / 19.43); all on the GPU, 48 layers
# Q4_0: v5 335.0 tok/s vs v3 296.5; session 9 Q6_K v5pdl 15.56 us vs v2 47.2 (v5 21.1), Q4_K v5pdl 13.35 us vs
# v2 28.8, v3 29.4 (v5 17.3); session 16 (their first GPU run, tests passed there) MXFP4 v5pdl 12.29 us vs v2 29.05,
# Q5_K 15.09 vs 36.61, IQ3_XXS 25.88 vs 62.53; session 30 Q4_0 v5qx (no x quantizer launch) pair 10.27 us vs v5q
# 10.62, all on the GPU 686.6 tok/s vs 670.8 / 670.7 in one process (Q4_K 14.04 vs 12.65 and Q6_K 14.72 vs 14.23: v5q);
# session 36 Q4_K v5qx with gate_up's row in two pieces (triton_decode_q8.SPLIT_FORMATS) 12.43 / 12.54 vs v5q 12.75 /
# 12.67 (interleaved in one process; v5qx in one piece 13.79 / 13.89); session 38, Q4_K's scales as two words a load
# (quant.repack): v5q at gate_up (32, 0, 8) in two pieces 11.91 / 11.93 vs v5qx 12.36-12.48 (its 32 rows: 12.41-14.53)
# session 44 (H100): Q5_K v5qx 15.15-15.17 us vs v5pdl 15.88-16.10 (58% vs 55-56% of the copy rate; four processes,
# session 43's one call too); not yet timed on an H200
DEFAULT_VARIANT = {"Q4_0": "v5qx", "Q8_0": "v5pdl", "Q4_K": "v5q", "Q6_K": "v5q", "MXFP4": "v5pdl",
                   "Q5_K": "v5qx", "IQ3_XXS": "v5pdl"}
VARIANTS = ("v1", "v2", "v2pdl", "v3", "v3pdl", "v5", "v5pdl", "v5q", "v5qx")


def variant_of(fmt: str, variant: str | None) -> str:
    """The decode kernel variant: "v1" (dense; Q8_0/Q4_0/Q4_K as before), "v2" (all quantized formats,
    the default for those not in DEFAULT_VARIANT) or "v2pdl" (v2, the down kernel a programmatic dependent launch on CUDA:
    scheduled while gate_up runs; measured by bench --variants before it can become the default), "v3"
    (one-step small-program kernels for Q8_0/Q4_0/Q4_K, the default for Q4_0/Q8_0; other formats run v2) or
    "v3pdl" (v3, the down kernel a programmatic dependent that loads its weights before waiting), "v5" / "v5pdl"
    (triton_decode_q8.FORMATS: x and h quantized to int8 per 32-block, dp4a integer dots; other formats run v3 /
    v3pdl), "v5q" (v5pdl with h quantized by gate_up's programs instead of a launch of its own, the default for
    Q6_K and Q4_K: moe_decode only; decode_gate_up / decode_down alone run v5pdl), "v5qx" (v5q without x's quantizer
    launch: each gate_up program quantizes x itself while its weight loads are in flight; the default for Q4_0 and
    Q5_K). DEFAULT_VARIANT has the timings that chose them.
    (v4, the whole layer in one persistent launch for T=1 Q4_0 / Q8_0, was slower and was removed (session 31: history
    `triton_decode_v4.py`); v6, the v5 pair in one launch whose programs spin on counters, was slower than v5pdl and
    raced on the H200: docs/perf-log.md, session 15; v5qxf, v5qx whose down waited for h's blocks by counters that
    gate_up's programs released, a piece at a time, instead of its PDL wait, took 11.8-11.9 against 9.45 us (also with
    one thread polling by loads) and was removed: session 36; v7, the pair in one launch of programs that each own 32
    rows of h and add their share of down by float32 atomics, was slower too: session 16;
    gate_up's programs asking L2 for down's bytes gained nothing: session 18; v5half, v5q in two halves of h's rows
    whose gate_up / down chains overlap, was slower than v5q in every format and was removed: docs/perf-log.md; so was
    v5qp, gate_up in about one persistent program an SM with the next item's loads in flight: session 29.)"""
    # MOETIER_DECODE_VARIANT: the default for quantized formats (A/B runs of the whole engine)
    default = "v1" if fmt == "dense" else os.environ.get("MOETIER_DECODE_VARIANT") or DEFAULT_VARIANT.get(fmt, "v2")
    v = variant or default
    if v not in VARIANTS or (v == "v1" and fmt not in V1_FORMATS) or (v != "v1" and fmt == "dense"):
        raise ValueError(f"decode variant {variant!r} does not read {fmt}: the variants are {', '.join(VARIANTS)}; "
                         f"v1 reads {', '.join(V1_FORMATS)}, v2 every quantized format ({', '.join(v2.STEP_BLOCK)}), "
                         f"v3 .. v5q the quantized ones too (those without kernels of their own run v2 / v3)")
    return v


def decode_gate_up(x, ids, gate_up: Weights, act: int, alpha: float, limit: float, bias, h, cfg=None,
                   variant=None):
    """h [T*k, I] = act(gate_up[ids] @ x) (+ bias); ids flat [T*k]. One launch."""
    v = variant_of(gate_up.fmt, variant)
    v = "v5pdl" if v in ("v5q", "v5qx") else v
    if v in ("v5", "v5pdl") and v5.supports(gate_up, x.shape[1]):
        return v5.gate_up_v5(x, ids, gate_up, act, alpha, limit, bias, h, cfg, pdl=v == "v5pdl" and pdl_supported(x))
    if v in ("v3", "v3pdl", "v5", "v5pdl"):
        return v2.gate_up_v3(x, ids, gate_up, act, alpha, limit, bias, h, cfg,
                             pdl=v in ("v3pdl", "v5pdl") and pdl_supported(x))
    if v != "v1":
        return v2.gate_up(x, ids, gate_up, act, alpha, limit, bias, h, cfg, pdl=v == "v2pdl" and pdl_supported(x))
    t, d = x.shape
    k, i = ids.numel() // t, gate_up.n // 2
    tile = DecodeTile(*(cfg or DECODE_GATE_UP[gate_up.fmt]))
    b, sb = _bias(bias, x)
    _decode_gate_up_kernel[(t * k, triton.cdiv(i, tile.bn))](
        x, x.stride(0), ids, *gate_up.args(), b, sb, h, alpha, limit, I=i, D=d, KTOP=k,
        FMT=gate_up.code, ACT=act, HAS_BIAS=bias is not None, BN=tile.bn, BK=_bk(tile.bk, d, gate_up.fmt),
        WORDS=tile.words, NS=tile.stages, num_warps=tile.warps)
    return h


def decode_down(h, ids, w, down: Weights, bias, out, cfg=None, variant=None):
    """out [T, D] = sum_j w[t, j] * (down[ids[t, j]] @ h[t*k + j] (+ bias)); ids, w flat. One launch."""
    v = variant_of(down.fmt, variant)
    v = "v5pdl" if v in ("v5q", "v5qx") else v
    if v in ("v5", "v5pdl") and v5.supports(down, down.k):
        return v5.down_v5(h, ids, w, down, bias, out, cfg, pdl=v == "v5pdl" and pdl_supported(out))
    if v in ("v3", "v3pdl", "v5", "v5pdl"):
        return v2.down_v3(h, ids, w, down, bias, out, cfg, pdl=v in ("v3pdl", "v5pdl") and pdl_supported(out))
    if v != "v1":
        return v2.down(h, ids, w, down, bias, out, cfg, pdl=v == "v2pdl" and pdl_supported(out))
    t, d = out.shape
    k, i = ids.numel() // t, down.k
    tile = DecodeTile(*(cfg or DECODE_DOWN[down.fmt]))
    b, sb = _bias(bias, out)
    _decode_down_kernel[(t, triton.cdiv(d, tile.bn))](
        h, ids, w, *down.args(), b, sb, out, out.stride(0), D=d, I=i, KTOP=k,
        FMT=down.code, HAS_BIAS=bias is not None, BN=tile.bn, BK=_bk(tile.bk, i, down.fmt),
        WORDS=tile.words, NS=tile.stages, num_warps=tile.warps)
    return out


def moe_decode(x, ids, w, gate_up: Weights, down: Weights, act: int, alpha: float, limit: float,
               biases=(None, None), out=None, cfg_gate_up=None, cfg_down=None, variant=None) -> torch.Tensor:
    """x [T, D], ids/w [T, k] device tensors -> out [T, D] (x's dtype). Two launches, no host sync.
    variant: None (the default per format) or one of VARIANTS (variant_of)."""
    t, k = ids.shape
    ids, w = ids.reshape(-1).contiguous(), w.reshape(-1).contiguous()
    v = variant_of(gate_up.fmt, variant)                 # v2, v3: h in float32 (values rounded to x's dtype)
    h = torch.empty(t * k, down.k, dtype=x.dtype if v == "v1" else torch.float32, device=x.device)
    if v in ("v5q", "v5qx") and v5.supports(gate_up, x.shape[1]) and v5.supports(down, down.k):
        pdl = pdl_supported(x)
        _, pre = v5.gate_up_v5(x, ids, gate_up, act, alpha, limit, biases[0], h, cfg_gate_up, pdl=pdl, quantize_h=True,
                               x_here=v == "v5qx")
        return v5.down_v5(h, ids, w, down, biases[1], torch.empty_like(x) if out is None else out, cfg_down, pdl=pdl,
                          pre=pre)
    decode_gate_up(x, ids, gate_up, act, alpha, limit, biases[0], h, cfg_gate_up, variant)
    return decode_down(h, ids, w, down, biases[1], torch.empty_like(x) if out is None else out, cfg_down, variant)


def align_pairs(ids: torch.Tensor, num_slots: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] slot ids (< 0: skipped) -> sorted_pairs [L] int32 (pair index t*k+j, grouped by slot,
    each slot's run padded to a multiple of bm with the value T*k), block_slot [L/bm] int32 (slot of
    each bm-row block, -1 past the end). L is a bound known without a host sync."""
    flat = ids.reshape(-1).long()
    p, dev = flat.numel(), flat.device
    key = torch.where(flat >= 0, flat, num_slots)                      # skipped pairs: bucket S
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + bm - 1) // bm * bm
    padded[num_slots:].zero_()   # (an in-place zero: a scalar assignment is a host copy, illegal in capture)
    ends = padded.cumsum(0)
    order = torch.argsort(key, stable=True)
    skey = key[order]
    rank = torch.arange(p, device=dev) - (counts.cumsum(0) - counts)[skey]
    nblocks = triton.cdiv(p, bm) + min(num_slots, p)
    pos = torch.where(skey < num_slots, ends[skey] - padded[skey] + rank, nblocks * bm)
    sorted_pairs = torch.full((nblocks * bm + 1,), p, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, pos, order.int())
    starts = torch.arange(nblocks, device=dev) * bm
    bslot = torch.searchsorted(ends[:num_slots].contiguous(), starts, right=True)
    return sorted_pairs[:-1], torch.where(bslot < num_slots, bslot, -1).int()


def pick_bm(pairs: int, slots: int) -> int:
    """Rows per block: about the mean rows per used slot (16, 32 or 64)."""
    mean = pairs / max(1, min(slots, pairs))
    return 16 if mean <= 16 else 32 if mean <= 48 else 64


def _bn(bn: int, n: int) -> int:
    return max(16, min(bn, triton.next_power_of_2(n)))                # tl.dot needs >= 16


def grouped_gate_up(x, sorted_pairs, bslot, bm: int, k: int, gate_up: Weights, act: int, alpha: float,
                    limit: float, bias, h, cfg=None):
    """h [blocks*bm, I] (rows in sorted_pairs order) = act(x[pair // k] @ gate_up[slot]^T (+ bias))."""
    d, i = x.shape[1], gate_up.n // 2
    bn, bk, nw, ns = GroupedTile(*(cfg or GROUPED[gate_up.fmt]))
    bn = _bn(bn, i)
    b, sb = _bias(bias, x)
    _grouped_gate_up_kernel[(bslot.numel(), triton.cdiv(i, bn))](
        x, x.stride(0), sorted_pairs, bslot, *gate_up.args(), *gate_up.extra_args(), b, sb, h, x.shape[0] * k, alpha, limit,
        I=i, D=d, KTOP=k, FMT=gate_up.code, ACT=act, HAS_BIAS=bias is not None, BM=bm, BN=bn,
        BK=_bk(bk, d, gate_up.fmt), PREC=_prec(x), num_warps=nw, num_stages=ns)
    return h


def grouped_down(h, sorted_pairs, bslot, bm: int, w, down: Weights, bias, y, cfg=None):
    """y [T*k, D] (pair order) = w[pair] * (h @ down[slot]^T (+ bias)); rows of skipped pairs untouched."""
    p, d = y.shape
    bn, bk, nw, ns = GroupedTile(*(cfg or GROUPED[down.fmt]))
    bn = _bn(bn, d)
    b, sb = _bias(bias, y)
    _grouped_down_kernel[(bslot.numel(), triton.cdiv(d, bn))](
        h, sorted_pairs, bslot, w, *down.args(), *down.extra_args(), b, sb, y, p, D=d, I=down.k,
        FMT=down.code, HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=_bk(bk, down.k, down.fmt), PREC=_prec(h),
        num_warps=nw, num_stages=ns)
    return y


def _prec(x) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"            # fp32 inputs: no TF32 rounding


def moe_grouped(x, ids, w, gate_up: Weights, down: Weights, act: int, alpha: float, limit: float,
                biases=(None, None), out=None, cfg=None, bm: int | None = None) -> torch.Tensor:
    """x [T, D], ids/w [T, k] -> out [T, D]: sorted pairs, two grouped GEMMs, a sum over k.
    Memory: h [~T*k, I] and y [T*k, D] in x's dtype."""
    t, d = x.shape
    k = ids.shape[1]
    bm = bm or pick_bm(t * k, gate_up.slots)
    sorted_pairs, bslot = align_pairs(ids, gate_up.slots, bm)
    h = torch.empty(bslot.numel() * bm, down.k, dtype=x.dtype, device=x.device)
    y = torch.zeros(t * k, d, dtype=x.dtype, device=x.device)          # skipped pairs stay 0
    grouped_gate_up(x, sorted_pairs, bslot, bm, k, gate_up, act, alpha, limit, biases[0], h, cfg)
    grouped_down(h, sorted_pairs, bslot, bm, w.reshape(-1).contiguous(), down, biases[1], y, cfg)
    res = y.view(t, k, d).sum(1, dtype=torch.float32)
    return res.to(x.dtype) if out is None else out.copy_(res)


# ------------------------------------------------------------------ prefill: the k weighted expert rows of a token
@triton.jit
def _combine_kernel(y_ptr, inv_ptr, w_ptr, out_ptr, D, K: tl.constexpr, BD: tl.constexpr):
    """grid (T, D / BD): out[t] = sum over j < K of round(y[inv[t K + j]] * w[t K + j]) (y's dtype), added in
    float32 in j order, stored in out's dtype: what add_pairs makes of y * w, in one pass."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    m = c < D
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(inv_ptr + t * K + j).to(tl.int64)
        wj = tl.load(w_ptr + t * K + j).to(tl.float32)
        y = tl.load(y_ptr + r * D + c, mask=m, other=0.0)
        acc += (y.to(tl.float32) * wj).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * D + c, acc.to(out_ptr.dtype.element_ty), mask=m)


def combine_pairs(ys: torch.Tensor, order: torch.Tensor, w: torch.Tensor, k: int, dtype) -> torch.Tensor:
    """ys [T*k, D] expert rows in sorted order (row i is pair order[i] = t*k + j), w [T, k] -> [T, D] in dtype:
    each token's k rows times their weights (rounded to ys' dtype) summed in float32, one launch (and the inverse
    permutation's scatter)."""
    p, d = ys.shape
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(p, device=order.device, dtype=order.dtype))
    out = torch.empty(p // k, d, dtype=dtype, device=ys.device)
    bd = min(1024, triton.next_power_of_2(d))
    _combine_kernel[(p // k, triton.cdiv(d, bd))](ys, inv, w.reshape(-1).to(ys.dtype).contiguous(), out, d, K=k,
                                                  BD=bd, num_warps=4)
    return out
