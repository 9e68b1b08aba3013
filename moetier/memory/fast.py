"""The fast tier's arena and the expert math that runs on it.

Per stacked expert param, one tensor [slots + stage, *shape] in the compute dtype on the fast
device (the GPU; without CUDA a CPU tensor stands in). Slots belong to layers (cache.SlotCache);
the `stage` slots at the end take prefill copies. `load` fills a slot from a RAM buffer (storage
dtype -> compute dtype). On CUDA copies run on a side stream: a copy waits for the compute that may
still read its slot, and a layer's next call waits for the copies into its slots.

GGML experts (layout.qtype "Q4_0" ...) stay quantized: a param's arena is the dict of planes
quant.repack makes ([slots + stage, rows, ...] each); `load` copies the raw blocks to the device
and repacks them there, and hits run through kernels.ops.moe (Triton on CUDA, the torch twin
elsewhere). `kernel_weights(li)` hands the whole arena to kernels in that form. gate_up and down
may be in different formats (layout.layer_qtypes), and a param's format may vary by layer (Q4_K_M's
down): then every slot has planes of each of its formats (`planes[(name, qtype)]`), and the methods
that read or write a slot take the layer whose expert it holds.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels import ops
from ..kernels.cpu import expert_ffn
from ..quant.formats import get_format
from ..quant.repack import repack
from .layout import ExpertLayout, ParamSpec


def expert_math(wts: dict[str, torch.Tensor], x: torch.Tensor, act: Callable, qtype: str | None = None) -> torch.Tensor:
    """One expert on rows x [n, D] -> [n, D]; the same ops as DenseExperts.expert (bit-identical on CPU).
    qtype: the weights are raw GGML blocks (layout.unpack), run by the CPU kernels in float32 on
    torch's current thread count (--cpu-threads); a format or (gate_up format, down format)."""
    if qtype is not None:
        return expert_ffn(qtype, wts["gate_up_proj"], wts["down_proj"], x, act, wts.get("gate_up_bias"),
                          wts.get("down_bias"), threads=torch.get_num_threads()).to(x.dtype)
    h = F.linear(x, wts["gate_up_proj"], wts.get("gate_up_bias"))
    gate, up = h.chunk(2, dim=-1)
    return F.linear(act(gate, up), wts["down_proj"], wts.get("down_bias"))


def _to(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor to `device` without blocking the host (pinned first on CUDA)."""
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _runs(bufs: list[torch.Tensor], nbytes: int):
    """Yield (i, j, src): bufs[i:j] lie back to back in one host allocation (a layer of an
    all-resident RAM bank, memory.plan orders it so), src a [j - i, nbytes] view over them: one copy
    instead of j - i (a layer of Qwen3-30B-A3B: 128 copies of 2.65 MB -> 1-2)."""
    i, n = 0, len(bufs)
    while i < n:
        j = i + 1
        base = bufs[i]
        if base.is_contiguous() and base.numel() >= nbytes:
            while (j < n and bufs[j].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
                   and bufs[j].data_ptr() == base.data_ptr() + (j - i) * base.numel()
                   and bufs[j].numel() == base.numel() and bufs[j].is_contiguous()):
                j += 1
        src = base[:nbytes][None] if j == i + 1 else base.as_strided((j - i, nbytes), (base.numel(), 1))
        yield i, j, src
        i = j


def _grouped(hits, per_group: list[int], gu: torch.Tensor, dn: torch.Tensor, xs, ys, act) -> None:
    """hits [(slot, row start, rows)] sorted like the groups of gu [G, 2I, D] / dn [G, D, I], with
    per_group rows each (0: an empty group): two torch._grouped_mm calls, rows written to ys."""
    rows = _to(torch.cat([torch.arange(a, a + n) for _, a, n in hits]), xs.device)
    offs = _to(torch.tensor(per_group, dtype=torch.int32).cumsum(0).to(torch.int32), xs.device)
    h = torch._grouped_mm(xs.index_select(0, rows), gu.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(act(gate, up).contiguous(), dn.transpose(-2, -1), offs=offs)
    ys.index_copy_(0, rows, y.to(ys.dtype))


def grouped_available(device: str, dtype: torch.dtype, layout: ExpertLayout) -> bool:
    """torch._grouped_mm runs all of a layer's hits as one GEMM per projection (CUDA, bf16, no biases)."""
    return (device.startswith("cuda") and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and layout.qtype is None and {p.name for p in layout.params} == {"gate_up_proj", "down_proj"})


DEQUANT_ROWS = 64      # CUDA: GGML hits with this many rows in one call run dequantized (see _run_dequant)
DEQUANT_EXPERTS = 16   # ... at most this many experts at once (bf16 Qwen3-30B-A3B: 9.4 MB each; memory.plan
                       # counts them in the workspace: all of a layer's hits at once overshot an 8 GiB budget)
REPACK_EXPERTS = 16    # staged copies repacked into their slots this many at a time


class Timer:
    """Wall time on the CPU; CUDA events on the GPU, resolved lazily (no sync on the hot path)."""

    def __init__(self, cuda: bool):
        self.cuda, self.s, self.events = cuda, 0.0, []

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, token, stream=None) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            self.events.append((token, ev))
        else:
            self.s += time.perf_counter() - token

    def seconds(self) -> float:
        if self.events:
            self.events[-1][1].synchronize()
            self.s += sum(a.elapsed_time(b) for a, b in self.events) / 1e3
            self.events.clear()
        return self.s


