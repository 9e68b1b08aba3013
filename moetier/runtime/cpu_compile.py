"""The CPU decode step compiled by torch.compile (inductor: generated C++), one per Engine.

Eager decode of a small model on the CPU is dispatch-bound (~1,000 tiny ops per token; see
docs/perf-log.md). The compiled step is `model(token [1], cache, pos=p)` — the static-shape
path CUDA graphs use — over views of the KV cut to the next multiple of `BUCKET` positions past
the token, so attention reads only what it needs; the view length is a dynamic dimension, so
one compile serves every length and every session. Experts take `fused_gather_experts` (no
host sync) inside the graph. The compile (~18 s cold, ~4 s with inductor's disk cache warm,
on 2 cores) is paid lazily on the first decode.

    step = CpuDecode(model)            # per Engine
    logits = step(cache, token_id)     # [1, V]; advances the cache
"""
from __future__ import annotations

import types
import warnings

import torch

from ..models.layers import DenseExperts
from .kv_cache import Cache, KVCache

BUCKET = 128  # attention view granularity (positions)


def wanted(mode: str, device: str, tiers, cache: Cache) -> bool:
    """`mode` is EngineConfig.cpu_compile. auto = off: the compile (4-18 s on the 2-core dev box)
    pays back only after ~5,000-20,000 tokens at the measured gain (perf-log 2026-11-30), so it is opt-in."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"cpu_compile must be auto, on or off (got {mode!r})")
    if mode != "on" or device != "cpu" or tiers is not None:
        return False
    return all(type(layer) is KVCache for layer in cache.layers)  # recurrent/int8 caches: eager


class _KVView(KVCache):
    """A KVCache over given k/v views (writes land in the real cache), built inside the graph."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v


def _graph_friendly_experts(model: torch.nn.Module) -> None:
    """Under torch.compile, DenseExperts take fused_gather_experts (no `.tolist()` host sync);
    eager calls keep their own path. Installed once per model, per instance (model code untouched)."""
    for m in model.modules():
        if isinstance(m, DenseExperts) and "forward" not in m.__dict__:
            eager = m.forward

            def forward(self, x, ids, w, eager=eager):
                if torch.compiler.is_compiling():
                    return fused_gather_experts(x, ids, w, self)
                return eager(x, ids, w)
            m.forward = types.MethodType(forward, m)


def fused_gather_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, ex: DenseExperts) -> torch.Tensor:
    """gathered_experts written as multiply + reduce, so inductor fuses the weight gather into the
    dot products instead of copying k expert matrices per token. x [T, D], ids/w [T, k] -> [T, D]."""
    t, k = ids.shape
    flat = ids.reshape(-1)                                                  # [T*k]
    xs = x.repeat_interleave(k, dim=0)                                      # [T*k, D]
    h = (ex.gate_up_proj[flat] * xs[:, None, :]).sum(-1)                    # [T*k, 2I]
    if ex.gate_up_bias is not None:
        h = h + ex.gate_up_bias[flat]
    gate, up = h.chunk(2, dim=-1)
    y = (ex.down_proj[flat] * ex.act(gate, up)[:, None, :]).sum(-1)         # [T*k, D]
    if ex.down_bias is not None:
        y = y + ex.down_bias[flat]
    return (y * w.reshape(-1, 1).to(y.dtype)).view(t, k, -1).sum(1)


class CpuDecode:
    """One compiled one-token decode step for a model; falls back to eager if compiling fails."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        _graph_friendly_experts(model)
        self.compiled = torch.compile(self._forward, fullgraph=True)
        self.failed = False

    def _forward(self, tokens, pos, ks, vs):
        """ks/vs: every layer's KV views (lists, so guards stay cheap); the Cache is built in-graph."""
        cache = Cache([_KVView(k, v) for k, v in zip(ks, vs)], ks[0].shape[0])
        return self.model(tokens, cache, pos=pos)

    def __call__(self, cache: Cache, token: int) -> torch.Tensor:
        start = cache.length
        if start + 1 > cache.max_len:
            raise ValueError("the cache is full")
        tokens = torch.tensor([token], dtype=torch.long)
        if self.failed:
            return self.model(tokens, cache)
        n = min(cache.max_len, (start // BUCKET + 1) * BUCKET)
        ks = [kv.k[:n] for kv in cache.layers]
        vs = [kv.v[:n] for kv in cache.layers]
        for t in ks + vs:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        try:
            logits = self.compiled(tokens, torch.tensor(start), ks, vs)
        except torch._dynamo.exc.TorchDynamoException as e:  # a model the compiler cannot take whole
            warnings.warn(f"cpu_compile: torch.compile failed ({type(e).__name__}: {str(e)[:200]}); "
                          "decoding eagerly. Pass --cpu-compile off to skip the attempt.")
            self.failed = True
            return self.model(tokens, cache)
        cache.advance(1)
        return logits
