"""Decode variant "v5half" (opt-in, issue #4): v5q's pair in two halves whose dependency chains overlap.

Why: the v5q pair (x quantizer, gate_up with h's int8 copy, down) costs ~4 us more than one read-only launch of
its bytes, and neither down's reads (L2 prefetch, session 18) nor the quantizer launches were that cost: down waits
for the whole of gate_up, then does its math (docs/perf-log.md, sessions 13-18). Here down's dependency is cut in
two, so that most of down's math runs while gate_up's last rows still stream, and the math left after the last
gate_up row is a third of down's.

The split is along h's I axis, at down's two K pieces (v3_pieces: I = 768 is 512 + 256 elements in every v5
format), not along the k experts: down already sums a row's dot as (first piece) + (second piece), so a launch for
each piece adds the same two float32 values and the result is bit-equal to v5q at equal tiles, on the GPU too (a
split of the k experts would change the order of the k-lane sum, which on the GPU follows the tile's register
layout). Four launches after the x quantizer, each a programmatic dependent of the one before (PDL, sm_90):
  1. gate_up, h's rows of the first piece (A)   weight loads, wait (x), trigger: its dependents are scheduled
                                                 once x is written, so launch 3 may read x without waiting
  2. down over the first piece of h (A)         trigger; loads; wait (1: h(A)); the dots of A -> part (float32)
  3. gate_up, the rows of the second piece (B)  trigger; loads and math with no wait before (x, ids written before
                                                 launch 1's wait); a wait at its end, so its end implies 2's
  4. down over the second piece (B)             trigger; loads; wait (3, hence 2: h(B) and part); part + B's dots,
                                                 bias, the weighted sum over the experts, out
PDL's wait is for the whole grid before, hence this order: down(A) as a dependent of a grid holding all of
gate_up would wait for gate_up(B) too, and launch 3 holds no wait before its math, so its rows stream while
down(A) computes. Tiles: A at v5q's gate_up tile (Qwen3-30B-A3B Q4_0: 128 programs of 32 rows, one wave on 132
SMs); B at v5pdl's small tile (4 or 8 rows, h quantized by the last program of a 32-block), whose programs fit
beside down(A)'s; down at v5q's tile for both pieces.
"""
from __future__ import annotations

import torch

from . import triton_decode_q8 as q8
from .triton_decode import STEP_BLOCK, Tile, v3_pieces

# the second half's gate_up tile: v5pdl's (rows dividing 32: the counters' h quantizer)
GATE_UP_B = q8.GATE_UP5


def first_rows(w_down) -> int:
    """h's rows of the first half: down's first K piece (0: a power-of-two number of step blocks, no split)."""
    nb1, nb2 = v3_pieces(w_down.k, w_down.fmt)
    return nb1 * STEP_BLOCK[w_down.fmt] if nb2 else 0


def tiles(fmt: str, cfg_gate_up=None) -> tuple[Tile, Tile]:
    """gate_up tiles (A, B): cfg_gate_up one tile for both halves or a pair (A, B); None the shipped ones."""
    if cfg_gate_up is not None and isinstance(cfg_gate_up[0], (tuple, list)):
        return tuple(Tile(*c[:4]) for c in cfg_gate_up)
    if cfg_gate_up is not None:
        return Tile(*cfg_gate_up[:4]), Tile(*cfg_gate_up[:4])
    return Tile(*q8.GATE_UP5Q.get(fmt, q8.GATE_UP5[fmt])[:4]), Tile(*GATE_UP_B[fmt][:4])


def supports(w_gate_up, w_down, d: int, cfg_gate_up=None) -> bool:
    """Both projections in v5's formats, down's K in two pieces, h quantized by both halves' tiles, and the first
    half's tile ending at the split."""
    if not (q8.supports(w_gate_up, d) and q8.supports(w_down, w_down.k) and first_rows(w_down)):
        return False
    a, b = tiles(w_gate_up.fmt, cfg_gate_up)
    return q8.h_quantizer(a.bn) > 0 and q8.h_quantizer(b.bn) > 0 and first_rows(w_down) % a.bn == 0


def moe_half(x, ids, w, gate_up, down, act: int, alpha: float, limit: float, biases, out, pdl: bool,
             cfg_gate_up=None, cfg_down=None) -> torch.Tensor:
    """As triton_moe.moe_decode's v5q (supports): x [T, D], ids / w flat [T*k] -> out [T, D], in the four launches
    above (PDL where pdl)."""
    t = x.shape[0]
    k, i = ids.numel() // t, down.k
    n1 = first_rows(down)
    ta, tb = tiles(gate_up.fmt, cfg_gate_up)
    tile_dn = Tile(*(cfg_down or q8.DOWN5[down.fmt])[:4])
    rnd = q8.ROUND.get(x.dtype, 0)
    h = torch.empty(t * k, i, dtype=torch.float32, device=x.device)
    hx = q8.h_int8(h)
    part = torch.empty(t * k, out.shape[1], dtype=torch.float32, device=x.device)     # down(A)'s dots
    xq = q8.quantize_x(x, pdl)
    gu = (xq, ids, gate_up, act, alpha, limit, biases[0], h, hx)
    q8.launch_gate_up(*gu, ta, q8.h_quantizer(ta.bn), pdl, rnd, 0, n1, split=1)
    q8.launch_down(hx, ids, w, down, biases[1], out, tile_dn, pdl, part, split=1)
    q8.launch_gate_up(*gu, tb, q8.h_quantizer(tb.bn), pdl, rnd, n1, i - n1, split=2)
    return q8.launch_down(hx, ids, w, down, biases[1], out, tile_dn, pdl, part, split=2)
