"""Codebook formats: MXFP4, IQ4_NL, IQ4_XS (16-entry value tables) and IQ3_S, IQ3_XXS,
IQ2_S, IQ2_XS, IQ2_XXS (lattice grids of 4 or 8 values per index, plus sign patterns: 7-bit indices, or
IQ2_S / IQ3_S's explicit sign bits).
IQ1_S, IQ1_M: a grid of 8 values in {-1, 0, 1} per 11-bit index, plus a +-1/8 shift (delta).

The grids and value tables are taken from gguf-py's quants module at first use (they are
data, not code); `dequant_*` maps `[n, type_size]` uint8 -> `[n, block_size]` float32,
bit-exact with gguf-py.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import quants as gq

from .bits import f16, i16, i32, shifts, table


def _grid(cls) -> torch.Tensor:
    """gguf-py grid of `cls` as a [n_entries, 4 or 8] float32 tensor."""
    cls.init_grid()
    return torch.from_numpy(np.ascontiguousarray(cls.grid.reshape(cls.grid_shape)))


def _ksigns_bits() -> torch.Tensor:
    """[128, 8] float32 of +-1: sign index (7 bits + parity bit) -> the 8 signs."""
    ks = torch.from_numpy(np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).copy())
    bits = (ks.view(128, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return torch.where(bits == 0, 1.0, -1.0).float()


def _values(cls):
    return lambda: torch.tensor(cls.kvalues, dtype=torch.float32)


def c_tables() -> dict[str, np.ndarray]:
    """The value tables the C kernels need (kernels/cpu.py writes them into a header at build
    time): mxfp4_values int8 [16], iq3xxs_grid uint8 [256, 4], iq2xxs_grid / iq2xs_grid / iq2s_grid
    uint8 [256 / 512 / 1024, 8], iq_ksigns uint8 [128] (bit j set: value j of 8 is negated), taken
    from the same tables the dequantizers use."""
    signs = (_ksigns_bits() < 0).to(torch.uint8) << torch.arange(8, dtype=torch.uint8)   # [128, 8]
    return {"mxfp4_values": _values(gq.MXFP4)().to(torch.int8).numpy(),
            "iq3xxs_grid": _grid(gq.IQ3_XXS).to(torch.uint8).numpy(),
            "iq2xxs_grid": _grid(gq.IQ2_XXS).to(torch.uint8).numpy(),
            "iq2xs_grid": _grid(gq.IQ2_XS).to(torch.uint8).numpy(),
            "iq2s_grid": _grid(gq.IQ2_S).to(torch.uint8).numpy(),
            "iq3s_grid": _grid(gq.IQ3_S).to(torch.uint8).numpy(),           # [512, 4] odd levels 1..15
            "iq1s_grid": _grid(gq.IQ1_S).to(torch.int8).numpy(),            # [2048, 8] of -1, 0, 1 (IQ1_M's too)
            "iq_ksigns": signs.sum(-1, dtype=torch.uint8).numpy()}


def _lookup(name: str, build, idx: torch.Tensor) -> torch.Tensor:
    return table(name, idx.device, build)[idx.long()]


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """MXFP4 shared exponent byte -> 2^(e-128) as float32 (half of the E8M0 scale, since
    the value table holds doubled E2M1 values); e < 2 gives the subnormal patterns."""
    e = e.int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, m, 16] packed -> [n, m, 32]: low nibbles then high nibbles."""
    return shifts(qs, [0, 4], 0x0F).flatten(-2)


def dequant_mxfp4(b: torch.Tensor) -> torch.Tensor:
    d = e8m0_half(b[:, :1])                                     # [n, 1]
    q = _lookup("mxfp4", _values(gq.MXFP4), _nibbles(b[:, 1:]))
    return d * q


def dequant_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = f16(b[:, :2])
    return d * _lookup("iq4nl", _values(gq.IQ4_NL), _nibbles(b[:, 2:]))


def dequant_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, sh = f16(b[:, :2]), i16(b[:, 2:4])
    lo = shifts(b[:, 4:8].unsqueeze(-1), [0, 4], 0x0F).reshape(n, 8)    # byte-major
    hi = shifts(sh, list(range(0, 16, 2)), 0x03).reshape(n, 8)
    sc = ((lo.int() | (hi << 4)) - 32).float()
    dl = (d * sc).view(n, 8, 1)
    q = _lookup("iq4nl", _values(gq.IQ4_NL), _nibbles(b[:, 8:].view(n, 8, 16)))
    return (dl * q).reshape(n, 256)


def _signs(packed: torch.Tensor) -> torch.Tensor:
    """[..., m] int32 words whose four 7-bit fields (bits 0, 7, 14, 21) index sign patterns
    -> [..., m, 4, 8] of +-1."""
    idx = shifts(packed, [0, 7, 14, 21], 0x7F).transpose(-1, -2)
    return _lookup("ksigns", _ksigns_bits, idx)


