"""Pure-torch twins of the expert kernels: dequantize to float32, then matmul.

Every fast kernel (kernels/cpu.py, the Triton kernels) is tested against these on random
inputs. They run on any device and are written for clarity, not speed.
"""
from __future__ import annotations

import torch

from moetier.quant.repack import dequantize_repacked


def expert_matvec(qtype, packed: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """y = W @ x for one quantized weight W [N, K] held as `repack(qtype, raw)` planes.
    x: [K] or [T, K] (any float dtype) -> y: [N] or [T, N] float32."""
    w = dequantize_repacked(qtype, packed)            # [N, K] float32
    return x.float() @ w.T
