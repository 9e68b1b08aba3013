"""Raw GGML experts in device staging rows -> quant.repack planes of GPU slots, one launch per param.

The graphed decode step's PCIe share (memory/doorbell.py) reads missed experts from the pinned RAM
bank into staging rows, then writes them into stage slots in the decode kernels' layout. In torch
ops (`FastTier.repack_into`) that is several passes per param over every staging row, used or not;
measured on the H200 it decided the share's worth (8 rows repacked where 4 were used: 41 tok/s, rows
sized to the share: 58-62). Here each used row is read once and every field written once; rows whose
stage offset is -1 (unused this layer) cost one load.

Field formats only (each plane a byte range of every block, as quant.repack._FIELDS), plus the K-quants'
unpacked 6-bit scales and mins (quant.kquants.scale_min_k4) in quant.repack's sc plane (per 64-chunk: sc_lo,
sc_hi, mn_lo, mn_hi). Other formats: `supported` is False.

    repack_rows(fmt, staging, stage_off, offset, rows, row_bytes, planes, stage0)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.formats import get_format
from ..quant.repack import _FIELDS

MAX_FIELDS = 4
ROWS = 2                    # rows per program (more programs in flight; each row is ~0.4-1.2 KB)


def supported(fmt: str) -> bool:
    return fmt in _FIELDS and len(_FIELDS[fmt]) <= MAX_FIELDS


@triton.jit
def _field(v, bb, cc, m, row0, p_ptr, ps, pr, slot, OFF: tl.constexpr, SZ: tl.constexpr):
    if SZ > 0:
        dst = p_ptr + slot * ps + row0 * pr + bb * SZ + (cc - OFF)
        tl.store(dst, v, mask=m & (cc >= OFF) & (cc < OFF + SZ))


@triton.jit
def _repack_kernel(src_ptr, soff_ptr, src_stride, p0, p1, p2, p3, ps0, ps1, ps2, ps3, pr0, pr1, pr2, pr3,
                   sc_ptr, sc_s, sc_r, stage0, n_rows,
                   OFF: tl.constexpr, RB: tl.constexpr, NB: tl.constexpr, TS: tl.constexpr, TSP: tl.constexpr,
                   O0: tl.constexpr, S0: tl.constexpr, O1: tl.constexpr, S1: tl.constexpr,
                   O2: tl.constexpr, S2: tl.constexpr, O3: tl.constexpr, S3: tl.constexpr,
                   KQ: tl.constexpr, CB: tl.constexpr, R: tl.constexpr):
    """grid (cdiv(rows, R), staging rows): rows [R] of staging row j -> the planes of slot stage0 + j."""
    j = tl.program_id(1)
    if tl.load(soff_ptr + j) >= 0:
        slot = (stage0 + j).to(tl.int64)
        for rr in range(R):
            row = tl.program_id(0) * R + rr
            if row < n_rows:
                row0 = row.to(tl.int64)
                base = src_ptr + j.to(tl.int64) * src_stride + OFF + row0 * RB
                for b0 in range(0, NB, CB):
                    bb = b0 + tl.arange(0, CB)[:, None]
                    cc = tl.arange(0, TSP)[None, :]
                    m = (bb < NB) & (cc < TS)
                    v = tl.load(base + bb * TS + cc, mask=m, other=0)
                    _field(v, bb, cc, m, row0, p0, ps0, pr0, slot, O0, S0)
                    _field(v, bb, cc, m, row0, p1, ps1, pr1, slot, O1, S1)
                    _field(v, bb, cc, m, row0, p2, ps2, pr2, slot, O2, S2)
                    _field(v, bb, cc, m, row0, p3, ps3, pr3, slot, O3, S3)
                    if KQ:      # 12 scale bytes at 4 -> the sc plane's 16 per block (quant.kquants.scale_min_k4)
                        jj = tl.arange(0, 16)[None, :]          # byte jj: chunk jj // 4's sc_lo, sc_hi, mn_lo, mn_hi
                        bm = bb < NB
                        sub = jj // 4 * 2 + jj % 2              # its sub-block
                        jm = sub % 4
                        blk = base + bb * TS
                        d = tl.load(blk + 4 + jm, mask=bm, other=0).to(tl.int32)
                        mm = tl.load(blk + 8 + jm, mask=bm, other=0).to(tl.int32)
                        md = tl.load(blk + 12 + jm, mask=bm, other=0).to(tl.int32)
                        lo = sub < 4
                        sc = tl.where(lo, d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30))
                        mn = tl.where(lo, mm & 0x3F, (md >> 4) | ((mm >> 2) & 0x30))
                        o = slot * sc_s + row0 * sc_r + bb * 16 + jj
                        tl.store(sc_ptr + o, tl.where(jj % 4 < 2, sc, mn).to(tl.uint8), mask=bm)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A plane [S, rows, w] of any dtype as uint8 [S, rows, w * itemsize] (same memory)."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def repack_rows(fmt: str, staging: torch.Tensor, stage_off: torch.Tensor, offset: int, rows: int,
                row_bytes: int, planes: dict[str, torch.Tensor], stage0: int) -> None:
    """staging uint8 [n, B] (device): row j holds an expert whose param of format fmt sits at byte
    `offset` as [rows, row_bytes]; for every j with stage_off[j] >= 0, write it into slot stage0 + j
    of `planes` (quant.repack's layout: {name: [S, rows, w]}). No host sync; one launch."""
    f = get_format(fmt)
    fields = list(_FIELDS[fmt].items())
    ptrs, ps, pr, os_, ss = [], [], [], [], []
    for name, (off, size, _) in fields:
        p = _bytes(planes[name])
        ptrs.append(p)
        ps.append(p.stride(0))
        pr.append(p.stride(1))
        os_.append(off)
        ss.append(size)
    while len(ptrs) < MAX_FIELDS:
        ptrs.append(staging)
        ps.append(0)
        pr.append(0)
        os_.append(0)
        ss.append(0)
    kq = fmt in ("Q4_K", "Q5_K")
    sc = planes["sc"] if kq else staging
    nb = row_bytes // f.type_size
    tsp = triton.next_power_of_2(f.type_size)
    cb = max(1, min(triton.next_power_of_2(nb), 4096 // tsp))
    n = staging.shape[0]
    _repack_kernel[(triton.cdiv(rows, ROWS), n)](
        staging, stage_off, staging.stride(0), *ptrs, *ps, *pr,
        sc, sc.stride(0) if kq else 0, sc.stride(1) if kq else 0, int(stage0), rows,
        OFF=offset, RB=row_bytes, NB=nb, TS=f.type_size, TSP=tsp,
        O0=os_[0], S0=ss[0], O1=os_[1], S1=ss[1], O2=os_[2], S2=ss[2], O3=os_[3], S3=ss[3],
        KQ=kq, CB=cb, R=ROWS, num_warps=4)
