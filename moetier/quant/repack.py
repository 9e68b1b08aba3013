"""Lossless repacking of GGML blocks into kernel-friendly planes (struct of arrays).

`repack(qtype, raw)`: raw uint8 [..., N, row_bytes] -> dict of tensors, leading dims kept:
  scales and mins become their own aligned planes (fp16 / uint8 / int8, one entry per
  (sub-)block) and quant bytes become one contiguous plane per row, so a kernel loads each
  with plain strided loads. Nibble planes keep the GGML order inside a 32-element group:
  byte j holds element j (low nibble) and element j + 16 (high nibble).
  K-quant 6-bit scale/min fields are unpacked to one uint8 each per 32 (Q4_K, Q5_K): the
  per-32 float scale is then `float(d) * sc`, exactly what the dequantiser computes. Q4_K / Q5_K
  keep each super-block's d and dmin side by side and a 64-chunk's four scale bytes together, so a
  decode kernel reads each pair / quad as one int32 word (`k_scales`: the four as separate tensors).
Types without a repacked layout pass through as {"raw": raw}.
`dequantize_repacked(qtype, packed)` -> float32 [..., N, K], bit-exact with `dequantize`.

Planes per type (K = row length):
  Q8_0  d f16[K/32]  qs i8[K]              Q4_0 / IQ4_NL  d f16[K/32]  qs u8[K/2]
  Q4_1  d, m f16[K/32]  qs u8[K/2]         Q5_0  d f16[K/32]  qh i32[K/32]  qs u8[K/2]
  Q5_1  d, m f16[K/32]  qh i32[K/32]  qs   MXFP4 e u8[K/32]  qs u8[K/2]
  Q4_K  d f16[K/128] (per 256: d, dmin: the block's first 4 bytes)  sc u8[K/16] (per 64-chunk c:
        sc[2c], sc[2c+1], mn[2c], mn[2c+1])  qs u8[K/2] (per 256: 4 x 32 bytes, byte j of chunk c =
        sub-block 2c element j (low) and sub-block 2c+1 element j (high))
  Q5_K  as Q4_K + qh u8[K/8] (per 256: bit s of byte j = high bit of element 32 s + j)
  Q6_K  d f16[K/256]  sc i8[K/16]  ql u8[K/2]  qh u8[K/4] (GGML order inside each 256)
  IQ3_XXS  d f16[K/256]  sc u8[K/32] (4-bit)  sg i32[K/32] (bit e = sign of element e of the
        32-block: the four 7-bit ksigns indices expanded, parity bit included)  qs u8[K/4] (grid
        indices; byte i -> elements 4i .. 4i+3 of the 4-wide grid row)
  IQ2_XXS  as IQ3_XXS (d, sc, sg the same) but qs u8[K/8]: byte i -> elements 8i .. 8i+7 of the 8-wide grid row
  Q2_K  sc u8[K/16] (low nibble the scale, high the min of 16 elements)  qs u8[K/4] (per 256: 2 x 32 bytes, bits
        2s, 2s + 1 of byte 32j + l = element 128j + 32s + l)  d f16[K/128] (per 256: d, dmin): the block's fields
  Q3_K  qs as Q2_K's (the 2 low bits)  hm u8[K/8] (per 256: bit r // 32 of byte r % 32 = high bit of element r;
        clear: q - 4)  sc i8[K/16] (the 6-bit scales, 32 off: q3_k_scales)  d f16[K/256]
"""
from __future__ import annotations

import torch
from gguf import quants as gq

from .bits import shifts, table, view_bytes
from .formats import dequantize, get_format
from .iquants import _grid, _values, e8m0_half
from .kquants import q3_k_scales, scale_min_k4

# field name -> (byte offset, byte length, dtype) inside one block
_FIELDS = {
    "Q8_0": {"d": (0, 2, torch.float16), "qs": (2, 32, torch.int8)},
    "Q4_0": {"d": (0, 2, torch.float16), "qs": (2, 16, torch.uint8)},
    "IQ4_NL": {"d": (0, 2, torch.float16), "qs": (2, 16, torch.uint8)},
    "Q4_1": {"d": (0, 2, torch.float16), "m": (2, 2, torch.float16), "qs": (4, 16, torch.uint8)},
    "Q5_0": {"d": (0, 2, torch.float16), "qh": (2, 4, torch.int32), "qs": (6, 16, torch.uint8)},
    "Q5_1": {"d": (0, 2, torch.float16), "m": (2, 2, torch.float16), "qh": (4, 4, torch.int32),
             "qs": (8, 16, torch.uint8)},
    "MXFP4": {"e": (0, 1, torch.uint8), "qs": (1, 16, torch.uint8)},
    "Q4_K": {"d": (0, 4, torch.float16), "qs": (16, 128, torch.uint8)},           # d: d, dmin
    "Q5_K": {"d": (0, 4, torch.float16), "qh": (16, 32, torch.uint8), "qs": (48, 128, torch.uint8)},
    "Q6_K": {"ql": (0, 128, torch.uint8), "qh": (128, 64, torch.uint8), "sc": (192, 16, torch.int8),
             "d": (208, 2, torch.float16)},
    "Q2_K": {"sc": (0, 16, torch.uint8), "qs": (16, 64, torch.uint8), "d": (80, 4, torch.float16)},  # d: d, dmin
}
REPACKED = set(_FIELDS) | {"IQ3_XXS", "IQ2_XXS", "Q3_K"}


