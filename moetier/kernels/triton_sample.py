"""The CUDA sampler's draw in two Triton launches and one torch.topk (opt-in: MOETIER_SAMPLER=triton; the default is
runtime.sampling.device_draw, ~40 small kernels a token in its graph).

_prep: rows of COLS logits a program: the penalties (repetition over the seen tokens, frequency / presence over
       the output counts), the temperature, -inf past V; each row's max and sum of exp (float64) for top-p's
       normaliser over all V.
torch.topk of each row (one block a row): its M largest.
_draw: one program: the R x M winners sorted (value descending, then id ascending) as int64 keys; top-k (every
       logit >= the k-th), top-p (float64 probabilities over all V or the top-k survivors, the mass ranked above a
       token already >= p drops it), min-p (in logits); the flag that the filters dropped the KC-th candidate (the
       set is whole); the Gumbel-max draw from tl.rand at a per-sampler counter the kernel advances (a seed gives
       the same tokens; the graph replays draw anew). Out: int64 [3] = token, drawable, whole (device_draw's).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

COLS_TOPK, COLS_TOPP = 2048, 8192     # _prep's row: top-k keeps top_k + 1 a row, top-p alone DEVICE_NUCLEUS
MAX_TOPK = 63                           # beyond: device_draw (the draw program sorts at most 8,192 keys)


@triton.jit
def _prep(x_ptr, seen_ptr, cnt_ptr, out_ptr, pmax_ptr, psum_ptr, V, t, rep, freq, pres, HAS_REP: tl.constexpr,
          HAS_FP: tl.constexpr, COLS: tl.constexpr):
    r = tl.program_id(0)
    i = r.to(tl.int64) * COLS + tl.arange(0, COLS)
    m = i < V
    x = tl.load(x_ptr + i, mask=m, other=float("-inf"))
    if HAS_REP:
        seen = tl.load(seen_ptr + i, mask=m, other=0) != 0
        x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    if HAS_FP:
        c = tl.load(cnt_ptr + i, mask=m, other=0.0)
        x = x - freq * c - pres * (c > 0).to(tl.float32)
    x = tl.where(m, x / t, float("-inf"))
    tl.store(out_ptr + i, x)
    mx = tl.max(x, axis=0)
    shift = tl.where(mx > float("-inf"), mx, 0.0).to(tl.float64)       # a row of -inf only: sum 0
    s = tl.sum(tl.where(m, tl.exp(x.to(tl.float64) - shift), 0.0), axis=0)
    tl.store(pmax_ptr + r, mx)
    tl.store(psum_ptr + r, s)


@triton.jit
def _key(v, gid):
    """(value, id) -> an int64 whose descending order is the value's descending order, then the id's ascending one."""
    b = v.to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)                    # float order as signed integers
    return (b.to(tl.int64) << 32) | (0xFFFFFFFF - gid)


@triton.jit
def _draw(val_ptr, col_ptr, pmax_ptr, psum_ptr, seed_ptr, out_ptr, R, M, V, top_k, top_p, log_min_p, KC,
          COLS: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, HAS_MINP: tl.constexpr,
          BLOCK: tl.constexpr, RB: tl.constexpr):
    j = tl.arange(0, BLOCK)
    ok = j < R * M
    v = tl.load(val_ptr + j, mask=ok, other=float("-inf"))
    gid = (j // M).to(tl.int64) * COLS + tl.load(col_ptr + j, mask=ok, other=0)
    key = tl.where(ok, _key(v, gid), -9223372036854775807 - 1)
    key = tl.sort(key, descending=True)
    b = (key >> 32).to(tl.int32)
    v = (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    gid = 0xFFFFFFFF - (key & 0xFFFFFFFF)
    drop = j >= KC
    if HAS_TOPK:
        kth = tl.max(tl.where(j == top_k - 1, v, float("-inf")), axis=0)
        drop = drop | (v < kth)
    if HAS_TOPP:
        vd = v.to(tl.float64)
        if HAS_TOPK:
            m0 = tl.max(tl.where(drop, float("-inf"), vd), axis=0)
            lse = m0 + tl.log(tl.sum(tl.where(drop, 0.0, tl.exp(vd - m0)), axis=0))
        else:
            r = tl.arange(0, RB)
            pm = tl.load(pmax_ptr + r, mask=r < R, other=float("-inf")).to(tl.float64)
            mx = tl.max(pm, axis=0)
            ps = tl.load(psum_ptr + r, mask=r < R, other=0.0)
            lse = mx + tl.log(tl.sum(ps * tl.exp(pm - mx), axis=0))
        p = tl.where(drop, 0.0, tl.exp(vd - lse))
        before = tl.cumsum(p, 0) - p                    # the mass ranked above each
        drop = drop | ((before >= top_p) & (j > 0))
    if HAS_MINP:
        v0 = tl.max(tl.where(j == 0, v, float("-inf")), axis=0)
        drop = drop | (v < v0 + log_min_p)
    whole = tl.where(KC < V, tl.max(tl.where(j == KC - 1, drop.to(tl.int32), 0), axis=0), 1)
    seed = tl.load(seed_ptr)
    u = tl.rand(seed, j)
    score = tl.where(drop, float("-inf"), v - tl.log(-tl.log(u)))    # Gumbel-max: v + G, G = -log(-log u)
    best = tl.max(score, axis=0)
    pick = tl.min(tl.where(score == best, j, BLOCK), axis=0)
    tok = tl.sum(tl.where(j == pick, gid, 0), axis=0)
    tl.store(out_ptr, tok)
    tl.store(out_ptr + 1, ((best > float("-inf")) & (best < float("inf"))).to(tl.int64))
    tl.store(out_ptr + 2, whole.to(tl.int64))
    tl.store(seed_ptr, seed + 1)


def supported(p, vocab: int) -> bool:
    """The Triton draw serves these parameters: sampled (not greedy) with top-k (within MAX_TOPK) or top-p; the
    others (temperature alone, min-p alone) are few kernels in device_draw already."""
    top_k = p.top_k if p.top_k and p.top_k < vocab else 0
    return p.temperature > 0 and top_k <= MAX_TOPK and bool(top_k or p.top_p < 1.0)


def triton_draw(logits, seen, counts, p, seed: torch.Tensor, nucleus: int) -> torch.Tensor:
    """device_draw's result (int64 [3]: token, drawable, whole) for parameters `supported` takes; `seed` an int64 [1]
    counter the draw advances. No host sync, static shapes: capturable."""
    v = logits.shape[-1]
    top_k = p.top_k if p.top_k and p.top_k < v else 0
    cols = COLS_TOPK if top_k else COLS_TOPP
    r = -(-v // cols)
    kc = min(v, top_k + 1 if top_k else nucleus)
    m = min(cols, kc)
    rows = torch.empty(r * cols, dtype=torch.float32, device=logits.device)
    pmax = torch.empty(r, dtype=torch.float32, device=logits.device)
    psum = torch.empty(r, dtype=torch.float64, device=logits.device)
    rep = p.repetition_penalty
    _prep[(r,)](logits, seen, counts, rows, pmax, psum, v, p.temperature, rep, p.frequency_penalty,
                p.presence_penalty, HAS_REP=rep != 1.0, HAS_FP=bool(p.frequency_penalty or p.presence_penalty),
                COLS=cols)
    vals, idx = torch.topk(rows.view(r, cols), m, dim=-1)
    out = torch.empty(3, dtype=torch.int64, device=logits.device)
    _draw[(1,)](vals, idx, pmax, psum, seed, out, r, m, v, top_k, p.top_p,
                math.log(p.min_p) if p.min_p > 0.0 else 0.0, kc, COLS=cols, HAS_TOPK=bool(top_k),
                HAS_TOPP=p.top_p < 1.0, HAS_MINP=p.min_p > 0.0, BLOCK=triton.next_power_of_2(r * m),
                RB=triton.next_power_of_2(r), num_warps=8)
    return out
