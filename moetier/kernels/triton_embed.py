"""Embedding rows gathered from a table in pinned host memory by a GPU kernel (models.host_embedding).

grid (T, D / BLOCK): out[t, d0:d0+BLOCK] = W[tok[t], d0:d0+BLOCK]. The table is read over PCIe through unified
addressing, 16 bytes per load where the row allows it (kernels.doorbell's gather measured 4-byte host loads at
12.7 GB/s, 16-byte ones at 49 on the H200 box); a token id outside [0, V) is clamped (the engine checks ids
before they get here) so the kernel never reads outside the table.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024            # elements per program


@triton.jit
def _gather_rows_kernel(w_ptr, tok_ptr, out_ptr, V, D: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tok = tl.load(tok_ptr + t).to(tl.int64)
    tok = tl.minimum(tl.maximum(tok, 0), V - 1)
    m = d < D
    row = tl.load(w_ptr + tok * D + d, mask=m, other=0.0)
    tl.store(out_ptr + t * D + d, row, mask=m)


def gather_rows(weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """weight [V, D] (host, pinned on CUDA), tokens [T] int on the target device -> [T, D] there. No host sync."""
    v, d = weight.shape
    flat = tokens.reshape(-1)
    out = torch.empty(flat.numel(), d, dtype=weight.dtype, device=tokens.device)
    if flat.numel():
        _gather_rows_kernel[(flat.numel(), triton.cdiv(d, BLOCK))](
            weight, flat, out, v, D=d, BLOCK=BLOCK, num_warps=4)
    return out.reshape(*tokens.shape, d)
