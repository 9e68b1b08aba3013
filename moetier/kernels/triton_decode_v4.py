"""Decode kernels, variant "v4" (Q4_0 / Q8_0, one token): the whole MoE layer in ONE persistent launch.

Why (H200, Qwen3-30B-A3B T=1, CUDA-graph replays): v2/v3 run two launches per layer, gate_up ~12 us
(1.17 TB/s) and down 12-16 us (0.43-0.58 TB/s) against 4.25 TB/s HBM copy. Both are latency-bound:
each program holds a few KB in flight (registers cap programs per SM), and the down kernel cannot load
a byte before gate_up has finished. v4:
  - a persistent grid of P <= #SMs programs (8 warps, one per SM, all co-resident: required by the
    barrier); phase 1 (gate_up + SwiGLU) and phase 2 (down + weighted sum over the k experts)
    separated by a grid-wide barrier instead of a kernel boundary;
  - phase 1 items (expert j, BI intermediate rows): the BI gate rows and the BI matching up rows of
    slot ids[j], the whole K = D in one load (Q4_0 BI=16, Q8_0 BI=8: 32 KB per item); a program takes
    items pid, pid+P, ... and issues the next item's loads before the current item's math; h =
    silu(g) * u rounded to x's dtype, stored as float32 into hbuf [k, I];
  - before its last phase-1 item's math (so before the barrier), each program issues the loads of its
    first chunk of down weights: they overlap phase 1's tail and the barrier;
  - the barrier: a generation counter in `sync` (int32 [cnt, gen, err, -]; scalar atomics run once per
    program): arrive with an acq_rel add on cnt, the last arriver resets cnt and bumps gen (release),
    the others spin on an acquire read of gen; bounded (SPIN_LIMIT polls), after which the program sets
    err, poisons its outputs with NaN and goes on instead of hanging. hbuf is read after it with ".cg"
    (L2; never a stale L1 line);
  - phase 2 (deterministic, no atomics): program p owns BR output rows for ALL k experts, tiles
    [words, KC experts, BR rows] in chunks of KC experts (chunk c+1's loads issued before chunk c's
    math), out[r] = sum_j w[j] * (down_j row r . h[j]).
The weight math is v3's (triton_decode module doc; word axis first, the bit tricks, one accumulator per
word starting at its zero-point term). A skipped expert (ids < 0) loads nothing (slot clamped to 0,
masked) and contributes 0 in both phases. PHASES: 3 = both phases and the barrier (CUDA); 1 / 2 = one
phase, no barrier (the interpreter runs programs one after another, so a spin barrier would deadlock:
the launcher runs PHASES=1 then PHASES=2 there, the same code).
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
    _v3_bload,
    v3_pieces,
)

V4_FORMATS = ("Q8_0", "Q4_0")
ITEM_ROWS = {"Q4_0": 16, "Q8_0": 8}          # BI: 2*BI rows x D per phase-1 item (32 KB at D = 2048)
CHUNK_BYTES = 48 * 1024                       # phase 2: quant bytes per chunk of experts in flight
# (Qwen3-30B-A3B, P=132: Q4_0 all 8 experts in one chunk, Q8_0 2 chunks of 4; sm_90 compile: 255
# registers, no spills either way)
H_CG = True     # h read with ".cg"; the acquire poll already invalidates L1 (CCTL.IVALL), so False is also correct
SPIN_LIMIT = 1 << 26                          # barrier polls before a program gives up (err flag)
SYNC_LEN = 4                                  # int32 [cnt, gen, err, unused] per call


@triton.jit
def _wload(q_ptr, d_ptr, rq, rd, mask, g0, NBK, FMT: tl.constexpr, NB: tl.constexpr):
    """Words [NB*W, A, B] of step blocks g0 .. g0+NB (of NBK) of rows [A, B] (masked: 0) and their block
    scales in the same shape (unmasked: rows and slot clamped in bounds; callers mask the sums)."""
    W: tl.constexpr = 4 if FMT == Q4_0 else 8
    e = g0 * W + tl.arange(0, NB * W)
    m3 = (e < NBK * W)[:, None, None] & mask[None, :, :]
    words = tl.load(q_ptr + rq[None, :, :] + e[:, None, None], mask=m3, other=0, eviction_policy="evict_first")
    return words, _v3_bload(d_ptr, rd, g0, NB, W, 1, 0, NBK)


@triton.jit
def _wmath(words, d, g0, NBK, x_ptr, xo, one, FMT: tl.constexpr, NB: tl.constexpr, CG: tl.constexpr):
    """Row dot products [A, B] of _wload's blocks with float x at offsets xo (broadcast over rows): v3's
    math (triton_decode._v3_math) with x loaded through L2 (".cg") when CG (h written by other SMs)."""
    W: tl.constexpr = 4 if FMT == Q4_0 else 8
    e = g0 * W + tl.arange(0, NB * W)
    xe = (e // 4) * 32 + (e % 4) * 4 if FMT == Q4_0 else e * 4
    xb = tl.broadcast_to(x_ptr + xo[None, :, :] + xe[:, None, None], words.shape)
    me = tl.broadcast_to((e < NBK * W)[:, None, None], words.shape)
    CM: tl.constexpr = ".cg" if CG else ""
    p = tl.zeros(words.shape, dtype=tl.float32)
    if FMT == Q4_0:         # sum (q - 8) x = 256 (p - sum(33/32 x_lo + 3/32 x_hi)), high nibbles read / 16
        one16 = one - 0x2000000
        for b in tl.static_range(4):
            x_lo = tl.load(xb + b, mask=me, other=0.0, cache_modifier=CM).to(tl.float32)
            x_hi = tl.load(xb + (b + 16), mask=me, other=0.0, cache_modifier=CM).to(tl.float32)
            t = _shift(words, 15 - 8 * b)
            p += _f(t & 0x78000, one) * x_lo - 1.03125 * x_lo
            p += _f(t & 0x780000, one16) * x_hi - 0.09375 * x_hi
    else:                   # Q8_0: f = 1 + (q + 128) / 256, sum q x = 256 (p - 1.5 sum x)
        one8 = one | 0x400000
        for b in tl.static_range(4):
            x = tl.load(xb + b, mask=me, other=0.0, cache_modifier=CM).to(tl.float32)
            p += (_field(words, 15 - 8 * b, 0x7F8000) ^ one8).to(tl.float32, bitcast=True) * x - 1.5 * x
    return 256.0 * tl.sum(d.to(tl.float32) * p, axis=0)


@triton.jit
def _item(it, ids_ptr, I: tl.constexpr, KTOP: tl.constexpr, BI: tl.constexpr):
    """Phase-1 item it -> expert j, rows n [BI], slot (clamped to 0), gate/up rows r [BI, 2] (in
    bounds) and the mask [BI, 2] (item exists, expert not skipped, row < I)."""
    NIB: tl.constexpr = (I + BI - 1) // BI
    valid = it < KTOP * NIB
    j = it // NIB
    n = (it % NIB) * BI + tl.arange(0, BI)
    s = tl.load(ids_ptr + j, mask=valid, other=-1).to(tl.int64)
    gu = tl.arange(0, 2)[None, :]
    r = tl.minimum(n, I - 1).to(tl.int64)[:, None] + gu * I
    mask = ((n < I) & valid & (s >= 0))[:, None] & (gu >= 0)
    return j, n, tl.maximum(s, 0), r, mask, valid


@triton.jit
def _item_load(it, ids_ptr, q_ptr, d_ptr, sq_s, sq_n, sd_s, sd_n, I: tl.constexpr, D: tl.constexpr,
               KTOP: tl.constexpr, FMT: tl.constexpr, BS: tl.constexpr, BI: tl.constexpr,
               NB1: tl.constexpr, NB2: tl.constexpr):
    """All weight loads of phase-1 item it (both K pieces; NB2 = 0: a dummy second piece)."""
    _j, _n, s, r, mask, _valid = _item(it, ids_ptr, I, KTOP, BI)
    wa, da = _wload(q_ptr, d_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n, mask, 0, D // BS, FMT, NB1)
    if NB2 > 0:
        wb, db = _wload(q_ptr, d_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n, mask, NB1, D // BS, FMT, NB2)
    else:
        wb, db = tl.zeros([1, 1, 1], dtype=tl.int32), tl.zeros([1, 1, 1], dtype=d_ptr.dtype.element_ty)
    return wa, da, wb, db


@triton.jit
def _item_math(it, wa, da, wb, db, ids_ptr, x_ptr, h_ptr, one, I: tl.constexpr, D: tl.constexpr,
               KTOP: tl.constexpr, FMT: tl.constexpr, BS: tl.constexpr, BI: tl.constexpr,
               NB1: tl.constexpr, NB2: tl.constexpr):
    """h[j, n] = silu(gate) * up of item it, rounded to x's dtype, stored as float32 (a skipped expert:
    0; a non-existent item stores nothing)."""
    j, n, _s, _r, mask, valid = _item(it, ids_ptr, I, KTOP, BI)
    xo = tl.zeros([1, 1], dtype=tl.int64)
    acc = _wmath(wa, da, 0, D // BS, x_ptr, xo, one, FMT, NB1, False)
    if NB2 > 0:
        acc += _wmath(wb, db, NB1, D // BS, x_ptr, xo, one, FMT, NB2, False)
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
def _chunk_load(c, pid, ids_ptr, q_ptr, d_ptr, sq_s, sq_n, sd_s, sd_n, I: tl.constexpr, D: tl.constexpr,
                KTOP: tl.constexpr, FMT: tl.constexpr, BS: tl.constexpr, KC: tl.constexpr, BR: tl.constexpr,
                NB1: tl.constexpr, NB2: tl.constexpr):
    _j, s, r, mask, _n = _chunk(c, pid, ids_ptr, I, D, KTOP, KC, BR)
    wa, da = _wload(q_ptr, d_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n, mask, 0, I // BS, FMT, NB1)
    if NB2 > 0:
        wb, db = _wload(q_ptr, d_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n, mask, NB1, I // BS, FMT, NB2)
    else:
        wb, db = tl.zeros([1, 1, 1], dtype=tl.int32), tl.zeros([1, 1, 1], dtype=d_ptr.dtype.element_ty)
    return wa, da, wb, db


@triton.jit
def _chunk_math(c, pid, wa, da, wb, db, ids_ptr, w_ptr, h_ptr, one, I: tl.constexpr, D: tl.constexpr,
                KTOP: tl.constexpr, FMT: tl.constexpr, BS: tl.constexpr, KC: tl.constexpr, BR: tl.constexpr,
                NB1: tl.constexpr, NB2: tl.constexpr, HCG: tl.constexpr):
    """[BR] sum over chunk c's experts of w[j] * (down_j rows . h[j]); h read through L2 (HCG)."""
    j, _s, _r, mask, _n = _chunk(c, pid, ids_ptr, I, D, KTOP, KC, BR)
    xo = (tl.minimum(j, KTOP - 1).to(tl.int64) * I)[:, None]
    acc = _wmath(wa, da, 0, I // BS, h_ptr, xo, one, FMT, NB1, HCG)
    if NB2 > 0:
        acc += _wmath(wb, db, NB1, I // BS, h_ptr, xo, one, FMT, NB2, HCG)
    wj = tl.load(w_ptr + j, mask=j < KTOP, other=0.0).to(tl.float32)
    return tl.sum(tl.where(mask, acc, 0.0) * wj[:, None], axis=0)


@triton.jit
def _grid_barrier(sync_ptr, P, SPIN: tl.constexpr):
    """All P programs arrive before any leaves (generation counter: sync = [cnt, gen, err]). Scalar
    atomics: one thread per program, the result broadcast to all. Returns False if this program gave
    up after SPIN polls (err set)."""
    tl.debug_barrier()                                   # every thread's h stores precede the arrive
    g0 = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
    a = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
    polls = a * 0
    if a == P - 1:                                       # last to arrive: reset, open the next generation
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    else:
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
    items pid, pid+P, .. (G1 + G2 blocks of D per row; NT steps, a program's missing last item masked), hbuf h [k, I] float32, the barrier, phase 2
    output rows [pid*BR, +BR) in chunks of KC experts (N1 + N2 blocks of I per row)."""
    pid = tl.program_id(0)
    NC: tl.constexpr = (KTOP + KC - 1) // KC
    NITEMS: tl.constexpr = KTOP * ((I + BI - 1) // BI)
    if PHASES != 2:
        NT: tl.constexpr = (NITEMS + P - 1) // P                             # items of program 0 (others: NT or NT - 1)
        wa, da, wb, db = _item_load(pid, ids_ptr, gq_ptr, gd_ptr, gsq_s, gsq_n, gsd_s, gsd_n, I, D, KTOP, FMT,
                                    BS, BI, G1, G2)
        for t in range(1, NT):                                            # software pipeline
            na, nda, nb, ndb = _item_load(pid + t * P, ids_ptr, gq_ptr, gd_ptr, gsq_s, gsq_n, gsd_s, gsd_n, I, D,
                                          KTOP, FMT, BS, BI, G1, G2)
            _item_math(pid + (t - 1) * P, wa, da, wb, db, ids_ptr, x_ptr, h_ptr, one, I, D, KTOP, FMT, BS, BI, G1, G2)
            wa, da, wb, db = na, nda, nb, ndb
    if PHASES != 1:                              # down weights of chunk 0: in flight over phase 1's tail
        ca, cda, cb, cdb = _chunk_load(0, pid, ids_ptr, dq_ptr, dd_ptr, dsq_s, dsq_n, dsd_s, dsd_n, I, D, KTOP, FMT,
                                       BS, KC, BR, N1, N2)
    if PHASES != 2:
        _item_math(pid + (NT - 1) * P, wa, da, wb, db, ids_ptr, x_ptr, h_ptr, one, I, D, KTOP, FMT, BS, BI, G1, G2)
    if PHASES == 3:
        ok = _grid_barrier(sync_ptr, P, SPIN)
    if PHASES != 1:
        y = tl.zeros([BR], dtype=tl.float32)
        for c in tl.static_range(NC):
            if c + 1 < NC:
                na, nda, nb, ndb = _chunk_load(c + 1, pid, ids_ptr, dq_ptr, dd_ptr, dsq_s, dsq_n, dsd_s, dsd_n, I, D,
                                               KTOP, FMT, BS, KC, BR, N1, N2)
            y += _chunk_math(c, pid, ca, cda, cb, cdb, ids_ptr, w_ptr, h_ptr, one, I, D, KTOP, FMT, BS, KC, BR, N1,
                             N2, HCG)
            if c + 1 < NC:
                ca, cda, cb, cdb = na, nda, nb, ndb
        if PHASES == 3:
            y = tl.where(ok, y, float("nan"))                               # gave up at the barrier: poison
        n = pid * BR + tl.arange(0, BR)
        tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < D)


# ------------------------------------------------------------------ launcher
def supports(x, gate_up, down, act: int, biases) -> bool:
    """v4 reads one token, Q4_0 / Q8_0 (both projections in the same one), SwiGLU, no biases."""
    return (x.shape[0] == 1 and gate_up.fmt in V4_FORMATS and down.fmt == gate_up.fmt and act == 0
            and not any(b is not None for b in biases or ()) and x.stride(-1) == 1)


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
          "BR": br, "N1": n1, "N2": n2, "SPIN": SPIN_LIMIT, "HCG": H_CG, "num_warps": 8}
    if x.is_cuda:
        _moe_v4_kernel[(p,)](*args, PHASES=3, **kw)
        if (os.environ.get("MOETIER_V4_CHECK") == "1" and not torch.cuda.is_current_stream_capturing()
                and sync[2].item()):
            raise RuntimeError(f"v4 decode: a program gave up at the grid barrier ({p} programs not co-resident?)")
    else:
        _moe_v4_kernel[(p,)](*args, PHASES=1, **kw)
        _moe_v4_kernel[(p,)](*args, PHASES=2, **kw)
    return out
