"""The decode step as one CUDA graph: static token/position buffers, replayed per token.

Eager PyTorch launches cost more than the whole token on a GPU (LESSONS.md §10: 13-21 ms for 48
layers vs ~3 ms graphed). The graph covers embedding -> all layers -> logits; sampling stays
outside (one host sync per token, which streaming needs anyway).
"""
from __future__ import annotations

import torch

from .kv_cache import Cache


class DecodeGraph:
    """Captures model(token [T], cache, pos=p) for one cache; `step(tokens)` replays it at cache.length."""

    def __init__(self, model, cache: Cache, t: int = 1, warmup: int = 2, tiers=None):
        """tiers: a memory.doorbell.GraphTiers whose CPU side answers each replay (tiered experts)."""
        self.model, self.cache, self.t, self.tiers = model, cache, t, tiers
        if tiers is not None:
            tiers.drain()       # no bookkeeping of an earlier graph's steps may run CUDA work during the capture
        dev = next(model.parameters()).device
        self.tokens = torch.zeros(t, dtype=torch.long, device=dev)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        saved = cache.length
        snap = cache.snapshot()  # warm-up and capture write at position 0: put the cache back after
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        if tiers is not None:
            tiers.capturing, tiers.counting = True, False
        try:
            with torch.inference_mode(), torch.cuda.stream(stream):
                for _ in range(warmup):  # warm-up writes land at position 0..t-1 and are overwritten later
                    server = tiers.serve_async() if tiers is not None else None
                    model(self.tokens, cache, pos=self.pos)
                    if server is not None:
                        server.join()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(self.graph):
                self.logits = model(self.tokens, cache, pos=self.pos)
        finally:
            if tiers is not None:
                tiers.capturing, tiers.counting = False, True
        cache.restore(snap)
        cache.length = saved

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [t] (device) -> logits [t, V] (a buffer the next replay overwrites)."""
        if self.cache.length + self.t > self.cache.max_len:
            raise ValueError("the cache is full")
        self.tokens.copy_(tokens)
        self.pos.fill_(self.cache.length)
        self.graph.replay()
        if self.tiers is not None:
            self.tiers.after_step()       # the CPU answers this step's expert misses
        self.cache.advance(self.t)
        return self.logits
