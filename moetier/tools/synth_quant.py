"""GGML block quantizers in torch (so they run on the GPU while a big synthetic model is written):
Q8_0 and Q4_0 bit-identical to gguf-py's `gguf.quants.quantize` (= ggml's reference), Q4_K with a
plain min/max fit (gguf-py has no Q4_K quantizer), and the matching dequantizers.

quantize(x [rows, cols] float32, qtype) -> uint8 [rows, cols // block * type_size]
"""
from __future__ import annotations

import torch

F32, F16, Q4_0, Q8_0, Q4_K, BF16 = 0, 1, 2, 8, 12, 30
NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q8_0: "Q8_0", Q4_K: "Q4_K", BF16: "BF16"}
BY_NAME = {v: k for k, v in NAMES.items()}
# qtype -> (elements per block, bytes per block)
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q8_0: (32, 34), Q4_K: (256, 144)}
# what a type falls back to when a row is not a whole number of its blocks (as llama-quantize does)
FALLBACK = {Q4_K: Q4_0, Q4_0: Q8_0, Q8_0: BF16}


def pick_type(qtype: int, cols: int) -> int:
    while cols % BLOCK[qtype][0]:
        qtype = FALLBACK[qtype]
    return qtype


def nbytes(qtype: int, shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    block, size = BLOCK[qtype]
    return n // block * size


def _f16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).contiguous().view(torch.uint8).reshape(*t.shape[:-1], -1)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, computed as gguf-py's np_roundf does."""
    a = x.abs()
    fl = torch.floor(a)
    return torch.sign(x) * (fl + torch.floor(2 * (a - fl)))


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    b = x.reshape(-1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(b * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], dim=-1)


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    b = x.reshape(-1, 32)
    imax = b.abs().argmax(-1, keepdim=True)
    d = torch.gather(b, -1, imax) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], dim=-1)


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    b = x.reshape(-1, 8, 32)                                # super-blocks of 8 sub-blocks of 32
    lo = b.amin(-1).clamp(max=0)
    scale, mins = (b.amax(-1) - lo) / 15, -lo               # [n, 8], both >= 0
    d = (scale.amax(-1, keepdim=True) / 63).half().float()
    dmin = (mins.amax(-1, keepdim=True) / 63).half().float()
    sc = torch.where(d > 0, torch.round(scale / d.clamp(min=1e-30)), 0).clamp(0, 63).to(torch.uint8)
    m = torch.where(dmin > 0, torch.round(mins / dmin.clamp(min=1e-30)), 0).clamp(0, 63).to(torch.uint8)
    step, off = d * sc.float(), dmin * m.float()
    q = torch.where(step[..., None] > 0, torch.round((b + off[..., None]) / step.clamp(min=1e-30)[..., None]), 0)
    q = q.clamp(0, 15).to(torch.uint8)                       # [n, 8, 32]
    scales = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], dim=-1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # byte j of pair p: sub-block 2p low, 2p+1 high
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), scales, qs], dim=-1)


def quantize(x: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [rows, cols] -> the GGUF bytes of those rows, uint8 [rows, bytes per row]."""
    rows = x.shape[0]
    if qtype == F32:
        return x.float().contiguous().view(torch.uint8).reshape(rows, -1)
    if qtype in (F16, BF16):
        dt = torch.float16 if qtype == F16 else torch.bfloat16
        return x.to(dt).contiguous().view(torch.uint8).reshape(rows, -1)
    fn = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_K: _q4_k}[qtype]
    return fn(x.float().contiguous()).reshape(rows, -1)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def dequantize(raw: torch.Tensor, qtype: int, shape: tuple) -> torch.Tensor:
    """uint8 bytes -> float32 tensor of `shape` (for the routing check and the tests)."""
    raw = raw.reshape(-1).contiguous()
    if qtype == F32:
        return raw.view(torch.float32).reshape(shape).clone()
    if qtype in (F16, BF16):
        return raw.view(torch.float16 if qtype == F16 else torch.bfloat16).float().reshape(shape)
    blk = raw.reshape(-1, BLOCK[qtype][1])
    if qtype == Q8_0:
        out = _f16(blk[:, :2]) * blk[:, 2:].view(torch.int8).float()
    elif qtype == Q4_0:
        qs = blk[:, 2:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float() - 8
        out = _f16(blk[:, :2]) * q
    else:
        d, dmin, s = _f16(blk[:, :2]), _f16(blk[:, 2:4]), blk[:, 4:16]
        sc = torch.cat([s[:, :4] & 63, (s[:, 8:] & 0xF) | ((s[:, :4] >> 6) << 4)], dim=-1).float()
        m = torch.cat([s[:, 4:8] & 63, (s[:, 8:] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=-1).float()
        qs = blk[:, 16:].reshape(-1, 4, 32)
        q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32).float()
        out = (d * sc)[..., None] * q - (dmin * m)[..., None]
    return out.reshape(shape)
