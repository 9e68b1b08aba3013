"""The tiered decode step inside one CUDA graph (issue #3 item 6, issue #5 item 3).

`TieredExperts` on a captured decode token calls `GraphTiers.forward` instead of the eager
path, which syncs with the host in every layer. Per MoE layer the graph holds:
  ring      slots = table[li][ids] on the device; x, ids, w, slots to pinned host memory; bell
  (gather, repack: the PCIe share's experts into stage slots, when it is on)
  hits      ops.moe_decode over the GPU cache slots (slot -1: skipped)
  guess     layer li+1's router on x, its guessed CPU misses to host memory (the CPU prefetches their rows)
  wait_add  if the layer missed: spin until the CPU answered, out = hits + y_cpu
and the host, after `graph.replay()`, runs `after_step`: the C server answers every layer's
misses from the RAM bank (kernels/doorbell.c, GIL released) while the GPU computes the hits;
then, off the critical path, the counters, the cache policy and the admissions of this step's
misses (copies on the copy stream; the device table entry is set after the copy, the evicted
entry cleared before it, so a replay never reads a half-copied slot).

Used when: CUDA, the Triton kernels, a gated activation the kernels know (expert biases too, as
gpt-oss has), and every expert not pinned on the GPU held in RAM (a miss must never wait for the SSD
inside the graph). Otherwise decode stays eager (`unavailable` says why).
"""
from __future__ import annotations

import os
import queue
import threading
import time

import numpy as np
import torch

from ..errors import UserError
from ..kernels import ops
from .plan import MAX_ADMIT, pcie_rows

MAX_ADMIT_PER_STEP = MAX_ADMIT    # decode misses copied into the GPU cache per token (PCIe work per step)
WARMUP_TIMEOUT_S = 900.0    # an eager warm-up step's wait for its bells (Triton compiles); a replay's: the server's 10 s


def unavailable(tiers, act) -> str | None:
    """Why the graph path cannot serve these tiers (None: it can)."""
    if not tiers.cuda:
        return "the fast tier is not a GPU"
    try:
        from ..kernels import doorbell  # noqa: F401
    except ImportError as e:
        return f"kernels.doorbell does not import ({e})"
    if ops.backend() != "triton":
        return "the Triton kernels are off"
    a = ops.as_act(act)
    if a is None:
        return "the experts' activation has no kernel"
    names = {p.name for p in tiers.layout.params}
    if not {"gate_up_proj", "down_proj"} <= names <= {"gate_up_proj", "down_proj", "gate_up_bias", "down_bias"}:
        return f"experts with params {sorted(names)} have no doorbell kernel"
    pinned = np.zeros_like(tiers.bank.where, dtype=bool)
    for li, es in enumerate(tiers.cache.pinned):
        pinned[li, list(es)] = True
    if not ((tiers.bank.where >= 0) | pinned).all():
        return "not every expert is in RAM (some stream from the SSD)"
    if _qtype_id(tiers.layout) is None:
        return "no CPU kernel for the expert format"
    return None


def _qtype_id(layout, x8: dict | None = None) -> tuple[int, int] | list[tuple[int, int]] | None:
    """(gate_up, down) GGML type ids for the C server, or one such pair per layer when the formats
    vary by layer (Q4_K_M); None when it has no kernel for one of them. x8: the bank's interleaved
    (param, format)s (interleave_bank): their interleaved ids (kernels.cpu.INTERLEAVED)."""
    from ..kernels import cpu, doorbell
    from ..quant.formats import get_format

    def tid(p):
        if p.qtype is None:
            return doorbell.GGML_IDS.get(p.dtype)
        f = get_format(p.qtype)
        return cpu.INTERLEAVED[f.type_id] if x8 and (p.name, f.name) in x8 else f.type_id
    pairs = []
    for li in range(layout.num_layers) if layout.varies_by_layer else [None]:
        spec = {p.name: p for p in layout.specs(li)}
        ids = tuple(tid(spec[n]) for n in ("gate_up_proj", "down_proj"))
        if not all(t is not None and doorbell.serve_supported(t) for t in ids):
            return None
        pairs.append(ids)
    return pairs if layout.varies_by_layer else pairs[0]