def dequant_iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = f16(b[:, :2])
    w = i32(b[:, 2:66]).view(n, 8, 2)                # per 32: (4 grid bytes, signs+scale)
    db = (d * (0.5 + (w[..., 1] >> 28 & 0xF).float()) * 0.25).view(n, 8, 1, 1)
    signs = _signs(w[..., 1])                                          # [n, 8, 4, 8]
    grid = _lookup("iq2xxs", lambda: _grid(gq.IQ2_XXS), b[:, 2:66].view(n, 8, 8)[..., :4])
    return (db * grid * signs).reshape(n, 256)


def dequant_iq2_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, qs = f16(b[:, :2]), i16(b[:, 2:66])                             # 32 x u16
    sc = shifts(b[:, 66:74].unsqueeze(-1), [0, 4], 0x0F).reshape(n, 16)
    db = (d * (0.5 + sc.float()) * 0.25).view(n, 16, 1, 1)
    signs = _lookup("ksigns", _ksigns_bits, qs >> 9).view(n, 16, 2, 8)
    grid = _lookup("iq2xs", lambda: _grid(gq.IQ2_XS), qs & 511).view(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def dequant_iq2_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, qs, sg, qh = f16(b[:, :2]), b[:, 2:34], b[:, 34:66], b[:, 66:74]   # 32 index bytes, 32 sign bytes
    sc = shifts(b[:, 74:82].unsqueeze(-1), [0, 4], 0x0F).reshape(n, 16)   # per 16 values
    db = (d * (0.5 + sc.float()) * 0.25).view(n, 16, 1, 1)
    signs = shifts(sg.unsqueeze(-1), list(range(8)), 1).view(n, 16, 2, 8)
    signs = torch.where(signs == 0, 1.0, -1.0)
    hi = shifts(qh.unsqueeze(-1), [0, 2, 4, 6], 0x03).reshape(n, 32)      # index bits 8-9
    grid = _lookup("iq2s", lambda: _grid(gq.IQ2_S), qs.int() | (hi.int() << 8)).view(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def dequant_iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, qs, w = f16(b[:, :2]), b[:, 2:66], i32(b[:, 66:98])            # w: 8 x u32
    db = (d * (0.5 + (w >> 28 & 0xF).float()) * 0.5).view(n, 8, 1, 1)
    signs = _signs(w)                                                  # [n, 8, 4, 8]
    grid = _lookup("iq3xxs", lambda: _grid(gq.IQ3_XXS), qs).view(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


def dequant_iq3_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, qs, qh, sg = f16(b[:, :2]), b[:, 2:66], b[:, 66:74], b[:, 74:106]
    sc = shifts(b[:, 106:110].unsqueeze(-1), [0, 4], 0x0F).reshape(n, 8)
    db = (d * (1 + 2 * sc.int()).float()).view(n, 8, 1, 1)
    signs = shifts(sg.unsqueeze(-1), list(range(8)), 1).view(n, 8, 4, 8)
    signs = torch.where(signs == 0, 1.0, -1.0)
    hi = shifts(qh.unsqueeze(-1), list(range(8)), 1).reshape(n, 64)
    idx = qs.int() | (hi.int() << 8)
    grid = _lookup("iq3s", lambda: _grid(gq.IQ3_S), idx).view(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


def dequant_iq1_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, qs, qh = f16(b[:, :2]), b[:, 2:34], i16(b[:, 34:50])          # qh: 8 x u16, one per 32
    dl = (d * (2 * (qh >> 12 & 7) + 1).float()).view(n, 8, 1, 1)
    delta = torch.where(qh & 0x8000 == 0, 0.125, -0.125).view(n, 8, 1, 1)
    hi = shifts(qh.unsqueeze(-1), [0, 3, 6, 9], 7).reshape(n, 32)    # 3 index bits per 8 values
    grid = _lookup("iq1s", lambda: _grid(gq.IQ1_S), qs.int() | (hi << 8)).view(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, 256)


def dequant_iq1_m(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs, qh, sc = b[:, :32], b[:, 32:48], i16(b[:, 48:56])            # sc: 4 x u16
    bits = sc[:, 0] >> 12 | (sc[:, 1] >> 8 & 0xF0) | (sc[:, 2] >> 4 & 0xF00) | (sc[:, 3] & 0xF000)
    d = ((bits ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16).float().view(n, 1)   # fp16 in the top nibbles
    dl = (d * (2 * shifts(sc.unsqueeze(-1), [0, 3, 6, 9], 7).reshape(n, 16) + 1).float()).view(n, 16, 1, 1)
    nib = shifts(qh.unsqueeze(-1), [0, 4], 0x0F).reshape(n, 32).int()  # per 8 values: 3 index bits, delta sign
    delta = torch.where(nib & 8 == 0, 0.125, -0.125).view(n, 16, 2, 1)
    grid = _lookup("iq1s", lambda: _grid(gq.IQ1_S), qs.int() | ((nib & 7) << 8)).view(n, 16, 2, 8)
    return (dl * (grid + delta)).reshape(n, 256)
