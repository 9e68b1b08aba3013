"""Prefetch: guess layer L+1's experts while layer L runs, by applying L+1's router to L's input
hidden state (LESSONS.md section 4: ~69% recall in nano-cuda-moe).

Per decode step and layer, the guess for L+1 is scored when L+1 routes for real (recall = right
guesses / experts used; precision = right guesses / guesses). The top `top` ranks that are
missing from the RAM bank start SSD reads; those in RAM but not in the fast tier are admitted
(copied) behind the demand copies. Measured elsewhere: +3-4% at best, negative under LRU and for
file-tier lookahead; so `--prefetch auto` turns it on only for a GPU fast tier with the mix policy.
"""
from __future__ import annotations

import torch


class Prefetcher:
    def __init__(self, tiers, routers: list, top: int = 2, reads: bool = True, copies: bool = True):
        self.tiers = tiers
        self.routers = routers        # routers[li]: the router of MoE layer li (None = unknown)
        self.top, self.reads, self.copies = top, reads, copies
        self.guess: dict[int, set[int]] = {}

    def observe(self, li: int, used: list[int]) -> None:
        """Layer li routed for real: score the guess made one layer earlier."""
        g = self.guess.pop(li, None)
        if g is None:
            return
        p = self.tiers.stats.prefetch
        p["predicted"] += len(g)
        p["actual"] += len(used)
        p["correct"] += len(g.intersection(used))

    @torch.no_grad()
    def predict(self, li: int, x: torch.Tensor) -> None:
        """At layer li (decode), guess li+1's experts from x [T, D] and start the top ranks' reads/copies."""
        nxt = li + 1
        if nxt >= len(self.routers) or self.routers[nxt] is None:
            return
        ids, _ = self.routers[nxt](x)                    # [T, k], ranks in order
        ids = ids.cpu()
        self.guess[nxt] = set(ids.reshape(-1).tolist())
        t = self.tiers
        p = t.stats.prefetch
        for e in dict.fromkeys(ids[:, :self.top].T.reshape(-1).tolist()):   # rank-major, unique
            if t.cache.slot_of[nxt, e] >= 0:
                continue
            s = t.bank.slot_of(nxt, e)
            if s < 0:
                if self.reads and t.bank.prefetch(nxt, e):
                    p["reads"] += 1
            elif self.copies and (nxt, e) not in t.bank.inflight and t.cache.sizes[nxt]:
                adm = t.cache.admit(nxt, e)
                if adm is not None:
                    ev = t.fast.load(adm[0], t.bank.slots[s], nxt)
                    if ev is not None:
                        t.bank.mark_busy(("bank", s), ev)
                    p["copies"] += 1