def interleave_bank(tiers, variant: str) -> dict[tuple[str, str], int]:
    """The RAM bank's Q4_0 / Q8_0 / IQ4_NL / IQ4_XS / Q5_1 / Q4_K / MXFP4 expert rows interleaved by 8 in place (the
    layout of kernels.cpu.interleave_rows), once per bank and per (param, format): a Q4_K_M file's Q4_K rows, not its
    Q6_K ones.
    The miss server then reads them with the x8 kernels (8 rows in the lanes, one dot product per 4-byte group for all
    of them): on the H200 box's Xeon ~2x the GGML-row kernels' math from cache (1 thread, Qwen3-30B-A3B's gate_up, Q4_0:
    24.7 vs 12.4 GB/s), the server +8-15% at RAM speed (docs/perf-log.md, session 14). Every other reader of the bank
    undoes it: the GPU tier on its copies (FastTier._ggml_rows), the eager CPU misses on a copy (Tiers._cpu_weights).
    -> {(param name, format name): GGML type id} of the interleaved params; {} when off: MOETIER_X8_BANK=0, variant
    1's per-row loops, dims not multiples of 16, no such C kernel, or the PCIe share on (its copies would be undone
    inside the graph, on the GPU's path of every layer: at --cpu-moe the round trip went 40 -> 91 us a layer)."""
    from ..kernels import cpu
    from ..quant.formats import get_format
    bank, lay = tiers.bank, tiers.layout
    if getattr(bank, "x8", None) is not None:
        if bank.x8 and variant == "1":
            raise UserError("MOETIER_MISS_VARIANT=1 (the per-row loops) cannot read this bank: an earlier decode "
                            "step interleaved its rows; set the variant before the model's first decode, or "
                            "MOETIER_X8_BANK=0")
        return bank.x8

    def key(p):
        return (p.name, get_format(p.qtype).name) if p.qtype is not None else None
    x8: dict[tuple[str, str], int] = {}
    spec = {p.name: p for p in lay.params}
    share = ((tiers.pl.pcie_share or 0) > 0 and tiers.fast.stage
             and not all(s >= lay.num_experts for s in tiers.cache.sizes))
    if (os.environ.get("MOETIER_X8_BANK", "1") != "0" and variant != "1" and not share and cpu.backend() == "c"
            and spec["down_proj"].shape[0] % 16 == 0 and spec["gate_up_proj"].shape[0] % 32 == 0):
        for li in range(lay.num_layers) if lay.varies_by_layer else [None]:
            for p in lay.specs(li):
                tid = get_format(p.qtype).type_id if p.qtype is not None else None
                if (p.name in ("gate_up_proj", "down_proj") and tid in cpu.INTERLEAVED
                        and cpu.interleaved_supported(tid)):
                    x8[key(p)] = tid
    if x8:
        if tiers.cuda:
            torch.cuda.synchronize()        # no copy to the GPU reads the bank while its rows move
        for li in range(lay.num_layers):
            moved = [(p.name, x8[key(p)]) for p in lay.specs(li) if key(p) in x8]
            for e in np.flatnonzero(bank.where[li] >= 0).tolist():
                w = lay.unpack(bank.slots[int(bank.where[li, e])], li)
                for name, tid in moved:
                    cpu.interleave_inplace(w[name], tid)
    bank.x8 = tiers.fast.x8 = x8
    return x8


PHASES = ("gate_up_s", "gate_up_wait_s", "h_s", "down_s", "tail_s")     # doorbell.c layer_runs, per thread
# MOETIER_MISS_TRACE=1: the layers' stragglers against the median thread (kernels.doorbell.late_thread_split)
TRACE_SUMS = ("trace_layers", "trace_tail_s", "trace_start_s", "trace_gate_up_s", "trace_down_s")
# GraphTiers.timing's sums over the graphed steps (report() turns them into per-step figures)
STEP_TIMING = ("steps", "serve_s", "cpu_busy_s", "bell_wait_s", "account_s", "admitted", "round_s", "round_pairs",
               "prep_s", "guessed", "guessed_right", "guessed_misses", "prefetched", "first_bell_s", "outside_s",
               "outside_n", "stamp_gpu_s", "stamp_add_s", "stamp_n", *PHASES, *TRACE_SUMS)


