"""Dense GEMV on GGML planes for decode rows (models.quant_linear.QuantLinear): y [T, N] = x [T, K] @ W^T (+ b).

The expert kernels' v5 math (triton_decode_q8: x quantized to int8 per 32-block by `quantize`, weight words
against activation words in dp4a, every weight load of a program issued before its math), over one weight
matrix instead of slots: grid (N/BN, T), tile [K words, 1, BN]. With `pdl` (CUDA) the GEMV is a programmatic
dependent of the quantizer: its weight loads start while x is quantized.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import triton_decode_q8 as q8
from .pdl import supported as pdl_supported
from .triton_decode import STEP_BLOCK, v3_pieces
from .triton_weights import BLOCK, Weights

WORDS_PER_PROGRAM = 2048        # BN = this / words per row, as the v5 gate_up tile (4 rows x 2 x 256 Q4_0 words)
WARPS = 2


@triton.jit
def _gemv_kernel(xw_ptr, xd_ptr, xs_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, h_ptr, sq_s, sq_n, sd_s, sd_n,
                 sm_s, sm_n, ssc_s, ssc_n, smn_s, smn_n, sh_s, sh_n, b_ptr, out_ptr, stride_o, N,
                 K: tl.constexpr, FMT: tl.constexpr, HAS_BIAS: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                 NB1: tl.constexpr, NB2: tl.constexpr, PDL: tl.constexpr, EMU: tl.constexpr):
    """grid (N/BN, T): out[t, n] = W row n . x[t] (+ b[n]) for BN rows n; slot 0 of the planes. The row tiles
    on axis 0: a vocabulary of 129K rows at BN = 1 is past the 65,535 programs axis 1 allows. PDL: launched as a
    programmatic dependent (the weight loads before the wait for x's grid), and the next kernel may be one."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    r = tl.minimum(n, N - 1).to(tl.int64)[None, :]                                     # [1, BN], in bounds
    xwo = tl.zeros([1, 1], dtype=tl.int64) + t * (K // 4)
    xdo = tl.zeros([1, 1], dtype=tl.int64) + t * (K // 32)
    acc = q8._v5_dot(q_ptr, d_ptr, m_ptr, sc_ptr, h_ptr, r * sq_n, r * sd_n, r * ssc_n, r * sh_n, r >= 0, K // BS,
                     xw_ptr, xwo, xd_ptr, xs_ptr, xdo, FMT, NB1, NB2, PDL, EMU)
    y = tl.sum(acc, axis=0)
    nm = n < N
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=nm)


def use_pdl(x: torch.Tensor) -> bool:
    """The GEMV and its quantizer as programmatic dependents (CUDA); MOETIER_QLINEAR_PDL=0: plain launches (A/B and
    diagnosis)."""
    return os.environ.get("MOETIER_QLINEAR_PDL", "1") != "0" and pdl_supported(x)


def x_int8(x: torch.Tensor) -> tuple:
    """x's int8 copy for gemv's `pre` (as gemv makes it when it has none): one quantizer launch for GEMVs that share
    x (ops.qlinear_parts)."""
    return q8.quantize(x, trigger=use_pdl(x))


def supports(fmt: str, k: int) -> bool:
    """The GEMV reads the v5 formats with whole blocks per row."""
    return fmt in q8.FORMATS and k % BLOCK[fmt] == 0


def gemv(x: torch.Tensor, planes: dict[str, torch.Tensor], fmt: str, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, pdl: bool | None = None, pre: tuple | None = None) -> torch.Tensor:
    """x [T, K] (unit last stride) -> [T, N] in x's dtype: the quantizer, then one GEMV launch. No host sync.
    pre: (q int8 [T, K], dx, xs [T, K/32]) = quantize(x) made already (by the kernel that wrote x): one launch."""
    t, k = x.shape
    w = Weights(planes, fmt)
    if w.k != k:
        raise ValueError(f"x has {k} columns, the {fmt} weight [{w.n}, {w.k}]")
    pdl = use_pdl(x) if pdl is None else pdl and pdl_supported(x)
    out = torch.empty(t, w.n, dtype=x.dtype, device=x.device) if out is None else out
    xq, xd, xs = pre if pre is not None else q8.quantize(x, trigger=pdl)
    words_per_row = k // STEP_BLOCK[fmt] * {"Q4_0": 4, "MXFP4": 4, "IQ3_XXS": 2, "IQ2_XXS": 1}.get(fmt, 8)
    bn = max(1, min(32, WORDS_PER_PROGRAM // words_per_row))
    bn = 1 << (bn.bit_length() - 1)
    nb1, nb2 = v3_pieces(k, fmt)
    _gemv_kernel[(triton.cdiv(w.n, bn), t)](
        xq.view(torch.int32), xd, xs, *q8._planes(w), bias if bias is not None else out, out, out.stride(0), w.n,
        K=k, FMT=w.code, HAS_BIAS=bias is not None, BS=STEP_BLOCK[fmt], BN=bn, NB1=nb1, NB2=nb2, PDL=pdl,
        EMU=q8._emulate(), num_warps=WARPS, **({"launch_pdl": True} if pdl else {}))
    return out
