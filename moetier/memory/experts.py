"""TieredExperts: the `experts` of every MoE block when memory tiers are on.

Same call as DenseExperts: forward(x [T, D], ids [T, k], w [T, k]) -> [T, D]. Per call:
  1. sort the T*k (token, expert) pairs by expert, as grouped_experts does; one host sync brings
     the per-expert counts and the slot of each expert from the device-side table;
  2. hits run on the fast tier (launched first: on CUDA they run while the CPU works);
  3. misses run on the CPU from the RAM bank (SSD reads first, `depth` ahead, on reader threads),
     or, in prefill when a chunk routes enough tokens to an expert that copying beats the CPU,
     are copied to a stage slot and run on the fast tier;
  4. decode misses are admitted into the fast tier when the policy says so (copied after use);
  5. results are scaled and summed per token in ascending expert order, exactly as
     grouped_experts does: on CPU the output is bit-identical to DenseExperts for any placement.
"""
from __future__ import annotations

import atexit
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import UserError
from ..models.layers import DenseExperts, add_pairs, grouped_mm_experts
from .cache import SlotCache
from .fast import FastTier, expert_math, grouped_available
from .layout import expert_modules
from .plan import DECODE_MAX, Placement
from .prefetch import Prefetcher
from .profile import ExpertProfile
from .stats import Counters, delta, request_view, snapshot
from .store import RamBank, SsdReader


class TieredExperts(nn.Module):
    """Drop-in for DenseExperts whose weights live in the tiers (no parameters of its own)."""

    def __init__(self, tiers: "Tiers", li: int, template: nn.Module):
        super().__init__()
        self.tiers, self.li = tiers, li
        self.num_experts, self.dim, self.hidden = template.num_experts, template.dim, template.hidden
        self.act = template.act
        # (input norm, attention) of the next decoder block (install; a tuple, not submodules), or None: this layer's
        # wait_add may make that norm in the graphed decode (GraphTiers._next_norm)
        self.next_input = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.tiers.forward(self.li, x, ids, w, self.act)

    def routed(self, x: torch.Tensor, router, residual: torch.Tensor) -> torch.Tensor | None:
        """residual + this layer on x with its router, fused (GraphTiers.routed) inside a captured decode step;
        None otherwise (the caller routes, calls forward and adds)."""
        g = self.tiers.graphed
        if g is None or not g.capturing or x.shape[0] != 1:
            return None
        return g.routed(self.li, x, router, residual, then=self.next_input)

    def add_norm_routed(self, h: torch.Tensor, a: torch.Tensor, norm, router) -> torch.Tensor | None:
        """routed on x = norm(h + a) with residual h + a, the add and the norm made by the router's launch
        (GraphTiers.add_norm_routed); None otherwise."""
        g = self.tiers.graphed
        if g is None or not g.capturing or h.shape[0] != 1:
            return None
        return g.add_norm_routed(self.li, h, a, norm, router, then=self.next_input)

    def extra_repr(self) -> str:
        return f"layer={self.tiers.layout.layers[self.li]}, experts={self.num_experts}"


