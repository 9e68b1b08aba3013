"""Decode GEMV kernels, variant "v5": int8 activations and integer dot products (dp4a) for Q8_0 / Q4_0 / Q4_K /
Q5_K / Q6_K / MXFP4 / IQ3_XXS / IQ2_XXS / Q2_K / Q3_K.

Why (H200, Qwen3-30B-A3B layer, T=1, session 8): v3 reads Q4_0 at 21% of HBM (gate_up 12.2 us, down 12.2 us
for half of Q8_0's bytes) and Q8_0 at 49%: the float math is the limit, not the memory. v3 spends per 4-bit
weight a shift share, a LOP3 and an FFMA plus one 4-byte x gather from L1 per element; Q4_0 down (x = h in
float32, 8 experts per program) is the worst. As llama.cpp's MMVQ does, x is quantized to int8 per 32-block
(scale dx = max|x| / 127, q = round(x / dx), like its q8_1), and a weight word meets an x word in one
`dp4a` (4 int8 products summed into an int32):
  - Q8_0 word (4 weights): r = dp4a(w, xw, MAGIC); v = float(r) - 1.5 * 2^23 (MAGIC: the bits of 1.5 * 2^23, so
    the int32 sum lands in the mantissa: no I2F); acc += d * (v * dx);
  - Q4_0 word (8 weights: the low nibbles are elements 4w..4w+3 of the block, the high ones + 16): lo = w &
    0x0F0F0F0F, hi = (w >> 4) & 0x0F0F0F0F, r = dp4a(hi, xh, dp4a(lo, xl, MAGIC)); the zero point 8 comes off
    per block with the block's sum of q (xs = dx * sum(q): 8 xs a block);
  - Q4_K word (8 weights of a 64-chunk c: low nibbles elements 64c + 4w..+3, sub-block 2c, the high ones
    + 32, sub-block 2c + 1): the sub-blocks have their own sc, mn and x scales, so two dp4a into two
    sums, v = d * (sc_lo * dx_lo * v_lo + sc_hi * dx_hi * v_hi) - dmin * (mn_lo * xs_lo + mn_hi * xs_hi) / 8
    (the min term per sub-block, an eighth per word); d and dmin come as one int32 load (the super-block's
    word of the d plane), sc_lo, sc_hi, mn_lo, mn_hi as another (the chunk's word of the sc plane);
  - Q6_K (v3 has no loader: `_q6_load`): per ql word pair a, b and qh word of a 128-chunk 16 weights, 4 parts
    of 4 (nibble of a or b | 2 qh bits: q 0..63), each its own x word, 32-block and 16-sub-block scale;
    q - 32 in the integer sum: r = dp4a(q, xw, dp4a(-32 bytes, xw, MAGIC)), v = d * sc * dx * r;
  - Q5_K word: Q4_K's, with each nibble's 5th bit OR-ed in (q 0..31, still a non-negative int8): qh word
    8 (c // 4) + e % 8 of the super-block holds it at bit 8b + 2 (c % 4) (low nibble of byte b), + 1 (high);
    hb = qh >> 2 (c % 4), lo = w & 0x0F0F0F0F | (hb << 4) & 0x10101010, hi = (w >> 4) & 0x0F0F0F0F |
    (hb << 3) & 0x10101010, then Q4_K's two dp4a and min term;
  - MXFP4 word (Q4_0's layout; d the e8m0 exponent byte): each nibble -> its doubled E2M1 value as int8
    (codebook {0, 1, 2, 3, 4, 6, 8, 12} and negated for bit 3) by byte permutes (`prmt`, 4 constant table
    words; `_mxfp4_values`, llama.cpp's get_int_from_table_16), r = dp4a(hi, xh, dp4a(lo, xl, MAGIC)),
    v = 2^(e - 128) * dx * r (the codebook's 2 folded into the scale: e8m0_half, subnormal for e < 2);
  - IQ3_XXS word (4 grid indices, 16 weights: `_iq3_math`): byte b -> an int32 gather of grid row lut[b] (4
    int8 values 4..62; the table rides in the dmin slot), signs from 4 bits of the block's sg word spread to
    byte masks m (a multiply and prmt's sign copy), (row ^ m) + (m & 0x01010101), one dp4a per byte with
    its x word; v = d * (0.5 + sc) * 0.5 * dx * r;
  - IQ2_XXS word (one a 32-block: 4 grid indices, 32 weights: `_iq2_math`): byte b -> two int32 gathers of grid row
    lut[b] (8 int8 values 8 / 25 / 43, 4 a word), signs from 8 bits of the block's sg word, a nibble a word as
    IQ3_XXS's, two dp4a with x words 8g + 2b, + 1; v = d * (0.5 + sc) * 0.25 * dx * r;
  - Q2_K word (16 weights of a 128-chunk c, its 4 parts m: `_q23_math`): q = (w >> 2m) & 0x03030303 are elements
    128c + 32m + 4 (e % 8)..+3 (x word 32c + 8m + e % 8, 32-block 4c + m), 16-sub-block 8c + 2m + (e % 8) // 4 with
    its byte sc | mn << 4; q * sc stays a byte (<= 45): r = dp4a(q * sc, xw), the min's u = mn * dp4a(0x01010101,
    xw) (x's sum over the 4 elements), each summed as int32 over the chunk's 8 words (both halves of the 32-block
    share dx), v = dx * (d * r - dmin * u) a 32-block;
  - Q3_K word: Q2_K's 2 low bits, the high bit of each byte from the hm word (bit 4 (c % 2) + m of each byte: clear
    -> q - 4, the byte OR 0xFC: a signed int8 -4..3); sc (-32..31) times q does not fit a byte: r = sc * dp4a(q,
    xw) per word, summed over the chunk's 8 words, v = d * dx * r;
  - Q8_0 / Q4_0 / MXFP4 sum a 32-block's dp4a results as int32 first (a thread holds the block's words of each of
    its rows: `_per_block`), then take the float step above once a block (|sum| < 2^22, exact in the mantissa);
  - x per token (gate_up) and h per pair (down) are quantized by `quantize`, a separate small launch each
    (grid: rows), into int8 words, dx and xs. `pdl`: every launch after the first a programmatic dependent:
    gate_up and down issue their weight loads before waiting for the quantized activations.
Loads and tiles are v3's (triton_decode._v3_load: every weight load of a program issued first, word axis
first); the words' register layout carries the x-word gathers (4x fewer than v3's element gathers).
Exactness: the integer dots are exact; the twin (ops.moe_native with act_q8) quantizes x and h the same way
and computes in float32. Under TRITON_INTERPRET the dp4a and prmt are emulated with shifts (same integers).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_decode import STEP_BLOCK, Tile, _act, _v3_bload, _v3_load, k_byte, k_dmin, v3_pieces
from .triton_tiles import e8m0_half
from .triton_weights import BLOCK

Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ3_XXS, IQ2_XXS, Q2_K, Q3_K = (tl.constexpr(c) for c in range(1, 11))  # FMT_CODES
FORMATS = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4", "Q5_K", "IQ3_XXS", "IQ2_XXS", "Q2_K", "Q3_K")
MAGIC = tl.constexpr(0x4B400000)      # bits of 1.5 * 2^23: an int32 added to them is read as 12582912 + int
MAGIC_F = tl.constexpr(12582912.0)
# MXFP4's doubled E2M1 codebook as int8 bytes, 4 a word: codes 0..7 (0, 1, 2, 3 | 4, 6, 8, 12), 8..15 negated
MX_POS0, MX_POS1 = tl.constexpr(0x03020100), tl.constexpr(0x0C080604)
MX_NEG0, MX_NEG1 = tl.constexpr(0xFDFEFF00 - (1 << 32)), tl.constexpr(0xF4F8FAFC - (1 << 32))
ROUND = {torch.bfloat16: 1, torch.float16: 2}      # h rounded to x's dtype (gate_up's ROUND)
# With pdl, the x quantizer is itself a programmatic dependent of the kernel before it (the router, the previous
# layer's down) and down lets its dependents be scheduled from its start: no launch of the pair waits for a whole
# predecessor grid to drain before being scheduled (session 13, H200: Q4_0 pair 11.81 -> 11.0 us, Q8_0 15.67 ->
# 14.28). The x quantizer lets gate_up be scheduled only after its own wait: gate_up (and down) read the routed ids
# before they wait, so the kernel that wrote the ids must have finished when they start. MOETIER_PDL_CHAIN=0: off.
PDL_CHAIN = os.environ.get("MOETIER_PDL_CHAIN", "1") != "0"


def _emulate() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dp4a(a, b, c, EMU: tl.constexpr):
    """c + sum_j a_j * b_j over the 4 signed bytes of int32 a, b (PTX dp4a.s32.s32; shifts under EMU)."""
    if EMU:
        r = c
        for j in tl.static_range(4):
            r += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return r
    else:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _prmt(a, b, c, EMU: tl.constexpr):
    """Byte permute (PTX prmt.b32, default mode): byte i of the result = byte (c >> 4i) & 7 of {b, a} (a bytes
    0..3, b 4..7); with bit 3 of that selector set, the picked byte's sign copied over its 8 bits instead."""
    if EMU:
        r = c & 0
        for i in tl.static_range(4):
            s = (c >> (4 * i)) & 15
            v = (tl.where((s & 4) != 0, b, a) >> (8 * (s & 3))) & 0xFF
            r |= tl.where((s & 8) != 0, tl.where(v >= 128, 0xFF, 0), v) << (8 * i)
        return r
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _mxfp4_values(w, EMU: tl.constexpr):
    """MXFP4 codes -> int8 values: the 8 nibbles of word w (byte b: low nibble element 4k + b of the 32-block,
    high one + 16) -> (lo, hi), 4 int8 each, the doubled E2M1 values {0, 1, 2, 3, 4, 6, 8, 12} (code & 7),
    negated where bit 3 of the code is set, in w's byte order. 8 byte permutes: per half of w, its 4 codes
    look up the positive and the negative table (selector bit 3 cleared: no sign copy), a third picks by
    the code's bit 3; then the halves' bytes [lo0, hi0, lo1, hi1], [lo2, hi2, lo3, hi3] are sorted."""
    pos0, pos1 = tl.full(w.shape, MX_POS0, tl.int32), tl.full(w.shape, MX_POS1, tl.int32)
    neg0, neg1 = tl.full(w.shape, MX_NEG0, tl.int32), tl.full(w.shape, MX_NEG1, tl.int32)
    code = w & 0x77777777
    pick = ((w >> 1) & 0x44444444) | 0x32103210                 # nibble i: byte i % 4 of pos (0..3) or neg (4..7)
    t0 = _prmt(_prmt(pos0, pos1, code, EMU), _prmt(neg0, neg1, code, EMU), pick, EMU)
    code = code >> 16
    pick = pick >> 16
    t1 = _prmt(_prmt(pos0, pos1, code, EMU), _prmt(neg0, neg1, code, EMU), pick, EMU)
    lo = _prmt(t0, t1, tl.full(w.shape, 0x6420, tl.int32), EMU)     # bytes 0, 2 of t0, then of t1
    hi = _prmt(t0, t1, tl.full(w.shape, 0x7531, tl.int32), EMU)
    return lo, hi


