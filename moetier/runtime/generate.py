"""The generation loop: prefill in chunks, decode token by token, sample, detokenise, stop.

`generate_stream` is the one loop; `Engine.generate` wraps it with tokenisation and sessions.
It yields `TokenEvent`s and one final `Done`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .kv_cache import Cache
from .sampling import Sampler


@dataclass
class TokenEvent:
    token_id: int
    text: str                              # text delta (may be "" while a character or stop string is pending)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class Done:
    finish_reason: str                     # "stop" | "length" | "cancelled"
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    stats: dict = field(default_factory=dict)


class StopMatcher:
    """Finds stop strings in streamed text; holds back a tail that could still become one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""        # all generated text so far
        self.emitted = 0      # chars of self.text already released

    def feed(self, delta: str) -> tuple[str, bool]:
        """-> (text safe to release now, stopped?)."""
        self.text += delta
        if not self.stops:
            out, self.emitted = self.text[self.emitted:], len(self.text)
            return out, False
        search_from = max(0, self.emitted - max(len(s) for s in self.stops))
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out = self.text[self.emitted:end] if end > self.emitted else ""
            self.text, self.emitted = self.text[:end], end
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        safe = len(self.text) - hold
        out = self.text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out, False

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out


def prefill(model, cache: Cache, tokens: list[int], device, chunk: int, every: int = 0,
            on_split: Callable[[], None] | None = None, graphs=None) -> torch.Tensor:
    """Run tokens through the model in chunks; -> logits of the last position [V]. With `every`,
    chunks also end where cache.length reaches a multiple of it, and `on_split()` runs there
    (not after the last token: the caller's turn boundary follows). `graphs` (runtime.cuda_graph.PrefillGraphs):
    a one-chunk prompt into an empty cache may be a graph replay instead."""
    if graphs is not None and not every and len(tokens) <= chunk:
        logits = graphs(cache, tokens)
        if logits is not None:
            return logits
    logits = None
    start = cache.length
    with torch.inference_mode():
        i = 0
        while i < len(tokens):
            end = min(i + chunk, len(tokens))
            if every:
                end = min(end, (start + i) // every * every + every - start)
            part = torch.tensor(tokens[i:end], dtype=torch.long, device=device)
            logits = model(part, cache, last_only=True)[-1]
            i = end
            if every and on_split is not None and i < len(tokens) and (start + i) % every == 0:
                on_split()
    return logits


def generate_stream(model, cache: Cache, prompt: list[int], new_tokens: list[int], sampler: Sampler,
                    max_tokens: int, eos_ids: set[int], detok=None, stops: list[str] = (),
                    logprobs: int | None = None, cancel: Callable[[], bool] | None = None,
                    chunk: int = 2048, cached: int = 0,
                    logits_processor: Callable | None = None,
                    step: Callable[[int], torch.Tensor] | None = None, snapshot_every: int = 0,
                    on_snapshot: Callable[[], None] | None = None,
                    prefill_graphs=None) -> Iterator[TokenEvent | Done]:
    """`cache` already holds prompt[:len(prompt) - len(new_tokens)]; run the rest and decode.
    `logits_processor(out, logits) -> logits` (optional) reshapes what the sampler sees;
    `on_snapshot()` runs each time the prefill reaches a multiple of `snapshot_every` tokens;
    `prefill_graphs`: `prefill`'s graphs."""
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    logits = prefill(model, cache, new_tokens, device, chunk, snapshot_every, on_snapshot, prefill_graphs)
    out: list[int] = []
    matcher = StopMatcher(list(stops))
    finish = "length"
    stop_hit = False  # a stop string matched: the text is final, nothing held back is released
    t_first = None
    room = cache.max_len - cache.length
    # pipelined greedy decoding (runtime.cuda_graph.GraphStep): each step's input is the previous one's argmax, made
    # on the GPU, so the next replay is queued before this token is read; a forcing processor (bench) gives inputs
    # known ahead instead
    forced = getattr(logits_processor, "forced", None)     # n -> the token after n generated ones
    pipe = step if (getattr(step, "pipelined", False) and logprobs is None and sampler.plain_greedy
                    and (logits_processor is None or forced)) else None
    t_last = None
    with torch.inference_mode():
        try:
            while len(out) < max_tokens:
                if cancel is not None and cancel():
                    finish = "cancelled"
                    break
                if pipe is not None and out:
                    tok = pipe.collect()
                    if forced:
                        tok = forced(len(out))
                else:
                    tok = sampler(logits if logits_processor is None else logits_processor(out, logits))
                if t_first is None:
                    sync()
                    t_first = time.perf_counter()
                lp = top = None
                if logprobs is not None:
                    logp = torch.log_softmax(logits.float(), dim=-1)
                    lp = float(logp[tok])
                    if logprobs > 0:
                        v, i = torch.topk(logp, logprobs)
                        top = list(zip(i.tolist(), v.tolist()))
                if tok in eos_ids:
                    finish = "stop"
                    break
                out.append(tok)
                sampler.observe(tok)
                delta = detok.add(tok) if detok is not None else ""
                text, stopped = matcher.feed(delta)
                yield TokenEvent(tok, text, lp, top)
                if stopped:
                    finish, stop_hit = "stop", True
                    break
                if len(out) >= max_tokens or len(out) >= room:
                    finish = "length"
                    break
                if pipe is not None:
                    if not pipe.queue:      # the first decode step: its input from the host
                        pipe.launch(tok)
                    n = len(out) + 1        # the step after it, if its token may be wanted
                    if n < max_tokens and n < room:
                        pipe.launch(forced(len(out)) if forced else None)
                elif step is not None:  # e.g. a CUDA-graph replay
                    logits = step(tok)
                else:
                    logits = model(torch.tensor([tok], device=device), cache, last_only=True)[-1]
        finally:
            if pipe is not None:        # the last token's step is done: a step queued past a stop is not timed
                t_last = time.perf_counter()
                pipe.discard()
    if not stop_hit:  # release what the detokeniser and the stop matcher still hold
        text, stopped = matcher.feed(detok.flush() if detok is not None else "")
        tail = text + ("" if stopped else matcher.flush())
        if tail:
            yield TokenEvent(-1, tail)
        finish = "stop" if stopped else finish
    sync()
    t_end = t_last or time.perf_counter()
    t_first = t_first or t_end
    n_new = len(new_tokens)
    decode_s = t_end - t_first
    stats = {
        "prompt_tokens": len(prompt), "cached_tokens": cached, "generated_tokens": len(out),
        "ttft_s": round(t_first - t0, 6), "prefill_s": round(t_first - t0, 6),
        "prefill_tok_s": round(n_new / (t_first - t0), 3) if t_first > t0 and n_new else 0.0,
        "decode_tok_s": round((len(out) - 1) / decode_s, 3) if len(out) > 1 and decode_s > 0 else 0.0,
        "total_s": round(t_end - t0, 6),
    }
    yield Done(finish, matcher.text, out, list(prompt), stats)


def greedy_tokens(model, prompt: list[int], n: int, dtype=torch.float32) -> list[int]:
    """n greedy tokens after `prompt` (no EOS stop): the reference check used by the tests."""
    device = next(model.parameters()).device
    cache = model.make_cache(len(prompt) + n + 1, dtype, device)
    logits = prefill(model, cache, prompt, device, 4096)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            tok = int(torch.argmax(logits))
            out.append(tok)
            logits = model(torch.tensor([tok], device=device), cache, last_only=True)[-1]
    return out
