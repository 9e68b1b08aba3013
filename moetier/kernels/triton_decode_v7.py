"""Decode MoE pair, variant "v7": gate_up, act, h's int8 copy and down in ONE launch after x's quantizer, with no
program waiting for another.

Why: v5pdl's pair is 4 dependent launches (x quantizer, gate_up, h quantizer, down) and takes 11.4 us on the H200
for Qwen3-30B-A3B's 21.2 MB of Q4_0 (44% of HBM copy), where one launch that only reads those bytes takes 6.2 us.
Down cannot start its math before every gate_up program has finished. Two single launches whose programs spin on
counters (v4, v6) were slower and v6 raced (docs/perf-log.md, sessions 7 and 15). v7 splits the pair by h's
32-blocks instead, so a program needs nothing another program makes:
  - grid (T*k pairs, I/(32*CH)); program (pair p, chunk c), slot s = ids[p] (< 0: skipped, it only arrives):
    1. the 32*CH gate rows from c*32*CH and their up rows (+ I) of slot s over the whole D, x as int8 words (v5's
       integer math: dp4a, a block's sums added as integers, then the MAGIC mantissa trick once a block, Q4_0's
       zero point via xs, MXFP4's byte permutes);
    2. h = act(gate, up) (+ bias), rounded to x's dtype, then quantized as CH int8 32-blocks (`_q8_blocks`:
       bit-equal to what `quantize` makes of those blocks of h);
    3. down: blocks c*CH.. of every one of the D rows of down[s] (Q4_0: 4 words and d a block) dotted with h's
       blocks, y[n] = w[p] * that (+ w[p] * bias[s, n] in chunk 0's program), added into a float32 acc[t, D] with
       relaxed atomics (4-wide reds on sm_90; acq_rel, the default, would fence every element);
    4. arrival: after its atomics (a CTA barrier first, so every thread's atomics precede the release) one
       acq_rel add on token t's counter (thread 0's); the program that arrives last (k * I/(32*CH) - 1 before it)
       resets the counter, reads acc[t] (.cg: from L2, where the atomics were done), stores out[t] in out's dtype
       and zeros acc[t] for the next launch (and the next CUDA-graph replay). acc and the counters are zeroed once
       and kept zero by the launches (`accumulator`, triton_decode_q8.arrival_counters).
    Why the last arriver sees every atomic: each program's reds happen before its barrier, the barrier before
    thread 0's release (cumulative: it covers what the CTA's barrier ordered before it); the counter's adds are
    one read-modify-write chain, so the acquire of the last add synchronizes with every earlier program's release;
    the result reaches the CTA's other threads through shared memory and a barrier, before their loads.
  - loads: one stream of pieces, gate/up NB blocks along D, then down BD rows, AHEAD pieces in flight ahead of
    the math (the first ones issued before the PDL wait); EARLY: all of down's rows (one piece) loaded first,
    with gate/up's first pieces, and held through the gate/up math (no load latency between h and down). Tiles
    are v3's [words, rows...] with the word axis first (16-byte loads, x gathers in the words' layout).
  - CH = 2: down's rows read in whole 32-byte sectors (CH = 1 uses half of each sector it fetches; the other
    half is chunk c +- 1's, from L2) and half the atomics, at half the programs (96 at Qwen3-30B T=1).
  - pdl: x's quantizer as v5pdl launches it; this kernel a programmatic dependent that issues its first loads
    before waiting for x, and (with MOETIER_PDL_CHAIN) lets its own dependent be scheduled from its start.
Exactness: the integer dots are exact; h's blocks and x's int8 copy are the twin's (ops.moe_native act_q8); the
float sums differ from the twin's in order only (the atomics' order over chunks is the GPU's, so the last bits of
out may differ between runs).
Formats: Q4_0, Q8_0, MXFP4 (gate_up and down each its own; I and D multiples of 32); others run v5pdl.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_decode import _act, _v3_bload
from .triton_decode_q8 import (MAGIC, MAGIC_F, PDL_CHAIN, ROUND, _dp4a, _emulate, _mxfp4_values, _planes, _q8_blocks,
                               arrival_counters, quantize)
from .triton_tiles import e8m0_half

Q8_0, Q4_0, MXFP4 = tl.constexpr(1), tl.constexpr(2), tl.constexpr(6)          # triton_weights.FMT_CODES
FORMATS = ("Q4_0", "Q8_0", "MXFP4")


class V7Tile(NamedTuple):
    """ch: 32-blocks of h per program (1, or 2 where they divide I/32: down's rows read in whole 32-byte sectors);
    nb: gate/up blocks per piece along D; bd: down rows per piece (both powers of two); warps; ahead: pieces in
    flight ahead of the math (1, 2; the first `ahead` issued before the PDL wait); maxnreg: ptxas's register cap
    (0: none; 128 at 8 warps lets 2 programs share an SM); early: all of down's rows loaded first, with gate/up's
    first pieces, and held through the gate/up math (where one piece of bd rows covers D; else the stream)."""
    ch: int
    nb: int
    bd: int
    warps: int = 8
    ahead: int = 2
    maxnreg: int = 0
    early: bool = False


# Picked from sm_90 SASS (ptxas registers / spill bytes, bench/compile_check.py) before any GPU run, Qwen3-30B-A3B
# T=1 (192 programs at ch 1): 2 programs an SM (8 warps at <= 128 registers, or 4 warps at <= 255) and no spills.
# Q4_0 (1, 16, 2048, 8, 2, 128, early) 128 / 0 (uncapped 142: ptxas hoists every load it can); Q8_0 (1, 4, 1024,
# 4 warps, stream) 244 / 0 (at 8 warps and 128 every Q8_0 tile tried spilled 16-128 B); MXFP4 (1, 8, 2048, 8, 2,
# 128, early) 128 / 0. Not timed yet: bench_gpu_kernels.py --variants --only v5pdl,v7 times these and ALT_TILES_V7.
TILES = {"Q4_0": V7Tile(1, 16, 2048, 8, 2, 128, True), "Q8_0": V7Tile(1, 4, 1024, 4, 2, 0, False),
         "MXFP4": V7Tile(1, 8, 2048, 8, 2, 128, True)}


@triton.jit
def _v7_load(q_ptr, d_ptr, rq, rd, g0, NBK, FMT: tl.constexpr, NB: tl.constexpr, MASK: tl.constexpr):
    """Words [NB*W, A, B] of blocks g0 .. g0+NB of rows [A, B] (word offsets rq, scale offsets rd, in bounds), word
    axis first, and each word's block scale (MXFP4: its e byte) in the same shape, as _v3_load's. MASK: blocks
    from NBK on are read as 0 (a last piece past the row's end); no mask otherwise: a predicate per row costs
    registers (sm_90, Q4_0 with down loaded first, uncapped, while v7 was built: 166 with _v3_load's row mask, 128
    without)."""
    W: tl.constexpr = 8 if FMT == Q8_0 else 4
    e = g0 * W + tl.arange(0, NB * W)
    ptr = q_ptr + rq[None, :, :] + e[:, None, None]
    if MASK:
        words = tl.load(ptr, mask=tl.broadcast_to((e < NBK * W)[:, None, None], ptr.shape), other=0,
                        eviction_policy="evict_first")
    else:
        words = tl.load(ptr, eviction_policy="evict_first")
    return words, _v3_bload(d_ptr, rd, g0, NB, W, 1, 0, NBK)


@triton.jit
def _v7_piece(J: tl.constexpr, NP: tl.constexpr, gq_ptr, gd_ptr, rq, rd, q_ptr, d_ptr, s, sq_s, sq_n, sd_s, sd_n,
              nr, c, D: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr, DFMT: tl.constexpr, NB: tl.constexpr,
              BD: tl.constexpr, CH: tl.constexpr):
    """The loads of piece J of a program's stream: gate/up blocks J*NB.. of its rows [32*CH, 2] for J < NP, else
    down rows (J - NP)*BD.. (clamped to D - 1; the atomics mask them), blocks c*CH.. of each."""
    if J < NP:
        w, d = _v7_load(gq_ptr, gd_ptr, rq, rd, J * NB, D // 32, FMT, NB, (J + 1) * NB > D // 32)
    else:
        n = nr + (J - NP) * BD
        if (J - NP + 1) * BD > D:                 # a last piece past D: its rows clamped (only there: registers)
            n = tl.minimum(n, D - 1)
        n = n.to(tl.int64)
        w, d = _v7_load(q_ptr, d_ptr, s * sq_s + n * sq_n, s * sd_s + n * sd_n, c * CH, I // 32, DFMT, CH, False)
    return w, d


@triton.jit
def _blocks(t, W: tl.constexpr, SUM: tl.constexpr):
    """[NB*W, A, B] per word -> [NB, A, B] per 32-block of W words: their sum (SUM) or the value they share (a max:
    they hold one value). A block's words sit in one thread (Q8_0: two lanes): no data through shared memory."""
    t4 = tl.reshape(t, [t.shape[0] // W, W, t.shape[1], t.shape[2]])
    if SUM:
        res = tl.sum(t4, axis=1)
    else:
        res = tl.max(t4, axis=1)
    return res


@triton.jit
def _gu_terms(words, d, g0, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT: tl.constexpr, NB: tl.constexpr,
              EMU: tl.constexpr):
    """Per-block terms [NB, A, B] of the rows' dot products with the int8 x words at xw_ptr + xwo (scales at
    xd_ptr / xs_ptr + xdo), not yet summed over the blocks: the caller adds the pieces elementwise and sums once.
    v5's word math (triton_decode_q8 module doc): Q8_0 word e elements 4e..4e+3; Q4_0 / MXFP4 block e // 4, low
    nibbles elements 4 (e % 4)..+3 (x word 8 (e // 4) + e % 4), high ones + 16 (x word + 4). A block's dp4a sums
    are added as integers (|sum| < 2^22: Q8_0 32 * 128 * 127) before the one MAGIC conversion and scaling a block."""
    W: tl.constexpr = 8 if FMT == Q8_0 else 4
    e = g0 * W + tl.arange(0, NB * W)
    me = tl.broadcast_to((e < NBK * W)[:, None, None], words.shape)
    blk = e // W
    xe = blk * 8 + (e % 4) if W == 4 else e
    xp = tl.broadcast_to(xw_ptr + xwo[None, :, :] + xe[:, None, None], words.shape)
    dp = tl.broadcast_to(xdo[None, :, :] + blk[:, None, None], words.shape)
    if W == 4:
        xl = tl.load(xp, mask=me, other=0)
        xh = tl.load(xp + 4, mask=me, other=0)
        if FMT == Q4_0:
            lo, hi = words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F
        else:
            lo, hi = _mxfp4_values(words, EMU)
        r = _dp4a(hi, xh, _dp4a(lo, xl, 0, EMU), EMU)
    else:
        r = _dp4a(words, tl.load(xp, mask=me, other=0), 0, EMU)
    v = ((_blocks(r, W, True) + MAGIC).to(tl.float32, bitcast=True) - MAGIC_F) * \
        _blocks(tl.load(xd_ptr + dp, mask=me, other=0.0), W, False)
    if FMT == Q4_0:                                              # the zero point 8: 8 * xs a block
        v -= 8.0 * _blocks(tl.load(xs_ptr + dp, mask=me, other=0.0), W, False)
    d = _blocks(d, W, False)
    if FMT == MXFP4:        # d: the e8m0 byte; 2^(e - 128) halves the doubled codebook (e8m0_half)
        res = e8m0_half(d.to(tl.int32)) * v
    else:
        res = d.to(tl.float32) * v
    return res


@triton.jit
def _h_words(h, FMT: tl.constexpr, CH: tl.constexpr):
    """h [32*CH] float32 -> its int8 copy as down's words meet it: hlo, hhi [CH*W] for down word e of the
    program's CH blocks: Q8_0 h word e; Q4_0 / MXFP4 h word 8 (e // 4) + e % 4 (low nibbles) and + 4 (high ones,
    hhi); and dx, xs [CH] per block. The blocks are `_q8_blocks`' (quantize's bits)."""
    W: tl.constexpr = 8 if FMT == Q8_0 else 4
    q, dx, xs = _q8_blocks(tl.reshape(h, [CH, 32]))
    qb = tl.reshape(q.to(tl.int32) & 0xFF, [CH, 8, 4]) << (8 * tl.arange(0, 4))[None, None, :]
    hw = tl.sum(qb, axis=2)                                       # [CH, 8] words (disjoint bytes: sum = or)
    if W == 8:
        hlo = tl.reshape(hw, [CH * 8])
        hhi = hlo
    else:
        h2 = tl.reshape(hw, [CH, 2, 4])
        half = tl.arange(0, 2)[None, :, None]
        hlo = tl.reshape(tl.sum(tl.where(half == 0, h2, 0), axis=1), [CH * 4])
        hhi = tl.reshape(tl.sum(tl.where(half == 1, h2, 0), axis=1), [CH * 4])
    return hlo, hhi, dx, xs


@triton.jit
def _down_dot(words, d, hlo, hhi, hdx, hxs, FMT: tl.constexpr, EMU: tl.constexpr):
    """Row dot products [1, BD] of the program's CH blocks of each row (words [CH*W, 1, BD], scales alike) with
    h's int8 blocks (`_h_words`), integer sums a block as _gu_terms'."""
    W: tl.constexpr = 8 if FMT == Q8_0 else 4
    if W == 4:
        if FMT == Q4_0:
            lo, hi = words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F
        else:
            lo, hi = _mxfp4_values(words, EMU)
        r = _dp4a(hi, hhi[:, None, None], _dp4a(lo, hlo[:, None, None], 0, EMU), EMU)
    else:
        r = _dp4a(words, hlo[:, None, None], 0, EMU)
    v = ((_blocks(r, W, True) + MAGIC).to(tl.float32, bitcast=True) - MAGIC_F) * hdx[:, None, None]
    if FMT == Q4_0:
        v -= 8.0 * hxs[:, None, None]
    d = _blocks(d, W, False)
    if FMT == MXFP4:
        res = e8m0_half(d.to(tl.int32)) * v
    else:
        res = d.to(tl.float32) * v
    return tl.sum(res, axis=0)


@triton.jit
def _h_of(gacc, gb_ptr, s, sgb_s, r, gu, alpha, limit, ACT: tl.constexpr, HAS_GB: tl.constexpr,
          ROUND: tl.constexpr, DFMT: tl.constexpr, CH: tl.constexpr):
    """The gate/up terms [blocks, 32*CH, 2] -> h = act(gate, up) (+ bias) rounded to x's dtype as _gate_up_kernel
    makes it, as down's int8 words (`_h_words`)."""
    g2 = tl.sum(gacc, axis=0)                                                  # [32*CH, 2]
    if HAS_GB:
        g2 += tl.load(gb_ptr + s * sgb_s + r).to(tl.float32)
    h = _act(tl.sum(tl.where(gu == 0, g2, 0.0), axis=1), tl.sum(tl.where(gu == 1, g2, 0.0), axis=1), ACT, alpha,
             limit)
    if ROUND == 1:
        h = h.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        h = h.to(tl.float16).to(tl.float32)
    return _h_words(h, DFMT, CH)


@triton.jit
def _down_add(words, d, hlo, hhi, hdx, hxs, n, wp, b_ptr, s, sb_s, c, acc_ptr, D: tl.constexpr, DFMT: tl.constexpr,
              HAS_DB: tl.constexpr, EMU: tl.constexpr):
    """acc[n] += wp * (the rows' dots with h (+ bias in chunk 0's program)), rows n [1, BD] (masked past D)."""
    y = _down_dot(words, d, hlo, hhi, hdx, hxs, DFMT, EMU)
    if HAS_DB:
        y += tl.load(b_ptr + s * sb_s + n, mask=(n < D) & (c == 0), other=0.0).to(tl.float32)
    tl.atomic_add(acc_ptr + n, wp * y, mask=n < D, sem="relaxed")


@triton.jit
def _v7_kernel(xw_ptr, xd_ptr, xs_ptr, ids_ptr, w_ptr, gq_ptr, gd_ptr, sgq_s, sgd_s, q_ptr, d_ptr, sq_s, sd_s,
               gb_ptr, sgb_s, b_ptr, sb_s, acc_ptr, cnt_ptr, out_ptr, stride_o, alpha, limit,
               sgq_n: tl.constexpr, sgd_n: tl.constexpr, sq_n: tl.constexpr, sd_n: tl.constexpr, D: tl.constexpr,
               I: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr, DFMT: tl.constexpr,
               ACT: tl.constexpr, HAS_GB: tl.constexpr, HAS_DB: tl.constexpr, CH: tl.constexpr, NB: tl.constexpr,
               BD: tl.constexpr, AHEAD: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
               EMU: tl.constexpr, ROUND: tl.constexpr):
    """grid (T*k pairs, I/(32*CH)): program (p, c) adds w[p] * (down[s][:, blocks c*CH..] . q8(h)) (+ w[p] * bias)
    into acc[t], h = act(gate_up[s] rows of those blocks . x[t]) (module doc); the last of token t's programs
    writes out[t] and zeros acc[t]. gq/gd: gate_up's q words and d (MXFP4: e) planes and (slot, row) strides;
    q/d: down's (row strides constexpr: sm_90 Q4_0 default tile 8 B of spills with them as arguments, none so).
    Loads: one stream of pieces (gate/up NB blocks, then down BD rows), AHEAD of the math; EARLY
    (BD >= D): the down rows loaded first instead, held through the gate/up pieces."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0)
    c = tl.program_id(1)
    t = (p // KTOP).to(tl.int64)
    s = tl.load(ids_ptr + p).to(tl.int64)
    if s >= 0:
        NP: tl.constexpr = (D // 32 + NB - 1) // NB
        NQ: tl.constexpr = NP if EARLY else NP + (D + BD - 1) // BD
        gu = tl.arange(0, 2)[None, :]
        r = (c * (32 * CH) + tl.arange(0, 32 * CH)).to(tl.int64)[:, None] + gu * I   # [32*CH, 2]: gate, up rows
        rq = s * sgq_s + r * sgq_n
        rd = s * sgd_s + r * sgd_n
        nr = tl.arange(0, BD)[None, :]                                             # [1, BD]: a down piece's rows
        aw, ad = _v7_piece(0, NP, gq_ptr, gd_ptr, rq, rd, q_ptr, d_ptr, s, sq_s, sq_n, sd_s, sd_n, nr, c, D, I,
                           FMT, DFMT, NB, BD, CH)
        if EARLY:
            ew, ed = _v7_piece(NP, NP, gq_ptr, gd_ptr, rq, rd, q_ptr, d_ptr, s, sq_s, sq_n, sd_s, sd_n, nr, c, D, I,
                               FMT, DFMT, NB, BD, CH)
        if AHEAD >= 2 and NQ >= 2:
            bw, bs = _v7_piece(1, NP, gq_ptr, gd_ptr, rq, rd, q_ptr, d_ptr, s, sq_s, sq_n, sd_s, sd_n, nr, c, D, I,
                               FMT, DFMT, NB, BD, CH)
        if PDL:
            tl.extra.cuda.gdc_wait()
        xwo = tl.zeros([1, 1], dtype=tl.int64) + t * (D // 4)
        xdo = tl.zeros([1, 1], dtype=tl.int64) + t * (D // 32)
        gacc = tl.zeros([NB, 32 * CH, 2], dtype=tl.float32)
        wp = tl.load(w_ptr + p).to(tl.float32)
        ap = acc_ptr + t * D
        for j in tl.static_range(NQ):
            cw, cd = aw, ad                                                         # piece j
            if AHEAD >= 2:                                                         # pieces j+1, j+2 in flight
                if j + 1 < NQ:
                    aw, ad = bw, bs
                if j + 2 < NQ:
                    bw, bs = _v7_piece(j + 2, NP, gq_ptr, gd_ptr, rq, rd, q_ptr, d_ptr, s, sq_s, sq_n, sd_s, sd_n,
                                       nr, c, D, I, FMT, DFMT, NB, BD, CH)
            elif j + 1 < NQ:
                aw, ad = _v7_piece(j + 1, NP, gq_ptr, gd_ptr, rq, rd, q_ptr, d_ptr, s, sq_s, sq_n, sd_s, sd_n, nr,
                                   c, D, I, FMT, DFMT, NB, BD, CH)
            if j < NP:
                gacc += _gu_terms(cw, cd, j * NB, D // 32, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB, EMU)
            else:
                if j == NP:
                    hlo, hhi, hdx, hxs = _h_of(gacc, gb_ptr, s, sgb_s, r, gu, alpha, limit, ACT, HAS_GB, ROUND, DFMT,
                                               CH)
                _down_add(cw, cd, hlo, hhi, hdx, hxs, nr + (j - NP) * BD, wp, b_ptr, s, sb_s, c, ap, D, DFMT, HAS_DB,
                          EMU)
        if EARLY:
            hlo, hhi, hdx, hxs = _h_of(gacc, gb_ptr, s, sgb_s, r, gu, alpha, limit, ACT, HAS_GB, ROUND, DFMT, CH)
            _down_add(ew, ed, hlo, hhi, hdx, hxs, nr, wp, b_ptr, s, sb_s, c, ap, D, DFMT, HAS_DB, EMU)
    elif PDL:
        tl.extra.cuda.gdc_wait()
    tl.debug_barrier()                      # every thread's atomics happen before the release below
    cnt = cnt_ptr + t
    if tl.atomic_add(cnt, 1, sem="acq_rel") == KTOP * (I // (32 * CH)) - 1:    # the token's last: all visible
        tl.atomic_xchg(cnt, 0)
        for jp in tl.static_range((D + BD - 1) // BD):
            n = jp * BD + tl.arange(0, BD)
            o = acc_ptr + t * D + n
            v = tl.load(o, mask=n < D, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + t * stride_o + n, v.to(out_ptr.dtype.element_ty), mask=n < D)
            tl.store(o, tl.zeros([BD], dtype=tl.float32), mask=n < D)


_accs: dict = {}
_kept: list = []


def accumulator(device, n: int) -> torch.Tensor:
    """A float32 buffer of at least n zeros on `device`, zeroed once: each v7 launch leaves the rows it used zero
    again (its last programs), so CUDA-graph replays start from zeros too. One per device, grown to a power of two
    when a launch needs more (warm-up calls come before a capture); an outgrown buffer is kept, since a captured
    graph may still point at it. Launches on one device must not overlap (one decode stream)."""
    key = (device.type, device.index)
    a = _accs.get(key)
    if a is None or a.numel() < n:
        a = _accs[key] = torch.zeros(1 << max(0, n - 1).bit_length(), dtype=torch.float32, device=device)
        _kept.append(a)
    return a


def supports(gate_up, down, k: int) -> bool:
    """v7 reads FORMATS (each projection its own), in 32-blocks: I and D multiples of 32."""
    i, d = down.k, down.n
    return (gate_up.fmt in FORMATS and down.fmt in FORMATS and k >= 1 and gate_up.n == 2 * i and gate_up.k == d
            and i % 32 == 0 and d % 32 == 0)


def moe_v7(x, ids, wt, gate_up, down, act: int, alpha: float, limit: float, biases, out, cfg=None,
           pdl: bool = False) -> torch.Tensor:
    """out [T, D] = sum_j wt[t, j] * (down[ids[t, j]] @ q8(act(gate_up[ids[t, j]] @ q8(x[t])) (+ bias)) (+ bias));
    ids, wt flat [T*k] (supports). Two launches (x's quantizer, the pair), no host sync. cfg: a V7Tile (TILES)."""
    t, d = x.shape
    k, i = ids.numel() // t, down.k
    tile = V7Tile(*(cfg or TILES[gate_up.fmt]))
    ch = tile.ch if (i // 32) % tile.ch == 0 else 1
    bd = min(tile.bd, triton.next_power_of_2(d))
    early = tile.early and bd >= d
    chain = pdl and PDL_CHAIN
    xq, xd, xs = quantize(x, wait=chain, trigger=2 if chain else pdl)
    gb, db = biases
    gp, dp = _planes(gate_up), _planes(down)                # q, d planes; their (slot, row) strides at 6..9
    _v7_kernel[(t * k, i // (32 * ch))](
        xq.view(torch.int32), xd, xs, ids, wt, gp[0], gp[1], gp[6], gp[8], dp[0], dp[1], dp[6], dp[8],
        gb if gb is not None else xd, gb.stride(0) if gb is not None else 0,
        db if db is not None else xd, db.stride(0) if db is not None else 0,
        accumulator(x.device, t * d), arrival_counters(x.device, t, "v7"), out, out.stride(0), alpha, limit,
        sgq_n=gp[7], sgd_n=gp[9], sq_n=dp[7], sd_n=dp[9], D=d, I=i, KTOP=k, FMT=gate_up.code, DFMT=down.code,
        ACT=act, HAS_GB=gb is not None, HAS_DB=db is not None, CH=ch, NB=min(tile.nb, triton.next_power_of_2(d // 32)),
        BD=bd, AHEAD=tile.ahead, EARLY=early, PDL=pdl, TRIGGER=pdl and PDL_CHAIN, EMU=_emulate(),
        ROUND=ROUND.get(x.dtype, 0), num_warps=tile.warps, **({"maxnreg": tile.maxnreg} if tile.maxnreg else {}),
        **({"launch_pdl": True} if pdl else {}))
    return out
