"""GGML expert planes (moetier.quant.repack) -> float weights in one pass on the GPU, for prefill's
grouped GEMMs. The torch dequantizer (`dequantize_repacked`) takes several float32 passes over
every weight; at 8K-token prefill chunks it was most of the time of a 30B-A3B layer (~12 ms for
the 128 experts of one Q4_0 layer on the H200, docs/perf-log.md). This kernel reads each block
once and writes the weight once in the output dtype, with the tile loaders of the grouped kernels (Q8_0, Q4_0,
Q4_K), whole bytes of each super-block / block (Q6_K, Q5_K, MXFP4: `_*_halves`), or element gathers (IQ3_XXS, IQ2_XXS).

    dequantize(fmt, planes, idx, dtype) -> [len(idx), N, K]     (planes [slots, N, K'] of one projection)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_moe import DENSE, MXFP4, Q4_0, Q5_K, Q6_K, Q8_0, _kidx, _q4_0_load, _q4_k_load, _q8_load
from .triton_tiles import deq_tile, e2m1_scaled, e8m0_half
from .triton_weights import Weights

# rows x elements per step (256 and 1024: every format's block divides them), warps. Timed on the H200
# (bench/dequant_tiles.py, one 30B-A3B layer's 128 experts to bf16, gate_up [1536, 2048] / down [2048, 768]):
# session 33, Q4_0: (8, 1024, 4) 297.6 / 146.0 us (81.6% / 83.2% of the copy rate) against (16, 256, 4) 331.3 / 161.4.
# Session 34: Q8_0 (8, 512, 2) 350.1 / 167.0 against 360.5 / 177.4; Q6_K, Q5_K, MXFP4 on whole bytes (the *_halves
# loaders; were per-element gathers): Q6_K (8, 1024, 4) 349.4 / 188.7 (were 1,140.7 / 278.8), Q5_K (16, 256, 4)
# 343.5 / 166.7 (1,298.0 / 406.1), MXFP4 (8, 1024, 4) 292.7 / 142.5 (643.3 / 207.1); Q4_K's best within 2%.
BN, BK, WARPS = 16, 256, 4
TILES = {"Q4_0": (8, 1024, 4), "Q8_0": (8, 512, 2), "Q6_K": (8, 1024, 4), "MXFP4": (8, 1024, 4)}


@triton.jit
def _rows_ld(ptr, rows, off, m):
    """ptr[rows + off]: rows [BN], off [C, L] -> [BN, C, L] (m the same shape)."""
    return tl.load(ptr + rows[:, None, None] + off[None, :, :], mask=m, other=0)


@triton.jit
def _q6_k_halves(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, k0, K, BK: tl.constexpr):
    """Q6_K values of elements k0 .. k0+BK (whole 256-super-blocks) as two [BN, C, 16] float32 halves and their
    element offsets (lo; hi = lo + 64): chunk c = 8 (sb - k0/256) + 2 j + t, j = 2 h + p, reads ql bytes 128 sb + 16
    (2j + t) + l (16 contiguous), whose low nibbles are elements 256 sb + 128 h + 32 p + 16 t + l (quarter p of half h,
    one 16-scale) and high ones + 64 (quarter 2 + p); qh byte 64 sb + 32 h + 16 t + l holds their 2 high bits at 2p
    and 4 + 2p."""
    c = tl.arange(0, BK // 32)[:, None]
    l = tl.arange(0, 16)[None, :]
    sb = k0 // 256 + c // 8
    j, t = c % 8 // 2, c % 2
    h, p = j // 2, j % 2
    mc = mask[:, None, None] & (sb < K // 256)[None, :, :]
    m = mc & (l >= 0)[None, :, :]
    b = _rows_ld(q_ptr, rq, sb * 128 + (c % 8) * 16 + l, m).to(tl.int32)
    hb = _rows_ld(h_ptr, rh, sb * 64 + h * 32 + t * 16 + l, m).to(tl.int32)
    d = _rows_ld(d_ptr, rd, sb, mc).to(tl.float32)
    s16 = sb * 16 + h * 8 + p * 2 + t                                   # the 16-scale of the low nibbles
    sc_lo = _rows_ld(sc_ptr, rsc, s16, mc).to(tl.float32)
    sc_hi = _rows_ld(sc_ptr, rsc, s16 + 4, mc).to(tl.float32)
    q_lo = (b & 15) | (((hb >> (2 * p)) & 3) << 4)
    q_hi = (b >> 4) | (((hb >> (4 + 2 * p)) & 3) << 4)
    e = sb * 256 + h * 128 + p * 32 + t * 16 + l
    return d * sc_lo * (q_lo - 32).to(tl.float32), d * sc_hi * (q_hi - 32).to(tl.float32), e, m


@triton.jit
def _q5_k_halves(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, rq, rd, rm, rsc, rmn, rh, mask, k0, K,
                 BK: tl.constexpr):
    """Q5_K values of elements k0 .. k0+BK (whole super-blocks) as two [BN, C, 32] halves and their offsets (lo; hi =
    lo + 32): chunk c = 4 (sb - k0/256) + j reads qs bytes 128 sb + 32 j + l, low nibbles elements 256 sb + 64 j + l
    (32-block 2j), high ones + 32 (2j + 1); the 5th bits are bits 2j, 2j + 1 of qh byte 32 sb + l. d, dmin at 2 sb of
    their slots, sc, mn of the chunk at 4 (4 sb + j), + 1 (triton_weights)."""
    c = tl.arange(0, BK // 64)[:, None]
    l = tl.arange(0, 32)[None, :]
    sb = k0 // 256 + c // 4
    j = c % 4
    mc = mask[:, None, None] & (sb < K // 256)[None, :, :]
    m = mc & (l >= 0)[None, :, :]
    b = _rows_ld(q_ptr, rq, sb * 128 + j * 32 + l, m).to(tl.int32)
    hb = _rows_ld(h_ptr, rh, sb * 32 + l, m).to(tl.int32)
    d = _rows_ld(d_ptr, rd, 2 * sb, mc).to(tl.float32)
    dm = _rows_ld(m_ptr, rm, 2 * sb, mc).to(tl.float32)
    sc_lo = _rows_ld(sc_ptr, rsc, sb * 16 + 4 * j, mc).to(tl.float32)
    sc_hi = _rows_ld(sc_ptr, rsc, sb * 16 + 4 * j + 1, mc).to(tl.float32)
    mn_lo = _rows_ld(mn_ptr, rmn, sb * 16 + 4 * j, mc).to(tl.float32)
    mn_hi = _rows_ld(mn_ptr, rmn, sb * 16 + 4 * j + 1, mc).to(tl.float32)
    q_lo = ((b & 15) | (((hb >> (2 * j)) & 1) << 4)).to(tl.float32)
    q_hi = ((b >> 4) | (((hb >> (2 * j + 1)) & 1) << 4)).to(tl.float32)
    return d * sc_lo * q_lo - dm * mn_lo, d * sc_hi * q_hi - dm * mn_hi, sb * 256 + j * 64 + l, m


@triton.jit
def _mxfp4_halves(q_ptr, d_ptr, rq, rd, mask, k0, K, BK: tl.constexpr):
    """MXFP4 values of elements k0 .. k0+BK as two [BN, G, 16] halves and their offsets (lo; hi = lo + 16): block g's
    16 bytes, low nibbles elements 32 g + l, high ones + 16; the e8m0 byte of the block halved (e8m0_half) times the
    doubled E2M1 value."""
    g = k0 // 32 + tl.arange(0, BK // 32)[:, None]
    l = tl.arange(0, 16)[None, :]
    mg = mask[:, None, None] & (g < K // 32)[None, :, :]
    m = mg & (l >= 0)[None, :, :]
    b = _rows_ld(q_ptr, rq, g * 16 + l, m).to(tl.int32)
    sc = e8m0_half(_rows_ld(d_ptr, rd, g, mg).to(tl.int32))
    return sc * (e2m1_scaled(b & 15) * 32768.0), sc * (e2m1_scaled(b >> 4) * 32768.0), g * 32 + l, m


@triton.jit
def _dequant_kernel(idx_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, sq_s, sq_n, sd_s, sd_n, sm_s, sm_n,
                    ssc_s, ssc_n, smn_s, smn_n, h_ptr, lut_ptr, sh_s, sh_n, out_ptr, N,
                    K: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    i = tl.program_id(0)
    s = tl.load(idx_ptr + i).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = n < N
    n64 = n.to(tl.int64)
    rq, rd, rm = s * sq_s + n64 * sq_n, s * sd_s + n64 * sd_n, s * sm_s + n64 * sm_n
    rsc, rmn, rh = s * ssc_s + n64 * ssc_n, s * smn_s + n64 * smn_n, s * sh_s + n64 * sh_n
    base = out_ptr + i.to(tl.int64) * N * K + n64 * K           # [BN] row starts
    ty = out_ptr.dtype.element_ty
    for k0 in range(0, K, BK):
        if FMT == Q6_K or FMT == Q5_K or FMT == MXFP4:               # two halves of contiguous bytes
            if FMT == Q6_K:
                lo, hi, e, m = _q6_k_halves(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, k0, K, BK)
                off = 64
            elif FMT == Q5_K:
                lo, hi, e, m = _q5_k_halves(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, rq, rd, rm, rsc, rmn, rh,
                                            mask, k0, K, BK)
                off = 32
            else:
                lo, hi, e, m = _mxfp4_halves(q_ptr, d_ptr, rq, rd, mask, k0, K, BK)
                off = 16
            ptrs = base[:, None, None] + e[None, :, :]
            tl.store(ptrs, lo.to(ty), mask=m)
            tl.store(ptrs + off, hi.to(ty), mask=m)
        elif FMT >= Q5_K:
            w = deq_tile(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, lut_ptr, rq, rd, rm, rsc, rmn, rh, mask, k0, K,
                         FMT, BK)
            e = k0 + tl.arange(0, BK)
            tl.store(base[:, None] + e[None, :], w.to(ty), mask=mask[:, None] & (e < K)[None, :])
        elif FMT == DENSE:
            e = k0 + tl.arange(0, BK)
            m2 = mask[:, None] & (e < K)[None, :]
            w = tl.load(q_ptr + rq[:, None] + e[None, :], mask=m2, other=0.0)
            tl.store(base[:, None] + e[None, :], w.to(ty), mask=m2)
        else:
            cols, hi_off, mg = _kidx(k0, K, FMT, BK)                  # [G, W] element indices of the low half
            m3 = mask[:, None, None] & mg[None, :, :]
            ptrs = base[:, None, None] + cols[None, :, :]
            if FMT == Q8_0:
                q, d = _q8_load(q_ptr, d_ptr, rq, rd, mask, k0, K, BK)
                tl.store(ptrs, (q * d[:, :, None]).to(ty), mask=m3)
            elif FMT == Q4_0:
                lo, hi, d = _q4_0_load(q_ptr, d_ptr, rq, rd, mask, k0, K, BK)
                tl.store(ptrs, (lo * d[:, :, None]).to(ty), mask=m3)
                tl.store(ptrs + hi_off, (hi * d[:, :, None]).to(ty), mask=m3)
            else:                                                       # Q4_K
                lo, hi, dl_lo, ml_lo, dl_hi, ml_hi = _q4_k_load(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rq, rd, rm,
                                                                rsc, rmn, mask, k0, K, BK)
                tl.store(ptrs, (dl_lo[:, :, None] * lo - ml_lo[:, :, None]).to(ty), mask=m3)
                tl.store(ptrs + hi_off, (dl_hi[:, :, None] * hi - ml_hi[:, :, None]).to(ty), mask=m3)


def dequantize(fmt: str, planes: dict[str, torch.Tensor] | torch.Tensor, idx: torch.Tensor,
               dtype: torch.dtype, out: torch.Tensor | None = None, tile: tuple | None = None) -> torch.Tensor:
    """Slots `idx` (int64 [n], on the planes' device) of one projection's planes (repack layout,
    [slots, N, K']) -> float weights [n, N, K] in `dtype` (into `out` when given). tile: (rows, elements a step,
    warps), default TILES' or (BN, BK, WARPS) (bench/dequant_tiles.py times others)."""
    w = Weights(planes, fmt)
    n, N, K = idx.shape[0], w.n, w.k
    bn, bk, warps = tile or TILES.get(fmt, (BN, BK, WARPS))
    if out is None:
        out = torch.empty(n, N, K, dtype=dtype, device=idx.device)
    if n:
        _dequant_kernel[(n, triton.cdiv(N, bn))](idx, *w.args(), *w.extra_args(), out, N, K, w.code, bn, bk,
                                                  num_warps=warps)
    return out
