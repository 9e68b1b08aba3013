"""One token's decode attention (kernels/small_ops.decode_attention dispatches; the twin is models.layers.Attention):
q/k RMSNorm + RoPE and the k/v cache write, split-K attention over the filled positions [0, pos] and the combine, in
three launches (a CUDA-graph step; session 19 measured the three in one launch 8 us a layer slower on the H200).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode_q8 import _q8_blocks
from .triton_small import _pdl_enter, _pdl_kw, pdl


@triton.jit
def _qkv_prep_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, eps,
                     H: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, R: tl.constexpr,
                     QK_NORM: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    """grid (H + 2 HKV,): q heads -> q_ptr, k heads -> k cache row `pos`, v heads -> v cache row."""
    i = tl.program_id(0)
    d = tl.arange(0, BD)
    dm = d < DH
    _pdl_enter(PDL)
    pos = tl.load(pos_ptr).to(tl.int64)
    if i < H + HKV:
        half: tl.constexpr = R // 2
        partner = tl.where(d < half, d + half, tl.where(d < R, d - half, d))
        x = tl.load(qkv_ptr + i * DH + d, mask=dm, other=0.0)
        xp = tl.load(qkv_ptr + i * DH + partner, mask=dm, other=0.0)
        y = x.to(tl.float32)
        yp = xp.to(tl.float32)
        if QK_NORM:
            r = tl.rsqrt(tl.sum(y * y, axis=0) / DH + eps)
            wq = tl.load(qw_ptr + d, mask=dm, other=0.0)
            wk = tl.load(kw_ptr + d, mask=dm, other=0.0)
            wqp = tl.load(qw_ptr + partner, mask=dm, other=0.0)
            wkp = tl.load(kw_ptr + partner, mask=dm, other=0.0)
            w = tl.where(i < H, wq, wk)
            wp = tl.where(i < H, wqp, wkp)
            y = (w * (y * r).to(x.dtype)).to(x.dtype).to(tl.float32)      # the twin's two roundings
            yp = (wp * (yp * r).to(x.dtype)).to(x.dtype).to(tl.float32)
        c = tl.load(cos_ptr + d, mask=d < R, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + d, mask=d < R, other=0.0).to(tl.float32)
        sign = tl.where(d < half, -1.0, 1.0)
        out = tl.where(d < R, y * c + sign * yp * s, y)
        if i < H:
            tl.store(q_ptr + i * DH + d, out.to(x.dtype), mask=dm)
        else:
            tl.store(kc_ptr + (pos * HKV + (i - H)) * DH + d, out.to(kc_ptr.dtype.element_ty), mask=dm)
    else:
        j = i - H - HKV
        v = tl.load(qkv_ptr + (H + HKV + j) * DH + d, mask=dm, other=0.0)
        tl.store(vc_ptr + (pos * HKV + j) * DH + d, v.to(vc_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _attn_split_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, pm_ptr, pl_ptr, pacc_ptr, scale,
                       HKV: tl.constexpr, REP: tl.constexpr, DH: tl.constexpr, NSPLIT: tl.constexpr,
                       BR: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    """grid (HKV, NSPLIT): the REP q heads of kv head g over keys [lo, hi) of [0, pos]; partial softmax
    statistics (max, sum) and the unnormalised output per (g, split, head)."""
    g = tl.program_id(0)
    sp = tl.program_id(1)
    _pdl_enter(PDL)
    n = tl.load(pos_ptr).to(tl.int32) + 1
    per = (n + NSPLIT - 1) // NSPLIT
    lo = sp * per
    hi = tl.minimum(lo + per, n)
    r = tl.arange(0, BR)
    d = tl.arange(0, BD)
    rm = r < REP
    dm = d < DH
    q = tl.load(q_ptr + (g * REP + r)[:, None] * DH + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
    q = (q.to(tl.float32) * scale).to(kc_ptr.dtype.element_ty)
    m = tl.full((BR,), float("-inf"), tl.float32)
    l = tl.zeros((BR,), tl.float32)
    acc = tl.zeros((BR, BD), tl.float32)
    s0 = lo
    while s0 < hi:
        s = s0 + tl.arange(0, BS)
        sm = s < hi
        off = (s.to(tl.int64) * HKV + g)[:, None] * DH + d[None, :]
        k = tl.load(kc_ptr + off, mask=sm[:, None] & dm[None, :], other=0.0)
        v = tl.load(vc_ptr + off, mask=sm[:, None] & dm[None, :], other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=PREC)                   # [BR, BS] fp32
        sc = tl.where(sm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
        s0 += BS
    base = (g * NSPLIT + sp) * BR + r
    tl.store(pm_ptr + base, m)
    tl.store(pl_ptr + base, l)
    tl.store(pacc_ptr + base[:, None] * BD + d[None, :], acc)


@triton.jit
def _attn_combine_kernel(pm_ptr, pl_ptr, pacc_ptr, out_ptr, q_ptr, dx_ptr, xs_ptr, REP: tl.constexpr,
                         DH: tl.constexpr, NSPLIT: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
                         Q8: tl.constexpr, PDL: tl.constexpr):
    """grid (H,): head h = g * REP + j combines its NSPLIT partials. Q8 (DH = BD, a multiple of 32): the head's
    output also quantized to int8 per 32-block, as triton_decode_q8.quantize does it (for the o_proj GEMV)."""
    h = tl.program_id(0)
    _pdl_enter(PDL)
    g = h // REP
    j = h % REP
    sp = tl.arange(0, NSPLIT)
    d = tl.arange(0, BD)
    base = (g * NSPLIT + sp) * BR + j
    m = tl.load(pm_ptr + base)
    l = tl.load(pl_ptr + base)
    top = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
    acc = tl.load(pacc_ptr + base[:, None] * BD + d[None, :])
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    o = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + h * DH + d, o, mask=d < DH)
    if Q8:      # quantize's math on the rounded output
        qf, dx, xs = _q8_blocks(tl.reshape(o.to(tl.float32), [BD // 32, 32]))
        b = tl.arange(0, BD // 32)
        tl.store(q_ptr + h * DH + b[:, None] * 32 + tl.arange(0, 32)[None, :], qf.to(tl.int8))
        tl.store(dx_ptr + h * (DH // 32) + b, dx)
        tl.store(xs_ptr + h * (DH // 32) + b, xs)


def decode_attention(qkv, q_w, k_w, eps: float, cos, sin, pos, k_cache, v_cache, h: int, hkv: int, scale: float,
                     nsplit: int = 16, q8: bool = False):
    """One token: qkv [1, (H + 2 Hkv) Dh] -> per-head RMSNorm (q_w / k_w [Dh] or None) and RoPE
    (cos / sin [1, R], first R features, halves) of q and k, k and v written to the caches [S, Hkv, Dh]
    at the device position `pos`, attention of q over keys [0, pos] -> [1, H Dh]. Three launches.
    q8: -> (out, (q int8, dx, xs)), the output also quantized as triton_decode_q8.quantize(out) would (what
    QuantLinear's GEMV takes; one launch fewer), or (out, None) where Dh is not a power of two >= 32."""
    dh = k_cache.shape[-1]
    rep, rot = h // hkv, cos.shape[-1]
    bd = triton.next_power_of_2(dh)
    q = qkv.new_empty((h, dh))
    on = pdl(qkv)
    kw = _pdl_kw(on)
    _qkv_prep_kernel[(h + 2 * hkv,)](qkv, q_w if q_w is not None else qkv, k_w if k_w is not None else qkv,
                                    cos, sin, pos, q, k_cache, v_cache, eps, H=h, HKV=hkv, DH=dh, R=rot,
                                    QK_NORM=q_w is not None, BD=bd, PDL=on, num_warps=1 if bd <= 128 else 2, **kw)
    br = max(16, triton.next_power_of_2(rep))
    pm = torch.empty(hkv * nsplit * br, dtype=torch.float32, device=qkv.device)
    pl = torch.empty_like(pm)
    pacc = torch.empty(hkv * nsplit * br * bd, dtype=torch.float32, device=qkv.device)
    _attn_split_kernel[(hkv, nsplit)](q, k_cache, v_cache, pos, pm, pl, pacc, scale, HKV=hkv, REP=rep, DH=dh,
                                      NSPLIT=nsplit, BR=br, BS=32, BD=bd, num_warps=4,
                                      PREC="ieee" if k_cache.dtype == torch.float32 else "tf32", PDL=on, **kw)
    out = qkv.new_empty((1, h * dh))
    want_q8, q8 = q8, q8 and dh == bd and dh % 32 == 0
    xq = torch.empty(1, h * dh, dtype=torch.int8, device=qkv.device) if q8 else out
    xd = torch.empty(1, h * dh // 32, dtype=torch.float32, device=qkv.device) if q8 else out
    xs = torch.empty_like(xd) if q8 else out
    _attn_combine_kernel[(h,)](pm, pl, pacc, out, xq, xd, xs, REP=rep, DH=dh, NSPLIT=nsplit, BR=br, BD=bd, Q8=q8,
                               PDL=on, num_warps=1, **kw)
    return (out, (xq, xd, xs) if q8 else None) if want_q8 else out
