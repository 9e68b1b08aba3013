"""Decode kernels, variant "v4" (Q4_0 / Q8_0, one token): the whole MoE layer in ONE persistent launch.

Why (H200, Qwen3-30B-A3B T=1, CUDA-graph replays): v2/v3 run two launches per layer, gate_up ~12 us
(1.17 TB/s) and down 12-16 us (0.43-0.58 TB/s) against 4.25 TB/s HBM copy. Both are latency-bound:
each program holds a few KB in flight (registers cap programs per SM), and the down kernel cannot load
a byte before gate_up has finished. v4:
  - a persistent grid of P <= #SMs programs (WARPS = 16 warps, one per SM, all co-resident: required by
    the barrier); phase 1 (gate_up + SwiGLU) and phase 2 (down + weighted sum over the k experts)
    separated by a grid-wide barrier instead of a kernel boundary;
  - phase 1 items (expert j, BI = 8 intermediate rows): the BI gate rows and the BI matching up rows of
    slot ids[j], the whole K = D in one load (Q4_0 16 KB, Q8_0 32 KB per item at D = 2048); a program
    takes items pid, pid+P, ... (NT of them, a constexpr: the loop is unrolled) and issues item t+2's
    loads before item t's math; h = silu(g) * u rounded to x's dtype, stored as float32 into hbuf [k, I];
  - the barrier: a generation counter in `sync` (int32 [cnt, gen, err, -]; scalar atomics run once per
    program): arrive with an acq_rel add on cnt, the last arriver resets cnt and bumps gen (release),
    the others spin on an acquire read of gen; bounded (SPIN_LIMIT polls), after which the program sets
    err, poisons its outputs with NaN and goes on instead of hanging. hbuf is read after it with ".cg"
    (L2; never a stale L1 line);
  - between the arrive and the spin, each program issues all its down weights (phase-2 chunk 0: all k
    experts at CHUNK_BYTES = 96 KB; Q4_0 48 KB, Q8_0 96 KB per SM): in flight during the wait;
  - phase 2 (deterministic, no atomics): program p owns BR output rows for ALL k experts, tiles
    [words, KC experts, BR rows] in chunks of KC experts (chunk c+1's loads issued before chunk c's
    math), out[r] = sum_j w[j] * (down_j row r . h[j]).
The weight math is v3's (triton_decode module doc; word axis first, the bit tricks, one accumulator per
word starting at its zero-point term). A skipped expert (ids < 0) loads nothing (slot clamped to 0,
masked) and contributes 0 in both phases. PHASES: 3 = both phases and the barrier (CUDA); 1 / 2 = one
phase, no barrier (the interpreter runs programs one after another, so a spin barrier would deadlock:
the launcher runs PHASES=1 then PHASES=2 there, the same code).

Why this shape: SASS (bench_gpu_kernels.py --compile-sm90 --only v4; scoreboard = the wait barriers in
each instruction's control bits). The first v4 (8 warps, items of 32 KB, a `range` loop carrying the
next item's tiles, x re-read per item, down loads before the arrive) measured Q4_0 79.9 / Q8_0 49.4 us
against v3's 24.0 / 19.6; its sm_90 code (255 registers, no spills):
  - the prefetch was not real: in the phase-1 loop (Q4_0 1479 instructions per item: 8 LDG.E.EF.128 of
    the next item, 40 LDG.E.U16 of x, 2 LDG.E of ids; Q8_0 1049: 8 + 24 + 2) all 8 128-bit loads of the
    next item were waited for in the SAME iteration (Q4_0 issued at instruction 205-229, waited at 483,
    on scoreboard SB2 shared with the current item's x loads; Q8_0 issued at 673-712, waited at 807).
    So each item paid the full HBM latency, with only one 32 KB item per SM in flight (12 load waits per
    iteration). The same happens to any global load inside the item loop: x (now loaded once, into
    registers, before the loop: _xpre), the slot ids (now all loaded first), fp16 scales (LLVM packs two
    into one register with PRMT right after the load: now read as int32 words, _wload), and register
    copies at a `range` loop's back edge (ptxas rotates the loop and copies / extracts fields of the
    fresh loads: now tl.static_range, no phis);
  - the down prefetch (12 LDG.E.EF.128, 48 KB/SM) had been placed after the last item's math and before
    the arrive, whose release fence (MEMBAR.ALL.GPU) waits for outstanding loads: now issued after it;
  - phase-1 dynamic instructions per SM: Q4_0 38.2K, Q8_0 53.7K warp-instructions (now 34.4K / 47.1K:
    x and the zero-point terms computed once per program instead of once per item).
Now (16 warps): Q4_0 117 registers, Q8_0 128, no spills; phase 1 unrolled, items t+1 and t+2 in flight
during item t's math in program order; the only loads between items are the weights and scale words.
ptxas still places some waits early (6 scoreboards for 3 items in flight: a wait for one item retires
another's loads); at the waits 8-64 KB per SM are in flight, 170-210 instructions after issue.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_decode import (
    ONE_BITS,
    Q4_0,
    STEP_BLOCK,
    _act,
    _f,
    _field,
    _shift,
    v3_pieces,
)

V4_FORMATS = ("Q8_0", "Q4_0")
ITEM_ROWS = {"Q4_0": 8, "Q8_0": 8}            # BI: 2*BI rows x D per phase-1 item (D = 2048: Q4_0 16 KB, Q8_0 32 KB)
CHUNK_BYTES = 96 * 1024                       # phase 2: quant bytes per chunk of experts in flight
# (Qwen3-30B-A3B, P=132: all 8 experts in one chunk, Q4_0 48 KB and Q8_0 96 KB per program)
WARPS = 16                                    # one program per SM: 512 threads x <= 128 registers
H_CG = True     # h read with ".cg"; the acquire poll already invalidates L1 (CCTL.IVALL), so False is also correct
SPIN_LIMIT = 1 << 26                          # barrier polls before a program gives up (err flag)
SYNC_LEN = 4                                  # int32 [cnt, gen, err, unused] per call


@triton.jit
def _wload(q_ptr, d_ptr, rq, rd, mask, g0, NBK, FMT: tl.constexpr, NB: tl.constexpr):
    """Words [NB*W, A, B] of step blocks g0 .. g0+NB (of NBK) of rows [A, B] (masked: 0), and their fp16
    block scales in the same shape as the int32 words that hold them (ds) with the bit offset of each
    scale in its word (dsh, 0 or 16; unmasked: rows and slot clamped in bounds, callers mask the sums).
    Why int32: two fp16 loads that a loop carries are packed by LLVM / ptxas into one register (PRMT) right
    after the load, a scoreboard wait that would expose the load's latency in the iteration that issues
    it; a 32-bit load is carried as is and first touched by _wdot (module doc). The d plane's base must
    be 4-byte aligned (supports())."""
    W: tl.constexpr = 4 if FMT == Q4_0 else 8
    e = g0 * W + tl.arange(0, NB * W)
    m3 = (e < NBK * W)[:, None, None] & mask[None, :, :]
    words = tl.load(q_ptr + rq[None, :, :] + e[:, None, None], mask=m3, other=0, eviction_policy="evict_first")
    g = tl.minimum(g0 + tl.arange(0, NB), NBK - 1)
    off = rd[None, None, :, :] + g[:, None, None, None]                                   # [NB, 1, A, B]
    off = tl.reshape(tl.broadcast_to(off, [NB, W, rd.shape[0], rd.shape[1]]), [NB * W, rd.shape[0], rd.shape[1]])
    ds = tl.load(d_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (off >> 1))
    return words, ds, (off & 1).to(tl.int32) * 16


@triton.jit
def _xpre(x_ptr, xo, g0, NBK, A: tl.constexpr, B: tl.constexpr, FMT: tl.constexpr, NB: tl.constexpr,
          CG: tl.constexpr):
    """The float x values of _wload's blocks g0 .. g0+NB in the words' shape [NB*W, A, B] (x at offsets xo
    [A, B] broadcast over the word axis; masked blocks 0) and each word's zero-point term zp, as one tuple
    (x_0 .. x_7, zp): Q4_0 x_b = x_lo b, x_4+b = x_hi b, zp = sum_b 33/32 x_lo + 3/32 x_hi; Q8_0 x_0..3 (4..7
    repeat them), zp = 1.5 sum_b x_b. Pointers of the words' shape with the word axis first give the words'
    register layout (triton_decode._v3_load) and ptxas keeps one load per distinct element a thread holds.
    x read through L2 (".cg") when CG (h, written by other SMs)."""
    W: tl.constexpr = 4 if FMT == Q4_0 else 8
    e = g0 * W + tl.arange(0, NB * W)
    xe = (e // 4) * 32 + (e % 4) * 4 if FMT == Q4_0 else e * 4
    xb = tl.broadcast_to(x_ptr + xo[None, :, :] + xe[:, None, None], [NB * W, A, B])
    me = tl.broadcast_to((e < NBK * W)[:, None, None], [NB * W, A, B])
    CM: tl.constexpr = ".cg" if CG else ""
    x0 = tl.load(xb + 0, mask=me, other=0.0, cache_modifier=CM).to(tl.float32)
    x1 = tl.load(xb + 1, mask=me, other=0.0, cache_modifier=CM).to(tl.float32)
    x2 = tl.load(xb + 2, mask=me, other=0.0, cache_modifier=CM).to(tl.float32)
    x3 = tl.load(xb + 3, mask=me, other=0.0, cache_modifier=CM).to(tl.float32)
    if FMT == Q4_0:
        x4 = tl.load(xb + 16, mask=me, other=0.0, cache_modifier=CM).to(tl.float32)
        x5 = tl.load(xb + 17, mask=me, other=0.0, cache_modifier=CM).to(tl.float32)
        x6 = tl.load(xb + 18, mask=me, other=0.0, cache_modifier=CM).to(tl.float32)
        x7 = tl.load(xb + 19, mask=me, other=0.0, cache_modifier=CM).to(tl.float32)
        zp = 1.03125 * x0 + 0.09375 * x4
        zp += 1.03125 * x1 + 0.09375 * x5
        zp += 1.03125 * x2 + 0.09375 * x6
        zp += 1.03125 * x3 + 0.09375 * x7
        return x0, x1, x2, x3, x4, x5, x6, x7, zp
    else:
        zp = 1.5 * x0 + 1.5 * x1 + 1.5 * x2 + 1.5 * x3
        return x0, x1, x2, x3, x0, x1, x2, x3, zp


@triton.jit
def _wdot(words, ds, dsh, xz, one, FMT: tl.constexpr):
    """Row dot products [A, B] of _wload's words / scales with _xpre's x tuple xz: v3's math
    (triton_decode._v3_math: each word's accumulator starts at its zero-point term, high nibbles read as
    f / 16). No memory access: the x values are registers loaded once (phase 1: before the item loop)."""
    p = -xz[8]
    if FMT == Q4_0:         # sum (q - 8) x = 256 (p - sum(33/32 x_lo + 3/32 x_hi)), high nibbles read / 16
        one16 = one - 0x2000000
        for b in tl.static_range(4):
            t = _shift(words, 15 - 8 * b)
            p += _f(t & 0x78000, one) * xz[b]
            p += _f(t & 0x780000, one16) * xz[4 + b]
    else:                   # Q8_0: f = 1 + (q + 128) / 256, sum q x = 256 (p - 1.5 sum x)
        one8 = one | 0x400000
        for b in tl.static_range(4):
            p += (_field(words, 15 - 8 * b, 0x7F8000) ^ one8).to(tl.float32, bitcast=True) * xz[b]
    d = ((ds >> dsh) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return 256.0 * tl.sum(d * p, axis=0)


@triton.jit
def _item(it, s, I: tl.constexpr, KTOP: tl.constexpr, BI: tl.constexpr):
    """Phase-1 item it of expert slot s (ids[j], loaded by the caller; < 0: skipped) -> expert j, rows n
    [BI], slot (clamped to 0), gate/up rows r [BI, 2] (in bounds) and the mask [BI, 2] (item exists,
    expert not skipped, row < I). Pure arithmetic: no load."""
    NIB: tl.constexpr = (I + BI - 1) // BI
    valid = it < KTOP * NIB
    j = it // NIB
    n = (it % NIB) * BI + tl.arange(0, BI)
    gu = tl.arange(0, 2)[None, :]
    r = tl.minimum(n, I - 1).to(tl.int64)[:, None] + gu * I
    mask = ((n < I) & valid & (s >= 0))[:, None] & (gu >= 0)
    return j, n, tl.maximum(s, 0).to(tl.int64), r, mask, valid


@triton.jit
def _slot(it, ids_ptr, I: tl.constexpr, KTOP: tl.constexpr, BI: tl.constexpr):
    """ids[expert of phase-1 item it] as int64 (-1 when the item does not exist)."""
    NIB: tl.constexpr = (I + BI - 1) // BI
    return tl.load(ids_ptr + it // NIB, mask=it < KTOP * NIB, other=-1)


@triton.jit
def _item_load(it, s, q_ptr, d_ptr, sq_s, sq_n, sd_s, sd_n, I: tl.constexpr, D: tl.constexpr,
               KTOP: tl.constexpr, FMT: tl.constexpr, BS: tl.constexpr, BI: tl.constexpr,
               NB1: tl.constexpr, NB2: tl.constexpr):
    """All weight loads of phase-1 item it (slot s; both K pieces; NB2 = 0: a dummy second piece)."""
    _j, _n, sc, r, mask, _valid = _item(it, s, I, KTOP, BI)
    return _pieces_load(q_ptr, d_ptr, sc * sq_s + r * sq_n, sc * sd_s + r * sd_n, mask, D // BS, FMT, NB1, NB2)


@triton.jit
def _pieces_load(q_ptr, d_ptr, rq, rd, mask, NBK: tl.constexpr, FMT: tl.constexpr, NB1: tl.constexpr,
                 NB2: tl.constexpr):
    """The loads of whole rows (offsets rq, rd) in two power-of-two pieces of blocks (NB2 = 0: a dummy)."""
    wa, da, sa = _wload(q_ptr, d_ptr, rq, rd, mask, 0, NBK, FMT, NB1)
    if NB2 > 0:
        wb, db, sb = _wload(q_ptr, d_ptr, rq, rd, mask, NB1, NBK, FMT, NB2)
    else:
        wb, db, sb = wa, da, sa                         # unused
    return (wa, da, sa), (wb, db, sb)


@triton.jit
def _item_math(it, s, pa, pb, xa, xb, x_ptr, h_ptr, one, I: tl.constexpr, KTOP: tl.constexpr,
               FMT: tl.constexpr, BI: tl.constexpr, NB2: tl.constexpr):
    """h[j, n] = silu(gate) * up of item it (slot s), rounded to x's dtype, stored as float32 (a
    skipped expert: 0; a non-existent item stores nothing). No load: x is in registers (xa, xb)."""
    j, n, _s, _r, mask, valid = _item(it, s, I, KTOP, BI)
    acc = _wdot(pa[0], pa[1], pa[2], xa, one, FMT)
    if NB2 > 0:
        acc += _wdot(pb[0], pb[1], pb[2], xb, one, FMT)
    acc = tl.where(mask, acc, 0.0)
    gu = tl.arange(0, 2)[None, :]
    h = _act(tl.sum(tl.where(gu == 0, acc, 0.0), axis=1), tl.sum(tl.where(gu == 1, acc, 0.0), axis=1), 0, 1.0, 0.0)
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(h_ptr + j.to(tl.int64) * I + n, h, mask=(n < I) & valid)


@triton.jit
def _chunk(c, pid, ids_ptr, I: tl.constexpr, D: tl.constexpr, KTOP: tl.constexpr, KC: tl.constexpr,
           BR: tl.constexpr):
    """Phase-2 chunk c of program pid: experts j [KC], slots [KC, 1] (clamped), rows [1, BR] (in
    bounds), the mask [KC, BR], output rows n [BR]."""
    n = pid * BR + tl.arange(0, BR)
    j = c * KC + tl.arange(0, KC)
    jm = j < KTOP
    s = tl.load(ids_ptr + j, mask=jm, other=-1).to(tl.int64)
    mask = (jm & (s >= 0))[:, None] & (n < D)[None, :]
    return j, tl.maximum(s, 0)[:, None], tl.minimum(n, D - 1).to(tl.int64)[None, :], mask, n


@triton.jit
def _chunk_load(c, pid, ids_ptr, w_ptr, q_ptr, d_ptr, sq_s, sq_n, sd_s, sd_n, I: tl.constexpr, D: tl.constexpr,
                KTOP: tl.constexpr, FMT: tl.constexpr, BS: tl.constexpr, KC: tl.constexpr, BR: tl.constexpr,
                NB1: tl.constexpr, NB2: tl.constexpr):
    """Everything of phase-2 chunk c that does not depend on phase 1: the down words / scales, the mask
    [KC, BR] and the routing weights [KC] (float32). Issued before the barrier's wait."""
    j, s, r, mask, _n = _chunk(c, pid, ids_ptr, I, D, KTOP, KC, BR)
    pa, pb = _pieces_load(q_ptr, d_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n, mask, I // BS, FMT, NB1, NB2)
    wj = tl.load(w_ptr + j, mask=j < KTOP, other=0.0)
    return pa, pb, mask, wj


@triton.jit
def _chunk_math(c, pa, pb, mask, wj, h_ptr, one, I: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr,
                BS: tl.constexpr, KC: tl.constexpr, BR: tl.constexpr, NB1: tl.constexpr, NB2: tl.constexpr,
                HCG: tl.constexpr):
    """[BR] sum over chunk c's experts of w[j] * (down_j rows . h[j]); h (the only loads here) through L2
    (HCG)."""
    j = c * KC + tl.arange(0, KC)
    xo = (tl.minimum(j, KTOP - 1).to(tl.int64) * I)[:, None]
    acc = _wdot(pa[0], pa[1], pa[2], _xpre(h_ptr, xo, 0, I // BS, KC, BR, FMT, NB1, HCG), one, FMT)
    if NB2 > 0:
        acc += _wdot(pb[0], pb[1], pb[2], _xpre(h_ptr, xo, NB1, I // BS, KC, BR, FMT, NB2, HCG), one, FMT)
    return tl.sum(tl.where(mask, acc, 0.0) * wj.to(tl.float32)[:, None], axis=0)


@triton.jit
def _arrive(sync_ptr, P):
    """Grid barrier, first half (generation counter: sync = [cnt, gen, err]): this program's h stores
    released, then counted. The last to arrive resets cnt and opens the next generation. Returns the
    generation to wait past (scalar atomics: one thread per program, the result broadcast to all)."""
    tl.debug_barrier()                                   # every thread's h stores precede the arrive
    g0 = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
    a = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
    if a == P - 1:                                       # last to arrive: reset, open the next generation
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    return g0


@triton.jit
def _wait(sync_ptr, g0, SPIN: tl.constexpr):
    """Grid barrier, second half: spin (acquire reads) until gen moves past g0, at most SPIN polls;
    returns False if this program gave up (err set)."""
    polls = g0 * 0
    while (tl.atomic_add(sync_ptr + 1, 0, sem="acquire") == g0) & (polls < SPIN):
        polls += 1
    if polls >= SPIN:
        tl.atomic_xchg(sync_ptr + 2, 1, sem="relaxed")
    tl.debug_barrier()
    return polls < SPIN


@triton.jit
def _moe_v4_kernel(x_ptr, ids_ptr, w_ptr, gq_ptr, gd_ptr, gsq_s, gsq_n, gsd_s, gsd_n,
                   dq_ptr, dd_ptr, dsq_s, dsq_n, dsd_s, dsd_n, h_ptr, out_ptr, sync_ptr, one, P: tl.constexpr,
                   I: tl.constexpr, D: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr, BS: tl.constexpr,
                   BI: tl.constexpr, G1: tl.constexpr, G2: tl.constexpr, KC: tl.constexpr, BR: tl.constexpr,
                   N1: tl.constexpr, N2: tl.constexpr, PHASES: tl.constexpr, SPIN: tl.constexpr, HCG: tl.constexpr):
    """grid (P,): out [D] = sum_j w[j] * down_j @ (silu(gate_j @ x) * up_j @ x), x one token. Phase 1
    items pid, pid+P, .. (G1 + G2 blocks of D per row; NT steps, a program's missing last item masked),
    hbuf h [k, I] float32, the barrier, phase 2 output rows [pid*BR, +BR) in chunks of KC experts (N1 + N2
    blocks of I per row). Inside phase 1's loop the only global loads are the next item's weights (x and
    the slot ids are loaded before: module doc, SASS)."""
    pid = tl.program_id(0)
    NC: tl.constexpr = (KTOP + KC - 1) // KC
    NITEMS: tl.constexpr = KTOP * ((I + BI - 1) // BI)
    if PHASES != 2:
        NT: tl.constexpr = (NITEMS + P - 1) // P                             # items of program 0 (others: NT or NT - 1)
        xo = tl.zeros([BI, 2], dtype=tl.int64)
        xa = _xpre(x_ptr, xo, 0, D // BS, BI, 2, FMT, G1, False)                 # x: registers, once
        if G2 > 0:
            xb = _xpre(x_ptr, xo, G1, D // BS, BI, 2, FMT, G2, False)
        else:
            xb = xa
        sl = ()                                 # every item's slot id first: no load waits between items
        for t in tl.static_range(NT):
            sl = sl + (_slot(pid + t * P, ids_ptr, I, KTOP, BI),)
        pa, pb = _item_load(pid, sl[0], gq_ptr, gd_ptr, gsq_s, gsq_n, gsd_s, gsd_n, I, D, KTOP, FMT, BS, BI, G1, G2)
        if NT > 1:
            qa, qb = _item_load(pid + P, sl[1], gq_ptr, gd_ptr, gsq_s, gsq_n, gsd_s, gsd_n, I, D, KTOP, FMT, BS, BI,
                                G1, G2)
            tl.debug_barrier()
        for t in tl.static_range(NT):           # unrolled: no register copies (phis) of in-flight loads
            if t + 2 < NT:                      # software pipeline: loads two items ahead
                ra, rb = _item_load(pid + (t + 2) * P, sl[t + 2], gq_ptr, gd_ptr, gsq_s, gsq_n, gsd_s, gsd_n, I, D,
                                    KTOP, FMT, BS, BI, G1, G2)
                tl.debug_barrier()              # anchor: ptxas keeps loads above a bar.sync (else sinks them)
            _item_math(pid + t * P, sl[t], pa, pb, xa, xb, x_ptr, h_ptr, one, I, KTOP, FMT, BI, G2)
            if t + 1 < NT:
                pa, pb = qa, qb
            if t + 2 < NT:
                qa, qb = ra, rb
    if PHASES == 3:
        g0 = _arrive(sync_ptr, P)
    if PHASES != 1:                              # down weights of chunk 0: in flight over the barrier's wait
        ca, cb, cm, cw = _chunk_load(0, pid, ids_ptr, w_ptr, dq_ptr, dd_ptr, dsq_s, dsq_n, dsd_s, dsd_n,
                                               I, D, KTOP, FMT, BS, KC, BR, N1, N2)
    if PHASES == 3:
        ok = _wait(sync_ptr, g0, SPIN)
    if PHASES != 1:
        y = tl.zeros([BR], dtype=tl.float32)
        for c in tl.static_range(NC):
            if c + 1 < NC:
                na, nb, nm, nw = _chunk_load(c + 1, pid, ids_ptr, w_ptr, dq_ptr, dd_ptr, dsq_s, dsq_n,
                                                       dsd_s, dsd_n, I, D, KTOP, FMT, BS, KC, BR, N1, N2)
            y += _chunk_math(c, ca, cb, cm, cw, h_ptr, one, I, KTOP, FMT, BS, KC, BR, N1, N2, HCG)
            if c + 1 < NC:
                ca, cb, cm, cw = na, nb, nm, nw
        if PHASES == 3:
            y = tl.where(ok, y, float("nan"))                               # gave up at the barrier: poison
        n = pid * BR + tl.arange(0, BR)
        tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < D)


# ------------------------------------------------------------------ launcher
def supports(x, gate_up, down, act: int, biases) -> bool:
    """v4 reads one token, Q4_0 / Q8_0 (both projections in the same one), SwiGLU, no biases; the fp16
    scale planes 4-byte aligned (read as int32 words: _wload)."""
    return (x.shape[0] == 1 and gate_up.fmt in V4_FORMATS and down.fmt == gate_up.fmt and act == 0
            and not any(b is not None for b in biases or ()) and x.stride(-1) == 1
            and all(wt.v2_planes[1].data_ptr() % 4 == 0 for wt in (gate_up, down)))


def programs(device: torch.device) -> int:
    """P: the SMs of a CUDA device (one co-resident program each), 8 elsewhere (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def moe_v4(x, ids, w, gate_up, down, out, num_programs: int | None = None, chunk: int | None = None):
    """out [1, D] = the MoE layer of x [1, D] (ids, w flat [k]; supports()); one launch on CUDA (PHASES=3),
    PHASES=1 then 2 elsewhere. Scratch: h [k, I] float32 (torch.empty) and sync (torch.zeros: a memset
    node under CUDA graphs, fresh per call, so no state is shared between call sites or replays).
    num_programs / chunk (experts per phase-2 chunk) override the defaults (tests).
    MOETIER_V4_CHECK=1 (eager only, syncs): raise if a program gave up at the barrier."""
    d, k, i = x.shape[1], ids.numel(), down.k
    fmt = gate_up.fmt
    bs = STEP_BLOCK[fmt]
    bi = ITEM_ROWS[fmt]
    items = k * triton.cdiv(i, bi)
    p = max(1, min(num_programs or programs(x.device), items))
    br = triton.next_power_of_2(triton.cdiv(d, p))
    kp = triton.next_power_of_2(k)
    row_bytes = i // 2 if fmt == "Q4_0" else i
    kc = chunk or max(1, min(kp, 1 << max(0, (CHUNK_BYTES // max(1, br * row_bytes)).bit_length() - 1)))
    h = torch.empty(k, i, dtype=torch.float32, device=x.device)
    sync = torch.zeros(SYNC_LEN, dtype=torch.int32, device=x.device)
    gq, gd, *_ = gate_up.v2_planes
    dq, dd, *_ = down.v2_planes
    gs, ds = gate_up.v2_strides, down.v2_strides
    g1, g2 = v3_pieces(d, fmt)
    n1, n2 = v3_pieces(i, fmt)
    args = (x, ids, w, gq, gd, *gs[:4], dq, dd, *ds[:4], h, out, sync, ONE_BITS)
    kw = {"P": p, "I": i, "D": d, "KTOP": k, "FMT": gate_up.code, "BS": bs, "BI": bi, "G1": g1, "G2": g2, "KC": kc,
          "BR": br, "N1": n1, "N2": n2, "SPIN": SPIN_LIMIT, "HCG": H_CG, "num_warps": WARPS}
    if x.is_cuda:
        _moe_v4_kernel[(p,)](*args, PHASES=3, **kw)
        if (os.environ.get("MOETIER_V4_CHECK") == "1" and not torch.cuda.is_current_stream_capturing()
                and sync[2].item()):
            raise RuntimeError(f"v4 decode: a program gave up at the grid barrier ({p} programs not co-resident?)")
    else:
        _moe_v4_kernel[(p,)](*args, PHASES=1, **kw)
        _moe_v4_kernel[(p,)](*args, PHASES=2, **kw)
    return out
