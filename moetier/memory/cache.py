"""The fast tier's expert slots and the policy that fills them.

MoE layer `li` owns the global slots [base[li], base[li] + size[li]) of the fast-tier arena.
`table` [L, E] int32 on the fast device maps (layer, expert) -> global slot or -1, so the hit path
can find its slots on the device without a host lookup; `slot_of` is its host mirror.

Policies (LESSONS.md section 2):
  lru     evict the least recently used expert of the layer; admit every decode miss
  lfu     evict the lowest aged route count (counts decay by `decay` per call of the layer);
          admit a miss only if its aged count beats the victim's (stops churn)
  static  only the experts pinned from a profile; nothing is admitted
  mix     pinned hot set from a profile + an LRU over the layer's remaining slots
Pinned experts are never evicted. Counts are per route (a token routed to an expert).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

POLICIES = ("lru", "lfu", "static", "mix")


class SlotCache:
    def __init__(self, num_experts: int, sizes: list[int], policy: str = "lru",
                 device: str | torch.device = "cpu", decay: float = 0.97):
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.num_experts, self.policy, self.decay = num_experts, policy, decay
        self.sizes = [min(int(s), num_experts) for s in sizes]
        self.base = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        n_layers = len(self.sizes)
        self.slot_of = np.full((n_layers, num_experts), -1, dtype=np.int32)
        self.owner = np.full(int(self.base[-1]), -1, dtype=np.int32)       # global slot -> expert
        self.free = [list(range(int(self.base[i + 1]) - 1, int(self.base[i]) - 1, -1)) for i in range(n_layers)]
        self.pinned: list[set[int]] = [set() for _ in range(n_layers)]
        self.recency: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(n_layers)]  # oldest first
        self.freq = np.zeros((n_layers, num_experts), dtype=np.float64)
        self.hits = np.zeros(n_layers, dtype=np.int64)       # routes served by the fast tier
        self.misses = np.zeros(n_layers, dtype=np.int64)
        self.admissions = self.evictions = self.rejected = 0
        self.table = torch.full((n_layers, num_experts), -1, dtype=torch.int32, device=device)
        self.write_table = True     # False: the caller orders the device table writes (memory.doorbell)

    @property
    def num_slots(self) -> int:
        return int(self.base[-1])

    def resident(self, li: int) -> int:
        return int((self.slot_of[li] >= 0).sum())

    # ------------------------------------------------------------------ lookups
    def lookup(self, li: int, experts: list[int], routes: list[int] | None = None) -> list[int]:
        """Slots of `experts` (-1 = miss); counts hits/misses per route and feeds the policy."""
        routes = routes if routes is not None else [1] * len(experts)
        slots = self.slot_of[li, experts].tolist() if experts else []
        if self.policy == "lfu":
            self.freq[li] *= self.decay
        for e, s, n in zip(experts, slots, routes):
            self.freq[li, e] += n
            if s >= 0:
                self.hits[li] += n
                if e in self.recency[li]:
                    self.recency[li].move_to_end(e)
            else:
                self.misses[li] += n
        return slots

    # ------------------------------------------------------------------ placement
    def place(self, li: int, e: int, pin: bool = False) -> int | None:
        """Put e into a free slot of layer li (preloading, pinning); -> global slot or None."""
        if self.slot_of[li, e] >= 0:
            if pin:
                self._pin(li, e)
            return int(self.slot_of[li, e])
        if not self.free[li]:
            return None
        s = self.free[li].pop()
        self._set(li, e, s)
        if pin:
            self._pin(li, e)
        return s

    def _pin(self, li: int, e: int) -> None:
        self.pinned[li].add(e)
        self.recency[li].pop(e, None)

    def admit(self, li: int, e: int) -> tuple[int, int] | None:
        """Decide whether miss e of layer li gets a slot: -> (global slot, evicted expert or -1),
        or None (static policy, no slots, already resident, or not worth a victim under LFU).
        The caller copies the weights in before the slot is next used."""
        if self.policy == "static" or self.sizes[li] == 0 or self.slot_of[li, e] >= 0:
            return None
        if self.free[li]:
            s = self.free[li].pop()
            self._set(li, e, s)
            self.admissions += 1
            return s, -1
        victim = self._victim(li)
        if victim is None:
            return None
        if self.policy == "lfu" and self.freq[li, e] <= self.freq[li, victim]:
            self.rejected += 1
            return None
        s = int(self.slot_of[li, victim])
        self._clear(li, victim)
        self._set(li, e, s)
        self.admissions += 1
        self.evictions += 1
        return s, victim

    def _victim(self, li: int) -> int | None:
        dyn = self.recency[li]
        if not dyn:
            return None
        if self.policy == "lfu":   # lowest aged count; ties: least recent
            return min(dyn, key=lambda e: self.freq[li, e])
        return next(iter(dyn))

    def _set(self, li: int, e: int, s: int) -> None:
        self.slot_of[li, e] = s
        self.owner[s] = e
        self.recency[li][e] = s
        if self.write_table:
            self.table[li, e] = s

    def _clear(self, li: int, e: int) -> None:
        s = int(self.slot_of[li, e])
        self.slot_of[li, e] = -1
        self.owner[s] = -1
        self.recency[li].pop(e, None)
        if self.write_table:
            self.table[li, e] = -1

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Invariants (used by the property tests): sizes respected, mirrors agree, pins resident."""
        for li, size in enumerate(self.sizes):
            res = np.flatnonzero(self.slot_of[li] >= 0)
            assert len(res) <= size, f"layer {li}: {len(res)} experts in {size} slots"
            for e in res:
                s = int(self.slot_of[li, e])
                assert self.base[li] <= s < self.base[li + 1], f"layer {li}: slot {s} outside its range"
                assert self.owner[s] == e
            assert len(res) + len(self.free[li]) == size
            assert self.pinned[li] <= set(res.tolist()), f"layer {li}: a pinned expert is not resident"
            assert set(self.recency[li]) == set(res.tolist()) - self.pinned[li]
        assert torch.equal(self.table.cpu(), torch.from_numpy(self.slot_of))
