"""GGML formats the GPU reads as stored (no repack planes): IQ4_XS, IQ2_XS, IQ2_S, IQ3_S, IQ1_S, IQ1_M, the experts
of llama.cpp's i-quant mixes, DeepSeek's 1.58-bit IQ1_S / IQ1_M and IQ4_XS files (Q2_K / Q3_K, read as stored before,
have repack planes now).

`deq_raw` dequantizes any elements of GGML rows by byte gathers, as the torch dequantizers of moetier.quant
(kquants / iquants) do, bit for bit: every product there is exact in float32 (an fp16 d times small
integers and grid values), so the order of the factors (or a fused multiply-add) does not change a bit. The rows'
bytes stay in the cache as the file has them (quant.repack passes these formats through as {"raw": rows}), so the
GPU, the CPU kernels and the staging copies share one layout. The kernels that use it (decode: triton_decode's
`_dot_raw`; prefill's grouped GEMM and the one-pass dequantizer: triton_tiles.deq_tile) gather each element's
bytes through L1: a first GPU path for these formats, not a tuned one (docs/perf-log.md has its figures).

lut: the format's value table as float32 (triton_weights.value_table): IQ4_XS the 16 non-linear values, the i-quants
their grids (IQ2_XS [512, 8], IQ2_S [1024, 8], IQ3_S [512, 4], IQ1_S / IQ1_M [2048, 8] of -1, 0, 1).
"""
from __future__ import annotations

import triton
import triton.language as tl

# format codes (triton_weights.FMT_CODES; after the repacked formats' 0 .. 10: IQ2_XXS 8, Q2_K 9, Q3_K 10)
IQ4_XS, IQ2_XS, IQ2_S, IQ3_S, IQ1_S, IQ1_M = (tl.constexpr(c) for c in range(11, 17))
FIRST_RAW = tl.constexpr(11)


@triton.jit
def _b(p, rows, off, m):
    """Byte off of rows (int64 byte offsets), as int32."""
    return tl.load(p + rows + off, mask=m, other=0).to(tl.int32)


@triton.jit
def _u16(p, rows, off, m):
    """The little-endian u16 at byte off, as int32."""
    return _b(p, rows, off, m) | (_b(p, rows, off + 1, m) << 8)


@triton.jit
def _half(v):
    """fp16 bits (int32 0 .. 65535) -> float32, exactly."""
    return v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _sign(bit):
    """A sign bit (0 / 1) -> 1.0 / -1.0."""
    return 1.0 - 2.0 * bit.to(tl.float32)