class GraphTiers:
    def __init__(self, tiers, act, threads: int, k: int):
        from ..kernels import doorbell
        self.tiers, self.act = tiers, ops.as_act(act)
        lay, dev = tiers.layout, tiers.pl.device
        self.L, self.E = lay.num_layers, lay.num_experts
        spec = {p.name: p for p in lay.params}
        self.dim = spec["down_proj"].shape[0]
        self.hidden = spec["gate_up_proj"].shape[0] // 2
        self.k, self.threads = k, threads
        self.seq = torch.zeros(1, dtype=torch.int64, device=dev)    # bumped on the device by layer 0
        self.host_seq = 0
        self.capturing = False
        self.counting = True
        self._pending = None        # the last served step's request rows, not yet accounted for
        self._worker = _Worker(dev)     # accounts for each step while the next one is served
        # host time per decode step: answering misses (C), and the bookkeeping after it (Python)
        self.timing = dict.fromkeys(STEP_TIMING, 0)
        # per miss thread (kernels.doorbell.TIMED_THREADS): work s and layers finished last, summed; the CPUs of the
        # last timed step (which threads shared a core)
        self.thread_timing = np.zeros((2, doorbell.TIMED_THREADS))
        self.thread_cpus = np.full(doorbell.TIMED_THREADS, -1.0)
        self._t_served = 0.0        # when the last serve of a run of graphed steps returned (0: none yet)
        self._db = doorbell
        self.slots = torch.zeros(self.L, k, dtype=torch.int64, device=dev)
        # the evicted entries' value, made once: torch.tensor(-1, device=...) per step was a pageable copy that
        # waited for the step being served (the bookkeeping thread then finished after it: account_ms)
        self._minus1 = torch.full((), -1, dtype=tiers.cache.table.dtype, device=dev)
        # MOETIER_MISS_VARIANT (A/B; all bit-identical): 6 the default (no barriers: kernels.doorbell.VARIANT), 0 the
        # phases with barriers (the default until session 17), 1 the old per-row loops, 2 the down phase over the
        # experts' rows (session 13, H200: no gain), 4 guided chunks (session 14, H200: undecided), 5 phase 3's down
        # rows prefetched during phase 1 (session 15), 8 variant 6 with every thread reading each bell and request
        # itself, no barrier there (session 28, H200: no gain shown); 3 only reads (bench only)
        variant = os.environ.get("MOETIER_MISS_VARIANT", str(doorbell.VARIANT))
        if variant not in ("0", "1", "2", "4", "5", "6", "8"):
            raise UserError(f"MOETIER_MISS_VARIANT={variant!r}: the miss server's variants are 6 (default), 0, 1, 2, "
                            "4, 5, 8 (3 reads the experts without computing them: bench/bench_miss_server.py only)")
        qtypes = _qtype_id(lay, interleave_bank(tiers, variant))
        # the ring writes x's int8 copy (the C prep's, bit for bit) where the server's gate_up reads int8 activations:
        # its thread 0 then reads nothing of x after the bell (its prep 0.12 -> 0.03 ms a token at 8 GiB on the H200,
        # session 21; the same tokens bit for bit there). MOETIER_RING_Q8=0 turns it off (A/B)
        q8 = (os.environ.get("MOETIER_RING_Q8", "1") != "0" and self.dim % 32 == 0
              and doorbell.ring_q8_useful(qtypes))
        self.req = doorbell.Requests(self.L, self.dim, k, pin=True, q8=q8)
        # the miss server reads each expert where the RAM bank holds it (the bank never moves them here)
        # (gpt-oss's biases as float32: views of the bank when stored so, else copies kept here)
        names = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias")
        has = {p.name for p in lay.params}
        tables = {n: [[None] * self.E for _ in range(self.L)] if n in has else None for n in names}
        for li in range(self.L):
            for e in np.flatnonzero(tiers.bank.where[li] >= 0).tolist():
                w = lay.unpack(tiers.bank.slots[int(tiers.bank.where[li, e])], li)
                for n, table in tables.items():
                    if table is not None:
                        t = w[n]
                        table[li][e] = t.float().contiguous() if n.endswith("_bias") else t
        self.biases = (tables["gate_up_bias"], tables["down_bias"])
        # the next layer's misses guessed from this layer's input (its router on it): the CPU loads their rows
        # while the GPU runs up to that layer's bell (doorbell.c prefetch_guess)
        # (none for a layer whose experts all have GPU slots: it never misses)
        routers = getattr(tiers, "routers", None) or []
        self.guess = [routers[li + 1] if tiers.pl.miss_prefetch and li + 1 < min(self.L, len(routers))
                      and tiers.cache.sizes[li + 1] < self.E else None for li in range(self.L)]
        self.server = doorbell.MissServer(self.req, tables["gate_up_proj"], tables["down_proj"], qtypes,
                                          self.dim, self.hidden, self.act, threads,
                                          biases=self.biases if any(b is not None for b in self.biases) else None,
                                          hints=any(r is not None for r in self.guess))
        self.server.ctx.variant = int(variant)
        self.share = tiers.pl.pcie_share     # 0 where the placement has no stage slots
        # wait_add makes the next block's input norm and its int8 copy (one launch fewer a layer, _next_norm: the
        # round trip 31 -> 27.5 us a layer at 8 GiB on the H200, session 21; the same tokens bit for bit there).
        # MOETIER_WAIT_ADD_NORM=0 turns it off (the block's own rms_norm_q8 launch, A/B). norm_layers: where it did
        self.wait_add_norm = os.environ.get("MOETIER_WAIT_ADD_NORM", "1") != "0"
        self.norm_layers: set[int] = set()
        self.n_pcie = 0     # set by _pcie_setup when the share is on
        self.pcie_why = self._pcie_setup()

    def _pcie_setup(self) -> str | None:
        """The PCIe share (issue #3 item 6): per layer the GPU reads round(share * misses) missed experts
        (at most n_pcie) straight from the pinned RAM bank into staging rows (one gather kernel, 16-byte
        loads over PCIe), repacks them into stage slots and computes them with the hits, while the CPU
        computes the rest. -> why it is off (None: on)."""
        t = self.tiers
        fast, bank, lay = t.fast, t.bank, t.layout
        if not fast.stage:
            return "no stage slots on the GPU"
        if self.share <= 0:
            return ("share 0 (--pcie-share 0, the CPU's prefetch of guessed misses at this RAM coverage, or a share "
                    "that would read no expert of an average layer: memory.plan.prefetch_share)")
        if all(s >= self.E for s in t.cache.sizes):
            return "every expert is on the GPU"
        if not bank.slots or not bank.slots[0].is_pinned():
            return "the RAM bank is not pinned"
        base, offs = bank_offsets(bank.slots, bank.where)
        if lay.expert_bytes % 16 or (offs[offs >= 0] % 16).any():
            return "the bank's expert buffers are not 16-byte aligned"
        dev = t.pl.device
        n = pcie_rows(self.share, self.k, len(fast.stage))     # as the placement reserved them
        self.base, self.stage0 = base, fast.stage[0]
        self.pcie_off = torch.from_numpy(offs).to(dev)
        self.stage_off = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.staging = torch.zeros(n, lay.expert_bytes, dtype=torch.uint8, device=dev)
        self.stage_idx = torch.arange(self.stage0, self.stage0 + n, device=dev)
        self.n_pcie = n
        for li in {id(lay.specs(li)): li for li in range(self.L)}.values():   # compile, build tables: not in capture
            self._stage_repack(li)
        return None

    def _stage_repack(self, li: int) -> None:
        """Staging rows -> stage slots in torch ops (FastTier.repack_into), or with MOETIER_STAGE_REPACK=triton
        the GGML field formats by one Triton launch per param that skips the rows this layer left unused
        (kernels/triton_repack.py; other params, float, IQ3_XXS, IQ2_XXS or Q3_K, stay in torch ops)."""
        from ..kernels import triton_repack
        fast, rest = self.tiers.fast, []
        # torch ops by default: what was measured on the H200; the kernel is verified under the Triton interpreter
        # only, until a GPU run times it (MOETIER_STAGE_REPACK=triton; docs/perf-log.md, session 5)
        kernel = os.environ.get("MOETIER_STAGE_REPACK", "torch") == "triton"
        for p in self.tiers.layout.specs(li):
            if kernel and p.qtype is not None and triton_repack.supported(p.qtype) and not fast.x8:
                triton_repack.repack_rows(p.qtype, self.staging, self.stage_off, p.offset, p.shape[0], p.shape[1],
                                          fast.planes[(p.name, p.qtype)], self.stage0)
            else:
                rest.append(p)
        if rest:
            fast.repack_into(self.staging, self.stage_idx, rest)

    # ------------------------------------------------------------------ inside the graph
    def routed(self, li: int, x: torch.Tensor, router, residual: torch.Tensor, then=None) -> torch.Tensor | None:
        """residual + the MoE layer on x with its router, in fewer launches: the router's last program rings the
        doorbell, and wait_add adds the residual (router: a SoftmaxRouter) and may make the next block's input norm
        (then: that block's (input norm, attention), _next_norm). None where it does not apply (the router kernel
        cannot run, or the PCIe share is on): the caller routes and calls forward."""
        from ..kernels import small_ops
        if (not self._rings_in_router(router) or not small_ops.router_kernel_ok(x, router.weight, router.k)
                or residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous()):
            return None
        slots = self.slots[li]
        ids, w = self._db.route_ring(x, router.weight, router.k, router.normalize, self.tiers.cache.table[li],
                                     self.seq, slots, self.req, li, bump=li == 0)
        return self._after_ring(li, x, slots, w, residual, then)

    def add_norm_routed(self, li: int, h: torch.Tensor, a: torch.Tensor, norm, router,
                        then=None) -> torch.Tensor | None:
        """routed(li, norm(s), router, s) with s = h + a, the add and the norm (an RMSNorm) made by the same launch
        (route_ring_add_norm: one launch fewer); None where it does not apply (as routed, or
        small_ops.router_add_norm_ok fails): the caller adds, norms and routes."""
        from ..kernels import small_ops
        if not self._rings_in_router(router) or not small_ops.router_add_norm_ok(h, a, norm.weight, router.weight,
                                                                                 router.k):
            return None
        slots = self.slots[li]
        s, x, ids, w = self._db.route_ring_add_norm(h, a, norm.weight, norm.eps, router.weight, router.k,
                                                    router.normalize, self.tiers.cache.table[li], self.seq, slots,
                                                    self.req, li, bump=li == 0)
        return self._after_ring(li, x, slots, w, residual=s, then=then)

    def _rings_in_router(self, router) -> bool:
        """The router's last program may ring this layer's doorbell: a SoftmaxRouter of our k, no PCIe share (its
        picks need the ring kernel's offsets)."""
        from ..models.layers import SoftmaxRouter
        return not self.n_pcie and type(router) is SoftmaxRouter and router.k == self.k

    def forward(self, li: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        if k != self.k:
            raise ValueError(f"the router picked {k} experts per token, the doorbell buffers hold {self.k}")
        slots = self.slots[li]
        pcie = (self.pcie_off[li], self.stage_off, self.share, self.stage0) if self.n_pcie else None
        self._db.ring(x, ids, w, self.tiers.cache.table[li], self.seq, slots, self.req, li, bump=li == 0, pcie=pcie)
        return self._after_ring(li, x, slots, w)

    def _after_ring(self, li: int, x, slots, w, residual=None, then=None) -> torch.Tensor:
        """The layer after its ring: the PCIe share, the hits, the guess of the next layer, wait_add (with the next
        block's input norm where _next_norm gives it)."""
        k = self.k
        fmt, gu, dn = self.tiers.fast.kernel_weights(li)
        if self.n_pcie:     # this layer's PCIe share: bank -> staging rows -> stage slots
            self._db.gather(self.base, self.stage_off, self.staging)
            self._stage_repack(li)
        hits = ops.moe_decode(x, slots.view(1, k), w, gu, dn, self.act, fmt=fmt,
                              biases=self.tiers.fast.kernel_biases())
        if self.guess[li] is not None:
            # after the hits (the GPU's share of this layer first): the CPU needs the guess only once it answered
            nxt = (self.pcie_off[li + 1], self.share, self.n_pcie) if self.n_pcie else None
            self._db.hint(self.guess[li](x)[0], self.tiers.cache.table[li + 1], self.seq, self.req, li + 1, pcie=nxt)
        out = torch.empty_like(x)
        norm = self._next_norm(out, then) if residual is not None else None
        if norm is None:
            self._db.wait_add(hits, slots, self.seq, self.req, li, out, residual=residual)
            return out
        from ..kernels import small_ops
        xn, pre = self._db.wait_add_norm(hits, slots, self.seq, self.req, li, out, residual, norm.weight, norm.eps)
        small_ops.made_norm_q8(out, norm.weight, norm.eps, xn, pre)
        self.norm_layers.add(li)
        return out

    def _next_norm(self, out, then):
        """The next decoder block's input RMSNorm where wait_add can make it with its int8 copy in its own launch:
        then = that block's (input norm, attention) (TieredExperts.next_input), small_ops.next_norm_q8 finds that the
        block would call rms_norm_q8 on out with its kernel, and MOETIER_WAIT_ADD_NORM is not 0. Else None. Whatever
        the block does, its results are the same: rms_norm_q8 returns what wait_add made, or computes them."""
        from ..kernels import small_ops
        return small_ops.next_norm_q8(out, then) if self.wait_add_norm else None

    # ------------------------------------------------------------------ around the graph
    def serve_async(self) -> "_Server":
        """Eager runs (graph warm-up): answer the next step from a thread while the main thread
        launches the layers (launches can block when the queue fills, so the main thread cannot
        answer them itself). `.join()` re-raises the thread's error. The step may wait long for its bells:
        on a cold Triton cache the main thread compiles the decode kernels between them (a fresh H200 box
        took over 10 s from layer 0's bell to layer 1's, and the first tiered bench failed)."""
        return _Server(lambda: self.after_step(WARMUP_TIMEOUT_S))

    def after_step(self, timeout_s: float | None = None) -> None:
        """Answer the misses of the step just launched. The previous step's bookkeeping (counters, cache policy,
        admissions) runs on the worker thread meanwhile: the serve holds no GIL, so the worker's Python never
        delays the main thread's sampling and next launch, as a thread started after the serve did (its Python
        held the GIL while the main thread waited for the logits, then wanted it back)."""
        self.host_seq += 1
        if self.counting and self._pending is not None:     # (warm-up steps leave it to drain())
            pending, self._pending = self._pending, None
            self._worker.submit(lambda: self._account_thread(*pending))
        t0 = time.perf_counter()
        busy, wait, n_miss = self.server.serve(self.host_seq, timeout_s)
        t1 = time.perf_counter()
        if int(self.req.err[0]):
            bad = int(self.req.err[0])
            self.req.err[0] = 0
            raise RuntimeError(f"decode step {bad}: the GPU stopped waiting for the CPU's expert results")
        if self.counting:
            # the rows as the server read them, copied before the next serve, so an error of the worker loses no
            # step
            sv = self.server
            self._pending = (sv.log_ids.numpy().copy(), sv.log_slots.numpy().copy(), sv.log_w.numpy().copy(), busy,
                             None if sv.trace is None else sv.trace.numpy().copy())
            self._wait_worker()
            tm = self.timing
            tm["steps"] += 1
            tm["serve_s"] += t1 - t0
            tm["cpu_busy_s"] += busy
            tm["bell_wait_s"] += wait
            round_s, pairs, prep = self.server.detail
            tm["round_s"] += round_s
            tm["round_pairs"] += pairs
            tm["prep_s"] += prep
            tm["prefetched"] += self.server.prefetched
            tm["first_bell_s"] += self.server.first_bell
            for key, v in zip(PHASES, self.server.phases):
                tm[key] += v
            per = self.server.per_thread.numpy()
            self.thread_timing += per[:2]
            self.thread_cpus = per[2]
            if self.req.stamping:
                self._stamps()
            if self._t_served:
                tm["outside_s"] += t0 - self._t_served
                tm["outside_n"] += 1
            pf = self.tiers.stats.prefetch      # the run's prefetch figures (stats.prefetch_summary): of the CPU's misses
            for key, stat, v in zip(("guessed", "guessed_right", "guessed_misses"), ("predicted", "correct", "actual"),
                                    self.server.guesses):
                tm[key] += v
                pf[stat] += v
            # _pending's bookkeeping runs on the worker while the next step is served (the server holds no GIL): off
            # the critical path, where it cost ~2.7 ms/token inline (48 layers, docs/perf-log.md); its admissions
            # then reach the GPU table one step later
        self._t_served = time.perf_counter()

    def _stamps(self) -> None:
        """MOETIER_STAMP=1 (diagnosis): from the GPU's clock, the part of each round trip between wait_add seeing
        layer li's answer and layer li + 1's ring (its kernels), and wait_add's own time after the answer (the y read
        over PCIe); the rest of round_trip_us is the two PCIe crossings. Stamps are zeroed for the next step."""
        st = self.req.stamp.numpy()
        seen, added, rang = st[:-1, 0], st[:-1, 1], st[1:, 2]
        ok = (seen > 0) & (added >= seen) & (rang > seen)
        self.timing["stamp_gpu_s"] += float((rang - seen)[ok].sum()) * 1e-9
        self.timing["stamp_add_s"] += float((added - seen)[ok].sum()) * 1e-9
        self.timing["stamp_n"] += int(ok.sum())
        st[:-1] = 0

    def _account_thread(self, *step) -> None:
        with torch.inference_mode():   # thread-local: buffers made under inference mode are updated here
            self._account(*step)

    def _wait_worker(self) -> None:
        t0 = time.perf_counter()
        self._worker.wait()
        self.timing["account_s"] += time.perf_counter() - t0

    def drain(self) -> None:
        """Finish the graphed steps' bookkeeping (before anything else reads or changes the tiers): the worker's,
        then the last step's, here."""
        self._wait_worker()
        self._t_served = 0.0            # the next step starts a new run of steps (outside_ms counts within runs)
        pending, self._pending = self._pending, None
        if pending is not None:
            self._account_thread(*pending)

    def close(self) -> None:
        """The bookkeeping done, its thread ended."""
        try:
            self.drain()
        finally:
            self._worker.close()

    def report(self) -> dict:
        """Mean host milliseconds per graphed decode step."""
        tm, n = self.timing, max(1, self.timing["steps"])
        return {"steps": tm["steps"], "admitted": tm["admitted"], "threads": self.threads,
                # the ring wrote x's int8 copy (prep_ms is then tid 0's bell work without quantizing x)
                "ring_q8": self.req.q8,
                # MoE layers whose wait_add made the next block's input norm (MOETIER_WAIT_ADD_NORM)
                "wait_add_norm_layers": len(self.norm_layers),
                "pcie_share": self.share if self.n_pcie else 0.0, "pcie_off_why": self.pcie_why,
                "pcie_per_step": round(self.tiers.stats.pcie["decode"] / n, 3),
                # account_ms: time the next step waited for the bookkeeping thread (0 when hidden)
                # first_bell_ms: serve's call to layer 0's bell; outside_ms: one serve's return to the next call
                **{k.removesuffix("_s") + "_ms": round(tm[k] / n * 1e3, 4)
                   for k in ("serve_s", "cpu_busy_s", "bell_wait_s", "account_s", "prep_s", "first_bell_s")},
                "outside_ms": round(tm["outside_s"] / max(1, tm["outside_n"]) * 1e3, 4),
                # the GPU's part between two answered layers, seen from the CPU: the last answer of a layer to
                # the next layer's bell (the flag over PCIe, post-MoE + attention + router kernels, the bell)
                "round_trip_us": round(tm["round_s"] / max(1, tm["round_pairs"]) * 1e6, 2),
                # MOETIER_STAMP=1: its GPU part by the GPU's clock (answer seen -> next ring), and wait_add's part of it
                **({"stamp_gpu_us": round(tm["stamp_gpu_s"] / tm["stamp_n"] * 1e6, 2),
                    "stamp_add_us": round(tm["stamp_add_s"] / tm["stamp_n"] * 1e6, 2)} if tm["stamp_n"] else {}),
                # the CPU's prefetch of guessed misses: share of the misses guessed, share of the guesses right
                "miss_prefetch": any(r is not None for r in self.guess),
                "guess_recall": round(tm["guessed_right"] / tm["guessed_misses"], 4) if tm["guessed_misses"] else None,
                "guess_precision": round(tm["guessed_right"] / tm["guessed"], 4) if tm["guessed"] else None,
                # MB of guessed rows the CPU prefetched per layer during the GPU's part (issued before the bell)
                "prefetch_mb_per_layer": round(tm["prefetched"] / n / max(1, self.L) / 2**20, 3),
                # a layer's phases in us, per thread: gate_up's work, the wait at its barrier, h with its barrier,
                # down's work, the wait from the thread's finish to the layer's last (imbalance)
                "phase_us": {k.removesuffix("_s"): round(tm[k] / n / max(1, self.L) / max(1, self.threads) * 1e6, 2)
                             for k in PHASES},
                # MOETIER_MISS_TRACE=1: per layer with misses, the thread that finished last against the median
                # thread, us: its finish later by `tail` = a later start + a longer gate_up + a longer rest
                **({"straggler_us": {k.removeprefix("trace_").removesuffix("_s"):
                                     round(tm[k] / tm["trace_layers"] * 1e6, 2) for k in TRACE_SUMS[1:]}}
                   if tm["trace_layers"] else {}),
                **self._thread_report(n)}

    def _thread_report(self, n) -> dict:
        """Per miss thread: its work per layer (us, from its start of the layer to its finish), its share of the
        layers it finished last, and the CPU it ran on at the end of the last step (two threads on one CPU: a
        straggler)."""
        nt = min(self.threads, self.thread_timing.shape[1])
        cpus = [int(c) for c in self.thread_cpus[:nt]]
        seen = [c for c in cpus if c >= 0]
        return {"thread_work_us": [round(float(v) / n / max(1, self.L) * 1e6, 1) for v in self.thread_timing[0, :nt]],
                "thread_last_share": [round(float(v) / n / max(1, self.L), 3) for v in self.thread_timing[1, :nt]],
                "thread_cpus": cpus, "threads_sharing_a_cpu": len(seen) - len(set(seen))}

    def _account(self, ids: np.ndarray, slots: np.ndarray, w: np.ndarray, busy: float, trace=None) -> None:
        if trace is not None:   # MOETIER_MISS_TRACE=1: here, off the path between the serve and the next step
            from ..kernels.doorbell import late_thread_split
            layers, late = late_thread_split(trace, self.threads)
            self.timing["trace_layers"] += layers
            for key, v in late.items():
                self.timing[f"trace_{key}_s"] += v
        t = self.tiers
        pcie = slots >= self.stage0 if self.n_pcie else np.zeros_like(slots, dtype=bool)
        hit = (slots >= 0) & ~pcie      # a PCIe-read expert is a miss served from the RAM bank
        t.stats.pcie["decode"] += int(pcie.sum())
        st, c = t.stats, t.cache
        st.tokens["decode"] += 1
        n_hit = int(hit.sum())
        st.routes["decode"]["gpu"] += n_hit
        st.experts["decode"]["gpu"] += n_hit
        st.routes["decode"]["ram"] += hit.size - n_hit
        st.experts["decode"]["ram"] += hit.size - n_hit
        st.layer_routes[:, 0] += hit.sum(1)
        st.layer_routes[:, 1] += (~hit).sum(1)
        st.cpu_s["decode"] += busy
        t.profile.add_host(ids, w, decode=True)
        for li in range(self.L):
            c.lookup(li, ids[li].tolist())
        miss_li, miss_j = np.nonzero(~hit)
        self._admit([(int(li), int(ids[li, j])) for li, j in zip(miss_li, miss_j)][:MAX_ADMIT_PER_STEP])

    def _admit(self, misses: list[tuple[int, int]]) -> None:
        """Admit this step's misses the policy wants, as one batch: victims' device entries cleared on
        the compute stream (later replays compute them on the CPU), copies on the copy stream after
        that point, then the new entries set on the copy stream (a replay sees -1 or a full slot)."""
        t = self.tiers
        c, fast, bank = t.cache, t.fast, t.bank
        if not misses or c.policy == "static":
            return
        victims, placed = [], {}
        c.write_table = False
        try:
            for li, e in misses:
                adm = c.admit(li, e)
                if adm is not None:
                    s, victim = adm
                    if victim >= 0:
                        victims.append((li, victim))
                    placed[s] = (li, e)          # an expert admitted and evicted in this batch is dropped
        finally:
            c.write_table = True
        if not placed:
            return
        dev = c.table.device
        if victims:
            li_t, e_t = _to_device(victims, dev)
            c.table.index_put_((li_t, e_t), self._minus1)
        after = torch.cuda.Event()
        after.record()
        slots = list(placed)
        fast.load_many(slots, [bank.slots[int(bank.where[li, e])] for li, e in placed.values()], after,
                       [li for li, _ in placed.values()])
        with torch.cuda.stream(fast.copy_stream):
            li_t, e_t, s_t = _to_device([(li, e, s) for s, (li, e) in placed.items()], dev)
            c.table.index_put_((li_t, e_t), s_t.to(c.table.dtype))
        self.timing["admitted"] += len(placed)


def bank_offsets(bufs: list[torch.Tensor], where: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """-> (base, offsets [L, E] int64): the bank buffer at the lowest address, and each expert's byte offset
    from it (-1 where `where` says the bank does not hold it). The bank is carved from separate ~1 GiB
    allocations, some below the first one: from the lowest, every offset is >= 0 (a negative one would
    read as 'not in the bank', as it once did for most of a 48-layer model)."""
    base = min(bufs, key=lambda b: b.data_ptr())
    offs = np.full(where.shape, -1, dtype=np.int64)
    held = where >= 0
    ptrs = np.array([b.data_ptr() for b in bufs], dtype=np.int64)
    offs[held] = ptrs[where[held]] - base.data_ptr()
    return base, offs


def _to_device(rows: list[tuple], dev) -> torch.Tensor:
    """Small index columns to the device without blocking the host (a pageable copy would wait for
    the stream, i.e. for the end of the step being served)."""
    return torch.tensor(rows, dtype=torch.long).T.contiguous().pin_memory().to(dev, non_blocking=True)


class _Worker:
    """One daemon thread running submitted functions in order; `wait()` blocks until all are done and re-raises
    the first error."""

    def __init__(self, device=None):
        self._q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.closed = False
        d = torch.device(device) if device is not None else None
        self.device = None                  # a CUDA device index ("cuda" alone: the caller's current GPU)
        if d is not None and d.type == "cuda":
            self.device = d.index if d.index is not None else torch.cuda.current_device()
        self._thread = threading.Thread(target=self._run, daemon=True, name="moetier-accounting")
        self._thread.start()

    def _run(self) -> None:
        try:
            if self.device is not None:
                torch.cuda.set_device(self.device)      # the thread's events and streams on the tiers' GPU
        except BaseException as e:    # noqa: BLE001 - handed to wait(); the queue is still served, never hangs
            self.error = e
        while True:
            fn = self._q.get()
            if fn is None:          # close(): the thread ends
                self._q.task_done()
                return
            try:
                fn()
            except BaseException as e:    # noqa: BLE001 - handed to wait()
                if self.error is None:
                    self.error = e
            finally:
                # the function holds the tiers: kept here until the next one arrived, it kept a closed engine's
                # GPU arenas alive (a bench's later configurations read 16 GiB over their 9 GiB budgets)
                fn = None
                self._q.task_done()

    def submit(self, fn) -> None:
        if self.closed:             # after close(): here, at once
            fn()
        else:
            self._q.put(fn)

    def close(self) -> None:
        """Run what was submitted, then end the thread."""
        if not self.closed:
            self.closed = True
            self._q.put(None)
            self._q.join()

    def wait(self) -> None:
        self._q.join()
        if self.error is not None:
            e, self.error = self.error, None
            raise e


class _Server(threading.Thread):
    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.error = fn, None
        self.start()

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as e:    # noqa: BLE001 - handed to the joining thread
            self.error = e

    def join(self, timeout=None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error
