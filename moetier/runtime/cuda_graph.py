"""The decode step as one CUDA graph: static token/position buffers, replayed per token.

Eager PyTorch launches cost more than the whole token on a GPU (LESSONS.md §10: 13-21 ms for 48
layers vs ~3 ms graphed). The graph covers embedding -> all layers -> logits; sampling stays
outside (one host sync per token, which streaming needs anyway).

A one-token graph also makes its greedy next token (argmax) and feeds it to its own input, so `GraphStep` can queue
the next replay before the host reads this one's token (pipelined greedy decoding): the host's sampling, streaming
and launches overlap the GPU's step instead of sitting between two steps.
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
                if t == 1:      # greedy's next input, made here: a replay queued behind this one needs no host token
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
    Pipelined greedy decoding (one-token graphs): `launch(tok)` queues a replay without waiting (tok None: its input
    is the previous replay's argmax, made in the graph), `collect() -> token id` waits for the oldest queued replay
    (and, with tiers, for the CPU's answers to it, given on the tiers' serving thread) and advances the cache,
    `discard()` waits for the rest without advancing it (a step queued past a stop: its KV row lies beyond the
    cache's length, where the next step writes)."""

    DEPTH = 2       # replays queued at once: the one the host waits for, and the next

    def __init__(self, graph: DecodeGraph):
        self.g = graph
        # MOETIER_PIPELINE: auto (default) pipelines graphs without tiers only; 1 tiered graphs too (their CPU answers
        # then come from the tiers' serving thread: at 8 GiB on the H200 box 126 tok/s against 135 served by the
        # host's thread, and wait_add's read of y took 10 us instead of 2.7, session 20: not understood yet); 0 off
        mode = os.environ.get("MOETIER_PIPELINE", "auto")
        if mode not in ("auto", "0", "1"):
            raise UserError(f"MOETIER_PIPELINE={mode!r}: use auto (the default), 1 or 0")
        self.pipelined = graph.next is not None and (mode == "1" or mode == "auto" and graph.tiers is None)
        self.buf = torch.zeros(1, dtype=torch.long, device=graph.tokens.device)
        self.host = torch.zeros(self.DEPTH, dtype=torch.long, pin_memory=True)   # each queued replay's argmax
        # with tiers the host's thread sleeps on a step's event instead of spinning beside the CPU's team (session 20's
        # suspect for the tiered pipelining's slower y reads; untimed)
        self.events = [torch.cuda.Event(blocking=graph.tiers is not None) for _ in range(self.DEPTH)] \
            if self.pipelined else []
        self.queue: deque = deque()      # (host slot, the tiers' serve ticket)
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
        ticket = g.tiers.serve_queued() if g.tiers is not None else 0
        self.queue.append((slot, ticket))

    def _wait(self) -> int:
        slot, ticket = self.queue.popleft()
        if ticket:
            self.g.tiers.wait_served(ticket)
        self.events[slot].synchronize()
        return slot

    def collect(self) -> int:
        slot = self._wait()
        self.g.cache.advance(1)
        return int(self.host[slot])

    def discard(self) -> None:
        err = None
        while self.queue:
            try:
                self._wait()
            except BaseException as e:    # noqa: BLE001 - the rest still waited for, then raised
                err = err or e
        if err is not None:
            raise err
