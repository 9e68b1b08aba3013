"""GGML expert planes (moetier.quant.repack) -> float weights in one pass on the GPU, for prefill's
grouped GEMMs. The torch dequantizer (`dequantize_repacked`) takes several float32 passes over
every weight; at 8K-token prefill chunks it was most of the time of a 30B-A3B layer (~12 ms for
the 128 experts of one Q4_0 layer on the H200, docs/perf-log.md). This kernel reads each block
once and writes the weight once in the output dtype, with the tile loaders of the grouped kernels.

    dequantize(fmt, planes, idx, dtype) -> [len(idx), N, K]     (planes [slots, N, K'] of one projection)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_moe import DENSE, Q4_0, Q5_K, Q8_0, _kidx, _q4_0_load, _q4_k_load, _q8_load
from .triton_tiles import deq_tile
from .triton_weights import Weights

# rows x elements per step (256 and 1024: every format's block divides them), warps. Timed on the H200 (session 33,
# bench/dequant_tiles.py, Q4_0, one 30B-A3B layer's 128 experts to bf16): (8, 1024, 4) gate_up 297.6 us / down 146.0
# (81.6% / 83.2% of the copy rate) against (16, 256, 4) 331.3 / 161.4; (8, 512, 2) 295.4 / 148.7; 7 others slower.
# The other formats keep (16, 256, 4) until timed.
BN, BK, WARPS = 16, 256, 4
TILES = {"Q4_0": (8, 1024, 4)}


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
        if FMT >= Q5_K:
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