# ------------------------------------------------------------------ activations -> int8 per 32-block
@triton.jit
def _quantize_kernel(x_ptr, stride_x, q_ptr, d_ptr, s_ptr, K: tl.constexpr, NBP: tl.constexpr,
                     WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    """grid (rows,): row r of x [R, K] -> q int8 [R, K], dx = max|x| / 127 and xs = dx * sum(q) f32 [R, K/32]
    per 32-block (q = round-half-even(x / dx); 0 where the block is all zero). WAIT: launched as a
    programmatic dependent (wait for the primary's grid); TRIGGER 1: let a dependent be scheduled now, 2: once
    the wait is over (the dependent may then read what the primary wrote before its own wait)."""
    if TRIGGER == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if TRIGGER == 2:
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0).to(tl.int64)
    _q8_row(x_ptr + r * stride_x, q_ptr + r * K, d_ptr + r * (K // 32), s_ptr + r * (K // 32), K, NBP)


@triton.jit
def _q8_row(x_ptr, q_ptr, d_ptr, s_ptr, K: tl.constexpr, NBP: tl.constexpr):
    """One row x [K] -> its int8 copy q [K], dx and xs [K / 32] (_q8_blocks)."""
    b = tl.arange(0, NBP)
    j = tl.arange(0, 32)
    mb = b < K // 32
    x = tl.load(x_ptr + b[:, None] * 32 + j[None, :], mask=mb[:, None], other=0.0).to(tl.float32)
    q, dx, xs = _q8_blocks(x)
    tl.store(q_ptr + b[:, None] * 32 + j[None, :], q.to(tl.int8), mask=mb[:, None])
    tl.store(d_ptr + b, dx, mask=mb)
    tl.store(s_ptr + b, xs, mask=mb)


@triton.jit
def _q8_blocks(x):
    """x float32 [NB, 32] -> (q float32 [NB, 32] integral, dx [NB], xs [NB]): dx = max|x| / 127, q = round-half-even(x /
    dx) (0 where the block is all zero), xs = dx * sum(q). The one definition: `quantize`, gate_up's fused x and h,
    the attention's and the norms' int8 outputs. (q = rint(x * (1 / dx)), llama.cpp's, was -6% of Q4_0's gate_up
    instructions and timed the same on the H200: session 36.)"""
    amax = tl.max(tl.abs(x), axis=1)
    dx = amax / 127.0
    y = tl.math.div_rn(x, tl.where(amax > 0, dx, 1.0)[:, None])
    q = (y + MAGIC_F) - MAGIC_F                                   # round half to even (|y| <= 127)
    return q, dx, dx * tl.sum(q, axis=1)


def quantize(x: torch.Tensor, wait: bool = False, trigger: bool | int = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, K] (K a multiple of 32, unit last stride) -> (q int8 [R, K], dx f32 [R, K/32], xs f32 [R, K/32]).
    One launch, no host sync. wait: launched as a programmatic dependent of the previous kernel (CUDA);
    trigger: the next kernel may be one, scheduled from this one's start (True / 1) or after its wait (2)."""
    r, k = x.shape
    q = torch.empty(r, k, dtype=torch.int8, device=x.device)
    dx = torch.empty(r, k // 32, dtype=torch.float32, device=x.device)
    xs = torch.empty_like(dx)
    _quantize_kernel[(r,)](x, x.stride(0), q, dx, xs, K=k, NBP=triton.next_power_of_2(k // 32), WAIT=wait,
                           TRIGGER=int(trigger), num_warps=4, **({"launch_pdl": True} if wait else {}))
    return q, dx, xs


def quantize_native(x: torch.Tensor) -> torch.Tensor:
    """The twin of `quantize`, dequantized: x [R, K] -> float32 q * dx (what the kernels multiply by)."""
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(dx > 0, torch.round(xb / torch.where(dx > 0, dx, 1.0)), 0.0)
    return (q * dx).reshape(x.shape)


# ------------------------------------------------------------------ one step of whole rows
@triton.jit
def _v5_math(words, d, s, g0, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo,
             FMT: tl.constexpr, NB: tl.constexpr, EMU: tl.constexpr, SUM: tl.constexpr = True):
    """Row dot products [A, B] of _v3_load's words [NB*W, A, B] and block scales d, s (same shape; Q4_K: the
    (d, dmin) word and the sc word, other formats d only) with the int8 activation words at
    xw_ptr + xwo [XA, XB] (broadcast over the rows), scales dx / xs at xd_ptr / xs_ptr + xdo. Word e of the
    step: Q8_0 elements 4e..4e+3 (x word e); Q4_0 / MXFP4 block e // 4, low nibbles elements 4 (e % 4)..+3
    (x word 8 (e // 4) + e % 4), high ones + 16 (x word + 4); Q4_K: _k_math's."""
    if FMT == Q4_K:
        res = _k_math(words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F, d, s, g0, NBK, xw_ptr, xwo, xd_ptr, xs_ptr,
                      xdo, NB, EMU, SUM)
    else:                   # integer sums per 32-block first: one scale step a block, not one a word
        W: tl.constexpr = 4 if FMT == Q4_0 or FMT == MXFP4 else 8
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
        dx = _per_block(tl.load(xd_ptr + dp, mask=me, other=0.0), NB, W, False, EMU)
        v = ((_per_block(r, NB, W, True, EMU) + MAGIC).to(tl.float32, bitcast=True) - MAGIC_F) * dx   # |sum| < 2^22
        if FMT == Q4_0:                                          # the zero point 8: 8 * xs a block
            v -= 8.0 * _per_block(tl.load(xs_ptr + dp, mask=me, other=0.0), NB, W, False, EMU)
        d = _per_block(d, NB, W, False, EMU)
        if FMT == MXFP4:    # d: the e8m0 byte; the scale 2^(e - 128) halves the doubled codebook (e8m0_half)
            d = e8m0_half(d.to(tl.int32))
        res = d.to(tl.float32) * v
        if SUM:
            res = tl.sum(res, axis=0)
    return res                  # one return: compiled Triton refuses a return inside a branch (the interpreter not)


@triton.jit
def _per_block(t, NB: tl.constexpr, W: tl.constexpr, SUM: tl.constexpr, EMU: tl.constexpr):
    """[NB*W, A, B] per word -> [NB, A, B] per 32-block of W words: the sum (SUM) or the value the words share.
    A block's words sit in one thread (one 16-byte load each 4): no shuffles. Under the interpreter (EMU) the shared
    value is their max (the same value: numpy's reduction, where the keep-first combine runs a Python loop per
    element and made the K formats' v5 tests minutes long)."""
    t4 = tl.reshape(t, [NB, W, t.shape[1], t.shape[2]])
    if SUM:
        res = tl.sum(t4, axis=1)
    elif EMU:
        res = tl.max(t4, axis=1)
    else:
        res = tl.reduce(t4, 1, _first)
    return res


@triton.jit
def _first(a, b):
    """A reduction that keeps its first operand: the words' shared value, no instruction (a max cost one a word)."""
    return a


@triton.jit
def _k_math(q_lo, q_hi, d, s, g0, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, NB: tl.constexpr, EMU: tl.constexpr,
            SUM: tl.constexpr = True):
    """Q4_K / Q5_K row dot products [A, B] (as _v5_math's) of the values q_lo, q_hi [NB*8, A, B] (4 non-negative
    int8 each: a word's low / high nibbles, Q5_K with their 5th bits) of 64-chunk c = e // 8: q_lo elements
    64c + 4 (e % 8)..+3 (x word 16c + e % 8, 32-block 2c), q_hi + 32 (x word + 8, block 2c + 1). The two
    sub-blocks have their own sc, mn and x scales: two dp4a, no shared accumulator; each summed as integers over
    the 4 words of a 16-byte load (half a chunk, one thread's) before the scale step, the min term half a
    sub-block's there. The scales come as two int32 words a word e, the super-block's (d, dmin) and the chunk's
    (sc_lo, sc_hi, mn_lo, mn_hi), taken once per 4 words and unpacked there (triton_decode.k_dmin, k_byte)."""
    e = g0 * 8 + tl.arange(0, NB * 8)
    me = tl.broadcast_to((e < NBK * 8)[:, None, None], q_lo.shape)
    xp = tl.broadcast_to(xw_ptr + xwo[None, :, :] + (16 * (e // 8) + e % 8)[:, None, None], q_lo.shape)
    dp = tl.broadcast_to(xdo[None, :, :] + (2 * (e // 8))[:, None, None], q_lo.shape)
    H: tl.constexpr = NB * 2
    r_lo = _per_block(_dp4a(q_lo, tl.load(xp, mask=me, other=0), 0, EMU), H, 4, True, EMU)
    r_hi = _per_block(_dp4a(q_hi, tl.load(xp + 8, mask=me, other=0), 0, EMU), H, 4, True, EMU)
    v_lo = (r_lo + MAGIC).to(tl.float32, bitcast=True) - MAGIC_F
    v_hi = (r_hi + MAGIC).to(tl.float32, bitcast=True) - MAGIC_F
    dx_lo = _per_block(tl.load(xd_ptr + dp, mask=me, other=0.0), H, 4, False, EMU)
    dx_hi = _per_block(tl.load(xd_ptr + dp + 1, mask=me, other=0.0), H, 4, False, EMU)
    xs_lo = _per_block(tl.load(xs_ptr + dp, mask=me, other=0.0), H, 4, False, EMU)
    xs_hi = _per_block(tl.load(xs_ptr + dp + 1, mask=me, other=0.0), H, 4, False, EMU)
    d, dm = k_dmin(_per_block(d, H, 4, False, EMU))
    s = _per_block(s, H, 4, False, EMU)
    r = (d * (k_byte(s, 0) * (v_lo * dx_lo) + k_byte(s, 1) * (v_hi * dx_hi))
         - dm * (0.5 * (k_byte(s, 2) * xs_lo + k_byte(s, 3) * xs_hi)))
    if SUM:
        r = tl.sum(r, axis=0)
    return r


@triton.jit
def _iq3_math(words, d, sc, sg, lut_ptr, g0, NBK, xw_ptr, xwo, xd_ptr, xdo, NB: tl.constexpr, EMU: tl.constexpr):
    """IQ3_XXS row dot products (as _v5_math's) of _v5_load's grid-index words: word e (32-block g = e // 2, half
    k = e % 2), byte b -> grid row lut[byte] (4 int8 values 4..62 in a word) of elements 32g + 16k + 4b..+3 (x word
    4e + b), their signs bits 16k + 4b..+3 of the block's sg word: a multiply puts bit j at bit 8j + 7, prmt's sign
    copy makes byte masks m (0 / -1), values (row ^ m) + (m & 0x01010101) (a byte negation: no row byte is 0, no
    carry). Scale d * (0.5 + sc) * 0.5."""
    e = g0 * 2 + tl.arange(0, NB * 2)
    me = tl.broadcast_to((e < NBK * 2)[:, None, None], words.shape)
    xp = tl.broadcast_to(xw_ptr + xwo[None, :, :] + (4 * e)[:, None, None], words.shape)
    dx = tl.load(xd_ptr + tl.broadcast_to(xdo[None, :, :] + (e // 2)[:, None, None], words.shape), mask=me,
                 other=0.0)
    signs = sg >> (16 * (e % 2))[:, None, None]
    sign_copy = tl.full(words.shape, 0xBA98, tl.int32)                 # prmt: bytes 0..3, each its bit 7 copied
    r = tl.full(words.shape, MAGIC, tl.int32)
    for b in tl.static_range(4):
        row = tl.load(lut_ptr + ((words >> (8 * b)) & 0xFF))
        m = ((signs >> (4 * b)) & 15) * 0x10204080
        m = _prmt(m, m, sign_copy, EMU)
        r = _dp4a((row ^ m) + (m & 0x01010101), tl.load(xp + b, mask=me, other=0), r, EMU)
    scale = d.to(tl.float32) * (0.5 + sc.to(tl.float32)) * 0.5
    return tl.sum(scale * ((r.to(tl.float32, bitcast=True) - MAGIC_F) * dx), axis=0)


@triton.jit
def _iq2_math(words, d, sc, sg, lut_ptr, g0, NBK, xw_ptr, xwo, xd_ptr, xdo, NB: tl.constexpr, EMU: tl.constexpr):
    """IQ2_XXS row dot products (as _v5_math's) of _v5_load's grid-index words: word e = 32-block g0 + e, byte b ->
    grid row lut[byte] (8 int8 values 8 / 25 / 43 in words 2 byte, 2 byte + 1) of elements 32g + 8b..+7 (x words
    8g + 2b, + 1), their signs bits 8b..+7 of the block's sg word, a nibble a grid word: _iq3_math's byte masks m and
    (row ^ m) + (m & 0x01010101). Scale d * (0.5 + sc) * 0.25."""
    e = g0 + tl.arange(0, NB)
    me = tl.broadcast_to((e < NBK)[:, None, None], words.shape)
    xp = tl.broadcast_to(xw_ptr + xwo[None, :, :] + (8 * e)[:, None, None], words.shape)
    dx = tl.load(xd_ptr + tl.broadcast_to(xdo[None, :, :] + e[:, None, None], words.shape), mask=me, other=0.0)
    sign_copy = tl.full(words.shape, 0xBA98, tl.int32)                 # prmt: bytes 0..3, each its bit 7 copied
    r = tl.full(words.shape, MAGIC, tl.int32)
    for b in tl.static_range(4):
        row = lut_ptr + 2 * ((words >> (8 * b)) & 0xFF)
        for h in tl.static_range(2):
            m = ((sg >> (8 * b + 4 * h)) & 15) * 0x10204080
            m = _prmt(m, m, sign_copy, EMU)
            r = _dp4a((tl.load(row + h) ^ m) + (m & 0x01010101), tl.load(xp + (2 * b + h), mask=me, other=0), r, EMU)
    scale = d.to(tl.float32) * (0.5 + sc.to(tl.float32)) * 0.25
    return tl.sum(scale * ((r.to(tl.float32, bitcast=True) - MAGIC_F) * dx), axis=0)


@triton.jit
def _v5_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, g0, NBK, FMT: tl.constexpr, NB: tl.constexpr):
    """Weight loads of step blocks g0 .. g0+NB (of NBK) of rows [A, B], word axis first: _v3_load's words and
    two scales (MXFP4 as Q4_0: its e byte in d) and a 4th value, Q5_K the qh words of the 64-chunks' 5th bits
    (word e: qh word 8 (e // 32) + e % 8 of the row), the words again for other formats. IQ3_XXS: its 2
    grid-index words per 32-block, d (per 8 blocks), sc, the block's sg word 4th. IQ2_XXS: one grid-index word per
    32-block, d (per 8 blocks), sc and sg loaded as the words are (one each a word: consecutive, vector loads)."""
    if FMT == IQ2_XXS:
        e = g0 + tl.arange(0, NB)
        m3 = (e < NBK)[:, None, None] & mask[None, :, :]
        words = tl.load(q_ptr + rq[None, :, :] + e[:, None, None], mask=m3, other=0, eviction_policy="evict_first")
        d = _v3_bload(d_ptr, rd, g0 // 8, NB // 8, 8, 1, 0, NBK // 8)
        s = tl.load(sc_ptr + rsc[None, :, :] + e[:, None, None], mask=m3, other=0, eviction_policy="evict_first")
        hw = tl.load(h_ptr + rh[None, :, :] + e[:, None, None], mask=m3, other=0, eviction_policy="evict_first")
    elif FMT == IQ3_XXS:
        e = g0 * 2 + tl.arange(0, NB * 2)
        m3 = (e < NBK * 2)[:, None, None] & mask[None, :, :]
        words = tl.load(q_ptr + rq[None, :, :] + e[:, None, None], mask=m3, other=0, eviction_policy="evict_first")
        d = _v3_bload(d_ptr, rd, g0 // 8, NB // 8, 16, 1, 0, NBK // 8)
        s = _v3_bload(sc_ptr, rsc, g0, NB, 2, 1, 0, NBK)
        hw = _v3_bload(h_ptr, rh, g0, NB, 2, 1, 0, NBK)
    elif FMT == Q5_K:
        words, d, s = _v3_load(q_ptr, d_ptr, sc_ptr, rq, rd, rsc, mask, g0, NBK, Q4_K, NB)
        e = g0 * 8 + tl.arange(0, NB * 8)
        m3 = (e < NBK * 8)[:, None, None] & mask[None, :, :]
        hw = tl.load(h_ptr + rh[None, :, :] + (8 * (e // 32) + e % 8)[:, None, None], mask=m3, other=0,
                     eviction_policy="evict_first")
    else:
        words, d, s = _v3_load(q_ptr, d_ptr, sc_ptr, rq, rd, rsc, mask, g0, NBK, Q4_0 if FMT == MXFP4 else FMT, NB)
        hw = words
    return words, d, s, hw


@triton.jit
def _v5_step(words, d, s, hw, g0, NBK, lut_ptr, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT: tl.constexpr,
             NB: tl.constexpr, EMU: tl.constexpr):
    """Row dot products of _v5_load's values: Q5_K's 5th bits (bits 8b + 2 (c % 4), + 1 of qh word hw, c the
    word's 64-chunk) OR-ed into the nibbles of byte b, then _k_math; IQ3_XXS _iq3_math, IQ2_XXS _iq2_math (lut: the
    grid words, _planes); other formats _v5_math."""
    if FMT == IQ3_XXS:
        res = _iq3_math(words, d, s, hw, lut_ptr, g0, NBK, xw_ptr, xwo, xd_ptr, xdo, NB, EMU)
    elif FMT == IQ2_XXS:
        res = _iq2_math(words, d, s, hw, lut_ptr, g0, NBK, xw_ptr, xwo, xd_ptr, xdo, NB, EMU)
    elif FMT == Q5_K:
        c = g0 + tl.arange(0, NB * 8) // 8
        hb = hw >> (2 * (c % 4))[:, None, None]
        q_lo = (words & 0x0F0F0F0F) | ((hb << 4) & 0x10101010)
        q_hi = ((words >> 4) & 0x0F0F0F0F) | ((hb << 3) & 0x10101010)
        res = _k_math(q_lo, q_hi, d, s, g0, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, NB, EMU)
    else:
        res = _v5_math(words, d, s, g0, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB, EMU)
    return res


@triton.jit
def _q6_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, g0, NBK, NB: tl.constexpr):
    """Q6_K loads of 128-chunks g0 .. g0+NB (of NBK) of rows [A, B], word axis first as _v3_load's: word e of
    the step (chunk c = e // 8, w = e % 8) gets ql words a = 16c + w, b = a + 8, qh word 8c + w, d (per 2
    chunks) and the scales sc[8c + 2m + w // 4] of its 4 parts m (16-sub-blocks; clamped, unmasked)."""
    e = g0 * 8 + tl.arange(0, NB * 8)
    m3 = (e < NBK * 8)[:, None, None] & mask[None, :, :]
    pa = q_ptr + rq[None, :, :] + (16 * (e // 8) + e % 8)[:, None, None]
    wa = tl.load(pa, mask=m3, other=0, eviction_policy="evict_first")
    wb = tl.load(pa + 8, mask=m3, other=0, eviction_policy="evict_first")
    wh = tl.load(h_ptr + rh[None, :, :] + e[:, None, None], mask=m3, other=0, eviction_policy="evict_first")
    d = _v3_bload(d_ptr, rd, g0 // 2, NB // 2, 16, 1, 0, NBK // 2)
    ps = sc_ptr + rsc[None, :, :] + (8 * tl.minimum(e // 8, NBK - 1) + (e % 8) // 4)[:, None, None]
    return wa, wb, wh, d, tl.load(ps), tl.load(ps + 2), tl.load(ps + 4), tl.load(ps + 6)


@triton.jit
def _q6_part(src, wh, me, c, w, xw_ptr, xwo, xd_ptr, xdo, M: tl.constexpr, EMU: tl.constexpr):
    """(sum (q - 32) x as int32, dx) per word of part M of the words (elements 128c + 4w + 32M .. + 3: a nibble of
    ql word a (M even) or b (odd), low for M < 2, and bits 2M, 2M + 1 of each qh byte on top; x word 32c + 8M + w,
    32-block 4c + M). q - 32 by a second dp4a with -32 in every byte (q alone is unsigned 6-bit)."""
    if M < 2:
        q = src & 0x0F0F0F0F
    else:
        q = (src >> 4) & 0x0F0F0F0F
    q = q | (((wh >> (2 * M)) & 0x03030303) << 4)
    xw = tl.load(tl.broadcast_to(xw_ptr + xwo[None, :, :] + (32 * c + 8 * M + w)[:, None, None], q.shape),
                 mask=me, other=0)
    dx = tl.load(xd_ptr + tl.broadcast_to(xdo[None, :, :] + (4 * c + M)[:, None, None], q.shape), mask=me,
                 other=0.0)
    return _dp4a(q, xw, _dp4a(tl.full(q.shape, -522133280, tl.int32), xw, 0, EMU), EMU), dx   # 0xE0E0E0E0


@triton.jit
def _q6_math(wa, wb, wh, d, s0, s1, s2, s3, g0, NBK, xw_ptr, xwo, xd_ptr, xdo, NB: tl.constexpr,
             EMU: tl.constexpr):
    """Row dot products [A, B] of _q6_load's words with the int8 activations (as _v5_math's). A part's sums are
    added as integers over the 4 words of a 16-byte load (one 16-element sub-block, one scale) before its scale
    step."""
    e = g0 * 8 + tl.arange(0, NB * 8)
    me = tl.broadcast_to((e < NBK * 8)[:, None, None], wa.shape)
    c = e // 8
    w = e % 8
    H: tl.constexpr = NB * 2
    v = tl.zeros([H, wa.shape[1], wa.shape[2]], dtype=tl.float32)
    for M in tl.static_range(4):
        r, dx = _q6_part(wa if M % 2 == 0 else wb, wh, me, c, w, xw_ptr, xwo, xd_ptr, xdo, M, EMU)
        sc = s0 if M == 0 else s1 if M == 1 else s2 if M == 2 else s3
        r = (_per_block(r, H, 4, True, EMU) + MAGIC).to(tl.float32, bitcast=True) - MAGIC_F
        v += _per_block(sc, H, 4, False, EMU).to(tl.float32) * (r * _per_block(dx, H, 4, False, EMU))
    return tl.sum(_per_block(d, H, 4, False, EMU).to(tl.float32) * v, axis=0)


@triton.jit
def _q23_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, g0, NBK, Q3: tl.constexpr, NB: tl.constexpr):
    """Q2_K / Q3_K loads of 128-chunks g0 .. g0+NB (of NBK) of rows [A, B], word axis first as _v3_load's: word e of
    the step (chunk c = e // 8, w = e % 8) gets q word e and d (per 2 chunks: Q2_K's the (d, dmin) word); Q2_K the
    sc words 2c, 2c + 1 (the bytes of 16-sub-blocks 8c .. 8c + 7); Q3_K the hm word 8 (c // 2) + w and the int8
    scales sc[8c + 2m + w // 4] of its 4 parts m (clamped, unmasked). A 7-tuple: words, d, hm / sc word 2c, the 4
    scales / sc word 2c + 1 (repeated)."""
    e = g0 * 8 + tl.arange(0, NB * 8)
    m3 = (e < NBK * 8)[:, None, None] & mask[None, :, :]
    words = tl.load(q_ptr + rq[None, :, :] + e[:, None, None], mask=m3, other=0, eviction_policy="evict_first")
    d = _v3_bload(d_ptr, rd, g0 // 2, NB // 2, 16, 1, 0, NBK // 2)
    if Q3:
        hw = tl.load(h_ptr + rh[None, :, :] + (8 * (e // 16) + e % 8)[:, None, None], mask=m3, other=0,
                     eviction_policy="evict_first")
        ps = sc_ptr + rsc[None, :, :] + (8 * tl.minimum(e // 8, NBK - 1) + (e % 8) // 4)[:, None, None]
        s0, s1, s2, s3 = tl.load(ps), tl.load(ps + 2), tl.load(ps + 4), tl.load(ps + 6)
    else:
        hw = _v3_bload(sc_ptr, rsc, g0, NB, 8, 2, 0, NBK)
        s0 = _v3_bload(sc_ptr, rsc, g0, NB, 8, 2, 1, NBK)
        s1, s2, s3 = s0, s0, s0
    return words, d, hw, s0, s1, s2, s3


@triton.jit
def _q23_math(words, d, hw, s0, s1, s2, s3, g0, NBK, xw_ptr, xwo, xd_ptr, xdo, Q3: tl.constexpr, NB: tl.constexpr,
              EMU: tl.constexpr):
    """Row dot products [A, B] of _q23_load's values with the int8 activations (as _v5_math's; module doc): per part
    m of a word (elements 128c + 32m + 4w..+3, x word 32c + 8m + w, 32-block 4c + m) one or two dp4a, summed as int32
    over the chunk's 8 words (|sum| < 2^22), one scale step a 32-block. Q2_K: hw and s0 are the sc words 2c, 2c + 1."""
    e = g0 * 8 + tl.arange(0, NB * 8)
    me = tl.broadcast_to((e < NBK * 8)[:, None, None], words.shape)
    c = e // 8
    w = e % 8
    if Q3:
        hb = hw >> (4 * (c % 2))[:, None, None]
    else:
        ones = tl.full(words.shape, 0x01010101, tl.int32)
    v = tl.zeros([NB, words.shape[1], words.shape[2]], dtype=tl.float32)
    v_m = tl.zeros([NB, words.shape[1], words.shape[2]], dtype=tl.float32)
    for m in tl.static_range(4):
        xw = tl.load(tl.broadcast_to(xw_ptr + xwo[None, :, :] + (32 * c + 8 * m + w)[:, None, None], words.shape),
                     mask=me, other=0)
        dx = tl.load(xd_ptr + tl.broadcast_to(xdo[None, :, :] + (4 * c + m)[:, None, None], words.shape), mask=me,
                     other=0.0)
        dx = _per_block(dx, NB, 8, False, EMU)
        q = (words >> (2 * m)) & 0x03030303
        if Q3:                 # a clear high bit: the byte - 4 (q | 0xFC, q < 4)
            q = q | ((((hb >> m) & 0x01010101) ^ 0x01010101) * 0xFC)
            sc = s0 if m == 0 else s1 if m == 1 else s2 if m == 2 else s3
            r = _per_block(sc.to(tl.int32) * _dp4a(q, xw, 0, EMU), NB, 8, True, EMU)
            v += dx * ((r + MAGIC).to(tl.float32, bitcast=True) - MAGIC_F)
        else:                  # the sub-block's byte 2 (m % 2) + w // 4 of sc word 2c + m // 2: scale | min << 4
            b = ((hw if m < 2 else s0) >> (8 * (2 * (m % 2) + w // 4))[:, None, None]) & 0xFF
            r = _per_block(_dp4a(q * (b & 15), xw, 0, EMU), NB, 8, True, EMU)
            u = _per_block((b >> 4) * _dp4a(ones, xw, 0, EMU), NB, 8, True, EMU)
            v += dx * ((r + MAGIC).to(tl.float32, bitcast=True) - MAGIC_F)
            v_m += dx * ((u + MAGIC).to(tl.float32, bitcast=True) - MAGIC_F)
    if Q3:
        res = _per_block(d, NB, 8, False, EMU).to(tl.float32) * v
    else:
        dd, dm = k_dmin(_per_block(d, NB, 8, False, EMU))
        res = dd * v - dm * v_m
    return tl.sum(res, axis=0)


@triton.jit
def _v5_loads(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, NBK: tl.constexpr, FMT: tl.constexpr,
              NB1: tl.constexpr, NB2: tl.constexpr):
    """_v5_dot's weight loads of both pieces, as two tuples (the second is the first again where NB2 == 0)."""
    if FMT == Q6_K:
        a = _q6_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, 0, NBK, NB1)
        b = a
        if NB2 > 0:
            b = _q6_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, NB1, NBK, NB2)
    elif FMT == Q2_K or FMT == Q3_K:
        a = _q23_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, 0, NBK, FMT == Q3_K, NB1)
        b = a
        if NB2 > 0:
            b = _q23_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, NB1, NBK, FMT == Q3_K, NB2)
    else:
        a = _v5_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, 0, NBK, FMT, NB1)
        b = a
        if NB2 > 0:
            b = _v5_load(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, NB1, NBK, FMT, NB2)
    return a, b


@triton.jit
def _v5_maths(a, b, m_ptr, NBK: tl.constexpr, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT: tl.constexpr,
              NB1: tl.constexpr, NB2: tl.constexpr, EMU: tl.constexpr):
    """_v5_dot's math on _v5_loads' values."""
    if FMT == Q6_K:
        acc = _q6_math(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], 0, NBK, xw_ptr, xwo, xd_ptr, xdo, NB1, EMU)
        if NB2 > 0:
            acc += _q6_math(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], NB1, NBK, xw_ptr, xwo, xd_ptr, xdo, NB2,
                            EMU)
    elif FMT == Q2_K or FMT == Q3_K:
        acc = _q23_math(a[0], a[1], a[2], a[3], a[4], a[5], a[6], 0, NBK, xw_ptr, xwo, xd_ptr, xdo, FMT == Q3_K, NB1,
                        EMU)
        if NB2 > 0:
            acc += _q23_math(b[0], b[1], b[2], b[3], b[4], b[5], b[6], NB1, NBK, xw_ptr, xwo, xd_ptr, xdo, FMT == Q3_K,
                             NB2, EMU)
    elif NB2 == NB1 and (FMT == Q4_0 or FMT == Q8_0 or FMT == MXFP4 or FMT == Q4_K):
        # equal pieces (gate_up_pieces' halves, or v3_pieces' 2^n + 2^n): block values added before one reduction
        pa = _v5_math(a[0], a[1], a[2], 0, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB1, EMU, False)
        pb = _v5_math(b[0], b[1], b[2], NB1, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB2, EMU, False)
        acc = tl.sum(pa + pb, axis=0)
    else:
        acc = _v5_step(a[0], a[1], a[2], a[3], 0, NBK, m_ptr, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB1, EMU)
        if NB2 > 0:
            acc += _v5_step(b[0], b[1], b[2], b[3], NB1, NBK, m_ptr, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB2, EMU)
    return acc


@triton.jit
def _v5_dot(q_ptr, d_ptr, m_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, NBK: tl.constexpr,
            xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT: tl.constexpr, NB1: tl.constexpr, NB2: tl.constexpr,
            PDL_WAIT: tl.constexpr, EMU: tl.constexpr):
    """[A, B] dot products of whole rows: the weight loads of both pieces, (PDL_WAIT: the wait for the
    activations' grid), then the math. Planes beyond q, d: sc (Q4_K; Q5_K + h; d and sc as words), sc, h (Q6_K),
    the grid in dmin's slot (m_ptr), sc, h (IQ3_XXS, IQ2_XXS), sc (Q2_K: d and sc as words), sc, h (Q3_K)."""
    a, b = _v5_loads(q_ptr, d_ptr, sc_ptr, h_ptr, rq, rd, rsc, rh, mask, NBK, FMT, NB1, NB2)
    if PDL_WAIT:
        tl.extra.cuda.gdc_wait()
    return _v5_maths(a, b, m_ptr, NBK, xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB1, NB2, EMU)


@triton.jit
def _x_q8_mine(x_ptr, stride_x, t, q8_ptr, xd_ptr, xs_ptr, slot, D: tl.constexpr, NBP: tl.constexpr):
    """XQ: token t's row of x (float / bf16 [T, D]) -> this program's own int8 copy at `slot` of gate_up's scratch (q8
    int8 [slot, D], dx and xs [slot, D / 32]: `quantize`'s values, _q8_blocks), then a barrier: the program's math
    reads it back from there (its own writes, so no other program is waited for)."""
    _q8_row(x_ptr + t * stride_x, q8_ptr + slot * D, xd_ptr + slot * (D // 32), xs_ptr + slot * (D // 32), D, NBP)
    tl.debug_barrier()


@triton.jit
def _gate_up_kernel(xw_ptr, xd_ptr, xs_ptr, ids_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr,
                    sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n,
                    b_ptr, sb_s, out_ptr, alpha, limit, hq_ptr, hd_ptr, hs_ptr, cnt_ptr, x_ptr, stride_x, xq8_ptr,
                    I: tl.constexpr, D: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr, ACT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, NB1: tl.constexpr,
                    NB2: tl.constexpr, PDL: tl.constexpr, EMU: tl.constexpr, ROUND: tl.constexpr, QH: tl.constexpr,
                    XQ: tl.constexpr, NBP: tl.constexpr, tr_ptr, TRACE: tl.constexpr):
    """grid (T*k pairs, I/BN): h[pair, n] = act(gate row n . x[t], up row n . x[t]) (+ bias), x as int8 words;
    tile [K, BN, 2] (gate rows, up rows), every weight load issued first (v3's). QH: h also quantized for down
    (`quantize`'s q, dx, xs, bit-equal), so down needs no quantizer launch. QH 1 (BN divides 32): the last of a
    32-block's 32 / BN programs to finish (an acq_rel counter per block, reset by that program for the next launch)
    quantizes the block; QH 2 (32 divides BN): each program owns whole blocks and quantizes them in registers.
    The ids are read before the PDL wait: safe because the x quantizer launched before it waits for the ids' writer
    first (a chain without that launch faulted: docs/perf-log.md, session 26). XQ (variant v5qx): no quantizer launch;
    each program makes its own int8 copy of x (x_ptr, bf16 / float [T, D]) into gate_up's scratch (xq8_ptr: int8
    [programs, D]; xd_ptr, xs_ptr: [programs, D / 32]) while its weight loads are in flight (_x_q8_mine); with PDL it
    first waits for the previous grid (it wrote the ids), and only then lets down be scheduled: down reads the ids
    before its own wait too (triggered at gate_up's start, down read ids the router had not written yet: an illegal
    address in the H200 engine, session 30). TRACE: `stamps`."""
    if TRACE:
        t_start = _stamp()
    if PDL and XQ:
        tl.extra.cuda.gdc_wait()
    if TRACE:
        t_go = _stamp()
        t_loaded = t_go
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    s = tl.load(ids_ptr + p).to(tl.int64)
    gu = tl.arange(0, 2)[None, :]
    r = tl.minimum(n, I - 1).to(tl.int64)[:, None] + gu * I
    m2 = (n < I)[:, None] & (gu >= 0)
    acc = tl.zeros([BN, 2], dtype=tl.float32)
    if s >= 0:
        t = (p // KTOP).to(tl.int64)
        if XQ:
            slot = p.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)      # this program's copy of x
            a, b = _v5_loads(q_ptr, d_ptr, sc_ptr, h_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n,
                             s * ssc_s + r * ssc_n, s * sh_s + r * sh_n, r >= 0, D // BS, FMT, NB1, NB2)
            _x_q8_mine(x_ptr, stride_x, t, xq8_ptr, xd_ptr, xs_ptr, slot, D, NBP)
            if TRACE:
                t_loaded = _stamp_after(b[0])
            acc = _v5_maths(a, b, m_ptr, D // BS, xw_ptr, tl.zeros([1, 1], dtype=tl.int64) + slot * (D // 4),
                            xd_ptr, xs_ptr, tl.zeros([1, 1], dtype=tl.int64) + slot * (D // 32), FMT, NB1, NB2, EMU)
        else:
            xwo = tl.zeros([1, 1], dtype=tl.int64) + t * (D // 4)
            xdo = tl.zeros([1, 1], dtype=tl.int64) + t * (D // 32)
            acc = _v5_dot(q_ptr, d_ptr, m_ptr, sc_ptr, h_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n,
                          s * ssc_s + r * ssc_n, s * sh_s + r * sh_n, r >= 0, D // BS, xw_ptr, xwo, xd_ptr, xs_ptr,
                          xdo, FMT, NB1, NB2, PDL, EMU)
    elif PDL and not XQ:
        tl.extra.cuda.gdc_wait()
    m2 = m2 & (s >= 0)
    s = tl.maximum(s, 0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + s * sb_s + r, mask=m2, other=0.0).to(tl.float32)
    gate = tl.sum(tl.where(gu == 0, acc, 0.0), axis=1)
    up = tl.sum(tl.where(gu == 1, acc, 0.0), axis=1)
    h = _act(gate, up, ACT, alpha, limit)
    if ROUND == 1:                                               # rounded to x's dtype, as the twin does
        h = h.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        h = h.to(tl.float16).to(tl.float32)
    tl.store(out_ptr + p.to(tl.int64) * I + n, h, mask=n < I)
    if QH == 2:
        b = tl.program_id(1) * (BN // 32) + tl.arange(0, BN // 32)
        _h_q8_store(tl.reshape(h, [BN // 32, 32]), p.to(tl.int64), b, b < I // 32, hq_ptr, hd_ptr, hs_ptr, I)
    if QH == 1:
        tl.debug_barrier()                   # every thread's h stores happen before the release below
        cb = cnt_ptr + p.to(tl.int64) * (I // 32) + (tl.program_id(1) * BN) // 32
        if tl.atomic_add(cb, 1, sem="acq_rel") == 32 // BN - 1:     # the block's last program: all of it visible
            tl.atomic_xchg(cb, 0)
            b = tl.zeros([1], dtype=tl.int64) + (tl.program_id(1) * BN) // 32
            hb = tl.load(out_ptr + p.to(tl.int64) * I + b[:, None] * 32 + tl.arange(0, 32)[None, :],
                         cache_modifier=".cg")
            _h_q8_store(hb, p.to(tl.int64), b, b >= 0, hq_ptr, hd_ptr, hs_ptr, I)
    if TRACE:
        _stamp_store(tr_ptr, p * tl.num_programs(1) + tl.program_id(1), t_start, t_go, t_loaded)


@triton.jit
def _stamp():
    """The GPU's nanosecond clock (%globaltimer)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _stamp_after(v):
    """The clock once every element of int32 tensor v (loaded words) is in: the latest of per-element stamps, each
    predicated on its element (an operand the instruction does not read would not wait for the load)."""
    t = tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u32 p, $1, 0x7f7f7f7f; @p mov.u64 $0, %globaltimer; "
                                  "@!p mov.u64 $0, 0; }", "=l,r", [v], dtype=tl.int64, is_pure=False, pack=1)
    return tl.max(tl.reshape(t, [t.numel]), axis=0)


@triton.jit
def _stamp_store(tr_ptr, prog, t_start, t_go, t_mid):
    """A program's stamps (`stamps`): start, after its wait, mid (gate_up: its weights in; down: its wait over), end
    (now), and its SM."""
    t_end = _stamp()
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    o = tr_ptr + prog.to(tl.int64) * 5
    tl.store(o, t_start)
    tl.store(o + 1, t_go)
    tl.store(o + 2, t_mid)
    tl.store(o + 3, t_end)
    tl.store(o + 4, sm.to(tl.int64))


@triton.jit
def _h_q8_store(h, row, b, bm, hq_ptr, hd_ptr, hs_ptr, I: tl.constexpr):
    """h float32 [NB, 32], the 32-blocks b [NB] of pair `row`'s h (those where bm) -> down's int8 copy of them
    (`quantize`'s q, dx, xs: _q8_blocks)."""
    q, dx, xs = _q8_blocks(h)
    tl.store(hq_ptr + row * I + b[:, None] * 32 + tl.arange(0, 32)[None, :], q.to(tl.int8), mask=bm[:, None])
    tl.store(hd_ptr + row * (I // 32) + b, dx, mask=bm)
    tl.store(hs_ptr + row * (I // 32) + b, xs, mask=bm)


@triton.jit
def _down_kernel(hw_ptr, hd_ptr, hs_ptr, ids_ptr, w_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr,
                 sq_s, sq_n, sd_s, sd_n, sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n,
                 b_ptr, sb_s, out_ptr, stride_o,
                 D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, KP: tl.constexpr, FMT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, NB1: tl.constexpr,
                 NB2: tl.constexpr, PDL: tl.constexpr, EMU: tl.constexpr, TRIGGER: tl.constexpr,
                 tr_ptr, TRACE: tl.constexpr):
    """grid (T, D/BN): out[t, n] = sum_j w[t, j] * (down_j row n . h[t, j] (+ bias)), h as int8 words; tile
    [I, k, BN] (v3's), no atomics. TRIGGER: a dependent launch may be scheduled from the start (it waits for this
    grid's writes before reading them). TRACE: `stamps`."""
    if TRACE:
        t_start = _stamp()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < D
    j = tl.arange(0, KP)
    jm = j < KTOP
    s = tl.load(ids_ptr + t * KTOP + j, mask=jm, other=-1).to(tl.int64)
    mask = (jm & (s >= 0))[:, None] & nm[None, :]
    s = tl.maximum(s, 0)[:, None]
    r = tl.minimum(n, D - 1).to(tl.int64)[None, :]
    pj = (t * KTOP + tl.minimum(j, KTOP - 1)).to(tl.int64)[:, None]    # pair of h (lanes past k: a real one)
    if TRACE:                                        # _v5_dot with a stamp after the wait
        a, b = _v5_loads(q_ptr, d_ptr, sc_ptr, h_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n,
                         s * ssc_s + r * ssc_n, s * sh_s + r * sh_n, mask, I // BS, FMT, NB1, NB2)
        t_loaded = _stamp_after(b[0])
        if PDL:
            tl.extra.cuda.gdc_wait()
        t_go = _stamp()
        acc = _v5_maths(a, b, m_ptr, I // BS, hw_ptr, pj * (I // 4), hd_ptr, hs_ptr, pj * (I // 32), FMT, NB1, NB2,
                        EMU)
    else:
        acc = _v5_dot(q_ptr, d_ptr, m_ptr, sc_ptr, h_ptr, s * sq_s + r * sq_n, s * sd_s + r * sd_n,
                      s * ssc_s + r * ssc_n, s * sh_s + r * sh_n, mask, I // BS, hw_ptr, pj * (I // 4), hd_ptr,
                      hs_ptr, pj * (I // 32), FMT, NB1, NB2, PDL, EMU)
    if HAS_BIAS:
        acc += tl.load(b_ptr + s * sb_s + r, mask=mask, other=0.0).to(tl.float32)
    wj = tl.load(w_ptr + t * KTOP + j, mask=jm, other=0.0).to(tl.float32)
    y = tl.sum(tl.where(mask, acc, 0.0) * wj[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=nm)
    if TRACE:
        _stamp_store(tr_ptr, t * tl.num_programs(1) + tl.program_id(1), t_start, t_go, t_loaded)


# Tiles (Tile.bn rows, warps). Timed on the H200 (session 8, bench --variants, graph replays, per call with
# its quantize launch, Qwen3-30B-A3B T=1): gate_up Q4_0 (4, 0, 2) 7.73 us vs (8, 0, 4) 8.16, (16, 0, 8) 8.04;
# Q8_0 10.57 vs 10.8, 10.73; down Q4_0 (4, 0, 4) 6.34 vs (8, 0, 4) 6.64; Q8_0 (16, 0, 8) 8.22 vs (8, 0, 4) 8.82.
# Session 9, Q6_K (pair at (2, 0, 1) / (8, 0, 4): v5 21.1 us, v5pdl 15.6): gate_up (16, 0, 4) 11.13 us vs (4, 0, 2)
# 11.35, (8, 0, 4) 11.47, (16, 0, 8) 11.9; down (8, 0, 4) 8.61 vs (4, 0, 4) 8.63, (16, 0, 8) 8.95. Q4_K (pair at
# (2, 0, 1) / (8, 0, 4): v5 17.3 us, v5pdl 13.35): gate_up (8, 0, 4) 10.71 vs (4, 0, 2) 10.73, (16, 0, 4) 11.37;
# down (8, 0, 4) 7.40 vs (16, 0, 8) 7.62, (4, 0, 4) 7.81. IQ3_XXS (Q4_0's tiles), Q5_K (Q4_K's): pairs timed
# (session 16: 25.88, 15.09 us), their tiles not swept yet. Session 17, the v5pdl pair at 15 tile combinations
# (bench --only v5pdl,v5tiles): MXFP4 gate_up (4, 0, 1) 11.56-11.97 us vs (4, 0, 2) 12.03-12.44 at each down tile;
# Q6_K gate_up (4, 0, 1) with down (8, 0, 2) 14.36 vs (16, 0, 4) / (8, 0, 4) 15.05; Q4_0 and Q4_K: no combination
# beat their tiles (10.87, 13.0) by more than the run-to-run spread. IQ2_XXS: IQ3_XXS's tiles, Q2_K / Q3_K Q6_K's
# (128-chunks as its), not timed yet.
GATE_UP5 = {"Q8_0": Tile(4, 0, 2), "Q4_0": Tile(4, 0, 2), "Q4_K": Tile(8, 0, 4), "Q6_K": Tile(4, 0, 1),
            "MXFP4": Tile(4, 0, 1), "Q5_K": Tile(8, 0, 4), "IQ3_XXS": Tile(4, 0, 2), "IQ2_XXS": Tile(4, 0, 2),
            "Q2_K": Tile(4, 0, 1), "Q3_K": Tile(4, 0, 1)}
# v5q's gate_up (h quantized by its programs; session 18, pairs with v5pdl's down tile, two calls on two boxes):
# Q4_0 (32, 0, 8) 10.65 / 10.49 us vs v5pdl 10.97 / 10.89; Q6_K (32, 0, 8) 13.97 / 14.21 vs 14.31 / 14.29; Q4_K at
# GATE_UP5's (8, 0, 4) 12.58 / 12.65 vs 13.02 / 12.98. (32, 0, 2): 17-234 us (spills); 64 rows slower.
# Q4_K (32, 0, 8) with its row in two pieces once its scales came as two words a load (session 38: 128 registers, two
# programs an SM, from 209): 11.91 / 11.93 us vs v5qx (8, 0, 4) 12.36-12.48; in one piece 12.90 / 12.97.
GATE_UP5Q = {"Q4_0": Tile(32, 0, 8), "Q6_K": Tile(32, 0, 8), "Q4_K": Tile(32, 0, 8)}
# Q4_0's down at (16, 0, 8) (session 35, v5qx pairs, three calls): 9.72-9.74 us vs (4, 0, 4) 10.12-10.39. Its 128
# programs (98 registers) load their weights beside gate_up's before their PDL wait; (4, 0, 8) 9.92-9.95, others
# 10.0-11.3. The same sweep on Q4_K / Q6_K / Q8_0 / MXFP4's default pairs moved none beyond the spread.
DOWN5 = {"Q8_0": Tile(16, 0, 8), "Q4_0": Tile(16, 0, 8), "Q4_K": Tile(8, 0, 4), "Q6_K": Tile(8, 0, 2),
         "MXFP4": Tile(4, 0, 4), "Q5_K": Tile(8, 0, 4), "IQ3_XXS": Tile(4, 0, 4), "IQ2_XXS": Tile(4, 0, 4),
         "Q2_K": Tile(8, 0, 2), "Q3_K": Tile(8, 0, 2)}


def _planes(w):
    """The 6 planes (q and h as int32 words; Q4_K / Q5_K's d and sc too) and their 12 slot / row strides in
    elements: v2_args without the table (sc read by Q4_K / Q5_K, Q6_K and IQ3_XXS / IQ2_XXS, h by Q5_K / Q6_K /
    IQ3_XXS / IQ2_XXS; dmin and mn by none: Q4_K / Q5_K's are in the d and sc words; MXFP4's e in d). IQ3_XXS and
    IQ2_XXS have no dmin: its slot carries the grid as int32 words (4 int8 values each, stride 0)."""
    a = w.v2_args()
    planes = a[0:6]
    if w.fmt in ("IQ3_XXS", "IQ2_XXS"):
        planes[2] = _grid_words(w.fmt, planes[0].device)
    return planes + a[7:19]


def _grid_words(fmt: str, device) -> torch.Tensor:
    """The IQ3_XXS / IQ2_XXS grid as int32 [256] / [512] on `device` (cached): 4 values of a row (IQ3_XXS 4..62,
    IQ2_XXS 8 / 25 / 43) as the bytes of a word, IQ2_XXS's row i in words 2i, 2i + 1."""
    from gguf import quants as gq

    from moetier.quant.bits import table
    from moetier.quant.iquants import _grid
    return table(f"{fmt.lower()}_words", device, lambda: _grid(getattr(gq, fmt)).to(torch.uint8).contiguous()
                 .view(torch.int32).reshape(-1))


def gate_up_v5(x, ids, w, act: int, alpha: float, limit: float, bias, h, cfg=None, pdl: bool = False,
               quantize_h: bool = False, x_here: bool = False):
    """As triton_decode.gate_up (h float32 [T*k, I], values rounded to x's dtype), x quantized to int8 per
    32-block first (one more launch). FORMATS (supports). quantize_h (the tile's rows divide 32): -> (h, its int8
    copy (q, dx, xs) as `quantize` makes it) from the same launch (variant v5q), for down_v5's `pre`: by the last
    program of each 32-block where the tile's rows divide 32, in registers where 32 divides them. x_here (variant
    v5qx): no quantizer launch, each gate_up program quantizes x itself (the same int8 copy)."""
    tile = Tile(*(cfg or (GATE_UP5Q if quantize_h else GATE_UP5).get(w.fmt, GATE_UP5[w.fmt]))[:4])
    qh = h_quantizer(tile.bn) if quantize_h else 0
    xq = None if x_here else quantize_x(x, pdl)
    hx = h_int8(h) if qh else (h, h, h)
    launch_gate_up(xq, ids, w, act, alpha, limit, bias, h, hx, tile, qh, pdl, ROUND.get(x.dtype, 0),
                   x if x_here else None)
    if quantize_h:
        return h, (hx if qh else None)
    return h


SPLIT_FORMATS = ("Q4_0", "Q4_K")
SPLIT_WHOLE = {"Q4_0": 1, "Q4_K": 4}      # a piece's steps: whole scale groups (Q4_K's d / dmin come per 4 steps)


def split_formats() -> tuple:
    """The formats gate_up reads in two pieces: env MOETIER_V5_SPLIT (read at each launch, for A/B in one process):
    "0" none, a comma list those of SPLIT_WHOLE (e.g. "Q4_0,Q4_K"), else SPLIT_FORMATS."""
    env = os.environ.get("MOETIER_V5_SPLIT", "1")
    return () if env == "0" else SPLIT_FORMATS if env == "1" else tuple(f for f in env.split(",") if f in SPLIT_WHOLE)


def gate_up_pieces(d: int, fmt: str) -> tuple[int, int]:
    """gate_up's step blocks of a row: v3_pieces', except that a power-of-two count of split_formats() blocks is split
    in two equal pieces of whole scale groups (SPLIT_WHOLE). Two [W NB / 2, rows, 2] tiles put all of a program's
    warps along the rows (one [W NB, rows, 2] tile has two along the words at Q4_0's (32, 0, 8)): _v5_maths adds the
    pieces' block values before one reduction within each warp, no cross-warp sum through shared memory (Q4_0 (32, 0,
    8): 1,696 -> 1,360 SASS instructions a thread; the pair 9.83-9.93 -> 9.14-9.31 us on the H200). Q4_K: v5q's
    pair was slower so (12.66-12.69 -> 12.86-12.91 us, session 35), v5qx's faster (13.79-13.89 -> 12.43-12.54, session
    36: its default); Q6_K's v5q too (14.12-14.25 -> 15.0-15.13): not split."""
    nb1, nb2 = v3_pieces(d, fmt)
    if nb2 == 0 and fmt in split_formats() and nb1 >= 2 and (nb1 // 2) % SPLIT_WHOLE[fmt] == 0:
        return nb1 // 2, nb1 // 2
    return nb1, nb2


def v5_maxnreg(fmt: str, kernel: str = "gate_up") -> dict:
    """A register cap for gate_up (or down), for A/B in one process (env MOETIER_V5_MAXNREG, read at each launch,
    e.g. "Q4_K:128,Q6_K/down:128": ptxas then spills what does not fit; Q4_K's v5qx gate_up at (32, 0, 8) holds 224
    registers, one program an SM, where two fit at 128; Q6_K's down at (8, 0, 2) 255, too many to load its weights
    beside gate_up's program). Measured on an H100 (session 44, pairs interleaved none / cap / none / cap): Q4_K v5qx
    at 128 13.86 -> 16.8 us (248 B spilled a thread), Q6_K v5q 16.5 -> 18.3: slower, no cap ships.
    -> the launch's option, {} without one."""
    want = fmt if kernel == "gate_up" else f"{fmt}/{kernel}"
    for item in filter(None, os.environ.get("MOETIER_V5_MAXNREG", "").split(",")):
        f, _, cap = item.partition(":")
        if f == want and cap.isdigit():
            return {"maxnreg": int(cap)}
    return {}


def h_quantizer(rows: int) -> int:
    """gate_up's QH for a tile of `rows` rows: 2 (32 divides them), 1 (they divide 32), else 0 (none)."""
    return 2 if rows % 32 == 0 else 1 if 32 % rows == 0 else 0


def quantize_x(x, pdl: bool) -> tuple:
    """x's int8 copy for gate_up; with pdl a programmatic dependent whose own dependents are scheduled after its
    wait (PDL_CHAIN)."""
    chain = pdl and PDL_CHAIN
    return quantize(x, wait=chain, trigger=2 if chain else pdl)


def h_int8(h) -> tuple:
    """Room for h's [T*k, I] int8 copy as `quantize` makes it: q int8, dx and xs float32 per 32-block."""
    n, i = h.shape
    return (torch.empty(n, i, dtype=torch.int8, device=h.device),
            *(torch.empty(n, i // 32, dtype=torch.float32, device=h.device) for _ in range(2)))


def launch_gate_up(xq, ids, w, act: int, alpha: float, limit: float, bias, h, hx, tile, qh: int, pdl: bool,
                   rnd: int, x=None):
    """One _gate_up_kernel launch: h of every pair from x's int8 copy xq, h's int8 copy into hx where qh, rounded as
    x's dtype (rnd: ROUND). x given (XQ, xq None): each program makes its own copy of x in a scratch made here."""
    t, d = xq[0].shape if x is None else x.shape
    k, i = ids.numel() // t, w.n // 2
    grid = (t * k, triton.cdiv(i, tile.bn))
    if x is not None:
        xq = (torch.empty(grid[0] * grid[1], d, dtype=torch.int8, device=x.device),
              *(torch.empty(grid[0] * grid[1], d // 32, dtype=torch.float32, device=x.device) for _ in range(2)))
    xw, xd, xs = xq
    b, sb = (bias, bias.stride(0)) if bias is not None else (h, 0)
    nb1, nb2 = gate_up_pieces(d, w.fmt)
    cnt = arrival_counters(h.device, t * k * (i // 32), "gate_up_h") if qh == 1 else xd
    _gate_up_kernel[grid](
        xw.view(torch.int32), xd, xs, ids, *_planes(w), b, sb, h, alpha, limit, *hx, cnt,
        *((x, x.stride(0), xw) if x is not None else (xd, 0, xw)),
        I=i, D=d, KTOP=k, FMT=w.code, ACT=act, HAS_BIAS=bias is not None, BS=STEP_BLOCK[w.fmt], BN=tile.bn,
        NB1=nb1, NB2=nb2, PDL=pdl, EMU=_emulate(), ROUND=rnd, QH=qh, XQ=x is not None,
        NBP=triton.next_power_of_2(d // 32), num_warps=tile.warps, **_trace_args("gate_up", xd),
        **v5_maxnreg(w.fmt), **({"launch_pdl": True} if pdl else {}))


_counters: dict = {}
_kept: list = []
_stamps: dict = {}


def stamps(gate_up: torch.Tensor | None = None, down: torch.Tensor | None = None) -> None:
    """Diagnosis (bench/pair_timeline.py): the next gate_up / down launches write each program's %globaltimer stamps
    into int64 [programs, 5] (`_stamp_store`); None: no stamps (the kernels' own
    code, TRACE off). Launches captured in a CUDA graph keep the buffer they were captured with."""
    _stamps.update(gate_up=gate_up, down=down)


def _trace_args(kernel: str, like: torch.Tensor) -> dict:
    t = _stamps.get(kernel)
    return {"tr_ptr": like if t is None else t, "TRACE": t is not None}


def arrival_counters(device, n: int, purpose: str) -> torch.Tensor:
    """int32 arrival counters for a kernel whose last program per group does the group's final step (the router's
    top-k, gate_up's fused h quantizer): zeroed once, reset to 0 by the programs that use them, so a CUDA graph
    replays with zeros. One buffer per (device, purpose), grown to a power of two when a launch needs more (warm-up
    calls come before a capture); an outgrown buffer is kept, since a captured graph may still point at it.
    Launches of one purpose on one device must not overlap (one decode stream)."""
    key = (device.type, device.index, purpose)
    c = _counters.get(key)
    if c is None or c.numel() < n:
        c = _counters[key] = torch.zeros(1 << max(0, n - 1).bit_length(), dtype=torch.int32, device=device)
        _kept.append(c)
    return c


def down_v5(hx, ids, wt, w, bias, out, cfg=None, pdl: bool = False, pre: tuple | None = None):
    """As triton_decode.down, h quantized to int8 per 32-block first (one more launch) (supports); pre: h's int8
    copy made already (gate_up_v5's quantize_h): no quantizer launch."""
    tile = Tile(*(cfg or DOWN5[w.fmt])[:4])
    hq = pre if pre is not None else quantize(hx, wait=pdl, trigger=pdl)
    return launch_down(hq, ids, wt, w, bias, out, tile, pdl)


def launch_down(hq, ids, wt, w, bias, out, tile, pdl: bool):
    """One _down_kernel launch from h's int8 copy hq (q, dx, xs)."""
    t, d = out.shape
    k, i = ids.numel() // t, w.k
    b, sb = (bias, bias.stride(0)) if bias is not None else (out, 0)
    nb1, nb2 = v3_pieces(i, w.fmt)
    _down_kernel[(t, triton.cdiv(d, tile.bn))](
        hq[0].view(torch.int32), *hq[1:], ids, wt, *_planes(w), b, sb, out, out.stride(0),
        D=d, I=i, KTOP=k, KP=triton.next_power_of_2(k), FMT=w.code, HAS_BIAS=bias is not None,
        BS=STEP_BLOCK[w.fmt], BN=tile.bn, NB1=nb1, NB2=nb2, PDL=pdl, EMU=_emulate(), TRIGGER=pdl and PDL_CHAIN,
        num_warps=tile.warps, **_trace_args("down", out), **v5_maxnreg(w.fmt, "down"),
        **({"launch_pdl": True} if pdl else {}))
    return out


def supports(w, k: int) -> bool:
    """v5 reads FORMATS rows of whole blocks (32; the K-quants, IQ3_XXS and IQ2_XXS 256-super-blocks)."""
    return w.fmt in FORMATS and k % BLOCK[w.fmt] == 0
