"""The import surface of the gated delta rule (DeltaNet layers): Triton kernels (kernels/triton_deltanet.py)
on CUDA (the kernel backend of kernels.ops), else their pure-torch twins in models/deltanet.py;
`use("torch" | "triton")` overrides the choice inside a block (tests, benchmarks).

    out, state = recurrent(q, k, v, g, beta, state, out_state=cache.ssm)      # decode: one launch
    out, state = chunk(q, k, v, g, beta, state, chunk=64, out_state=cache.ssm)  # prefill

q, k [T, H, Dk]; v [T, H, Dv]; g (log decay), beta [T, H]; state [H, Dk, Dv] float32. With `out_state`
the final state lands there (it may be `state` itself: the kernels update it in place).
"""
from __future__ import annotations

import contextlib

import torch

from ..models import deltanet
from . import ops

# On by default since the whole-model logits test (16-token chunks, fp32, 1e-5) passed on the H200
# (its earlier failure was the test's CPU-side cache, not the kernels).
_choice = ops.OpBackend("DeltaNet")
use = _choice.use       # run the DeltaNet ops on "torch" or "triton" inside a block


def backend() -> str:
    return _choice.get()


def _kernels(x: torch.Tensor):
    """The Triton module when it should run on x, else None."""
    if backend() != "triton" or not (x.is_cuda or ops._interpret or _choice.name == "triton"):
        return None
    try:
        from . import triton_deltanet
    except ImportError:
        return None
    return triton_deltanet


def _on_device(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def recurrent(q, k, v, g, beta, state, out_state=None):
    """Token by token (decode, T small): -> (out [T, H, Dv] float32, final state)."""
    tk = _kernels(q)
    if tk is None or q.shape[0] == 0:
        return deltanet.recurrent_gated_delta_rule(q, k, v, g, beta, state, out_state)
    with _on_device(q):
        return tk.recurrent(q, k, v, g, beta, state, out_state)


def chunk(q, k, v, g, beta, state, chunk: int = deltanet.CHUNK, out_state=None):
    """A prompt in chunks of `chunk` tokens: -> (out [T, H, Dv] float32, final state). The kernel runs
    the per-chunk scan (chunk >= 16, a power of 2); the batched preparation is torch either way."""
    tk = _kernels(q)
    if tk is None or chunk < 16 or chunk & (chunk - 1):
        return deltanet.chunk_gated_delta_rule(q, k, v, g, beta, state, chunk, out_state)
    with _on_device(q):
        return deltanet.chunk_gated_delta_rule(q, k, v, g, beta, state, chunk, out_state, scan=tk.chunk_scan)
