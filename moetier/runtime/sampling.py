"""Sampling: penalties -> temperature -> top-k -> top-p -> min-p -> draw (the order transformers uses).

Temperature 0 is greedy. A seed makes the draws reproducible (a private torch.Generator).
Repetition penalty (HF semantics) covers prompt and output; presence/frequency penalties
(OpenAI semantics) cover the output only.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UserError


def argmax(logits: torch.Tensor) -> int:
    """torch.argmax of a 1-D tensor (the first maximum, the first NaN if any): numpy's on float32 CPU logits, 3 us
    for 8,192 values where torch's took 9-12 us, ~2% of a default-model token on the Zen 4 dev box (session 13)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 1 and not logits.requires_grad:
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def check(self) -> "SamplingParams":
        bad = []
        if not (self.temperature >= 0):
            bad.append(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            bad.append(f"top_k must be >= 0 (got {self.top_k})")
        if not (0 < self.top_p <= 1):
            bad.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if not (0 <= self.min_p <= 1):
            bad.append(f"min_p must be in [0, 1] (got {self.min_p})")
        if not (self.repetition_penalty > 0):
            bad.append(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")
        if not (-2 <= self.presence_penalty <= 2) or not (-2 <= self.frequency_penalty <= 2):
            bad.append("presence_penalty and frequency_penalty must be in [-2, 2]")
        if bad:
            raise UserError("; ".join(bad))
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, out_counts: torch.Tensor,
                    p: SamplingParams) -> torch.Tensor:
    """logits [V]; seen [V] bool (prompt + output); out_counts [V] (output only). On CUDA over the whole vocabulary
    (no host sync); on the CPU over the seen tokens only (the others keep their logits): 0.73 -> 0.18 ms for a
    151,936-token vocabulary and 600 seen tokens on the dev box (8,192: ~30 us either way)."""
    return (_penalties_dense if logits.is_cuda else _penalties_sparse)(logits, seen, out_counts, p)


def _penalties_dense(logits, seen, out_counts, p):
    if p.repetition_penalty != 1.0:
        penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if p.frequency_penalty or p.presence_penalty:
        logits = logits - p.frequency_penalty * out_counts - p.presence_penalty * (out_counts > 0).to(logits.dtype)
    return logits


def _penalties_sparse(logits, seen, out_counts, p):
    """In numpy on float32 (the same float32 arithmetic as torch's ops; ~8 against ~27 us at 8,192 logits), other
    dtypes in torch."""
    if p.repetition_penalty == 1.0 and not (p.frequency_penalty or p.presence_penalty):
        return logits
    out = logits.clone()
    if out.dtype != torch.float32:
        if p.repetition_penalty != 1.0:
            ids = torch.nonzero(seen).flatten()
            v = out[ids]
            out[ids] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            ids = torch.nonzero(out_counts).flatten()
            c = out_counts[ids]
            out[ids] = out[ids] - p.frequency_penalty * c - p.presence_penalty * (c > 0).to(out.dtype)
        return out
    o = out.numpy()
    r = np.float32(p.repetition_penalty)
    if p.repetition_penalty != 1.0:
        ids = np.flatnonzero(seen.numpy())
        v = o[ids]
        o[ids] = np.where(v > 0, v / r, v * r)
    if p.frequency_penalty or p.presence_penalty:
        c = out_counts.numpy()
        ids = np.flatnonzero(c)
        cc = c[ids]
        o[ids] = (o[ids] - np.float32(p.frequency_penalty) * cc
                  - np.float32(p.presence_penalty) * (cc > 0).astype(np.float32))
    return out


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k / nucleus top-p / min-p sets. logits [V] (already tempered). Masks
    over the whole vocabulary, no host sync: the CUDA sampler's filters (a sort of 151,936 logits is cheap there, a
    sync is not); `candidates` keeps the same sets on the CPU."""
    logits = logits.clone()
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits.double(), dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p    # mass before this token already >= p
        drop[0] = False
        logits[order[drop]] = float("-inf")
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits[probs < min_p * probs.max()] = float("-inf")
    return logits


NUCLEUS_FIRST = 1024     # top-p looks at this many of the largest logits before sorting them all


def candidates(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """The logits that survive top-k (every one >= the k-th largest), then top-p (the smallest set of the largest
    whose probability reaches p: each token whose higher-ranked tokens' mass is still < p), then min-p (probability
    >= min_p x the largest), in that order -> (values, their token ids; None: all of them, unchanged): the sets of
    filter_logits, for the CPU sampler. Works on the survivors only: top-k leaves k of them (in order, unless the
    k-th ties with others), and top-p without top-k first tries the NUCLEUS_FIRST largest (then 8x as many, ...),
    sorting the whole vocabulary only if half of it holds less than p (a 151,936-token vocabulary: 4-20 ms a token
    on a CPU otherwise)."""
    vals, ids, ordered = logits, None, False
    if top_k and top_k < vals.shape[-1]:
        top, idx = torch.topk(vals, top_k)
        if int(torch.count_nonzero(vals >= top[-1])) == top_k:
            vals, ids, ordered = top, idx, True
        else:                                           # ties at the k-th: all of them stay
            ids = torch.nonzero(vals >= top[-1]).flatten()
            vals = vals[ids]
    if top_p < 1.0:
        n = vals.shape[-1]
        lse = torch.logsumexp(vals.double(), -1)        # float64: float32's rounding moved the boundary
        k = n if ordered else min(n, NUCLEUS_FIRST)
        while True:
            top, order = ((vals, None) if ordered else torch.topk(vals, k) if k < n
                          else torch.sort(vals, descending=True))
            p = torch.exp(top.double() - lse)
            before = p.cumsum(-1) - p                   # mass of the tokens ranked above each
            if k == n or before[-1] >= top_p:           # the k-th is dropped, so is every token after it
                break
            k = n if k * 8 > n // 2 else k * 8
        keep = before < top_p
        keep[0] = True
        if ordered:
            vals, ids = vals[keep], ids[keep]
        else:
            order = order[keep]
            vals, ids = vals[order], order if ids is None else ids[order]
    if min_p > 0.0:
        keep = vals >= vals.max() + math.log(min_p)     # p >= min_p * p_max, in logits
        vals, ids = vals[keep], torch.nonzero(keep).flatten() if ids is None else ids[keep]
    return vals, ids


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """An index of probs [n] (sums to ~1) drawn with these probabilities: the inverse of the cumulative sum at one
    uniform number (float64: a token of probability 0 is never drawn). torch.multinomial drew an exponential
    number for every entry: 160 us for 8,192 on a CPU, 3 ms for 151,936."""
    cdf = probs.double().cumsum(-1)
    total = float(cdf[-1])
    if not total > 0:       # NaN or 0: every logit was -inf (a logits processor that allows no token)
        raise RuntimeError("no token can be sampled: every candidate has probability 0 or NaN")
    u = torch.rand((), generator=gen, dtype=torch.float64, device=probs.device) * total
    return min(int(torch.searchsorted(cdf, u.reshape(1), right=True)), probs.shape[-1] - 1)


DEVICE_NUCLEUS = 256     # the CUDA sampler's top-p alone looks at this many of the largest logits (else sorts all V)
TOP_COLS = 2048          # _largest's rows


def _largest(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The m largest of x [n], largest first, and their indices: torch.topk of each row of TOP_COLS (a thread block
    each), then of the rows' winners, until one row is left. torch.topk and torch.sort of one long row run in one
    block (~100-150 us for 151,936 logits on the H200)."""
    ids = None
    while x.shape[-1] > 2 * TOP_COLS and m <= TOP_COLS // 2:
        n = x.shape[-1]
        r = -(-n // TOP_COLS)
        v, i = torch.topk(torch.nn.functional.pad(x, (0, r * TOP_COLS - n), value=float("-inf"))
                          .view(r, TOP_COLS), m, dim=-1)
        i = (i + torch.arange(0, r * TOP_COLS, TOP_COLS, device=x.device)[:, None]).flatten().clamp_(max=n - 1)
        x, ids = v.flatten(), (i if ids is None else ids[i])
    v, i = torch.topk(x, m)
    return v, (i if ids is None else ids[i])


def device_draw(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, p: SamplingParams,
                gen: torch.Generator, full: bool = False) -> torch.Tensor:
    """The sampler without a host sync (the CUDA one): logits [V] float32 -> int64 [3]: the token; 1 if a token could
    be drawn (0: every candidate had probability 0 or NaN); 1 if the candidates held every token the filters keep
    (0: draw again with full=True). Static shapes only, so it can be captured in a CUDA graph (DeviceDraw).

    The same sets as filter_logits. With top-k or top-p the candidates are the top_k + 1 (top-k) or DEVICE_NUCLEUS
    (top-p alone) largest logits (`_largest`), not all V sorted: they hold the filters' whole set when the filters
    drop the last of them (the flag; top-p alone over a flat distribution can miss it); top-p's probabilities are
    over all V logits (or the top-k survivors) in float64, as filter_logits' are. The draw is the Gumbel-max one:
    the argmax of the kept logits minus log E, E exponential, a token with the softmax's probability (no cumulative
    sum over a long row: torch.cumsum of one row is one block too)."""
    x = apply_penalties(logits, seen, counts, p)
    one = torch.ones(1, dtype=torch.long, device=x.device)
    if p.greedy:                                            # penalties, then the argmax (NaN: the first NaN)
        return torch.cat((torch.argmax(x).reshape(1), one, one))
    x = x / p.temperature
    v = x.shape[-1]
    top_k = p.top_k if p.top_k and p.top_k < v else 0
    ids, covered = None, one
    if top_k or p.top_p < 1.0:
        kc = v if full else min(v, top_k + 1 if top_k else DEVICE_NUCLEUS)
        y, (x, ids) = x, (torch.sort(x, descending=True) if kc == v else _largest(x, kc))
        drop = x < x[top_k - 1] if top_k else torch.zeros(kc, dtype=torch.bool, device=x.device)
        if p.top_p < 1.0:
            lse = torch.logsumexp((x.masked_fill(drop, float("-inf")) if top_k else y).double(), -1)
            probs = torch.exp(x.double() - lse).masked_fill(drop, 0.0)
            cut = probs.cumsum(-1) - probs >= p.top_p       # the mass ranked above it already reaches p
            cut[:1].fill_(False)
            drop = drop | cut
        if kc < v:
            covered = drop[-1:].long()
        x = x.masked_fill(drop, float("-inf"))
    if p.min_p > 0.0:
        x = x.masked_fill(x < x.max() + math.log(p.min_p), float("-inf"))
    e = torch.empty_like(x).exponential_(generator=gen)
    best, i = torch.max(x - e.log(), dim=-1, keepdim=True)
    tok = i if ids is None else ids[i]
    return torch.cat((tok, torch.isfinite(best).long(), covered))


class DeviceDraw:
    """A Sampler's draws on CUDA as one graph replay: the logits copied into a fixed buffer, `device_draw` (captured
    at the first call, its generator registered with the graph so each replay draws anew), one read of the token.
    MOETIER_SAMPLER_GRAPH=0, or a graph that cannot be made, runs `device_draw` eagerly: ~40 launches from Python
    (947 against 171 us a call alone at 151,936 logits on the H200; in a decode loop their launches overlap the step's
    GPU work: 601 against 617 tok/s, session 38)."""

    def __init__(self, sampler: "Sampler", vocab: int):
        from ..kernels import triton_sample        # (here: a CPU engine never imports Triton for its sampler)
        self.s = sampler
        self.x = torch.empty(vocab, dtype=torch.float32, device=sampler.device)
        self.graph = self.out = None
        self.seed = None        # MOETIER_SAMPLER=triton: kernels.triton_sample's draw, its counter seeded from gen
        if os.environ.get("MOETIER_SAMPLER") == "triton" and triton_sample.supported(sampler.p, vocab):
            self.seed = torch.randint(0, 1 << 62, (1,), generator=sampler.gen, device=sampler.device)
        if os.environ.get("MOETIER_SAMPLER_GRAPH", "1") != "0":
            try:
                self._capture()
            except Exception as e:      # noqa: BLE001 (an older torch without generator registration, ...)
                logging.getLogger(__name__).warning("the sampler runs eagerly: its CUDA graph failed (%s)", e)
                self.graph = self.out = None

    def _draw(self) -> torch.Tensor:
        if self.seed is not None:
            from ..kernels.triton_sample import triton_draw
            return triton_draw(self.x, self.s.seen, self.s.counts, self.s.p, self.seed, DEVICE_NUCLEUS)
        return device_draw(self.x, self.s.seen, self.s.counts, self.s.p, self.s.gen)

    def _capture(self) -> None:
        self.x.normal_()
        state = self.s.gen.get_state()
        seed = None if self.seed is None else self.seed.clone()
        side = torch.cuda.Stream(self.x.device)
        side.wait_stream(torch.cuda.current_stream(self.x.device))
        with torch.inference_mode(), torch.cuda.stream(side):   # warm-up: lazy initialisations stay out of the graph
            self._draw()
        torch.cuda.current_stream(self.x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(self.s.gen)
        # thread_local: a tier's worker thread may use CUDA meanwhile (a global capture would fail its calls)
        with torch.inference_mode(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = self._draw()
        self.s.gen.set_state(state)         # the warm-up's and the capture's draws are not the sequence's
        if seed is not None:
            self.seed.copy_(seed)
        self.graph, self.out = graph, out

    def __call__(self, logits: torch.Tensor) -> int:
        self.x.copy_(logits.reshape(-1))
        if self.graph is not None:
            self.graph.replay()
            out = self.out
        else:
            out = self._draw()
        tok, ok, covered = out.tolist()
        if not covered:     # the candidates missed part of top-p's set: all V logits sorted (rare)
            tok, ok, _ = device_draw(self.x, self.s.seen, self.s.counts, self.s.p, self.s.gen, full=True).tolist()
        if not ok:
            raise RuntimeError("no token can be sampled: every candidate has probability 0 or NaN")
        return tok


class Sampler:
    """Holds the per-sequence state sampling needs (penalty counts, the RNG)."""

    def __init__(self, params: SamplingParams, vocab_size: int, device, prompt_ids: list[int] = ()):
        self.p = params.check()
        self.device = device
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if len(prompt_ids):
            self.seen[torch.tensor(list(prompt_ids), device=device).clamp_(0, vocab_size - 1)] = True
        self.penalised = params.repetition_penalty != 1.0 or bool(params.frequency_penalty or params.presence_penalty)
        self.gen = torch.Generator(device=device)
        self._graph = None          # DeviceDraw: the CUDA sampler, made at the first sampled token
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    @property
    def plain_greedy(self) -> bool:
        """Greedy without penalties: the token is the logits' argmax alone (a decode graph can make it itself)."""
        return self.p.greedy and not self.penalised

    def observe(self, token: int) -> None:
        if self.penalised:  # only penalties read these (two indexed writes: ~5 us per token on a CPU)
            self.seen[token] = True
            self.counts[token] += 1

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] (any float dtype) -> token id."""
        if self.plain_greedy:  # the decode fast path: one argmax, no copies
            return argmax(logits)
        if logits.is_cuda:
            if self._graph is None:
                self._graph = DeviceDraw(self, logits.shape[-1])
            return self._graph(logits)
        x = apply_penalties(logits.float(), self.seen, self.counts, self.p)
        if self.p.greedy:
            return int(torch.argmax(x))
        x = x / self.p.temperature
        tok = _top_k_draw(x, self.p, self.gen) if 0 < self.p.top_k < x.shape[-1] // 4 else None
        if tok is not None:
            return tok
        vals, ids = candidates(x, self.p.top_k, self.p.top_p, self.p.min_p)
        i = draw(torch.softmax(vals, dim=-1), self.gen)
        return i if ids is None else int(ids[i])


def _top_k_draw(x: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int | None:
    """The CPU sampler's common case, top-k (then top-p, min-p) on float32 logits x [V] (penalised, tempered), with
    the k survivors in numpy: `candidates`' sets and `draw`'s draw (float64 sums, one uniform number of gen) without
    ~20 small torch ops (147 -> ~70 us a token at 8,192 logits on the dev box: the default model's sampled token is
    ~0.5 ms). None where the k-th largest ties with another logit (candidates keeps them all)."""
    top, idx = torch.topk(x, p.top_k)
    t, xs = top.numpy(), x.numpy()
    if int(np.count_nonzero(xs >= t[-1])) != p.top_k:
        return None
    keep = np.ones(p.top_k, dtype=bool)
    if p.top_p < 1.0:
        t64 = t.astype(np.float64)
        e = np.exp(t64 - t64[0])
        q = e / e.sum()                                 # float64, as candidates' logsumexp
        keep = np.cumsum(q) - q < p.top_p
        keep[0] = True
    if p.min_p > 0.0:
        keep &= t >= t.max() + math.log(p.min_p)
    v = t[keep]
    w = np.exp(v - v.max())                             # softmax (float32), then float64 sums as draw's
    cdf = np.cumsum((w / w.sum()).astype(np.float64))
    total = float(cdf[-1])
    if not total > 0:
        raise RuntimeError("no token can be sampled: every candidate has probability 0 or NaN")
    u = float(torch.rand((), generator=gen, dtype=torch.float64)) * total
    i = min(int(np.searchsorted(cdf, u, side="right")), len(v) - 1)
    return int(idx.numpy()[np.flatnonzero(keep)[i]])