class Tiers:
    """All tier state of one loaded model: RAM bank, SSD reader, fast-tier arena and cache, counters."""

    def __init__(self, pl: Placement, routers: list, config):
        self.pl, self.layout = pl, pl.layout
        self.E = pl.num_experts
        self.cuda = pl.fast_device == "cuda"
        # CPU math: the model dtype on a CPU-only run (bit-identical); on CUDA the storage dtype
        # (no conversion pass over the weights; the result is cast on the GPU)
        self.cpu_dtype = pl.dtype if not self.cuda else (pl.storage_dtype if pl.storage_dtype.is_floating_point
                                                         else torch.float32)
        self.reader = SsdReader(self.layout, threads=pl.scratch, direct=config.direct_io)
        self.bank = RamBank(self.layout, pl.bank_slots, self.reader, pin=self.cuda, scratch=pl.scratch,
                            disk_layers=pl.disk_layers())
        self.bank.all_resident = pl.bank_all
        self.cache = SlotCache(self.E, pl.fast_slots, pl.policy, pl.device)
        self.fast = FastTier(self.layout, self.cache.num_slots, pl.stage_slots, pl.device, pl.dtype,
                             grouped=grouped_available(pl.device, pl.dtype, self.layout))
        self.copy_tokens = pl.prefill_copy_tokens if pl.stage_slots else None
        self.stats = Counters(pl.num_layers)
        self.profile = ExpertProfile(self.layout.layers, self.E, pl.model_type, pl.device)
        self.routers = routers      # routers[li]: MoE layer li's router (None = unknown); the graph path guesses with them
        self.prefetcher = Prefetcher(self, routers) if pl.prefetch else None
        self.save_profile_path = config.save_profile
        self._conv = None
        self._pinned = None     # CUDA: host rows of CPU misses [x rows; y rows]
        self.graphed = None     # memory.doorbell.GraphTiers once a CUDA-graph decode step uses these tiers
        self._deferred = []     # (layer, device counts [E]) of _forward_staged_layer, for _fold
        self._grouped_ok = (self.cuda and pl.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
                            and pl.stage_slots >= 2 * self.E
                            and {p.name for p in self.layout.params} == {"gate_up_proj", "down_proj"})
        self.closed = False

    # ------------------------------------------------------------------ loading
    def fill(self) -> None:
        """Preload the RAM bank (all experts, or the hottest / an even share), then the fast tier's
        pinned and preloaded experts."""
        pl = self.pl
        self.bank.preload(pl.bank_order[:pl.bank_slots])
        for li, es in enumerate(pl.fast_preload):
            pins = set(pl.pinned[li])
            for e, buf, _, handle in self.bank.fetch(li, list(es), admit=False):
                s = self.cache.place(li, e, pin=e in pins)
                if s is not None:
                    ev = self.fast.load(s, buf, li)
                    if ev is not None:
                        self.bank.mark_busy(handle, ev)
        # loading is not serving: start the counters at zero
        self.bank.stats.update(ram_hits=0, ssd_reads=0, wait_s=0.0)
        for tm in self.fast.copy_timer.values():
            tm.seconds()
            tm.s = 0.0
        self.fast.bytes_copied = {p: 0 for p in self.fast.bytes_copied}
        self.reader.bytes, self.reader.reads, self.reader.busy_s = 0, 0, 0.0

    # ------------------------------------------------------------------ the call
    def forward(self, li: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, act) -> torch.Tensor:
        t, k = ids.shape
        if self.graphed is not None:
            if self.graphed.capturing and t == 1:
                return self.graphed.forward(li, x, ids, w)
            if li == 0:
                self.graphed.drain()    # the graphed steps' bookkeeping is done before the eager path
        decode = t <= DECODE_MAX
        self.stats.phase = self.fast.phase = "decode" if decode else "prefill"
        if li == 0:
            self.stats.tokens[self.stats.phase] += t
        big = not decode and self.copy_tokens and t * k >= self.E * self.copy_tokens   # rows the average expert gets
        if self._deferred and (li == 0 or not big):
            self._fold()        # the last chunk's staged layers (one sync per chunk, before its first layer)
        if big and self._whole_layer_staged(li):
            return self._forward_staged_layer(li, x, ids, w, act)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order // k                                   # token of each sorted pair
        xs = x[rows]                                        # [T*k, D]
        counts_t = torch.bincount(flat, minlength=self.E)
        self.profile.add(li, ids, w, decode)
        self.fast.wait(li)
        info = torch.stack([counts_t, self.cache.table[li].to(counts_t.dtype)]).cpu().numpy()  # one sync
        used = np.flatnonzero(info[0])
        n_rows = info[0][used]
        starts = np.cumsum(n_rows) - n_rows
        slots = info[1][used]
        self.cache.lookup(li, used.tolist(), n_rows.tolist())
        if self.prefetcher is not None:
            self.prefetcher.observe(li, used.tolist())
        ys = torch.empty_like(xs)
        hits = [(int(s), int(a), int(n)) for s, a, n in zip(slots, starts, n_rows) if s >= 0]
        misses = [(int(e), int(a), int(n)) for e, s, a, n in zip(used, slots, starts, n_rows) if s < 0]
        # prefill only: decode misses stay on the CPU (splitting them between PCIe and CPU is future work)
        staged = {e for e, _, n in misses if self.copy_tokens and n >= self.copy_tokens and not decode}
        if not decode:      # what prefetch_layer copied already runs on the GPU however few its rows
            staged |= {e for e, _, _ in misses} & self.fast.ahead(li)
        host = self._rows_to_host(xs, [(a, n) for e, a, n in misses if e not in staged])
        base = int(self.cache.base[li])
        self.fast.run(hits, xs, ys, act, (base, self.cache.sizes[li]), li)   # async on CUDA
        for _, _, n in hits:
            self.stats.served(li, "gpu", n)
        if misses:
            self._misses(li, misses, staged, host, xs, ys, act, decode)
        if big:
            self._prefetch_next(li + 1)
        if self.prefetcher is not None and decode:
            self.prefetcher.predict(li, x)
        ys = ys * w.reshape(-1)[order, None].to(ys.dtype)
        return add_pairs(x, rows, order, ys, k)

    def _rows_to_host(self, xs: torch.Tensor, cpu_rows: list[tuple[int, int]]):
        """CUDA: the CPU misses' rows to pinned host memory, before the hits are queued (a copy
        behind them would wait for them). -> (row index on device, x_host, y_host, start of each
        block in x_host) or None (nothing to move, or everything is on the CPU already)."""
        if not cpu_rows or xs.device.type == "cpu":
            return None
        idx = torch.cat([torch.arange(a, a + n) for a, n in cpu_rows]).to(xs.device, non_blocking=True)
        m, d = idx.shape[0], xs.shape[1]
        if self._pinned is None or self._pinned.shape[0] < 2 * m:
            self._pinned = torch.empty(max(2 * m, 64), d, dtype=self.cpu_dtype, pin_memory=True)
        x_host, y_host = self._pinned[:m], self._pinned[m:2 * m]
        x_host.copy_(xs.index_select(0, idx))     # synchronous: the stream is idle after the counts sync
        at = dict(zip([a for a, _ in cpu_rows], np.cumsum([0] + [n for _, n in cpu_rows])[:-1].tolist()))
        return idx, x_host, y_host, at

    def _misses(self, li, misses, staged, host, xs, ys, act, decode) -> None:
        """Misses in ascending expert order: each from the RAM bank (read from SSD first if needed),
        computed on the CPU, or in prefill copied to a stage slot when that is cheaper."""
        rows_of = {e: (a, n) for e, a, n in misses}
        wait0 = self.bank.stats["wait_s"]
        batch = []      # staged experts from a bank that never evicts: copied and run together
        for e, buf, tier, handle in self.bank.fetch(li, [m[0] for m in misses], decode):
            a, n = rows_of[e]
            ev = None
            if e in staged and self.bank.all_resident and handle[0] == "bank":
                batch.append((buf, a, n, handle, e))
                self.stats.served(li, tier, n)
                if len(batch) == self.fast.stage_batch:
                    self._run_batch(li, batch, xs, ys, act)
                continue
            if e in staged:
                y, ev = self.fast.run_staged(buf, xs[a:a + n], act, li)
                ys[a:a + n] = y
                self.stats.staged[self.stats.phase] += 1
            else:
                t0 = time.perf_counter()
                wts, q = self._cpu_weights(buf, li), self.layout.layer_qtypes(li)   # q: GGML blocks -> CPU kernels
                if host is None:
                    ys[a:a + n] = expert_math(wts, xs[a:a + n], act, q)
                else:
                    h = host[3][a]
                    host[2][h:h + n] = expert_math(wts, host[1][h:h + n], act, q)
                self.stats.cpu_s[self.stats.phase] += time.perf_counter() - t0
            self.stats.served(li, tier, n)     # a staged expert is still a cache miss: counted where it came from
            if decode:
                adm = self.cache.admit(li, e)
                if adm is not None:
                    ev = self.fast.load(adm[0], buf, li)
            if ev is not None:
                self.bank.mark_busy(handle, ev)
        self._run_batch(li, batch, xs, ys, act)
        self.stats.wait_s[self.stats.phase] += self.bank.stats["wait_s"] - wait0
        if host is not None:   # the pinned y rows are rewritten only after the next layer's sync
            idx, _, y_host, _ = host
            ys.index_copy_(0, idx, y_host.to(ys.device, non_blocking=True).to(ys.dtype))

    # ------------------------------------------------------------------ prefill, a whole layer staged
    def _whole_layer_staged(self, li: int) -> bool:
        """Prefill of a chunk that routes copy_tokens or more rows to the average expert, with the
        plan's layer stage (--cpu-moe and alike: the fast tier holds none of layer li's experts, all
        are in the pinned bank): every expert of layer li is (or is now) copied to the stage, and the
        layer runs without a host sync (_forward_staged_layer). bf16 or GGML experts without biases."""
        if not self._grouped_ok:
            return False
        if len(self.fast.ahead(li)) < self.E:   # the first layer of a chunk: copied now, not overlapped
            self._prefetch_next(li)
        return len(self.fast.ahead(li)) == self.E

    def _forward_staged_layer(self, li: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, act) -> torch.Tensor:
        """All E experts of layer li in stage slots (FastTier.prefetch_layer): rows sorted by expert,
        per-expert row counts and offsets computed on the device, the layer's experts (GGML:
        dequantized at once; bf16: the stage slots themselves) and two grouped GEMMs; then layer
        li+1's copies start. No host sync: the host runs ahead and the GPU never waits for it between
        layers (with the sync per layer, the GPU idled ~6 ms a layer on an 8K chunk of Qwen3-30B-A3B).
        Counters are folded in later (_fold)."""
        fast = self.fast
        half, slots, ev = fast.take_ahead(li)
        torch.cuda.current_stream(fast.device).wait_event(ev)
        tok = fast.compute_timer["prefill"].start()
        self.profile.add(li, ids, w, False)
        if self.layout.qtype is not None:
            gu, dn = fast.dequantized(slots, x.dtype, li)
        else:       # prefetch_layer gave the layer's experts one run of stage slots, in expert order
            s0 = slots[0]
            assert slots == list(range(s0, s0 + len(slots))), "a staged layer's slots are one run"
            gu, dn = fast.arena["gate_up_proj"][s0:s0 + len(slots)], fast.arena["down_proj"][s0:s0 + len(slots)]
        out, counts = grouped_mm_experts(x, ids, w, gu, dn, act)
        fast.compute_timer["prefill"].stop(tok)
        fast.computed(half, slots)
        self._deferred.append((li, counts))
        self._prefetch_next(li + 1)
        return out

    def _fold(self) -> None:
        """Counters of layers run without a host sync (_forward_staged_layer: one sync for all of them): routes
        served from RAM through the stage, staged experts, the cache's miss counts and policy. An entry is (layer,
        device rows per expert)."""
        items, self._deferred = self._deferred, []
        counts = torch.stack([c[1] for c in items]).cpu().numpy()
        phase, self.stats.phase = self.stats.phase, "prefill"
        for (li, _), row in zip(items, counts):
            used = np.flatnonzero(row)
            self.cache.lookup(li, used.tolist(), row[used].tolist())
            for e, n in zip(used.tolist(), row[used].tolist()):
                self.stats.served(li, "ram", n)
            self.stats.staged["prefill"] += len(used)
            self.bank.stats["ram_hits"] += len(used)
        self.stats.phase = phase

    def _prefetch_next(self, li: int) -> None:
        """Prefill with a chunk that routes copy_tokens or more rows to the average expert: copy layer
        li's experts (all its RAM-bank experts the fast tier lacks) to the stage now, to overlap the
        current layer's computation, when the stage holds two layers (plan's layer stage) and layer
        li is all in the pinned bank."""
        fast, bank = self.fast, self.bank
        if (not self.cuda or li >= self.pl.num_layers or fast.stage_batch < self.E or not bank.all_resident
                or li in bank.disk_layers):
            return
        where = bank.where[li]
        todo = [e for e in range(self.E) if self.cache.slot_of[li][e] < 0]
        if not todo or any(where[e] < 0 for e in todo):
            return
        ev = fast.prefetch_layer(li, [(e, bank.slots[where[e]]) for e in todo])
        for e in todo:
            bank.mark_busy(("bank", int(where[e])), ev)

    def _run_batch(self, li: int, batch: list, xs, ys, act) -> None:
        """Staged prefill experts of layer li, one copy batch and one grouped computation (emptied in place)."""
        if not batch:
            return
        ev = self.fast.run_staged_many([(buf, a, n) for buf, a, n, _, _ in batch], xs, ys, act, li,
                                       [e for *_, e in batch])
        self.stats.staged[self.stats.phase] += len(batch)
        if ev is not None:
            for *_, handle, _ in batch:
                self.bank.mark_busy(handle, ev)
        batch.clear()

    def _cpu_weights(self, buf: torch.Tensor, li: int) -> dict[str, torch.Tensor]:
        """The expert in the CPU compute dtype: views of the RAM buffer when the dtypes agree, else
        converted into one preallocated buffer (no allocation per miss: glibc would keep the freed
        memory and RSS would creep past the budget). GGML experts: views of the raw blocks."""
        src = self.layout.unpack(buf, li)
        if self.layout.qtype and self.fast.x8:     # the miss server's interleaved rows: GGML rows again (a copy)
            src = {p.name: self.fast._ggml_rows(p, src[p.name]) for p in self.layout.specs(li)}
        if self.layout.qtype or all(v.dtype == self.cpu_dtype for v in src.values()):
            return src
        if self._conv is None:
            self._conv = {n: torch.empty(v.shape, dtype=self.cpu_dtype) for n, v in src.items()}
        return {n: self._conv[n].copy_(v) for n, v in src.items()}

    def admits(self) -> bool:
        """Whether decode can admit experts into the fast tier (a dynamic policy with room in some
        layer that does not hold all of its experts)."""
        c = self.cache
        return c.policy != "static" and any(0 < s < self.E for s in c.sizes)

    def graph_path(self, act, threads: int, k: int):
        """-> (GraphTiers, None) when a captured decode step can serve these tiers, else (None, why)."""
        if self.graphed is None:
            from .doorbell import GraphTiers, unavailable
            why = unavailable(self, act)
            if why:
                return None, why
            self.graphed = GraphTiers(self, act, threads, k)
        return self.graphed, None

    # ------------------------------------------------------------------ reporting
    def snapshot(self) -> dict:
        if self.graphed is not None:
            self.graphed.drain()
        if self._deferred:
            self._fold()
        return snapshot(self)

    def request_stats(self, before: dict) -> dict:
        return request_view(delta(self.snapshot(), before))

    def memory_stats(self) -> dict:
        """The shape Engine.memory_stats() always had ({"tiers", "layers", "hit_rate"}) plus the detail:
        per-phase and per-token figures under "cumulative" (see stats.request_view)."""
        snap = self.snapshot()
        pl = self.pl
        view = request_view(snap)
        layers = []
        for li, layer in enumerate(self.layout.layers):
            r = snap["layer_routes"][li]
            fast = self.cache.slot_of[li] >= 0
            ram = self.bank.where[li] >= 0
            if self.bank.all_resident and li not in self.bank.disk_layers:
                ram = ~fast | ram
            layers.append({"layer": layer, "gpu": int(fast.sum()), "ram": int(ram.sum()),
                           "ssd": int(self.E - (fast | ram).sum()), "slots": self.cache.sizes[li],
                           "tier": pl.layer_tiers[li], "hit_rate": r[0] / sum(r) if sum(r) else 1.0})
        tiers = {
            "gpu": {"experts": sum(x["gpu"] for x in layers), "slots": self.cache.num_slots,
                    "bytes": self.fast.nbytes, "budget": pl.gpu_budget, "device": pl.fast_device,
                    "hits": view["hits"]["gpu"], "bytes_read": view["bytes_read"]["gpu"], "ms": view["ms"]["gpu"],
                    "copy_ms": view["ms"]["copy"], "bytes_copied": view["bytes_read"]["copy"]},
            "ram": {"experts": sum(x["ram"] for x in layers), "slots": self.bank.capacity,
                    "pcie_experts": view["pcie_experts"], "pcie_share": pl.pcie_share,
                    "bytes": (self.bank.capacity + len(self.bank.scratch)) * self.layout.expert_bytes,
                    "budget": pl.ram_budget, "all_experts": self.bank.all_resident,
                    "hits": view["hits"]["ram"], "bytes_read": view["bytes_read"]["ram"], "ms": view["ms"]["cpu"]},
            "ssd": {"experts": sum(x["ssd"] for x in layers), "hits": view["hits"]["ssd"],
                    "bytes_read": snap["ssd_bytes_total"], "reads": snap["ssd_reads"],
                    "wait_ms": view["ms"]["ssd_wait"], "busy_ms": round(snap["ssd_busy_ms"], 3)},
        }
        return {"tiers": tiers, "layers": layers, "hit_rate": view["hit_rate"],
                "graph": self.graphed.report() if self.graphed is not None else None,
                "policy": pl.policy, "fast_tier": pl.fast_device, "prefetch_enabled": self.prefetcher is not None,
                "expert_bytes": self.layout.expert_bytes, "cumulative": view}

    # ------------------------------------------------------------------ exit
    def save_profile(self, path: str | Path | None = None) -> None:
        if self.graphed is not None:
            self.graphed.drain()
        path = path or self.save_profile_path
        if path:
            self.profile.save(path)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.save_profile()
        finally:
            if self.graphed is not None:
                self.graphed.close()
            self.reader.close()


