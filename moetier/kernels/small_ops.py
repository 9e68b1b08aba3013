"""The import surface of the decode step's small fused ops: RMSNorm and the softmax top-k router.
Triton (kernels/triton_small.py) on CUDA for a few tokens, else the twins passed in by the caller
(models/layers.py keeps the math). The backend follows kernels.ops; `use` overrides it (tests run the
kernels on CPU tensors under TRITON_INTERPRET=1).

    y = rms_norm(x, weight, eps, twin)           # x [..., N]; weight None | [N] | [R, N] over dim -2
    ids, w = softmax_topk(logits, k, norm, twin)  # logits [T, E]
"""
from __future__ import annotations

import contextlib
import os

from . import ops

MAX_TOKENS = 64        # above this the step is a prefill chunk: the twins' big kernels are fine
_backend: str | None = None


@contextlib.contextmanager
def use(name: str):
    global _backend
    if name not in ("torch", "triton"):
        raise ValueError(f"unknown backend {name!r}: use 'torch' or 'triton'")
    old, _backend = _backend, name
    try:
        yield
    finally:
        _backend = old


def _triton(x, tokens: int) -> bool:
    if tokens > MAX_TOKENS or not x.is_contiguous():
        return False
    name = _backend or ops.backend()
    return name == "triton" and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def rms_norm(x, weight, eps: float, twin):
    """RMSNorm over the last dim: fp32 statistics, normalised x rounded to x's dtype, times the weight
    in x's dtype (what `twin(x)` computes)."""
    if not _triton(x, x.shape[0] if x.dim() > 1 else 1) or (weight is not None and weight.dtype != x.dtype):
        return twin(x)
    from .triton_small import rms_norm as kernel
    return kernel(x, weight, eps)


def softmax_topk(logits, k: int, normalize: bool, twin):
    if not _triton(logits, logits.shape[0]):
        return twin(logits, k, normalize)
    from .triton_small import softmax_topk as kernel
    return kernel(logits, k, normalize)
