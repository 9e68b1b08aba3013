"""Counters of the memory tiers, kept apart for prefill and decode: routes and experts served per
tier, bytes read, time spent; plus prefetch accuracy. `snapshot()` is a plain dict of numbers,
`delta(a, b)` gives a request's share, `request_view` the per-token figures (decode / decode tokens)."""
from __future__ import annotations

import copy

import numpy as np

TIERS = ("gpu", "ram", "ssd")
PHASES = ("prefill", "decode")


class Counters:
    def __init__(self, n_layers: int):
        self.phase = "decode"
        self.routes = {p: {t: 0 for t in TIERS} for p in PHASES}     # (token, expert) pairs served by each tier
        self.experts = {p: {t: 0 for t in TIERS} for p in PHASES}    # expert computations (one per used expert per call)
        self.staged = {p: 0 for p in PHASES}                         # experts copied to a stage slot and run there
        self.pcie = {p: 0 for p in PHASES}      # RAM misses the GPU read over PCIe itself (graphed decode's share)
        self.cpu_s = {p: 0.0 for p in PHASES}
        self.wait_s = {p: 0.0 for p in PHASES}                       # waiting for SSD reads
        self.tokens = {p: 0 for p in PHASES}
        self.layer_routes = np.zeros((n_layers, len(TIERS)), dtype=np.int64)
        self.prefetch = {"predicted": 0, "actual": 0, "correct": 0, "reads": 0, "copies": 0}

    def served(self, li: int, tier: str, routes: int) -> None:
        self.routes[self.phase][tier] += routes
        self.experts[self.phase][tier] += 1
        self.layer_routes[li, TIERS.index(tier)] += routes


def snapshot(tiers) -> dict:
    """All cumulative numbers of a `Tiers` object (resolves pending GPU timers)."""
    c, fast = tiers.stats, tiers.fast
    fb, raw = tiers.pl.expert_fast_bytes, tiers.layout.raw_bytes
    phases = {}
    for p in PHASES:
        ex = c.experts[p]
        phases[p] = {
            "tokens": c.tokens[p], "routes": c.routes[p], "experts": ex, "staged": c.staged[p],
            "pcie": c.pcie[p],
            "bytes": {"gpu": ex["gpu"] * fb, "ram": (ex["ram"] + ex["ssd"]) * raw, "ssd": ex["ssd"] * raw,
                      "copy": fast.bytes_copied[p], "pcie": c.pcie[p] * raw},
            "ms": {"cpu": c.cpu_s[p] * 1e3, "gpu": fast.compute_timer[p].seconds() * 1e3,
                   "copy": fast.copy_timer[p].seconds() * 1e3, "ssd_wait": c.wait_s[p] * 1e3},
        }
    bank = tiers.bank.stats
    return copy.deepcopy({
        **phases, "ssd_bytes_total": tiers.reader.bytes, "ssd_reads": tiers.reader.reads,
        "ssd_busy_ms": tiers.reader.busy_s * 1e3,
        "admissions": tiers.cache.admissions, "evictions": tiers.cache.evictions, "bank_evictions": bank["evictions"],
        "prefetch": {**c.prefetch, "bank_reads": bank["prefetch_reads"], "bank_used": bank["prefetch_used"]},
        "layer_routes": c.layer_routes.tolist(),
    })


def _sub(a, b):
    if isinstance(a, dict):
        return {k: _sub(a[k], b.get(k, 0) if isinstance(b, dict) else 0) for k in a}
    if isinstance(a, list):
        return [_sub(x, y) for x, y in zip(a, b)]
    return a - b


def delta(after: dict, before: dict) -> dict:
    return _sub(after, before)


def hit_rate(routes: dict) -> float:
    total = sum(routes.values())
    return routes["gpu"] / total if total else 1.0


def _add(a: dict, b: dict) -> dict:
    return {k: _add(a[k], b[k]) if isinstance(a[k], dict) else a[k] + b[k] for k in a}


def prefetch_summary(p: dict) -> dict:
    return {"recall": p["correct"] / p["actual"] if p["actual"] else None,
            "precision": p["correct"] / p["predicted"] if p["predicted"] else None,
            "reads": p["reads"], "copies": p["copies"],
            "reads_used": p["bank_used"] / p["bank_reads"] if p.get("bank_reads") else None}


def _phase_view(p: dict) -> dict:
    total = sum(p["routes"].values())
    return {"tokens": p["tokens"], "hits": p["routes"], "hit_rate": hit_rate(p["routes"]),
            "pcie_experts": p.get("pcie", 0),     # of the RAM misses: read by the GPU over PCIe
            "tier_share": {t: (v / total if total else 0.0) for t, v in p["routes"].items()},
            "experts": p["experts"], "bytes_read": p["bytes"], "ms": {k: round(v, 3) for k, v in p["ms"].items()}}


def request_view(d: dict) -> dict:
    """A request's (or the whole run's) numbers: both phases, their sum, and per decode token."""
    dec, pre = d["decode"], d["prefill"]
    n = dec["tokens"]
    per = (lambda v: v / n if n else 0.0)
    both = _phase_view({"tokens": n + pre["tokens"], "pcie": dec.get("pcie", 0) + pre.get("pcie", 0),
                        **{k: _add(dec[k], pre[k]) for k in ("routes", "experts", "bytes", "ms")}})
    return {
        **{k: both[k] for k in ("hits", "hit_rate", "tier_share", "experts", "bytes_read", "ms", "pcie_experts")},
        "decode": _phase_view(dec), "prefill": {**_phase_view(pre), "staged_experts": pre["staged"]},
        "per_token": {"bytes_read": {k: per(v) for k, v in dec["bytes"].items()},
                      "ms": {k: round(per(v), 4) for k, v in dec["ms"].items()},
                      "hits": {k: per(v) for k, v in dec["routes"].items()}, "pcie_experts": per(dec.get("pcie", 0))},
        "decode_tokens": n, "prefill_tokens": pre["tokens"], "staged_prefill_experts": pre["staged"],
        "ssd_bytes_total": d["ssd_bytes_total"], "ssd_reads": d["ssd_reads"], "ssd_busy_ms": round(d["ssd_busy_ms"], 3),
        "admissions": d["admissions"], "evictions": d["evictions"], "bank_evictions": d["bank_evictions"],
        "prefetch": prefetch_summary(d["prefetch"]),
    }
