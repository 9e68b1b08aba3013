"""Decode kernels, variant "v6": the whole T-token int8-activation MoE pair (v5) in ONE launch.

Why (H200, Qwen3-30B-A3B, T=1, Q4_0, 21.2 MB of weights): v5pdl is 4 dependent launches (x quantizer -> gate_up ->
h quantizer -> down) and takes 11.5 us, while one launch that only reads the same bytes takes 6.2 us: the launch
boundaries cost the difference. v6 runs the same tiles as programs of one 1-D grid, in this order of program id:
  [T x-quantizer programs (row t)] [gate_up programs: v5's tiles (pair p = t*k + j, BN rows), p fastest]
  [down programs: v5's tiles (token t, BN rows of D), t fastest]
and links them by counters in memory instead of launch boundaries:
  - quantizer t: `_quantize_kernel`'s math (`_q8_blocks`) into scratch q / dx / xs, then x_ready += 1 (release);
  - gate_up: issues all its weight loads, spins until x_ready == T, then v5's math, SwiGLU, h rounded as v5 (ROUND),
    stored as float32; the last of a 32-block's 32 / BN programs (an acq_rel arrival counter per block, as v5q's
    QH) quantizes the block and adds 1 to h_ready (release): h_ready counts finished 32-blocks (T*k*I/32, fewer
    atomics on one address than one per gate_up program);
  - down: issues all its weight loads, spins until h_ready == T*k*I/32, then v5's down math on the int8 h;
  - the last down program to finish (down_done, acq_rel) resets x_ready, h_ready and down_done to 0; the block
    counters are reset by the programs that complete them. So the counters (`arrival_counters`, zeroed once) are 0
    at every launch's start: CUDA-graph replays and the next layer reuse them. No host sync, no allocation but
    torch.empty scratch.
Deadlock freedom: the GPU dispatches the programs of a 1-D grid in increasing id order (observed; CUDA does not
document it, and CUB's decoupled look-back takes atomic tickets instead of relying on it). A program waits only on
programs of lower id, which have all been dispatched when it runs (resident, or done), and those wait only on
lower ids again: by induction every wait ends, whatever the occupancy. Spins are bounded (SPIN polls): a program
that gives up goes on with NaN (gate_up's h, down's output) instead of hanging the GPU.
Memory order: polls are relaxed (volatile loads, every warp its own; no fence per poll: session 7's persistent
kernel paid an acquire per poll); after the last poll ONE acquire (one thread; Triton emits ld.acquire.gpu, sm_90
SASS LDG.E.STRONG.GPU + CCTL.IVALL) and a CTA barrier, so every thread's later loads happen after it. Producers
store, pass a CTA barrier, then one thread releases (cooperative groups' grid sync does the same). The scratch
written in this launch (x's and h's int8 words and scales) is read by triton_decode_q8's math through ordinary
loads: that relies on the acquire (on sm_70+ an acquire at gpu scope invalidates the SM's L1, whose lines are not
coherent); h's float32 values, read by the block's quantizing program, also go through L2 (".cg") as in v5q.
Under TRITON_INTERPRET the programs run one after another in id order, so every spin passes at its first poll.
Weights, tiles and math are v5's (triton_decode_q8): a format added there (FORMATS, `_v5_dot`) runs here too; the
formats `_dot` knows (Q8_0, Q4_0, Q4_K, Q6_K) keep their weight loads in flight during the wait, a newer one waits
first and then runs `_v5_dot` whole.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import triton_decode_q8 as q8
from .triton_decode import STEP_BLOCK, Tile, _act, _v3_load, v3_pieces
from .triton_decode_q8 import Q4_0, Q4_K, Q6_K, Q8_0, _q6_load, _q6_math, _q8_blocks, _v5_dot, _v5_math

# counters (int32, `arrival_counters`): three of one launch 128 bytes apart (no shared line under the polls),
# then one arrival counter per 32-block of h
X_READY, H_READY, DONE, BLOCKS = tl.constexpr(0), tl.constexpr(32), tl.constexpr(64), tl.constexpr(96)
SPIN_LIMIT = 1 << 22              # polls before a waiting program gives up (NaN out; seconds of polling)
POLL_NS = 0                       # nanosleep between polls (0: none); bench sweeps it to cut L2 traffic on the counter


class Tile6(NamedTuple):
    """v6's launch: rows per gate_up program (dividing 32: the h block quantizer), rows of D per down program, and
    the warps of every program (one kernel, one num_warps)."""
    gate_up_bn: int
    down_bn: int
    warps: int


def default_tile(gu_fmt: str, dn_fmt: str) -> Tile6:
    """From the v5 tiles timed alone (triton_decode_q8.GATE_UP5 / DOWN5): down's tile and warps as they are, gate_up
    rows scaled to those warps so a thread holds as many weight words as at v5's tile (Q4_0 (8, 4, 4), Q8_0
    (16, 16, 8), Q4_K (8, 8, 4), Q6_K (16, 8, 4)). Not timed yet as a whole launch: bench --variants sweeps. The
    launch's registers are its largest role's (sm_90 ptxas, Qwen3-30B-A3B: Q4_0 112, (4, 4, 4) 80; Q8_0 248; Q4_K
    and Q6_K 255 with 552 / 240 B spilled, as v5's own Q4_K down and Q6_K gate_up)."""
    g, d = q8.GATE_UP5.get(gu_fmt, Tile(8, 0, 4)), q8.DOWN5.get(dn_fmt, Tile(8, 0, 4))
    return Tile6(min(32, max(1, g.bn * d.warps // g.warps)), d.bn, d.warps)


def tile_from(cfg_gate_up, cfg_down, gu_fmt: str, dn_fmt: str) -> Tile6:
    """moe_decode's per-kernel tiles ((bn, bk, warps) each, or None) as v6's: gate_up rows from cfg_gate_up, down rows
    from cfg_down, warps from cfg_down (else cfg_gate_up); the default for what is not given."""
    t = default_tile(gu_fmt, dn_fmt)
    warps = next((c[2] for c in (cfg_down, cfg_gate_up) if c and len(c) > 2), t.warps)
    return Tile6(cfg_gate_up[0] if cfg_gate_up else t.gate_up_bn, cfg_down[0] if cfg_down else t.down_bn, warps)


# ------------------------------------------------------------------ waits
@triton.jit
def _spin(ready_ptr, target, WAIT: tl.constexpr, SPIN: tl.constexpr, POLL: tl.constexpr, EMU: tl.constexpr):
    """Wait until *ready_ptr >= target (WAIT; else return at once): relaxed polls, then one acquire (one thread,
    its result broadcast through a CTA barrier) and a CTA barrier. -> int32 1, or 0 when it gave up after SPIN
    polls."""
    ok = tl.full([], 1, tl.int32)
    if WAIT:
        v = tl.load(ready_ptr, volatile=True)
        polls = tl.full([], 0, tl.int32)
        while (v < target) & (polls < SPIN):
            if POLL > 0 and not EMU:
                tl.inline_asm_elementwise("nanosleep.u32 $1;\n\tmov.u32 $0, $1;", "=r,r", [polls * 0 + POLL],
                                          dtype=tl.int32, is_pure=False, pack=1)
            polls += 1
            v = tl.load(ready_ptr, volatile=True)
        ok = (tl.atomic_add(ready_ptr, 0, sem="acquire") >= target).to(tl.int32)
        tl.debug_barrier()
    return ok


@triton.jit
def _dot(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, rq, rd, rm, rsc, rmn, rh, mask, NBK: tl.constexpr,
         xw_ptr, xwo, xd_ptr, xs_ptr, xdo, ready_ptr, target, FMT: tl.constexpr, NB1: tl.constexpr,
         NB2: tl.constexpr, WAIT: tl.constexpr, SPIN: tl.constexpr, POLL: tl.constexpr, EMU: tl.constexpr):
    """triton_decode_q8._v5_dot with the PDL wait replaced by `_spin` on ready_ptr (between the weight loads and the
    math) -> ([A, B] dot products, ok). A format it does not know: the wait, then _v5_dot (loads after the wait)."""
    if FMT == Q6_K:
        a0, a1, a2, a3, a4, a5, a6, a7 = _q6_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, 0, NBK, NB1)
        if NB2 > 0:
            b0, b1, b2, b3, b4, b5, b6, b7 = _q6_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, NB1, NBK,
                                                      NB2)
        ok = _spin(ready_ptr, target, WAIT, SPIN, POLL, EMU)
        acc = _q6_math(a0, a1, a2, a3, a4, a5, a6, a7, 0, NBK, xw_ptr, xwo, xd_ptr, xdo, NB1, EMU)
        if NB2 > 0:
            acc += _q6_math(b0, b1, b2, b3, b4, b5, b6, b7, NB1, NBK, xw_ptr, xwo, xd_ptr, xdo, NB2, EMU)
    elif FMT == Q8_0 or FMT == Q4_0 or FMT == Q4_K:
        a0, a1, a2, a3, a4, a5, a6 = _v3_load(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rq, rd, rm, rsc, rmn, mask,
                                              0, NBK, FMT, NB1)
        if NB2 > 0:
            b0, b1, b2, b3, b4, b5, b6 = _v3_load(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rq, rd, rm, rsc, rmn,
                                                  mask, NB1, NBK, FMT, NB2)
        ok = _spin(ready_ptr, target, WAIT, SPIN, POLL, EMU)
        acc = _v5_math(a0, a1, a2, a3, a4, a5, a6, 0, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB1, EMU)
        if NB2 > 0:
            acc += _v5_math(b0, b1, b2, b3, b4, b5, b6, NB1, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB2,
                            EMU)
    else:
        ok = _spin(ready_ptr, target, WAIT, SPIN, POLL, EMU)
        acc = _v5_dot(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, rq, rd, rm, rsc, rmn, rh, mask, NBK,
                      xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB1, NB2, False, EMU)
    return acc, ok


# ------------------------------------------------------------------ the three kinds of program
@triton.jit
def _quantize_x(t, x_ptr, stride_x, xq_ptr, xd_ptr, xs_ptr, cnt_ptr, D: tl.constexpr, NBP: tl.constexpr):
    """Row t of x -> int8 q [D], dx, xs [D/32] (as `quantize`), then x_ready += 1 (release)."""
    t = t.to(tl.int64)
    b = tl.arange(0, NBP)
    j = tl.arange(0, 32)
    mb = b < D // 32
    x = tl.load(x_ptr + t * stride_x + b[:, None] * 32 + j[None, :], mask=mb[:, None], other=0.0).to(tl.float32)
    q, dx, xs = _q8_blocks(x)
    tl.store(xq_ptr + t * D + b[:, None] * 32 + j[None, :], q.to(tl.int8), mask=mb[:, None])
    tl.store(xd_ptr + t * (D // 32) + b, dx, mask=mb)
    tl.store(xs_ptr + t * (D // 32) + b, xs, mask=mb)
    tl.debug_barrier()                                     # every thread's stores precede the release
    tl.atomic_add(cnt_ptr + X_READY, 1, sem="release")


@triton.jit
def _quantize_h_block(p, n0, hf_ptr, hq_ptr, hd_ptr, hs_ptr, cnt_ptr, I: tl.constexpr, BN: tl.constexpr):
    """v5q's fused h quantizer: the last of the 32 / BN programs of h's 32-block (pair p, rows n0 ..) to arrive
    (acq_rel: the others' h stores visible to it) quantizes the block, resets its counter, then h_ready += 1."""
    tl.debug_barrier()                                     # every thread's h stores precede the release
    blk = p.to(tl.int64) * (I // 32) + n0 // 32
    cb = cnt_ptr + BLOCKS + blk
    if tl.atomic_add(cb, 1, sem="acq_rel") == 32 // BN - 1:
        tl.atomic_xchg(cb, 0, sem="relaxed")
        o = blk * 32 + tl.arange(0, 32)[None, :]
        q, dx, xs = _q8_blocks(tl.load(hf_ptr + o, cache_modifier=".cg"))
        tl.store(hq_ptr + o, q.to(tl.int8))
        z = tl.zeros([1], dtype=tl.int64) + blk
        tl.store(hd_ptr + z, dx)
        tl.store(hs_ptr + z, xs)
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + H_READY, 1, sem="release")


@triton.jit
def _gate_up(g, P, xw_ptr, xd_ptr, xs_ptr, ids_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr,
             sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n, b_ptr, sb_s,
             hf_ptr, hq_ptr, hd_ptr, hs_ptr, cnt_ptr, nq, alpha, limit,
             I: tl.constexpr, D: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr, ACT: tl.constexpr,
             HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, NB1: tl.constexpr, NB2: tl.constexpr,
             XWAIT: tl.constexpr, ROUND: tl.constexpr, SPIN: tl.constexpr, POLL: tl.constexpr, EMU: tl.constexpr):
    """gate_up program g of P pairs x I/BN row blocks (pair fastest, as v5's grid): h[pair, n] = act(gate row n .
    x[t], up row n . x[t]) (+ bias), v5's tile [K, BN, 2]; x waited for after the weight loads."""
    p = g % P
    n0 = (g // P) * BN
    n = n0 + tl.arange(0, BN)
    s = tl.load(ids_ptr + p).to(tl.int64)
    gu = tl.arange(0, 2)[None, :]
    r = tl.minimum(n, I - 1).to(tl.int64)[:, None] + gu * I
    m2 = (n < I)[:, None] & (gu >= 0)
    acc = tl.zeros([BN, 2], dtype=tl.float32)
    ok = tl.full([], 1, tl.int32)
    if s >= 0:                                   # a skipped pair (-1) reads nothing and waits for nothing: h = 0
        t = (p // KTOP).to(tl.int64)
        xwo = tl.zeros([1, 1], dtype=tl.int64) + t * (D // 4)
        xdo = tl.zeros([1, 1], dtype=tl.int64) + t * (D // 32)
        acc, ok = _dot(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n,
                       s * sm_s + r * sm_n, s * ssc_s + r * ssc_n, s * smn_s + r * smn_n, s * sh_s + r * sh_n,
                       r >= 0, D // BS, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, cnt_ptr + X_READY, nq, FMT, NB1, NB2,
                       XWAIT, SPIN, POLL, EMU)
    m2 = m2 & (s >= 0)
    s = tl.maximum(s, 0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + s * sb_s + r, mask=m2, other=0.0).to(tl.float32)
    gate = tl.sum(tl.where(gu == 0, acc, 0.0), axis=1)
    up = tl.sum(tl.where(gu == 1, acc, 0.0), axis=1)
    h = _act(gate, up, ACT, alpha, limit)
    if ROUND == 1:                                               # rounded to x's dtype, as v5 and the twin do
        h = h.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        h = h.to(tl.float16).to(tl.float32)
    h = tl.where(ok != 0, h, float("nan"))                       # gave up waiting for x
    tl.store(hf_ptr + p.to(tl.int64) * I + n, h, mask=n < I)
    _quantize_h_block(p, n0, hf_ptr, hq_ptr, hd_ptr, hs_ptr, cnt_ptr, I, BN)


@triton.jit
def _down(g, T, hw_ptr, hd_ptr, hs_ptr, ids_ptr, w_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr,
          sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n, b_ptr, sb_s,
          out_ptr, stride_o, cnt_ptr, nh, nd,
          D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, KP: tl.constexpr, FMT: tl.constexpr,
          HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, NB1: tl.constexpr, NB2: tl.constexpr,
          SPIN: tl.constexpr, POLL: tl.constexpr, EMU: tl.constexpr):
    """down program g of T tokens x D/BN row blocks (token fastest): out[t, n] = sum_j w[t, j] * (down_j row n .
    h[t, j] (+ bias)), v5's tile [I, k, BN]; h (nh 32-blocks) waited for after the weight loads. The last of the
    nd down programs resets the launch's counters."""
    t = g % T
    n = (g // T) * BN + tl.arange(0, BN)
    nm = n < D
    j = tl.arange(0, KP)
    jm = j < KTOP
    s = tl.load(ids_ptr + t * KTOP + j, mask=jm, other=-1).to(tl.int64)
    mask = (jm & (s >= 0))[:, None] & nm[None, :]
    s = tl.maximum(s, 0)[:, None]
    r = tl.minimum(n, D - 1).to(tl.int64)[None, :]
    pj = (t * KTOP + j).to(tl.int64)[:, None]                                         # pair of h
    acc, ok = _dot(q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n,
                   s * sm_s + r * sm_n, s * ssc_s + r * ssc_n, s * smn_s + r * smn_n, s * sh_s + r * sh_n, mask,
                   I // BS, hw_ptr, pj * (I // 4), hd_ptr, hs_ptr, pj * (I // 32), cnt_ptr + H_READY, nh, FMT, NB1,
                   NB2, True, SPIN, POLL, EMU)
    if HAS_BIAS:
        acc += tl.load(b_ptr + s * sb_s + r, mask=mask, other=0.0).to(tl.float32)
    wj = tl.load(w_ptr + t * KTOP + j, mask=jm, other=0.0).to(tl.float32)
    y = tl.sum(tl.where(mask, acc, 0.0) * wj[:, None], axis=0)
    y = tl.where(ok != 0, y, float("nan"))                                            # gave up waiting for h
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=nm)
    if tl.atomic_add(cnt_ptr + DONE, 1, sem="acq_rel") == nd - 1:      # the launch's last program: reset for the next
        tl.atomic_xchg(cnt_ptr + X_READY, 0, sem="relaxed")
        tl.atomic_xchg(cnt_ptr + H_READY, 0, sem="relaxed")
        tl.atomic_xchg(cnt_ptr + DONE, 0, sem="relaxed")


@triton.jit
def _moe_v6_kernel(x_ptr, stride_x, xq_ptr, xw_ptr, xd_ptr, xs_ptr, ids_ptr, w_ptr,
                   gq_ptr, gd_ptr, gm_ptr, gsc_ptr, gmn_ptr, gh_ptr, gsq_s, gsq_n, gsd_s, gsd_n, gsm_s, gsm_n,
                   gssc_s, gssc_n, gsmn_s, gsmn_n, gsh_s, gsh_n, gb_ptr, gsb_s,
                   dq_ptr, dd_ptr, dm_ptr, dsc_ptr, dmn_ptr, dh_ptr, dsq_s, dsq_n, dsd_s, dsd_n, dsm_s, dsm_n,
                   dssc_s, dssc_n, dsmn_s, dsmn_n, dsh_s, dsh_n, db_ptr, dsb_s,
                   hf_ptr, hq_ptr, hw_ptr, hd_ptr, hs_ptr, out_ptr, stride_o, cnt_ptr, T, alpha, limit,
                   D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, KP: tl.constexpr, GFMT: tl.constexpr,
                   DFMT: tl.constexpr, ACT: tl.constexpr, GBIAS: tl.constexpr, DBIAS: tl.constexpr,
                   GBS: tl.constexpr, DBS: tl.constexpr, GBN: tl.constexpr, DBN: tl.constexpr, GNB1: tl.constexpr,
                   GNB2: tl.constexpr, DNB1: tl.constexpr, DNB2: tl.constexpr, NBP: tl.constexpr, QX: tl.constexpr,
                   ROUND: tl.constexpr, SPIN: tl.constexpr, POLL: tl.constexpr, EMU: tl.constexpr):
    """grid (QX*T + T*k*I/GBN + T*cdiv(D, DBN),): x quantizers, gate_up programs, down programs (module doc).
    QX 0: x given quantized (xq / xw, xd, xs filled before the launch): no quantizer program, no x wait."""
    pid = tl.program_id(0)
    nq = T * QX
    P = T * KTOP
    ng = P * (I // GBN)
    if pid < nq:
        _quantize_x(pid, x_ptr, stride_x, xq_ptr, xd_ptr, xs_ptr, cnt_ptr, D, NBP)
    elif pid < nq + ng:
        _gate_up(pid - nq, P, xw_ptr, xd_ptr, xs_ptr, ids_ptr, gq_ptr, gd_ptr, gm_ptr, gsc_ptr, gmn_ptr, gh_ptr,
                 gsq_s, gsq_n, gsd_s, gsd_n, gsm_s, gsm_n, gssc_s, gssc_n, gsmn_s, gsmn_n, gsh_s, gsh_n, gb_ptr, gsb_s,
                 hf_ptr, hq_ptr, hd_ptr, hs_ptr, cnt_ptr, nq, alpha, limit, I, D, KTOP, GFMT, ACT, GBIAS, GBS, GBN,
                 GNB1, GNB2, QX != 0, ROUND, SPIN, POLL, EMU)
    else:
        _down(pid - nq - ng, T, hw_ptr, hd_ptr, hs_ptr, ids_ptr, w_ptr, dq_ptr, dd_ptr, dm_ptr, dsc_ptr, dmn_ptr,
              dh_ptr, dsq_s, dsq_n, dsd_s, dsd_n, dsm_s, dsm_n, dssc_s, dssc_n, dsmn_s, dsmn_n, dsh_s, dsh_n, db_ptr,
              dsb_s, out_ptr, stride_o, cnt_ptr, P * (I // 32), T * ((D + DBN - 1) // DBN), D, I, KTOP, KP, DFMT,
              DBIAS, DBS, DBN, DNB1, DNB2, SPIN, POLL, EMU)


# ------------------------------------------------------------------ launcher
def supports(gate_up, down, d: int) -> bool:
    """v6 runs where v5 runs both projections (triton_decode_q8.supports)."""
    return q8.supports(gate_up, d) and q8.supports(down, down.k)


def moe_v6(x, ids, w, gate_up, down, act: int, alpha: float, limit: float, biases, out, tile=None,
           pre_x: tuple | None = None, poll_ns: int | None = None):
    """out [T, D] = the MoE pair of x [T, D] (ids, w flat [T*k]; supports()) in one launch, the same values as
    v5pdl at the same tiles. tile: Tile6 (default_tile). pre_x: x already quantized, (q int8 [T, D], dx, xs f32
    [T, D/32]) as `triton_decode_q8.quantize` makes them (a fused norm): no quantizer programs. Scratch: x's and h's
    int8 copies, h float32 (torch.empty); counters: arrival_counters(.., "decode_v6"), launches must not overlap."""
    t, d = x.shape
    k, i = ids.numel() // t, down.k
    tile = Tile6(*(tile or default_tile(gate_up.fmt, down.fmt)))
    if tile.gate_up_bn < 1 or 32 % tile.gate_up_bn:
        raise ValueError(f"v6's gate_up rows per program must divide 32 (h is quantized per 32-block by the programs "
                         f"that write it); got {tile.gate_up_bn}: use 1, 2, 4, 8, 16 or 32")
    dev = x.device
    if pre_x is None:
        xq = torch.empty(t, d, dtype=torch.int8, device=dev)
        xd, xs = (torch.empty(t, d // 32, dtype=torch.float32, device=dev) for _ in range(2))
    else:
        xq, xd, xs = pre_x
        if (xq.dtype, tuple(xq.shape), xd.shape, xs.shape) != (torch.int8, (t, d), (t, d // 32), (t, d // 32)) or \
                not all(a.is_contiguous() for a in pre_x):
            raise ValueError(f"pre_x must be contiguous (q int8 [{t}, {d}], dx, xs float32 [{t}, {d // 32}]) as "
                             f"triton_decode_q8.quantize makes them; got {[(a.dtype, tuple(a.shape)) for a in pre_x]}")
    h = torch.empty(t * k, i, dtype=torch.float32, device=dev)
    pad = triton.next_power_of_2(k) - k              # down's tile reads k rounded up to a power of two pairs (masked)
    hq = torch.empty(t * k + pad, i, dtype=torch.int8, device=dev)
    hd, hs = (torch.empty(t * k + pad, i // 32, dtype=torch.float32, device=dev) for _ in range(2))
    cnt = q8.arrival_counters(dev, BLOCKS.value + t * k * (i // 32), "decode_v6")
    gb, dbias = biases if biases is not None else (None, None)
    (gnb1, gnb2), (dnb1, dnb2) = v3_pieces(d, gate_up.fmt), v3_pieces(i, down.fmt)
    nq = 0 if pre_x is not None else t
    grid = (nq + t * k * (i // tile.gate_up_bn) + t * triton.cdiv(d, tile.down_bn),)
    _moe_v6_kernel[grid](
        x, x.stride(0), xq, xq.view(torch.int32), xd, xs, ids, w,
        *q8._planes(gate_up), *((gb, gb.stride(0)) if gb is not None else (h, 0)),
        *q8._planes(down), *((dbias, dbias.stride(0)) if dbias is not None else (out, 0)),
        h, hq, hq.view(torch.int32), hd, hs, out, out.stride(0), cnt, t, alpha, limit,
        D=d, I=i, KTOP=k, KP=triton.next_power_of_2(k), GFMT=gate_up.code, DFMT=down.code, ACT=act,
        GBIAS=gb is not None, DBIAS=dbias is not None, GBS=STEP_BLOCK[gate_up.fmt], DBS=STEP_BLOCK[down.fmt],
        GBN=tile.gate_up_bn, DBN=tile.down_bn, GNB1=gnb1, GNB2=gnb2, DNB1=dnb1, DNB2=dnb2,
        NBP=triton.next_power_of_2(d // 32), QX=int(pre_x is None), ROUND=q8.ROUND.get(x.dtype, 0), SPIN=SPIN_LIMIT,
        POLL=POLL_NS if poll_ns is None else poll_ns, EMU=q8._emulate(), num_warps=tile.warps)
    return out