class FastTier:
    def __init__(self, layout: ExpertLayout, n_slots: int, n_stage: int, device: str, dtype: torch.dtype,
                 grouped: bool = False):
        self.layout, self.device, self.dtype = layout, device, dtype
        self.n_slots = n_slots
        self.cuda = device.startswith("cuda")
        self.qtype = layout.qtype           # GGML format of the experts (layer 0's gate_up), None for float
        # GGML params: (name, qtype) -> planes, one entry per format the param has in some layer
        self.planes = {(v.name, v.qtype): self._alloc(v, n_slots + n_stage)
                       for p in layout.params if p.qtype for v in layout.param_variants(p.name)}
        self.arena = {p.name: self.planes[(p.name, p.qtype)] if p.qtype else self._alloc(p, n_slots + n_stage)
                      for p in layout.params}     # layer 0's formats
        self._staging = None                # CUDA, GGML experts: one raw expert on the device
        self.stage = list(range(n_slots, n_slots + n_stage))
        self._next_stage = 0
        # experts per staged prefill batch: half the stage slots (double buffering) when there are 4+
        self.stage_batch = n_stage // 2 if n_stage >= 4 else n_stage
        self._half_free: dict[int, object] = {}     # stage half -> event after the compute that read it
        self._ahead = None          # prefetch_layer: (layer, half, {expert: slot}, copy event)
        self.layers_ahead = 0       # layers prefetch_layer copied
        self.grouped = grouped
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending: dict[int, object] = {}        # layer -> event of its last copy
        self.stage_free: dict[int, object] = {}     # stage slot -> event after the compute that read it
        self.phase = "decode"     # which counters the work goes to (set per call by experts.Tiers)
        self.copy_timer = {p: Timer(self.cuda) for p in ("prefill", "decode")}
        self.compute_timer = {p: Timer(self.cuda) for p in ("prefill", "decode")}
        self.bytes_copied = {"prefill": 0, "decode": 0}
        # (param, format)s whose RAM rows are interleaved by 8 (memory/doorbell.interleave_bank): GGML type ids
        self.x8: dict[tuple[str, str], int] = {}

    def _alloc(self, p: ParamSpec, n: int):
        """[n, *shape] in the compute dtype, or for a GGML param its repack planes [n, rows, ...]."""
        if p.qtype is None:
            return torch.empty((n, *p.shape), dtype=self.dtype, device=self.device)
        one = repack(p.qtype, torch.zeros(1, p.shape[1], dtype=torch.uint8))     # plane widths of a row
        return {k: torch.empty((n, p.shape[0], t.shape[-1]), dtype=t.dtype, device=self.device)
                for k, t in one.items()}

    def _tensors(self) -> list[torch.Tensor]:
        ts = [t for t in self.arena.values() if not isinstance(t, dict)]
        return ts + [x for ps in self.planes.values() for x in ps.values()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def weights(self, slot: int) -> dict:
        return {n: {k: v[slot] for k, v in t.items()} if isinstance(t, dict) else t[slot]
                for n, t in self.arena.items()}

    def kernel_weights(self, li: int | None = None) -> tuple[str, object, object]:
        """(fmt, gate_up, down) of every slot (stage slots last) as kernels.ops.moe / moe_decode take
        them, with slot ids from cache.table: float experts fmt "dense" and the arena tensors
        [S, 2I, D] / [S, D, I]; GGML experts the format name ("Q4_0"), or (gate_up format, down
        format) when they differ (Q4_K_M: ("Q4_K", "Q6_K"); kernels.ops takes either), and the dicts
        of repack planes [S, rows, ...], of layer li's formats. No copies: the kernels read the live
        arena (biases: kernel_biases())."""
        q = self.layout.layer_qtypes(li)
        if q is None:
            return "dense", self.arena["gate_up_proj"], self.arena["down_proj"]
        return q[0] if q[0] == q[1] else q, self.planes[("gate_up_proj", q[0])], self.planes[("down_proj", q[1])]

    def kernel_biases(self) -> tuple | None:
        """None, or (gate_up_bias [S, 2I] | None, down_bias [S, D] | None) for kernels.ops."""
        b = (self.arena.get("gate_up_bias"), self.arena.get("down_bias"))
        return None if b == (None, None) else b

    def _ggml_rows(self, p: ParamSpec, raw: torch.Tensor) -> torch.Tensor:
        """raw [..., rows, row bytes] of param p as read from the RAM bank -> GGML rows (undoes the bank's
        interleaving, on raw's device)."""
        tid = self.x8.get((p.name, get_format(p.qtype).name)) if self.x8 and p.qtype is not None else None
        if tid is None:
            return raw
        from ..kernels.cpu import deinterleave_rows
        return deinterleave_rows(raw.reshape(-1, raw.shape[-1]), tid).view(raw.shape)

    def _put(self, slot: int, src: dict[str, torch.Tensor], li: int | None = None) -> None:
        """Write one expert of layer li (layout.unpack views, on the arena's device) into `slot`; GGML
        params are repacked (plain torch indexing: on CUDA it runs on the GPU, on the current stream)."""
        for p in self.layout.specs(li):
            t = src[p.name]
            if p.qtype is None:
                self.arena[p.name][slot].copy_(t)
                continue
            dst = self.planes[(p.name, p.qtype)]
            for k, plane in repack(p.qtype, self._ggml_rows(p, t)[None]).items():
                dst[k][slot].copy_(plane[0])

    # ------------------------------------------------------------------ copies
    def load(self, slot: int, buf: torch.Tensor, li: int | None = None, after=None):
        """Fill `slot` from a RAM buffer (uint8, storage layout). -> CUDA event when the copy is done
        (the buffer must stay untouched until then), None on the CPU (done on return). li: the layer
        of the expert (needed when formats vary by layer)."""
        src = self.layout.unpack(buf, li)
        timer = self.copy_timer[self.phase]
        tok = timer.start() if not self.cuda else None
        if not self.cuda:
            self._put(slot, src, li)
            timer.stop(tok)
            ev = None
        else:
            cur = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.copy_stream):
                if after is not None:
                    self.copy_stream.wait_event(after)
                else:
                    self.copy_stream.wait_stream(cur)    # compute may still read the slot's old expert
                t0 = torch.cuda.Event(enable_timing=True)
                t0.record(self.copy_stream)
                if self.qtype is None:
                    for n, t in src.items():
                        self.arena[n][slot].copy_(t, non_blocking=True)
                else:   # raw blocks to the device (one staging buffer: the copy stream orders its reuse)
                    if self._staging is None:
                        self._staging = torch.empty(8, self.layout.expert_bytes, dtype=torch.uint8, device=self.device)
                    self._staging[0].copy_(buf[:self.layout.expert_bytes], non_blocking=True)
                    self._put(slot, self.layout.unpack(self._staging[0], li), li)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(self.copy_stream)
            timer.events.append((t0, ev))
            if li is not None:
                self.pending[li] = ev
        self.bytes_copied[self.phase] += self.layout.raw_bytes
        return ev

    def load_many(self, slots: list[int], bufs: list[torch.Tensor], after, layers: list[int] | None = None) -> object:
        """CUDA: fill several slots on the copy stream after event `after`, GGML experts repacked in
        one batch per layer format (a handful of launches however many experts). layers: the layer
        of each expert (needed when formats vary by layer). -> event when all are done."""
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(after)
            t0 = torch.cuda.Event(enable_timing=True)
            t0.record(self.copy_stream)
            if self.qtype is None:
                for s, buf in zip(slots, bufs):
                    for n, t in self.layout.unpack(buf).items():
                        self.arena[n][s].copy_(t, non_blocking=True)
            else:
                n = len(bufs)
                if self._staging is None or self._staging.dim() == 1 or self._staging.shape[0] < n:
                    self._staging = torch.empty(max(n, 8), self.layout.expert_bytes, dtype=torch.uint8,
                                                device=self.device)
                for i, j, src in _runs(bufs, self.layout.expert_bytes):
                    self._staging[i:j].copy_(src, non_blocking=True)
                groups: dict = {}       # layer specs -> rows of the staging buffer
                for i, li in enumerate(layers if self.layout.varies_by_layer else [None] * n):
                    groups.setdefault(id(self.layout.specs(li)), (self.layout.specs(li), []))[1].append(i)
                for specs, rows in groups.values():
                    self._put_many(specs, rows, [slots[i] for i in rows])
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.copy_stream)
        self.copy_timer[self.phase].events.append((t0, ev))
        self.bytes_copied[self.phase] += self.layout.raw_bytes * len(slots)
        return ev

    def _put_many(self, specs: list[ParamSpec], rows: list[int], slots: list[int]) -> None:
        """Staging rows (experts laid out as `specs`) -> `slots`, GGML params repacked in one batch."""
        for i in range(0, len(rows), REPACK_EXPERTS):    # bounded repack temporaries (a layer's stage: 128)
            part, dst = rows[i:i + REPACK_EXPERTS], slots[i:i + REPACK_EXPERTS]
            if part == list(range(part[0], part[0] + len(part))):
                src = self._staging[part[0]:part[0] + len(part)]
            else:
                src = self._staging[_to(torch.tensor(part, dtype=torch.long), self.device)]
            self.repack_into(src, _to(torch.tensor(dst, dtype=torch.long), self.device), specs)

    def repack_into(self, src: torch.Tensor, idx: torch.Tensor, specs: list[ParamSpec]) -> None:
        """Raw experts src (device uint8 [n, expert_bytes], laid out as `specs`) -> slots idx (device
        int64 [n]): float params cast, GGML params repacked. Fixed shapes and no host sync, so a CUDA
        graph can hold it (memory.doorbell's PCIe share)."""
        n = src.shape[0]
        for p in specs:
            raw = src[:, p.offset:p.offset + p.nbytes]
            if p.qtype is None:
                dst = self.arena[p.name]
                dst.index_copy_(0, idx, raw.view(p.dtype).view(n, *p.shape).to(dst.dtype))
                continue
            dst = self.planes[(p.name, p.qtype)]
            for k, plane in repack(p.qtype, self._ggml_rows(p, raw.view(n, *p.shape))).items():
                dst[k].index_copy_(0, idx, plane)

    def wait(self, li: int) -> None:
        """Before layer li reads its slots: wait for copies into them (CUDA)."""
        ev = self.pending.pop(li, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def stage_slot(self) -> int:
        s = self.stage[self._next_stage % len(self.stage)]
        self._next_stage += 1
        return s

    def run_staged(self, buf: torch.Tensor, x: torch.Tensor, act: Callable,
                   li: int | None = None) -> tuple[torch.Tensor, object]:
        """Prefill: copy one expert (of layer li) into a stage slot and run it there. -> (y, copy event)."""
        s = self.stage_slot()
        if self._ahead is not None and s in self._ahead[2].values():
            self._ahead = None      # overwritten: run_staged_many copies those experts again
        ev = self.load(s, buf, after=self.stage_free.get(s), li=li)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        if self.qtype is not None and self._dequant_ok(x, DEQUANT_ROWS):
            gu, dn = self.dequantized([s], x.dtype, li)
            y = expert_math({"gate_up_proj": gu[0], "down_proj": dn[0]}, x, act)
        elif self.qtype is not None:
            y = torch.empty_like(x)
            self._run_kernel([(s, 0, x.shape[0])], x, y, act, li)
        else:
            y = expert_math(self.weights(s), x, act)
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
            self.stage_free[s] = done
            self._half_free.clear()     # the next batch waits for everything queued so far
        return y, ev

    def prefetch_layer(self, li: int, experts: list[tuple[int, torch.Tensor]]) -> object:
        """Prefill (CUDA, a stage of two layers' worth): copy layer li's experts [(expert, RAM buffer)]
        into the stage half its batch will use, now, so the copies run while the current layer
        computes; run_staged_many of layer li then finds them there. -> the copy event."""
        half = self._next_stage % 2
        slots = self.stage[half * self.stage_batch:][:len(experts)]
        ev = self.load_many(slots, [buf for _, buf in experts], self._after(half), [li] * len(experts))
        self._ahead = (li, half, {e: s for (e, _), s in zip(experts, slots)}, ev)
        self.layers_ahead += 1
        return ev

    def take_ahead(self, li: int) -> tuple[int, list[int], object]:
        """Layer li's prefetch (all E experts): (stage half, slot of each expert in order, copy event);
        the caller computes from those slots and then calls computed()."""
        _, half, have, ev = self._ahead
        self._ahead = None
        self._next_stage += 1           # the half is used, as by run_staged_many
        return half, [have[e] for e in range(len(have))], ev

    def ahead(self, li: int) -> set[int]:
        """Experts of layer li already copied to the stage by prefetch_layer."""
        return set(self._ahead[2]) if self._ahead is not None and self._ahead[0] == li else set()

    def _after(self, half: int):
        """The event after which stage half `half` may be overwritten (the computation that last read it)."""
        after = self._half_free.get(half)
        if after is None:
            after = torch.cuda.Event()
            after.record()
        return after

    def run_staged_many(self, items: list[tuple[torch.Tensor, int, int]], xs: torch.Tensor, ys: torch.Tensor,
                        act: Callable, li: int | None = None, experts: list[int] | None = None):
        """Prefill: up to len(self.stage) experts [(RAM buffer, row start, rows)] copied into the stage
        slots as one batch and run together (rows of xs -> ys), as the hits are. experts: their ids,
        to use what prefetch_layer copied already. -> the copy event (CUDA: the buffers must stay
        untouched until it) or None."""
        half = self._next_stage % 2 if self.stage_batch < len(self.stage) else 0
        self._next_stage += 1
        ahead, self._ahead = self._ahead, None
        have, ev = {}, None         # expert -> slot already there (prefetch_layer), its copy event
        if ahead is not None and experts is not None and ahead[0] == li and ahead[1] == half:
            have, ev = ahead[2], ahead[3]
            torch.cuda.current_stream(self.device).wait_event(ev)
        spare = iter([s for s in self.stage[half * self.stage_batch:][:self.stage_batch] if s not in have.values()])
        slots = [have[e] if e in have else next(spare) for e in (experts or [None] * len(items))]
        new = [(s, buf) for s, e, (buf, _, _) in zip(slots, experts or [None] * len(items), items) if e not in have]
        hits = [(s, a, n) for s, (_, a, n) in zip(slots, items)]
        if not self.cuda:
            for s, buf in new:
                self._put(s, self.layout.unpack(buf, li), li)
            self.run(hits, xs, ys, act, li=li)
            return None
        if new:     # double buffering: this half's copies wait only for the computation that last read
            # this half, so they overlap the other half's computation
            ev = self.load_many([s for s, _ in new], [buf for _, buf in new], self._after(half), [li] * len(new))
            torch.cuda.current_stream(self.device).wait_event(ev)
        self.run(hits, xs, ys, act, (self.n_slots, len(self.stage)), li)
        self.computed(half, slots)
        return ev

    def computed(self, half: int, slots: list[int]) -> None:
        """After the computation that reads stage `slots` (of half `half`) is queued."""
        done = torch.cuda.Event()
        done.record()
        self._half_free[half] = done
        for s in slots:                 # a single staged copy into one of these slots waits for it too
            self.stage_free[s] = done

    # ------------------------------------------------------------------ hits
    def run(self, hits: list[tuple[int, int, int]], xs: torch.Tensor, ys: torch.Tensor, act: Callable,
            slot_range: tuple[int, int] | None = None, li: int | None = None) -> None:
        """hits [(slot, row start, rows)] of xs (rows sorted by expert; experts of layer li) -> ys rows."""
        if not hits:
            return
        timer = self.compute_timer[self.phase]
        tok = timer.start()
        if self.qtype is not None and self._dequant_ok(xs, sum(n for _, _, n in hits)):
            self._run_dequant(hits, xs, ys, act, li)
        elif self.qtype is not None:
            self._run_kernel(hits, xs, ys, act, li)
        elif self.grouped and slot_range is not None and len(hits) > 1:
            self._run_grouped(hits, xs, ys, act, slot_range)
        else:
            for s, a, n in hits:
                ys[a:a + n] = expert_math(self.weights(s), xs[a:a + n], act)
        timer.stop(tok)

    def _run_grouped(self, hits, xs, ys, act, slot_range) -> None:
        """All hits of a layer as two grouped GEMMs over the layer's slot range: no weight gather;
        slots without rows are empty groups."""
        base, size = slot_range
        hits = sorted(hits)
        per_slot = [0] * size
        for s, _, n in hits:
            per_slot[s - base] = n
        _grouped(hits, per_slot, self.arena["gate_up_proj"][base:base + size],
                 self.arena["down_proj"][base:base + size], xs, ys, act)

    def _dequant_ok(self, xs: torch.Tensor, rows: int) -> bool:
        return (self.cuda and rows >= DEQUANT_ROWS and xs.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
                and self.kernel_biases() is None)

    def dequantized(self, slots: list[int], dtype: torch.dtype, li: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """GGML experts (of layer li) of `slots` as float weights: gate_up [n, 2I, D], down [n, D, I] in
        `dtype` (kernels.ops.dequantize: one Triton pass on CUDA)."""
        spec = {p.name: p for p in self.layout.specs(li)}
        out = []
        idx = _to(torch.tensor(slots, dtype=torch.long), self.device)
        for name in ("gate_up_proj", "down_proj"):
            w = ops.dequantize(spec[name].qtype, self.planes[(name, spec[name].qtype)], idx, dtype)
            out.append(w)
        return out[0], out[1]

    def _run_dequant(self, hits, xs, ys, act, li=None) -> None:
        """CUDA prefill on GGML experts: the hit slots dequantized to the compute dtype, then the
        grouped GEMMs of float experts (the Triton grouped kernels on planes were measured ~30x slower
        on the H200: 247 tok/s prefill for the 48-layer Q4_0 30B-A3B shape)."""
        hits = sorted(hits)
        for i in range(0, len(hits), DEQUANT_EXPERTS):     # bounded float copies (a layer's stage: 128 experts)
            part = hits[i:i + DEQUANT_EXPERTS]
            gu, dn = self.dequantized([s for s, _, _ in part], xs.dtype, li)
            _grouped(part, [n for _, _, n in part], gu, dn, xs, ys, act)
            del gu, dn      # before the next part's copies: else two parts are live (measured 32 experts at the peak)

    def _run_kernel(self, hits, xs, ys, act, li=None) -> None:
        """GGML experts: every hit row in one kernels.ops.moe call (k = 1, weight 1) on the slots."""
        rows = torch.cat([torch.arange(a, a + n) for _, a, n in hits])
        slots = torch.cat([torch.full((n,), s, dtype=torch.int32) for s, _, n in hits])
        rows, slots = rows.to(xs.device, non_blocking=True), slots.to(xs.device, non_blocking=True)
        fmt, gate_up, down = self.kernel_weights(li)
        ones = torch.ones(rows.shape[0], 1, dtype=xs.dtype, device=xs.device)
        y = ops.moe(xs.index_select(0, rows), slots[:, None], ones, gate_up, down, act, self.kernel_biases(), fmt)
        ys.index_copy_(0, rows, y.to(ys.dtype))
