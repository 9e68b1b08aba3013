"""Small fused kernels of the decode step (kernels/small_ops.py dispatches; twins in models/layers.py).

rms_norm: one row per program: fp32 mean of squares, x * rsqrt(. + eps) rounded to x's dtype, then
          times the weight in x's dtype (the twin's two roundings; weight row `w_row` of a stacked
          [R, N] weight, so q and k heads can share one launch).
softmax_topk: one token per program: fp32 softmax over E logits, the k largest by repeated arg-max
          (ties: the lower expert id, as torch.topk on CUDA for distinct values), renormalised if asked.
The decode step on CUDA otherwise spends ~7 launches per norm and ~5 per router (LESSONS §10: each
small launch is ~3-6 us inside a graph).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, rows_per_w, eps, HAS_W: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0)
    n = tl.arange(0, BN)
    m = n < N
    x = tl.load(x_ptr + r.to(tl.int64) * N + n, mask=m, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    if HAS_W:
        wr = (r % rows_per_w).to(tl.int64)
        w = tl.load(w_ptr + wr * N + n, mask=m, other=0.0)
        y = (w.to(x.dtype) * y).to(x.dtype)
    tl.store(out_ptr + r.to(tl.int64) * N + n, y, mask=m)


def rms_norm(x, weight, eps: float):
    """x [..., N] contiguous; weight None, [N] or [R, N] applied to rows cyclically over the
    second-to-last dim (R = x.shape[-2]). -> like x."""
    n = x.shape[-1]
    out = x.new_empty(x.shape)
    rows = x.numel() // n
    rows_per_w = 1 if weight is None or weight.dim() == 1 else weight.shape[0]
    _rms_norm_kernel[(rows,)](x, weight if weight is not None else x, out, n, rows_per_w, eps,
                              HAS_W=weight is not None, BN=triton.next_power_of_2(n), num_warps=4 if n >= 1024 else 1)
    return out


@triton.jit
def _softmax_topk_kernel(logit_ptr, ids_ptr, w_ptr, E, K: tl.constexpr, NORM: tl.constexpr, BE: tl.constexpr,
                         BK: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BE)
    m = e < E
    z = tl.load(logit_ptr + t.to(tl.int64) * E + e, mask=m, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(tl.where(m, p, 0.0), axis=0)
    p = tl.where(m, p, -1.0)
    kk = tl.arange(0, BK)
    sel_w = tl.zeros((BK,), dtype=tl.float32)
    sel_i = tl.zeros((BK,), dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BE), axis=0)      # the lowest id among equal maxima
        sel_w = tl.where(kk == j, best, sel_w)
        sel_i = tl.where(kk == j, idx.to(tl.int64), sel_i)
        p = tl.where(e == idx, -1.0, p)
    if NORM:
        sel_w = sel_w / tl.sum(tl.where(kk < K, sel_w, 0.0), axis=0)
    tl.store(ids_ptr + t.to(tl.int64) * K + kk, sel_i, mask=kk < K)
    tl.store(w_ptr + t.to(tl.int64) * K + kk, sel_w.to(w_ptr.dtype.element_ty), mask=kk < K)


def softmax_topk(logits, k: int, normalize: bool):
    """logits [T, E] contiguous -> ids [T, k] int64, w [T, k] in logits' dtype."""
    t, e = logits.shape
    ids = torch.empty((t, k), dtype=torch.long, device=logits.device)
    w = logits.new_empty((t, k))
    _softmax_topk_kernel[(t,)](logits, ids, w, e, K=k, NORM=normalize, BE=triton.next_power_of_2(e),
                               BK=triton.next_power_of_2(k), num_warps=1 if e <= 256 else 4)
    return ids, w
