"""How synthetic weights make routing realistic, and the check that they do.

Every router input is (nearly) the token's embedding, because residual-branch outputs are scaled
down. Embeddings are built from three zero-mean parts (no positive-mean weights: those collapse all
hidden states onto one direction and every token then picks the same experts):

    e_t = sqrt(D) * (a * mu + b * u[topic(t)] + c * n_t),   a^2 + b^2 + c^2 = 1

mu is one shared unit direction (a > 0 only with --skew), u[c] one unit direction per topic
(topics are contiguous token-id blocks), n_t per-token noise. A router row

    w_e = (beta_e * mu + sigma * r_e) / sqrt(D),   r_e random, orthogonal to mu

gives logits z_e = a * beta_e + sigma * (b * G[e, topic] + c * N): a per-expert offset (the skew:
beta is fitted so expert popularity follows Zipf(S)) plus a part shared by all tokens of a topic
(temporal locality when text stays on a topic) plus noise. lm_head rows lean towards their topic,
so greedy decoding tends to stay on the topic of the last token.
"""
from __future__ import annotations

import math
import zlib
from collections import OrderedDict

import torch

from .synth_shapes import is_moe_layer, num_experts, top_k

SIGMA = 1.0          # router logit noise std
STAY_BOOST = 2.0     # same-topic lm_head logit boost, in noise stds
P_MAX = 0.95         # no expert is picked by more than this fraction of tokens


def seed_of(base: int, key: str) -> int:
    return (base * 1_000_003 + zlib.crc32(key.encode())) % (2 ** 62)


