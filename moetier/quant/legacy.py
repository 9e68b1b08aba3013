"""Float and legacy block formats: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (32 per block).

Each `dequant_*` maps `[n_blocks, type_size]` uint8 -> `[n_blocks, block_size]` float32 with
the same float32 operations, in the same order, as gguf-py's numpy reference (bit-exact).
Nibble order in a 32-block: byte j holds element j (low nibble) and element j + 16 (high).
"""
from __future__ import annotations

import torch

from .bits import f16, i32, shifts


def dequant_f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def dequant_f16(b: torch.Tensor) -> torch.Tensor:
    return f16(b)


def dequant_bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()  # bf16 -> f32 is a 16-bit shift, exact


def nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed uint8 -> [n, 32] uint8 in element order (low nibbles, then high)."""
    return shifts(qs, [0, 4], 0x0F).reshape(qs.shape[0], 32)


def high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] uint8 (a little-endian u32) -> [n, 32] uint8: bit j of the u32 for element j."""
    return shifts(i32(qh), list(range(32)), 1).reshape(qh.shape[0], 32).to(torch.uint8)


def dequant_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = f16(b[:, :2])                                  # [n, 1]
    return b[:, 2:].view(torch.int8).float() * d       # [n, 32]


def dequant_q4_0(b: torch.Tensor) -> torch.Tensor:
    d = f16(b[:, :2])
    q = nibbles32(b[:, 2:]).to(torch.int8) - 8
    return d * q.float()


def dequant_q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = f16(b[:, :2]), f16(b[:, 2:4])
    return d * nibbles32(b[:, 4:]).float() + m


def dequant_q5_0(b: torch.Tensor) -> torch.Tensor:
    d = f16(b[:, :2])
    q = nibbles32(b[:, 6:]) | (high_bits32(b[:, 2:6]) << 4)
    return d * (q.to(torch.int8) - 16).float()


def q5_0_as_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks uint8 [..., n * 22] -> Q8_0 blocks [..., n * 34] of the same values, exactly: the scale kept, the
    5-bit q - 16 as int8 (dequant_q8_0 then makes dequant_q5_0's products). llama.cpp's K-quant mixes store rows
    whose length is not a multiple of 256 as Q5_0 (Q4_K_M's fallback); the CPU kernels read Q8_0."""
    b = raw.reshape(-1, 22)
    q = (nibbles32(b[:, 6:]) | (high_bits32(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return torch.cat([b[:, :2], q.view(torch.uint8)], 1).reshape(*raw.shape[:-1], raw.shape[-1] // 22 * 34)


def dequant_q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = f16(b[:, :2]), f16(b[:, 2:4])
    q = nibbles32(b[:, 8:]) | (high_bits32(b[:, 4:8]) << 4)
    return d * q.float() + m
