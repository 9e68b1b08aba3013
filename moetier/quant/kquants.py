"""K-quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256-element super-blocks of 16- or 32-sub-blocks).

`dequant_*`: `[n, type_size]` uint8 -> `[n, 256]` float32, bit-exact with gguf-py (same float32
ops in the same order). `scale_min_k4` is shared with the repacker (moetier.quant.repack).
"""
from __future__ import annotations

import torch

from .bits import f16, shifts

QK_K = 256


def scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte scales -> (sc, mn), each [n, 8] uint8 (6-bit values).
    Bytes 0-3: low 6 bits of sc[0:4] (top 2 bits -> sc[4:8] bits 4-5); bytes 4-7 likewise
    for mn; bytes 8-11: low nibble = sc[4:8] bits 0-3, high nibble = mn[4:8] bits 0-3."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def dequant_q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, qs = b[:, 0:16], b[:, 16:80]                      # 16 sub-blocks of 16
    d, dmin = f16(b[:, 80:82]), f16(b[:, 82:84])
    dl = (d * (sc & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (sc >> 4).float()).view(n, 16, 1)
    q = shifts(qs.view(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K 12 scale bytes -> [n, 16] int8 (6-bit, offset 32 removed).
    Bytes 0-7 give the low nibbles (low halves for sub-blocks 0-7, high halves for 8-15);
    bytes 8-11 give 2-bit highs, shift 2k covering sub-blocks 4k..4k+3."""
    n = s.shape[0]
    lo = shifts(s[:, 0:8], [0, 4], 0x0F).reshape(n, 16)
    hi = shifts(s[:, 8:12], [0, 2, 4, 6], 0x03).reshape(n, 16)
    return (lo | (hi << 4)).to(torch.int8) - 32


def dequant_q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, d = b[:, 0:32], b[:, 32:96], f16(b[:, 108:110])
    dl = (d * q3_k_scales(b[:, 96:108]).float()).view(n, 16, 1)
    ql = shifts(qs.view(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16)
    qh = shifts(hmask.view(n, 1, 32), list(range(8)), 1).reshape(n, 16, 16) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()  # high bit set = no offset
    return (dl * q).reshape(n, QK_K)


def _q45_k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-32 (d * sc, dmin * mn), each [n, 8, 1] float32."""
    n = b.shape[0]
    d, dmin = f16(b[:, 0:2]), f16(b[:, 2:4])
    sc, mn = scale_min_k4(b[:, 4:16])
    return (d * sc.float()).view(n, 8, 1), (dmin * mn.float()).view(n, 8, 1)


def dequant_q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dl, ml = _q45_k_scales(b)
    q = shifts(b[:, 16:144].view(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32).float()
    return (dl * q - ml).reshape(n, QK_K)


def dequant_q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dl, ml = _q45_k_scales(b)
    qh = shifts(b[:, 16:48].view(n, 1, 32), list(range(8)), 1).reshape(n, 8, 32)
    ql = shifts(b[:, 48:176].view(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return (dl * q - ml).reshape(n, QK_K)


def dequant_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc, d = b[:, 192:208].view(torch.int8), f16(b[:, 208:210])
    dl = (d * sc.float()).view(n, 16, 1)
    lo = shifts(ql.reshape(n, 2, 64), [0, 4], 0x0F).reshape(n, 256)
    hi = shifts(qh.reshape(n, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, 256)
    q = (lo | (hi << 4)).to(torch.int8) - 32
    return (dl * q.view(n, 16, 16).float()).reshape(n, QK_K)