class Structure:
    """The shared directions and per-layer router offsets of one synthetic model (CPU, float32)."""

    def __init__(self, cfg: dict, skew: float = 0.0, locality: float = 0.5, topics: int = 64,
                 topic_run: int = 64, seed: int = 0):
        self.cfg, self.skew, self.seed = cfg, float(skew), seed
        self.D, self.V = cfg["hidden_size"], cfg["vocab_size"]
        self.topics = max(1, min(topics, self.V // 8))
        self.block = self.V // self.topics
        self.topic_run = topic_run
        self.a = 0.5 if skew > 0 else 0.0
        self.b = math.sqrt(max(0.0, min(locality, 0.95)) * (1 - self.a ** 2))
        self.c = math.sqrt(max(0.0, 1 - self.a ** 2 - self.b ** 2))
        g = torch.Generator().manual_seed(seed_of(seed, "structure"))
        mu = torch.randn(self.D, generator=g)
        self.mu = mu / mu.norm()
        u = torch.randn(self.topics, self.D, generator=g)
        u = u - (u @ self.mu)[:, None] * self.mu[None]
        self.u = u / u.norm(dim=1, keepdim=True)
        self._offsets: dict[int, torch.Tensor] = {}
        self._by_rank: torch.Tensor | None = None

    def meta(self) -> dict:
        return {"skew": self.skew, "seed": self.seed, "topics": self.topics, "topic_block": self.block,
                "topic_run": self.topic_run, "shared": self.a, "topic": round(self.b, 4), "noise": round(self.c, 4)}

    def topic_of(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.clamp(ids // self.block, max=self.topics - 1)

    # ------------------------------------------------------------ tensor rows
    def embed_rows(self, r0: int, r1: int, gen: torch.Generator, device) -> torch.Tensor:
        ids = torch.arange(r0, r1)
        base = self.a * self.mu[None] + self.b * self.u[self.topic_of(ids)]
        noise = torch.randn(r1 - r0, self.D, generator=gen, device=device)
        return math.sqrt(self.D) * base.to(device) + self.c * noise

    def lm_head_rows(self, r0: int, r1: int, gen: torch.Generator, device) -> torch.Tensor:
        kappa = STAY_BOOST / (self.b * math.sqrt(self.D)) if self.b > 0 else 0.0
        ids = torch.arange(r0, r1)
        r = torch.randn(r1 - r0, self.D, generator=gen, device=device) / math.sqrt(self.D)
        mu = self.mu.to(device)
        r = r - (r @ mu)[:, None] * mu[None]
        return kappa * self.u[self.topic_of(ids)].to(device) + r

    def router_rows(self, layer: int, r0: int, r1: int, gen: torch.Generator, device) -> torch.Tensor:
        beta = (self.offsets(layer)[r0:r1] / self.a if self.a > 0 else torch.zeros(r1 - r0)).to(device)
        mu = self.mu.to(device)
        r = torch.randn(r1 - r0, self.D, generator=gen, device=device)
        r = r - (r @ mu)[:, None] * mu[None]
        return (beta[:, None] * mu[None] + SIGMA * r) / math.sqrt(self.D)

    # ------------------------------------------------------------ popularity
    def offsets(self, layer: int) -> torch.Tensor:
        """Per-expert logit offsets of a layer, fitted so popularity follows Zipf(skew)."""
        if layer not in self._offsets:
            E = num_experts(self.cfg)
            if self.skew <= 0:
                self._offsets[layer] = torch.zeros(E)
            else:
                if self._by_rank is None:   # fitted once; every layer permutes it
                    g = torch.Generator().manual_seed(seed_of(self.seed, "zipf"))
                    self._by_rank = fit_offsets(self.cfg, zipf_targets(E, top_k(self.cfg), self.skew),
                                                SIGMA * math.sqrt(1 - self.a ** 2), g)
                g = torch.Generator().manual_seed(seed_of(self.seed, f"zipf{layer}"))
                rank = torch.randperm(E, generator=g)      # a different hot set in every layer
                self._offsets[layer] = self._by_rank[rank]
        return self._offsets[layer]

    # ------------------------------------------------------------ token streams
    def stream(self, n: int, seed: int = 0) -> list[int]:
        """Token ids that stay on one topic for ~topic_run tokens at a time (the locality of text)."""
        g = torch.Generator().manual_seed(seed_of(self.seed + seed, "stream"))
        return topic_stream(n, self.topics, self.block, self.topic_run, self.V, g)


def topic_stream(n: int, topics: int, block: int, run: int, vocab: int, g: torch.Generator) -> list[int]:
    """n ids: a topic (block of `block` ids) kept for a geometric ~`run` tokens, ids uniform in it."""
    switch = torch.rand(n, generator=g) < 1.0 / max(1, run)
    new_topic = torch.randint(0, topics, (n,), generator=g)
    offset = torch.randint(0, block, (n,), generator=g)
    out, topic = [], int(new_topic[0])
    for i in range(n):
        if switch[i]:
            topic = int(new_topic[i])
        out.append(min(topic * block + int(offset[i]), vocab - 1))
    return out


def zipf_targets(E: int, k: int, s: float) -> torch.Tensor:
    """Per-token pick probability of each expert (rank order), summing to k, capped at P_MAX."""
    w = torch.arange(1, E + 1, dtype=torch.float64) ** -s
    p = k * w / w.sum()
    for _ in range(E):
        over = p > P_MAX
        if not over.any():
            break
        excess = (p[over] - P_MAX).sum()
        p[over] = P_MAX
        p[~over] += excess * p[~over] / p[~over].sum()
    return p.float()


def fit_offsets(cfg: dict, target: torch.Tensor, noise: float, g: torch.Generator,
                tokens: int = 4096, steps: int = 50) -> torch.Tensor:
    """Logit offsets whose routing (this architecture's, on Gaussian logits) picks each expert
    with probability `target`."""
    z = torch.randn(tokens, target.numel(), generator=g) * noise
    # bounded: a saturated sigmoid (or a group that never wins) must not push offsets to infinity
    lim = 4.0 if cfg["model_type"] in ("deepseek_v3", "glm4_moe") else 8.0 * noise
    off = torch.zeros_like(target)
    for step in range(steps):
        ids = route(cfg, z + off)
        pop = torch.bincount(ids.reshape(-1), minlength=target.numel()).float() / tokens
        rate = 0.7 * (1 - step / steps) + 0.1
        off = (off + rate * noise * (torch.log(target) - torch.log(pop + 0.5 / tokens))).clamp(-lim, lim)
        off = off - off.mean()
    return off


def route(cfg: dict, logits: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Expert ids [T, k] the architecture's router picks from logits [T, E] (best first)."""
    k, mt = top_k(cfg), cfg["model_type"]
    if mt in ("qwen3_moe", "gpt_oss"):            # softmax over all / over the top k: same choice
        return torch.topk(logits if bias is None else logits + bias, k, dim=-1).indices
    s = torch.sigmoid(logits)                       # deepseek_v3, glm4_moe: grouped sigmoid routing
    choice = s if bias is None else s + bias
    groups, keep = cfg.get("n_group", 1), cfg.get("topk_group", 1)
    if groups > 1:
        t, e = choice.shape
        gs = choice.view(t, groups, e // groups).topk(2, dim=-1).values.sum(-1)
        top = torch.topk(gs, keep, dim=-1).indices
        mask = torch.zeros(t, groups, dtype=torch.bool).scatter_(1, top, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // groups, dim=1), 0.0)
    return torch.topk(choice, k, dim=-1).indices


# ---------------------------------------------------------------- the check
def lru_hit_rate(ids: torch.Tensor, capacity: int) -> float:
    """Ideal per-layer LRU: fraction of (token, expert) uses found in a cache of `capacity` experts."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for row in ids.tolist():
        for e in row:
            total += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / max(1, total)


CACHE_FRACTIONS = (0.10, 0.25, 0.50, 0.75)


def layer_stats(ids: torch.Tensor, E: int) -> dict:
    t, k = ids.shape
    counts = torch.bincount(ids.reshape(-1), minlength=E).float()
    p = counts / counts.sum()
    ent = float(-(p[p > 0] * p[p > 0].log()).sum() / math.log(E))
    top1 = torch.bincount(ids[:, 0], minlength=E).float() / t
    ranked = p.sort(descending=True).values
    return {"distinct": int((counts > 0).sum()), "top8_share": round(float(ranked[:8].sum()), 4),
            "topk_share": round(float(ranked[:k].sum()), 4),
            "entropy": round(ent, 4), "top1_max_share": round(float(top1.max()), 4),
            "lru": {f"{int(f * 100)}%": round(lru_hit_rate(ids, max(1, round(f * E))), 4) for f in CACHE_FRACTIONS}}


def spread_problems(stats: list[dict], E: int, k: int) -> list[str]:
    bad = []
    for s in stats:
        if s["top1_max_share"] > 0.5:
            bad.append(f"layer {s['layer']}: {s['top1_max_share']:.0%} of tokens pick the same top expert")
        if s["topk_share"] > 0.75:
            bad.append(f"layer {s['layer']}: the same {k} experts serve {s['topk_share']:.0%} of all routes")
        if s["distinct"] < min(E, 2 * k):
            bad.append(f"layer {s['layer']}: only {s['distinct']} of {E} experts are ever used")
    return bad


def check_routing(cfg: dict, st: Structure, rows, full, names, tokens: int = 512, layers: int = 4) -> dict:
    """Route a topic-local stream of random tokens through the first MoE layers' routers, reading the
    written weights: rows(name, ids) -> float rows, full(name) -> float tensor, names(layer) -> dict
    with norm / router / router_bias / choice_bias tensor names (None where absent)."""
    ids = torch.tensor(st.stream(tokens, seed=1))
    emb = rows(names(None)["embed"], ids).float()                     # [T, D]
    h = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + 1e-6)
    E, k = num_experts(cfg), top_k(cfg)
    out = []
    moe = [i for i in range(cfg["num_hidden_layers"]) if is_moe_layer(cfg, i)][:layers]
    for i in moe:
        n = names(i)
        x = h * full(n["norm"]).float()
        logits = x @ full(n["router"]).float().T
        if n.get("router_bias"):
            logits = logits + full(n["router_bias"]).float()
        bias = full(n["choice_bias"]).float() if n.get("choice_bias") else None
        out.append({"layer": i, **layer_stats(route(cfg, logits, bias), E)})
    return {"tokens": tokens, "experts": E, "top_k": k, "layers": out,
            "problems": spread_problems(out, E, k), "structure": st.meta()}


def format_report(rep: dict) -> str:
    E, k = rep["experts"], rep["top_k"]
    fr = [f"{int(f * 100)}%" for f in CACHE_FRACTIONS]
    lines = [(f"routing check: {rep['tokens']} topic-local random tokens through the written routers "
              f"({E} experts, top-{k}; skew {rep['structure']['skew']}, topics {rep['structure']['topics']})"),
             f"{'layer':>5} {'distinct':>8} {'top8':>6} {'entropy':>7} {'top1max':>7}  ideal-LRU hit rate at "
             + " / ".join(fr) + " of experts"]
    for s in rep["layers"]:
        lines.append(f"{s['layer']:>5} {s['distinct']:>8} {s['top8_share']:>6.1%} {s['entropy']:>7.3f} "
                     f"{s['top1_max_share']:>7.1%}  " + "  ".join(f"{s['lru'][f]:>6.1%}" for f in fr))
    if rep["problems"]:
        bar = "!" * 78
        lines += [bar, "ROUTING SPREAD CHECK FAILED: this checkpoint routes unrealistically; speed measured on it",
                  "would mislead (offloaded runs look far too fast). Problems:"]
        lines += [f"  - {p}" for p in rep["problems"]] + [bar]
    else:
        lines.append("routing spread check passed")
    return "\n".join(lines)