@triton.jit
def _ksign(s7, v):
    """Bit v (0 .. 7) of gguf's ksigns[s7]: s7's own bits, bit 7 their parity."""
    p = s7 ^ (s7 >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return tl.where(v == 7, p & 1, (s7 >> v) & 1)


@triton.jit
def _scale4(p, rows, at, r, m):
    """The 4-bit scale of 16-element group r // 16: byte at + r // 32, low nibble for the first 16 (IQ2_XS, IQ2_S)."""
    return (_b(p, rows, at + r // 32, m) >> (r // 16 % 2 * 4)) & 15


@triton.jit
def deq_raw(q_ptr, lut_ptr, rows, e, m, FMT: tl.constexpr):
    """Elements e (int32, of a row) of the GGML rows at byte offsets `rows` (broadcast against e; mask m of the
    broadcast shape) -> float32, bit for bit the torch dequantizer's value (0 where m is off)."""
    r = e % 256
    sb = e // 256
    if FMT == IQ4_XS:  # d, scales_h u16, 4 scales_l bytes, 128 nibble bytes (16 per 32): value table
        bb = sb * 136
        i = r // 32
        lo = (_b(q_ptr, rows, bb + 4 + i // 2, m) >> (i % 2 * 4)) & 15
        hi = (_u16(q_ptr, rows, bb + 2, m) >> (2 * i)) & 3
        dl = _half(_u16(q_ptr, rows, bb, m)) * ((lo | (hi << 4)) - 32).to(tl.float32)
        q = (_b(q_ptr, rows, bb + 8 + i * 16 + r % 16, m) >> (r % 32 // 16 * 4)) & 15
        return dl * tl.load(lut_ptr + q, mask=m, other=0.0)
    elif FMT == IQ2_XS:   # d, per 8: u16 (9-bit grid index, 7-bit sign index), 8 scale bytes (4 bits a 16)
        bb = sb * 74
        w = _u16(q_ptr, rows, bb + 2 + r // 8 * 2, m)
        db = _half(_u16(q_ptr, rows, bb, m)) * (0.5 + _scale4(q_ptr, rows, bb + 66, r, m).to(tl.float32)) * 0.25
        g = tl.load(lut_ptr + (w & 511) * 8 + r % 8, mask=m, other=0.0)
        return db * g * _sign(_ksign(w >> 9, r % 8))
    elif FMT == IQ2_S:    # d, 32 index bytes, 32 sign bytes, 8 qh bytes (2 index bits an 8), 8 scale bytes
        bb = sb * 82
        gi = r // 8
        idx = _b(q_ptr, rows, bb + 2 + gi, m) | (((_b(q_ptr, rows, bb + 66 + gi // 4, m) >> (gi % 4 * 2)) & 3) << 8)
        db = _half(_u16(q_ptr, rows, bb, m)) * (0.5 + _scale4(q_ptr, rows, bb + 74, r, m).to(tl.float32)) * 0.25
        g = tl.load(lut_ptr + idx * 8 + r % 8, mask=m, other=0.0)
        return db * g * _sign((_b(q_ptr, rows, bb + 34 + gi, m) >> (r % 8)) & 1)
    elif FMT == IQ3_S:    # d, 64 index bytes, 8 qh bytes (1 index bit a 4), 32 sign bytes, 4 scale bytes
        bb = sb * 110
        gi = r // 4
        idx = _b(q_ptr, rows, bb + 2 + gi, m) | (((_b(q_ptr, rows, bb + 66 + gi // 8, m) >> (gi % 8)) & 1) << 8)
        i = r // 32
        sc = (_b(q_ptr, rows, bb + 106 + i // 2, m) >> (i % 2 * 4)) & 15
        db = _half(_u16(q_ptr, rows, bb, m)) * (1 + 2 * sc).to(tl.float32)
        g = tl.load(lut_ptr + idx * 4 + r % 4, mask=m, other=0.0)
        return db * g * _sign((_b(q_ptr, rows, bb + 74 + r // 8, m) >> (r % 8)) & 1)
    elif FMT == IQ1_S:    # d, 32 index bytes, per 32 a u16 (3 index bits an 8, 3-bit scale, delta's sign)
        bb = sb * 50
        gi = r // 8
        qh = _u16(q_ptr, rows, bb + 34 + r // 32 * 2, m)
        idx = _b(q_ptr, rows, bb + 2 + gi, m) | (((qh >> (gi % 4 * 3)) & 7) << 8)
        dl = _half(_u16(q_ptr, rows, bb, m)) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        delta = tl.where((qh & 0x8000) == 0, 0.125, -0.125)
        return dl * (tl.load(lut_ptr + idx * 8 + r % 8, mask=m, other=0.0) + delta)
    else:                 # IQ1_M: 32 index bytes, 16 qh bytes (a nibble an 8: 3 index bits, delta's sign),
        bb = sb * 56      # 4 u16 of 3-bit scales (one a 16) whose top nibbles hold d
        gi = r // 8
        nib = (_b(q_ptr, rows, bb + 32 + gi // 2, m) >> (gi % 2 * 4)) & 15
        idx = _b(q_ptr, rows, bb + gi, m) | ((nib & 7) << 8)
        d = ((_u16(q_ptr, rows, bb + 48, m) >> 12) | ((_u16(q_ptr, rows, bb + 50, m) >> 8) & 0xF0)
             | ((_u16(q_ptr, rows, bb + 52, m) >> 4) & 0xF00) | (_u16(q_ptr, rows, bb + 54, m) & 0xF000))
        i = r // 16
        s = (_u16(q_ptr, rows, bb + 48 + i // 4 * 2, m) >> (i % 4 * 3)) & 7
        dl = _half(d) * (2 * s + 1).to(tl.float32)
        delta = tl.where((nib & 8) == 0, 0.125, -0.125)
        return dl * (tl.load(lut_ptr + idx * 8 + r % 8, mask=m, other=0.0) + delta)
