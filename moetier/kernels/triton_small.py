"""Small fused kernels of the decode step (kernels/small_ops.py dispatches; twins in models/layers.py).

rms_norm: one row per program: fp32 mean of squares, x * rsqrt(. + eps) rounded to x's dtype, then
          times the weight in x's dtype (the twin's two roundings; weight row `w_row` of a stacked
          [R, N] weight, so q and k heads can share one launch).
softmax_topk: one token per program: fp32 softmax over E logits, the k largest by repeated arg-max
          (ties: the lower expert id, as torch.topk on CUDA for distinct values), renormalised if asked.
router_topk: one token: the router GEMV x @ W.T (logits rounded to x's dtype) and softmax_topk in one
          launch: E/ROWS programs write their logits, the last to arrive (atomic counter) picks the top k.
add_rms_norm: the residual add s = h + y and RMSNorm(s) of the next sub-layer, one row per program.
router_topk_add_norm: add_rms_norm and router_topk in one launch (the decode block's add + norm + router): every
          router program computes s and x itself, program 0 stores them.
The decode step on CUDA otherwise spends ~7 launches per norm and ~5 per router (LESSONS §10: each
small launch is ~3-6 us inside a graph).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import supported as pdl_supported
from .triton_decode_q8 import _q8_blocks, arrival_counters


def pdl(x) -> bool:
    """Launch the decode step's small kernels as programmatic dependents of the kernel before them (CUDA): each
    may be scheduled while its predecessor runs and waits for that grid's writes (`_pdl_enter`) before reading.
    MOETIER_PDL=0: plain launches (A/B, diagnosis)."""
    return os.environ.get("MOETIER_PDL", "1") != "0" and pdl_supported(x)


def _pdl_kw(on: bool) -> dict:
    return {"launch_pdl": True} if on else {}


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """PDL: let the next kernel be scheduled now, then wait for the previous kernel's grid (its writes visible)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _rms(x, N, eps):
    """A row x [BN] (0 past N) -> x / rms(x) from fp32 statistics, rounded to x's dtype."""
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    return (xf * tl.rsqrt(var + eps)).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, rows_per_w, eps, HAS_W: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0)
    n = tl.arange(0, BN)
    m = n < N
    x = tl.load(x_ptr + r.to(tl.int64) * N + n, mask=m, other=0.0)
    y = _rms(x, N, eps)
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
def _topk_picks(z, e, m, K: tl.constexpr, NORM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    """z [BE] fp32 logits (lanes where m is False ignored) -> (ids [BK] int64, w [BK] fp32, at [BE, BK]: lane i is
    pick j): softmax, the K largest in the order repeated arg-max picks them (larger first; ties: the lower id),
    renormalised if NORM (picks past K: 0 and their ids garbage). Each lane's rank in that order is the count of
    lanes ahead of it, all at once ([BE, BE] compares, one sum), and pick j is the sum over the lanes of rank j (one
    lane: exact): two reductions where 2 K sequential ones (a max and an arg-min per pick) took ~2 us of the
    router's launch on the H200 (docs/perf-log.md, session 28). NaN probabilities rank as -1 (masked lanes' value),
    so every id is a lane's."""
    z = tl.where(m, z, float("-inf"))
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(tl.where(m, p, 0.0), axis=0)
    p = tl.where(m & (p == p), p, -1.0)
    pi, pj = p[:, None], p[None, :]
    ahead = (pj > pi) | ((pj == pi) & (e[None, :] < e[:, None]))       # lane j picked before lane i
    rank = tl.sum(ahead.to(tl.int32), axis=1)                           # [BE]: 0 .. BE - 1, each once
    kk = tl.arange(0, BK)
    at = rank[:, None] == kk[None, :]
    sel_w = tl.sum(tl.where(at, p[:, None], 0.0), axis=0)
    sel_i = tl.sum(tl.where(at, e[:, None], 0), axis=0).to(tl.int64)
    sel_w = tl.where(kk < K, sel_w, 0.0)
    if NORM:
        sel_w = sel_w / tl.sum(sel_w, axis=0)
    return sel_i, sel_w, at


@triton.jit
def _topk_of_probs(z, e, m, ids_ptr, w_ptr, K: tl.constexpr, NORM: tl.constexpr, BE: tl.constexpr,
                   BK: tl.constexpr):
    """_topk_picks stored: ids_ptr[:K] (int64), w_ptr[:K] in its dtype."""
    sel_i, sel_w, _ = _topk_picks(z, e, m, K, NORM, BE, BK)
    kk = tl.arange(0, BK)
    tl.store(ids_ptr + kk, sel_i, mask=kk < K)
    tl.store(w_ptr + kk, sel_w.to(w_ptr.dtype.element_ty), mask=kk < K)


@triton.jit
def _softmax_topk_kernel(logit_ptr, ids_ptr, w_ptr, E, K: tl.constexpr, NORM: tl.constexpr, BE: tl.constexpr,
                         BK: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BE)
    m = e < E
    z = tl.load(logit_ptr + t.to(tl.int64) * E + e, mask=m, other=float("-inf")).to(tl.float32)
    _topk_of_probs(z, e, m, ids_ptr + t.to(tl.int64) * K, w_ptr + t.to(tl.int64) * K, K, NORM, BE, BK)


def softmax_topk(logits, k: int, normalize: bool):
    """logits [T, E] contiguous -> ids [T, k] int64, w [T, k] in logits' dtype."""
    t, e = logits.shape
    ids = torch.empty((t, k), dtype=torch.long, device=logits.device)
    w = logits.new_empty((t, k))
    _softmax_topk_kernel[(t,)](logits, ids, w, e, K=k, NORM=normalize, BE=triton.next_power_of_2(e),
                               BK=triton.next_power_of_2(k), num_warps=1 if e <= 256 else 4)
    return ids, w


# ---------------------------------------------------------------- fused router (T = 1, graph)
@triton.jit
def _router_topk_kernel(x_ptr, wt_ptr, logit_ptr, cnt_ptr, ids_ptr, w_ptr, E: tl.constexpr, D: tl.constexpr,
                        K: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr, BD: tl.constexpr,
                        BE: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """grid (cdiv(E, ROWS),): _router_part, then the last program runs the softmax top-k over all E."""
    if _router_part(x_ptr, wt_ptr, logit_ptr, cnt_ptr, E, D, ROWS, BD, PDL):
        _router_pick(logit_ptr, ids_ptr, w_ptr, E, K, NORM, BE, BK)


@triton.jit
def _router_add_norm_kernel(x_ptr, wt_ptr, logit_ptr, cnt_ptr, ids_ptr, w_ptr, h_ptr, a_ptr, nw_ptr, s_ptr, N, eps,
                            E: tl.constexpr, D: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr,
                            ROWS: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                            PDL: tl.constexpr):
    """_add_rms_norm_kernel's s = h + a and x = RMSNorm(s) * nw (to s_ptr, x_ptr), then _router_topk_kernel on x:
    one launch (_router_part_add_norm)."""
    last, x = _router_part_add_norm(x_ptr, wt_ptr, logit_ptr, cnt_ptr, h_ptr, a_ptr, nw_ptr, s_ptr, N, eps, E, D,
                                    ROWS, BD, PDL)
    if last:
        _router_pick(logit_ptr, ids_ptr, w_ptr, E, K, NORM, BE, BK)


@triton.jit
def _router_pick(logit_ptr, ids_ptr, w_ptr, E: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr,
                 BE: tl.constexpr, BK: tl.constexpr):
    """The last program of _router_part: softmax top-k of the E logits -> ids_ptr, w_ptr; -> _topk_picks' (ids, w,
    at) in registers."""
    e = tl.arange(0, BE)
    m = e < E
    zz = tl.load(logit_ptr + e, mask=m, other=float("-inf"), cache_modifier=".cg")
    sel_i, sel_w, at = _topk_picks(zz, e, m, K, NORM, BE, BK)
    kk = tl.arange(0, BK)
    tl.store(ids_ptr + kk, sel_i, mask=kk < K)
    tl.store(w_ptr + kk, sel_w.to(w_ptr.dtype.element_ty), mask=kk < K)
    return sel_i, sel_w.to(w_ptr.dtype.element_ty), at


@triton.jit
def _router_part(x_ptr, wt_ptr, logit_ptr, cnt_ptr, E: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                 BD: tl.constexpr, PDL: tl.constexpr):
    """Program p computes logits [p ROWS, (p + 1) ROWS) of the one token (fp32 sums rounded to x's dtype, as
    F.linear returns them) into logit_ptr (fp32 scratch [E]). -> whether it is the last program to arrive
    (_router_arrive)."""
    pid = tl.program_id(0)
    r = pid * ROWS + tl.arange(0, ROWS)
    rm = r < E
    d = tl.arange(0, BD)
    acc = tl.zeros((ROWS, BD), dtype=tl.float32)
    if D <= BD:     # one chunk: the weight loads before the wait for x (PDL)
        dm = d < D
        wt = tl.load(wt_ptr + r.to(tl.int64)[:, None] * D + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
        _pdl_enter(PDL)
        x = tl.load(x_ptr + d, mask=dm, other=0.0)
        acc += wt.to(tl.float32) * x.to(tl.float32)[None, :]
    else:
        _pdl_enter(PDL)
        for d0 in tl.static_range(0, D, BD):     # D constexpr: unrolled, no masks when BD divides D
            dd = d0 + d
            dm = dd < D
            x = tl.load(x_ptr + dd, mask=dm, other=0.0)
            wt = tl.load(wt_ptr + r.to(tl.int64)[:, None] * D + dd[None, :], mask=rm[:, None] & dm[None, :],
                         other=0.0)
            acc += wt.to(tl.float32) * x.to(tl.float32)[None, :]
    z = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)       # the twin's logits dtype
    return _router_arrive(z, r, rm, logit_ptr, cnt_ptr)


@triton.jit
def _router_part_add_norm(x_ptr, wt_ptr, logit_ptr, cnt_ptr, h_ptr, a_ptr, nw_ptr, s_ptr, N, eps,
                          E: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    """_router_part (one chunk: D <= BD = next_power_of_2(D)) on x = _add_norm(h, a, nw): every program computes s
    and x from h and a (2 D elements of L2 reads each), program 0 stores them to s_ptr, x_ptr (no program of this
    launch reads them back: later launches do, after this grid). N = D at run time (_add_rms_norm_kernel's N: the
    same division). -> (last to arrive, x [BD] in registers)."""
    pid = tl.program_id(0)
    r = pid * ROWS + tl.arange(0, ROWS)
    rm = r < E
    d = tl.arange(0, BD)
    dm = d < D
    wt = tl.load(wt_ptr + r.to(tl.int64)[:, None] * D + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
    nw = tl.load(nw_ptr + d, mask=dm, other=0.0)
    _pdl_enter(PDL)         # the weights above before the wait, h and a (the previous kernels' outputs) after
    h = tl.load(h_ptr + d, mask=dm, other=0.0)
    a = tl.load(a_ptr + d, mask=dm, other=0.0)
    s, x = _add_norm(h, a, nw, N, eps)
    if pid == 0:
        tl.store(s_ptr + d, s, mask=dm)
        tl.store(x_ptr + d, x, mask=dm)
    acc = tl.zeros((ROWS, BD), dtype=tl.float32)
    acc += wt.to(tl.float32) * x.to(tl.float32)[None, :]       # _router_part's one-chunk math
    z = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)
    return _router_arrive(z, r, rm, logit_ptr, cnt_ptr), x


@triton.jit
def _router_arrive(z, r, rm, logit_ptr, cnt_ptr):
    """Store this program's logits z [ROWS] (rows r, mask rm) -> whether it is the last program to arrive (int32
    counter, acq_rel; it resets the counter): all E logits are then visible to it (the threadfence-reduction
    pattern: one launch, no float atomics, deterministic)."""
    tl.store(logit_ptr + r, z, mask=rm)
    tl.debug_barrier()                        # every thread's stores happen before the release below
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    last = done == tl.num_programs(0) - 1     # the last program: all logits are visible
    if last:
        tl.atomic_xchg(cnt_ptr, 0)            # ready for the next launch (a CUDA-graph replay)
    return last


def _router_counter(device):
    """The router kernel's arrival counter (triton_decode_q8.arrival_counters): launches on one device must not
    overlap (one decode stream): two routers running at once would share it."""
    return arrival_counters(device, 1, "router")


def router_tile(e: int, dim: int, rows: int | None = None) -> tuple[int, int]:
    """The router kernels' (ROWS, BD): ~E/2 programs (enough SMs pulling the weight, E D bytes), chunks of x of BD."""
    if rows is None:
        rows = 2 if e >= 64 else 1
    return rows, min(triton.next_power_of_2(dim), max(64, 4096 // rows))


ROUTER_WARPS = 4


def router_add_norm_fits(e: int, dim: int) -> bool:
    """router_topk_add_norm is add_rms_norm then router_topk bit for bit: x in one chunk of the router's tile, and
    add_rms_norm's sum of squares over the router's 4 warps (the same reduction order; it takes 1 warp below 1024)."""
    return router_tile(e, dim)[1] >= dim and _norm_warps(dim) == ROUTER_WARPS


def router_launch(x, weight, k: int, normalize: bool, rows: int | None = None, out=None):
    """The router kernels' common arguments: -> (grid, positional args, constexpr and launch kwargs, (ids, w))."""
    e, dim = weight.shape
    rows, bd = router_tile(e, dim, rows)
    logits = torch.empty(e, dtype=torch.float32, device=x.device)
    ids, w = out if out is not None else (torch.empty((1, k), dtype=torch.long, device=x.device), x.new_empty((1, k)))
    on = pdl(x)
    return ((triton.cdiv(e, rows),), (x, weight, logits, _router_counter(x.device), ids, w),
            dict(E=e, D=dim, K=k, NORM=normalize, ROWS=rows, BD=bd, BE=triton.next_power_of_2(e),
                 BK=triton.next_power_of_2(k), PDL=on, **_pdl_kw(on)), (ids, w))


def router_topk(x, weight, k: int, normalize: bool, rows: int | None = None, out=None):
    """x [1, D] contiguous, weight [E, D] contiguous, same dtype -> ids [1, k] int64, w [1, k] in x's
    dtype: softmax_topk(F.linear(x, weight), k, normalize) in one launch. `out`: (ids, w) to write."""
    grid, args, const, res = router_launch(x, weight, k, normalize, rows, out)
    _router_topk_kernel[grid](*args, **const, num_warps=ROUTER_WARPS)
    return res


def router_add_norm_launch(h, a, norm_w, eps: float, weight, k: int, normalize: bool, rows: int | None = None,
                           out=None):
    """router_launch's for x = add_rms_norm(h, a, norm_w, eps)[1], made in the launch: -> (grid, positional args
    (the router's, then h, a, norm_w, s, N, eps), constexpr and launch kwargs, (s, x, ids, w))."""
    s, x, *iw = out if out is not None else (h.new_empty(h.shape), h.new_empty(h.shape))
    if any(o.data_ptr() in (h.data_ptr(), a.data_ptr()) for o in (s, x)):
        raise ValueError("router_topk_add_norm: s and x must not alias h or a (program 0 writes them while the "
                         "other programs read h and a)")
    grid, args, const, (ids, w) = router_launch(x, weight, k, normalize, rows, tuple(iw) or None)
    if const["BD"] < const["D"]:
        raise ValueError(f"router_topk_add_norm needs x in one chunk of the router's tile: D = {const['D']} > "
                         f"BD = {const['BD']} (router_tile); use add_rms_norm then router_topk")
    return grid, (*args, h, a, norm_w, s, h.shape[-1], eps), const, (s, x, ids, w)


def router_topk_add_norm(h, a, norm_w, eps: float, weight, k: int, normalize: bool, rows: int | None = None,
                         out=None):
    """h, a [1, D] contiguous, norm_w [D], weight [E, D] contiguous, one dtype, x in one chunk of the router's tile
    (router_add_norm_fits: bit for bit on CUDA too) -> (s [1, D], x [1, D], ids [1, k], w [1, k]) =
    add_rms_norm(h, a, norm_w, eps), then router_topk(x, weight, k, normalize), in one launch (one fewer on the
    decode step's serial path). `out`: (s, x) or (s, x, ids, w) to write; s and x must not alias h or a."""
    grid, args, const, res = router_add_norm_launch(h, a, norm_w, eps, weight, k, normalize, rows, out)
    _router_add_norm_kernel[grid](*args, **const, num_warps=ROUTER_WARPS)
    return res


@triton.jit
def _rms_norm_q8_kernel(x_ptr, w_ptr, out_ptr, q_ptr, dx_ptr, xs_ptr, N, eps, BN: tl.constexpr, PDL: tl.constexpr):
    """One row: out = RMSNorm(x) * w as _rms_norm_kernel, and out quantized per 32-block as
    triton_decode_q8.quantize(out) (N a multiple of 32)."""
    n = tl.arange(0, BN)
    m = n < N
    w = tl.load(w_ptr + n, mask=m, other=0.0)
    _pdl_enter(PDL)
    x = tl.load(x_ptr + n, mask=m, other=0.0)
    _norm_q8(x, w, N, eps, out_ptr, q_ptr, dx_ptr, xs_ptr, BN)


@triton.jit
def _norm_q8(x, w, N, eps, out_ptr, q_ptr, dx_ptr, xs_ptr, BN: tl.constexpr):
    """_rms_norm_q8_kernel's math on the row x [BN] and the weight w as loaded (0 past N): out, q, dx, xs stored.
    Also kernels/doorbell.py's wait_add with the next layer's norm (the same loads, for the same sums)."""
    n = tl.arange(0, BN)
    m = n < N
    y = (w.to(x.dtype) * _rms(x, N, eps)).to(x.dtype)
    tl.store(out_ptr + n, y, mask=m)
    qf, dx, xs = _q8_blocks(tl.reshape(y.to(tl.float32), [BN // 32, 32]))
    b = tl.arange(0, BN // 32)
    bm = b < N // 32
    tl.store(q_ptr + b[:, None] * 32 + tl.arange(0, 32)[None, :], qf.to(tl.int8), mask=bm[:, None])
    tl.store(dx_ptr + b, dx, mask=bm)
    tl.store(xs_ptr + b, xs, mask=bm)


def norm_q8_buffers(x) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """rms_norm_q8's outputs for a row like x [1, N]: (out like x, (q int8 [1, N], dx, xs f32 [1, N / 32]))."""
    n = x.shape[-1]
    dx = torch.empty(1, n // 32, dtype=torch.float32, device=x.device)
    return x.new_empty(x.shape), (torch.empty(1, n, dtype=torch.int8, device=x.device), dx, torch.empty_like(dx))


def rms_norm_q8(x, weight, eps: float):
    """x [1, N] contiguous (N a multiple of 32), weight [N] -> (rms_norm(x, weight, eps), (q int8 [1, N], dx, xs
    f32 [1, N / 32])): the norm and the int8 copy QuantLinear's GEMV takes (`pre`) in one launch."""
    n = x.shape[-1]
    out, (q, dx, xs) = norm_q8_buffers(x)
    on = pdl(x)
    _rms_norm_q8_kernel[(1,)](x, weight, out, q, dx, xs, n, eps, BN=triton.next_power_of_2(n), PDL=on,
                              num_warps=_norm_warps(n), **_pdl_kw(on))
    return out, (q, dx, xs)


# ---------------------------------------------------------------- residual add + RMSNorm
@triton.jit
def _add_norm(h, y, w, N, eps):
    """Rows h, y, w [BN] (0 past N) -> (s = h + y rounded to h's dtype, RMSNorm(s) * w as _rms_norm_kernel)."""
    s = (h.to(tl.float32) + y.to(tl.float32)).to(h.dtype)
    return s, (w.to(h.dtype) * _rms(s, N, eps)).to(h.dtype)


@triton.jit
def _add_rms_norm_kernel(h_ptr, y_ptr, w_ptr, s_ptr, out_ptr, N, eps, BN: tl.constexpr, PDL: tl.constexpr):
    """One row per program: s = h + y (rounded to h's dtype), out = RMSNorm(s) * w as _rms_norm_kernel."""
    r = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BN)
    m = n < N
    _pdl_enter(PDL)
    h = tl.load(h_ptr + r * N + n, mask=m, other=0.0)
    y = tl.load(y_ptr + r * N + n, mask=m, other=0.0)
    w = tl.load(w_ptr + n, mask=m, other=0.0)
    s, o = _add_norm(h, y, w, N, eps)
    tl.store(s_ptr + r * N + n, s, mask=m)
    tl.store(out_ptr + r * N + n, o, mask=m)


@triton.jit
def _add_norm_q8_kernel(h_ptr, y_ptr, w_ptr, s_ptr, out_ptr, q_ptr, dx_ptr, xs_ptr, N, eps, BN: tl.constexpr,
                        PDL: tl.constexpr):
    """One row: s = h + y (rounded to h's dtype, as `h + y`) to s_ptr, then rms_norm_q8 of s (loaded back: the
    layout _rms_norm_q8_kernel loads x in, for the same sums) to out_ptr, q_ptr, dx_ptr, xs_ptr."""
    n = tl.arange(0, BN)
    m = n < N
    w = tl.load(w_ptr + n, mask=m, other=0.0)
    _pdl_enter(PDL)
    h = tl.load(h_ptr + n, mask=m, other=0.0)
    y = tl.load(y_ptr + n, mask=m, other=0.0)
    tl.store(s_ptr + n, (h.to(tl.float32) + y.to(tl.float32)).to(h.dtype), mask=m)
    tl.debug_barrier()      # every thread's stores of s, visible to the program's loads below
    x = tl.load(s_ptr + n, mask=m, other=0.0)
    _norm_q8(x, w, N, eps, out_ptr, q_ptr, dx_ptr, xs_ptr, BN)


def add_norm_q8(h, y, weight, eps: float):
    """h, y [1, N] contiguous, one dtype (N a multiple of 32), weight [N] -> (s = h + y, rms_norm_q8(s, weight, eps)'s
    (out, (q, dx, xs))) in one launch: the residual add after a decode block's MoE and the next block's input norm
    with its int8 copy, bit for bit the two launches."""
    n = h.shape[-1]
    s = h.new_empty(h.shape)
    out, (q, dx, xs) = norm_q8_buffers(h)
    on = pdl(h)
    _add_norm_q8_kernel[(1,)](h, y, weight, s, out, q, dx, xs, n, eps, BN=triton.next_power_of_2(n), PDL=on,
                              num_warps=_norm_warps(n), **_pdl_kw(on))
    return s, out, (q, dx, xs)


def _norm_warps(n: int) -> int:
    """add_rms_norm's and rms_norm_q8's warps for rows of n (their sums of squares are added in an order that depends
    on them)."""
    return 4 if n >= 1024 else 1


def add_rms_norm(h, y, weight, eps: float, out=None):
    """h, y [..., N] contiguous, same dtype; weight [N] -> (s = h + y, rms_norm(s, weight, eps)).
    `out`: (s, normed) to write."""
    n = h.shape[-1]
    s, out = out if out is not None else (h.new_empty(h.shape), h.new_empty(h.shape))
    on = pdl(h)
    _add_rms_norm_kernel[(h.numel() // n,)](h, y, weight, s, out, n, eps, BN=triton.next_power_of_2(n), PDL=on,
                                            num_warps=_norm_warps(n), **_pdl_kw(on))
    return s, out