def _router_of(parent: nn.Module):
    for name in ("gate", "router"):
        r = getattr(parent, name, None)
        if isinstance(r, nn.Module):
            return r
    return None


def install(model: nn.Module, pl: Placement, config) -> Tiers:
    """Replace every MoE block's experts with TieredExperts backed by one `Tiers`; fill the tiers."""
    mods = expert_modules(model)
    for prefix, mod in mods:
        if type(mod) is not DenseExperts:
            raise UserError(f"memory tiers support DenseExperts blocks; {prefix}.experts is "
                            f"{type(mod).__name__} (run without budget flags)")
    if config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    routers = [_router_of(model.get_submodule(prefix)) for prefix, _ in mods]
    tiers = Tiers(pl, routers, config)
    for li, (prefix, mod) in enumerate(mods):
        experts = TieredExperts(tiers, li, mod)
        owner = model.get_submodule(prefix)         # the MoE block (SoftmaxMoE knows the next decoder block)
        experts.next_input = owner.next_input() if hasattr(owner, "next_input") else None
        setattr(owner, "experts", experts)
    tiers.fill()
    if config.save_profile:     # written at exit (or by Tiers.close); only the small profile is kept alive
        atexit.register(_save_at_exit, tiers.profile, config.save_profile)
    weakref.finalize(tiers, tiers.reader.close)
    return tiers


def _save_at_exit(profile: ExpertProfile, path: str) -> None:
    try:
        profile.save(path)
    except OSError as e:
        print(f"moetier: could not write the expert profile {path}: {e.strerror}", file=sys.stderr)