def repack(qtype, raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """raw uint8 [..., N, row_bytes] -> planes (see module doc). Lossless."""
    fmt = get_format(qtype)
    if fmt.name not in REPACKED:
        return {"raw": raw}
    if raw.dtype != torch.uint8 or raw.dim() < 2 or raw.shape[-1] % fmt.type_size:
        raise ValueError(f"repack({fmt.name}) needs uint8 [..., N, row_bytes] with row_bytes a "
                         f"multiple of {fmt.type_size}; got {raw.dtype} {tuple(raw.shape)}")
    lead, nb = raw.shape[:-1], raw.shape[-1] // fmt.type_size
    blocks = raw.reshape(*lead, nb, fmt.type_size)
    if fmt.name == "IQ3_XXS":
        return _repack_iq3_xxs(blocks, lead)
    if fmt.name == "IQ2_XXS":
        return _repack_iq2_xxs(blocks, lead)
    if fmt.name == "Q3_K":
        return _repack_q3_k(blocks, lead)
    out = {}
    for name, (off, size, dtype) in _FIELDS[fmt.name].items():
        field = view_bytes(blocks[..., off:off + size], dtype)          # [..., nb, size / itemsize]
        out[name] = field.reshape(*lead, -1).contiguous()
    if fmt.name in ("Q4_K", "Q5_K"):
        sc, mn = scale_min_k4(blocks[..., 4:16].reshape(-1, 12))
        out["sc"] = _chunk_scales(sc, mn).reshape(*lead, -1)
    return out


def _chunk_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """sc, mn [..., 8] per super-block -> [..., 16]: per 64-chunk c, sc[2c], sc[2c+1], mn[2c], mn[2c+1]."""
    return torch.stack([sc[..., 0::2], sc[..., 1::2], mn[..., 0::2], mn[..., 1::2]], dim=-1).flatten(-2)


def k_planes(d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor) -> dict[str, torch.Tensor]:
    """Q4_K / Q5_K scales as separate tensors (d, dmin f16 [..., K/256]; sc, mn u8 [..., K/32]) -> the d and sc
    planes of `repack` (module doc), for code that builds planes without GGML blocks."""
    pair = torch.stack([d.half(), dmin.half()], dim=-1).flatten(-2).contiguous()
    quad = _chunk_scales(sc.to(torch.uint8).unflatten(-1, (-1, 8)), mn.to(torch.uint8).unflatten(-1, (-1, 8)))
    return {"d": pair, "sc": quad.flatten(-2).contiguous()}


def k_scales(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K planes -> (d, dmin f16 [..., K/256], sc, mn u8 [..., K/32]): the scales as separate tensors
    (the inverse of `k_planes`)."""
    quad = _groups(p["sc"], 4)                                           # [..., K/64, 4]
    return (p["d"][..., 0::2], p["d"][..., 1::2], quad[..., 0:2].flatten(-2), quad[..., 2:4].flatten(-2))


def _sign_words(w: torch.Tensor) -> torch.Tensor:
    """u32 words [..., m] whose bits 0-27 are four 7-bit ksigns indices (one per 8 elements) -> int32 [..., m]:
    bit e = sign of element e of the 32-block (the parity bit included)."""
    idx = shifts(w.unsqueeze(-1), [0, 7, 14, 21], 0x7F)                    # [..., m, 4, 1]
    ks = table("iq3xxs_ksigns", w.device,      # cached per device: no H2D copy per call (CUDA-graph safe)
               lambda: torch.tensor([i | (i.bit_count() & 1) << 7 for i in range(128)], dtype=torch.int32))
    sh = table("iq3xxs_shift", w.device, lambda: torch.tensor([0, 8, 16, 24], dtype=torch.int32))
    return (ks[idx.long()].squeeze(-1) << sh).sum(-1, dtype=torch.int32)


def _repack_iq3_xxs(blocks: torch.Tensor, lead) -> dict[str, torch.Tensor]:
    """[..., nb, 98] blocks -> d, sc, sg, qs planes (module doc)."""
    w = view_bytes(blocks[..., 66:98], torch.int32)                        # [..., nb, 8] u32 bit patterns
    return {"d": view_bytes(blocks[..., 0:2], torch.float16).reshape(*lead, -1),
            "sc": ((w >> 28) & 0xF).to(torch.uint8).reshape(*lead, -1),
            "sg": _sign_words(w).reshape(*lead, -1).contiguous(),
            "qs": blocks[..., 2:66].reshape(*lead, -1).contiguous()}


def _repack_iq2_xxs(blocks: torch.Tensor, lead) -> dict[str, torch.Tensor]:
    """[..., nb, 66] blocks (d, then per 32: 4 grid bytes, a u32 of signs and scale) -> d, sc, sg, qs planes."""
    q = blocks[..., 2:66].reshape(*blocks.shape[:-1], 8, 8)                # [..., nb, 8 per 32, 8 bytes]
    w = view_bytes(q[..., 4:8], torch.int32).squeeze(-1)                    # [..., nb, 8] u32 bit patterns
    return {"d": view_bytes(blocks[..., 0:2], torch.float16).reshape(*lead, -1),
            "sc": ((w >> 28) & 0xF).to(torch.uint8).reshape(*lead, -1),
            "sg": _sign_words(w).reshape(*lead, -1).contiguous(),
            "qs": q[..., 0:4].reshape(*lead, -1).contiguous()}


def _repack_q3_k(blocks: torch.Tensor, lead) -> dict[str, torch.Tensor]:
    """[..., nb, 110] blocks (hmask, qs, 12 scale bytes, d) -> qs, hm, sc, d planes (module doc)."""
    return {"qs": blocks[..., 32:96].reshape(*lead, -1).contiguous(),
            "hm": blocks[..., 0:32].reshape(*lead, -1).contiguous(),
            "sc": q3_k_scales(blocks[..., 96:108].reshape(-1, 12)).reshape(*lead, -1),
            "d": view_bytes(blocks[..., 108:110], torch.float16).reshape(*lead, -1)}


def dequantize_repacked(qtype, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """Planes from `repack` -> float32 [..., N, K] (bit-exact with `dequantize(raw)`)."""
    fmt = get_format(qtype)
    if "raw" in packed:
        raw = packed["raw"]
        shape = (*raw.shape[:-1], raw.shape[-1] // fmt.type_size * fmt.block_size)
        return dequantize(raw, fmt, shape)
    return _DEQUANT[fmt.name](packed)


def _groups(t: torch.Tensor, size: int) -> torch.Tensor:
    """[..., M] -> [..., M / size, size]."""
    return t.reshape(*t.shape[:-1], -1, size)


def _nib32(qs: torch.Tensor) -> torch.Tensor:
    """[..., K/2] nibble plane -> [..., K/32, 32] uint8 values in element order."""
    return shifts(_groups(qs, 16), [0, 4], 0x0F).flatten(-2)


def _hbit32(qh: torch.Tensor) -> torch.Tensor:
    """[..., K/32] int32 high-bit words -> [..., K/32, 32] uint8 bits."""
    return shifts(qh.unsqueeze(-1), list(range(32)), 1).flatten(-2).to(torch.uint8)


def _rows(v: torch.Tensor) -> torch.Tensor:
    """[..., nb, bs] -> [..., nb * bs]."""
    return v.flatten(-2)


def _q8_0(p):
    return _rows(_groups(p["qs"], 32).float() * p["d"].float().unsqueeze(-1))


def _q4_0(p):
    return _rows(p["d"].float().unsqueeze(-1) * (_nib32(p["qs"]).to(torch.int8) - 8).float())


def _iq4_nl(p):
    lut = table("iq4nl", p["qs"].device, _values(gq.IQ4_NL))
    return _rows(p["d"].float().unsqueeze(-1) * lut[_nib32(p["qs"]).long()])


def _q4_1(p):
    d, m = p["d"].float().unsqueeze(-1), p["m"].float().unsqueeze(-1)
    return _rows(d * _nib32(p["qs"]).float() + m)


def _q5(p):
    q = _nib32(p["qs"]) | (_hbit32(p["qh"]) << 4)
    d = p["d"].float().unsqueeze(-1)
    if "m" in p:
        return _rows(d * q.float() + p["m"].float().unsqueeze(-1))
    return _rows(d * (q.to(torch.int8) - 16).float())


def _mxfp4(p):
    lut = table("mxfp4", p["qs"].device, _values(gq.MXFP4))
    return _rows(e8m0_half(p["e"]).unsqueeze(-1) * lut[_nib32(p["qs"]).long()])


def _q45_k(p):
    d, dmin, sc, mn = k_scales(p)
    d = d.float().repeat_interleave(8, dim=-1).unsqueeze(-1)             # [..., K/32, 1]
    dmin = dmin.float().repeat_interleave(8, dim=-1).unsqueeze(-1)
    dl, ml = d * sc.float().unsqueeze(-1), dmin * mn.float().unsqueeze(-1)
    ql = shifts(_groups(p["qs"], 32).unflatten(-2, (-1, 4)), [0, 4], 0x0F)  # [..., K/256, 4, 2, 32]
    q = ql.reshape(*dl.shape[:-1], 32)
    if "qh" in p:
        qh = shifts(_groups(p["qh"], 32), list(range(8)), 1)           # [..., K/256, 8, 32]
        q = q | (qh.reshape(q.shape) << 4)
    return _rows(dl * q.float() - ml)


def _q6_k(p):
    ql = shifts(_groups(p["ql"], 64).unflatten(-2, (-1, 2)), [0, 4], 0x0F)   # [.., K/256, 2, 2, 64]
    qh = shifts(_groups(p["qh"], 32).unflatten(-2, (-1, 2)), [0, 2, 4, 6], 3)  # [.., K/256, 2, 4, 32]
    lead = p["sc"].shape[:-1]
    q = (ql.reshape(*lead, -1) | (qh.reshape(*lead, -1) << 4)).to(torch.int8) - 32
    d = p["d"].float().repeat_interleave(16, dim=-1)                    # [..., K/16]
    dl = (d * p["sc"].float()).unsqueeze(-1)
    return _rows(dl * _groups(q, 16).float())


def _iq_xxs(p, name: str, cls, half: float):
    """IQ3_XXS / IQ2_XXS planes: value = d * (0.5 + sc) * half * grid[qs][j] * sign (grid rows of 4 / 8)."""
    sc = p["sc"].float()
    lead = sc.shape[:-1]
    d = p["d"].float().repeat_interleave(8, dim=-1)                      # [..., K/32]
    db = (d * (0.5 + sc) * half).unsqueeze(-1)
    grid = table(name, p["qs"].device, lambda: _grid(cls))[p["qs"].long()]   # [..., K / 4 or 8, 4 or 8]
    bits = shifts(p["sg"].unsqueeze(-1), list(range(32)), 1).flatten(-2)  # [..., K/32, 32]
    signs = torch.where(bits == 0, 1.0, -1.0)
    return _rows(db * grid.reshape(*lead, -1, 32) * signs)


def _iq3_xxs(p):
    return _iq_xxs(p, "iq3xxs", gq.IQ3_XXS, 0.5)


def _iq2_xxs(p):
    return _iq_xxs(p, "iq2xxs", gq.IQ2_XXS, 0.25)


def _q2_bits(qs: torch.Tensor) -> torch.Tensor:
    """[..., K/4] Q2_K / Q3_K qs plane -> [..., K/16, 16] uint8 2-bit values in element order."""
    q = shifts(_groups(qs, 32).unflatten(-2, (-1, 2)), [0, 2, 4, 6], 3)     # [..., K/256, 2, 4, 32]
    return q.reshape(*qs.shape[:-1], -1, 16)


def _q2_k(p):
    d = p["d"][..., 0::2].float().repeat_interleave(16, dim=-1)            # [..., K/16]
    dmin = p["d"][..., 1::2].float().repeat_interleave(16, dim=-1)
    dl, ml = (d * (p["sc"] & 0x0F).float()).unsqueeze(-1), (dmin * (p["sc"] >> 4).float()).unsqueeze(-1)
    return _rows(dl * _q2_bits(p["qs"]).float() - ml)


def _q3_k(p):
    dl = (p["d"].float().repeat_interleave(16, dim=-1) * p["sc"].float()).unsqueeze(-1)   # [..., K/16, 1]
    hb = shifts(_groups(p["hm"], 32), list(range(8)), 1) ^ 1              # [..., K/256, 8, 32]: 1 = take 4 off
    q = _q2_bits(p["qs"]).to(torch.int8) - (hb.reshape(*hb.shape[:-3], -1, 16) << 2).to(torch.int8)
    return _rows(dl * q.float())


_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "IQ4_NL": _iq4_nl, "Q4_1": _q4_1, "Q5_0": _q5,
            "Q5_1": _q5, "MXFP4": _mxfp4, "Q4_K": _q45_k, "Q5_K": _q45_k, "Q6_K": _q6_k, "IQ3_XXS": _iq3_xxs,
            "IQ2_XXS": _iq2_xxs, "Q2_K": _q2_k, "Q3_K": _q3_k}
