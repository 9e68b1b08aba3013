"""The decode step as one CUDA graph: static token/position buffers, replayed per token.

Eager PyTorch launches cost more than the whole token on a GPU (LESSONS.md §10: 13-21 ms for 48
layers vs ~3 ms graphed). The graph covers embedding -> all layers -> logits; sampling stays
outside (one host sync per token, which streaming needs anyway).

A one-token graph without memory tiers also makes its greedy next token (argmax) and feeds it to its own input, so
`GraphStep` can queue the next replay before the host reads this one's token (pipelined greedy decoding): the host's
sampling, streaming and launches overlap the GPU's step instead of sitting between two steps.
"""
from __future__ import annotations

import os
from collections import deque

import torch

from ..errors import UserError
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
                self.next = None
                # greedy's next input, made here: a replay queued behind this one needs no host token (GraphStep
                # pipelines one-token graphs without tiers)
                if t == 1 and tiers is None:
                    self.next = torch.argmax(self.logits[-1]).view(1)
                    self.tokens.copy_(self.next)
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


class GraphStep:
    """A DecodeGraph as generate_stream's decode step. `step(tok) -> logits [V]`: one replay, read by the host.
    Pipelined greedy decoding (one-token graphs without memory tiers): `launch(tok)` queues a replay without waiting
    (tok None: its input is the previous replay's argmax, made in the graph), `collect() -> token id` waits for the
    oldest queued replay and advances the cache, `discard()` waits for the rest without advancing it (a step queued
    past a stop: its KV row lies beyond the cache's length, where the next step writes).
    Tiered graphs are not pipelined: their CPU answers would come from a serving thread, and that was measured no
    faster at 8 GiB (125.0 tok/s against 127.5 on one H200 box) and stalled a GPU test twice (session 21)."""

    DEPTH = 2       # replays queued at once: the one the host waits for, and the next

    def __init__(self, graph: DecodeGraph):
        self.g = graph
        # MOETIER_PIPELINE: 1 (default) pipelines graphs without tiers, 0 none (A/B)
        mode = os.environ.get("MOETIER_PIPELINE", "1")
        if mode not in ("0", "1"):
            raise UserError(f"MOETIER_PIPELINE={mode!r}: use 1 (the default) or 0")
        self.pipelined = graph.next is not None and mode == "1"     # (next: made by graphs without tiers only)
        self.buf = torch.zeros(1, dtype=torch.long, device=graph.tokens.device)
        self.host = torch.zeros(self.DEPTH, dtype=torch.long, pin_memory=True)   # each queued replay's argmax
        self.events = [torch.cuda.Event() for _ in range(self.DEPTH)] if self.pipelined else []
        self.queue: deque = deque()      # host slots of the queued replays
        self.n = 0

    def __call__(self, tok: int) -> torch.Tensor:
        if self.queue:
            raise RuntimeError("GraphStep: a pipelined replay is still queued; collect() or discard() it first")
        return self.g.step(self.buf.fill_(tok))[-1]

    def launch(self, tok: int | None) -> None:
        g = self.g
        if len(self.queue) >= self.DEPTH:
            raise RuntimeError(f"GraphStep: at most {self.DEPTH} replays queued")
        at = g.cache.length + len(self.queue)
        if at + 1 > g.cache.max_len:
            raise ValueError("the cache is full")
        if tok is not None:
            g.tokens.fill_(tok)
        g.pos.fill_(at)
        g.graph.replay()
        slot = self.n % self.DEPTH
        self.n += 1
        self.host[slot:slot + 1].copy_(g.next, non_blocking=True)
        self.events[slot].record()
        self.queue.append(slot)

    def _wait(self) -> int:
        slot = self.queue.popleft()
        self.events[slot].synchronize()
        return slot

    def collect(self) -> int:
        slot = self._wait()
        self.g.cache.advance(1)
        return int(self.host[slot])

    def discard(self) -> None:
        while self.queue:
            self._wait()
