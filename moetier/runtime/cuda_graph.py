"""The decode step as one CUDA graph: static token/position buffers, replayed per token.

Eager PyTorch launches cost more than the whole token on a GPU (LESSONS.md §10: 13-21 ms for 48
layers vs ~3 ms graphed). The graph covers embedding -> all layers -> logits; sampling stays
outside (one host sync per token, which streaming needs anyway).

A one-token graph without memory tiers also makes its greedy next token (argmax) and feeds it to its own input, so
`GraphStep` can queue the next replay before the host reads this one's token (pipelined greedy decoding): the host's
sampling, streaming and launches overlap the GPU's step instead of sitting between two steps.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import deque

import torch

from ..errors import UserError
from .kv_cache import Cache, KVCache, session_cache

log = logging.getLogger(__name__)


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


def prefill_graph_max() -> int:
    """MOETIER_PREFILL_GRAPH_MAX: the longest prompt (tokens) prefilled by a CUDA graph (PrefillGraphs); 0: none."""
    return _env_tokens("MOETIER_PREFILL_GRAPH_MAX", PrefillGraphs.MAX_TOKENS, "0 turns prefill graphs off")


def prefill_graph_context() -> int:
    """MOETIER_PREFILL_GRAPH_CONTEXT: the longest context (cached + new tokens) whose continuation prefill is a CUDA
    graph (PrefillGraphs); 0: fresh prompts only."""
    return _env_tokens("MOETIER_PREFILL_GRAPH_CONTEXT", PrefillGraphs.MAX_CONTEXT,
                       "0 keeps prefill graphs to fresh prompts")


def _env_tokens(name: str, default: int, zero: str) -> int:
    raw = os.environ.get(name, str(default))
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise UserError(f"{name}={raw!r}: give a token count ({zero})")
    return n


class PrefillGraphs:
    """A prompt's prefill (one chunk) as a CUDA graph replay, one graph per bucket of lengths.

    Why: an eager prefill launches ~110 kernels a layer from Python; a 512-token prompt on the 48-layer Q4_0
    30B-A3B shape all on the H200 took 101-142 ms eagerly (the host's enqueue as long as the whole forward) and
    63 ms as one graph replay (docs/perf-log.md, session 33). The prompt is padded to its bucket (BUCKETS, then
    multiples of STEP): the padding comes after every real token, so causal attention never lets a real token see
    it, and each token's MoE is its own. The graph writes K/V into a scratch cache of its own (a session's cache has
    its own addresses); the real positions are copied into the session's cache after the replay. The logits are
    those of the last real position (`CausalLM.forward(last=...)`).
    A fresh prompt (an empty cache) runs the forward over the scratch's first positions. A continuation (a chat's
    next turn: `start` positions cached, start + bucket <= `context`) runs the forward's `pos` mode over the
    scratch's first `keys(start + bucket)` positions (powers of two from KEYS_MIN, capped at `context`; attention
    covers them under the causal mask), after the session's cached K/V are copied into the scratch.
    The first prompt of a (bucket, keys) runs eagerly (its kernels compile there; a shape met once does not pay a
    capture: ~1.3 s for the 48-layer 30B-A3B shape), the second captures its graph, later ones replay it. Only
    caches of plain KVCache layers (no recurrent state, no --kv-dtype / --kv-offload stores) and only on an engine
    without memory tiers; the caller checks the placement."""

    BUCKETS = (16, 32, 64)
    STEP = 128
    MAX_TOKENS = 2048
    MAX_CONTEXT = 8192
    KEYS_MIN = 1024

    def __init__(self, model, dtype, device, max_tokens: int, context: int = 0):
        self.model, self.dtype, self.device = model, dtype, torch.device(device)
        self.max_tokens = max_tokens
        self.context = context                   # 0: fresh prompts only
        self.scratch: Cache | None = None        # made at the first capture: max(max_tokens + STEP, context)
        self.graphs: dict[tuple[int, int], tuple] = {}   # (bucket, keys; 0 fresh) -> (graph, tokens, last, pos, logits)
        self.seen: set[tuple[int, int]] = set()  # graph keys run once eagerly
        self.pool = None
        self.failed: str | None = None           # why capturing stopped (then every prefill runs eagerly)
        self.lock = threading.Lock()

    def bucket(self, n: int) -> int:
        for b in self.BUCKETS:
            if n <= b:
                return b
        return -(-n // self.STEP) * self.STEP

    def keys(self, end: int) -> int:
        """The key-length bucket of a continuation that ends at position `end` (<= context)."""
        return min(max(self.KEYS_MIN, 1 << (end - 1).bit_length()), self.context)

    def applies(self, cache: Cache, n: int) -> bool:
        start = cache.length
        return (self.failed is None and 0 < n <= self.max_tokens
                and (start == 0 or start + self.bucket(n) <= self.context)
                and all(type(layer) is KVCache for layer in cache.layers))

    @staticmethod
    def fits(model, dtype) -> bool:
        """The model's expert layers prefill without a host sync in bf16: GGUF experts as planes, or stacked bf16
        experts without biases (torch._grouped_mm). Others (e.g. biased bf16 experts, whose only capturable form
        copies k whole experts a token) stay eager."""
        from ..models.layers import DenseExperts
        from ..models.quant_experts import QuantExperts
        if dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
            return False
        for m in model.modules():
            if isinstance(m, QuantExperts):
                if m.layout != "planes":
                    return False
            elif isinstance(m, DenseExperts) and (type(m) is not DenseExperts or m.gate_up_bias is not None):
                return False
        return True

    def __call__(self, cache: Cache, tokens: list[int]) -> torch.Tensor | None:
        """Prefill `tokens` into `cache` by a replay -> logits [V] of the last token, or None (the caller runs the
        eager forward: a (bucket, keys)'s first prompt, or a cache or length this does not cover)."""
        n, start = len(tokens), cache.length
        if not self.applies(cache, n):
            return None
        b = self.bucket(n)
        key = (b, self.keys(start + b) if start else 0)
        with self.lock:
            entry = self.graphs.get(key)
            if entry is None:
                if key not in self.seen:
                    self.seen.add(key)
                    return None
                entry = self._capture(*key)
                if entry is None:
                    return None
            graph, buf, last, pos, logits = entry
            buf.copy_(torch.tensor(tokens + [0] * (b - n), dtype=torch.long))    # padded with token 0
            last.fill_(n - 1)
            layers = list(zip(self.scratch.layers, cache.layers))
            if start:
                pos.fill_(start)
                torch._foreach_copy_([t[:start] for mine, _ in layers for t in (mine.k, mine.v)],
                                     [t[:start] for _, layer in layers for t in (layer.k, layer.v)])
            graph.replay()
            end = start + n
            torch._foreach_copy_([t[start:end] for _, layer in layers for t in (layer.k, layer.v)],
                                 [t[start:end] for mine, _ in layers for t in (mine.k, mine.v)])
            cache.advance(n)
            return logits[-1].clone()       # (the next replay of this bucket, from any thread, rewrites the buffer)

    def _capture(self, b: int, keys: int):
        """The graph of token bucket b over `keys` positions of the scratch (0: a fresh prompt's), or None with
        self.failed set where the capture fails (out of memory, an op that syncs with the host)."""
        try:
            if self.scratch is None:
                self.scratch = session_cache(self.model, max(self.max_tokens + self.STEP, self.context), self.dtype,
                                             self.device)
                self.pool = torch.cuda.graph_pool_handle()
            buf = torch.zeros(b, dtype=torch.long, device=self.device)
            last = torch.zeros(1, dtype=torch.long, device=self.device)
            pos = torch.zeros((), dtype=torch.long, device=self.device)
            if keys:        # a continuation: pos mode over the first `keys` positions
                views = Cache([KVCache.of(layer.k[:keys], layer.v[:keys]) for layer in self.scratch.layers], keys)

                def forward():
                    return self.model(buf, views, pos=pos, last=last)
            else:
                def forward():
                    self.scratch.truncate(0)
                    return self.model(buf, self.scratch, last=last)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.inference_mode(), torch.cuda.stream(stream):     # warm-up (rope tables, scratch buffers)
                forward()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
                logits = forward()
            self.scratch.truncate(0)
            torch.cuda.empty_cache()    # the eager warm-up's blocks: the graph's pool holds its own
        except Exception as e:  # noqa: BLE001 (any capture failure: prefill stays eager, said once)
            self.failed = f"{type(e).__name__}: {str(e)[:200]}"
            self.graphs.clear()
            self.scratch = None
            torch.cuda.empty_cache()
            log.warning("prefill CUDA graphs are off for this engine: capture failed (%s)", self.failed)
            return None
        self.graphs[b, keys] = (graph, buf, last, pos, logits)
        return self.graphs[b, keys]
