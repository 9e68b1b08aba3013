"""The fast tier's arena and the expert math that runs on it.

Per stacked expert param, one tensor [slots + stage, *shape] in the compute dtype on the fast
device (the GPU; without CUDA a CPU tensor stands in). Slots belong to layers (cache.SlotCache);
the `stage` slots at the end take prefill copies. `load` fills a slot from a RAM buffer (storage
dtype -> compute dtype). On CUDA copies run on a side stream: a copy waits for the compute that may
still read its slot, and a layer's next call waits for the copies into its slots.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from .layout import ExpertLayout


def expert_math(wts: dict[str, torch.Tensor], x: torch.Tensor, act: Callable) -> torch.Tensor:
    """One expert on rows x [n, D] -> [n, D]; the same ops as DenseExperts.expert (bit-identical on CPU)."""
    h = F.linear(x, wts["gate_up_proj"], wts.get("gate_up_bias"))
    gate, up = h.chunk(2, dim=-1)
    return F.linear(act(gate, up), wts["down_proj"], wts.get("down_bias"))


def grouped_available(device: str, dtype: torch.dtype, layout: ExpertLayout) -> bool:
    """torch._grouped_mm runs all of a layer's hits as one GEMM per projection (CUDA, bf16, no biases)."""
    return (device.startswith("cuda") and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and {p.name for p in layout.params} == {"gate_up_proj", "down_proj"})


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
        self.arena = {p.name: torch.empty((n_slots + n_stage, *p.shape), dtype=dtype, device=device)
                      for p in layout.params}
        self.stage = list(range(n_slots, n_slots + n_stage))
        self._next_stage = 0
        self.grouped = grouped
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending: dict[int, object] = {}        # layer -> event of its last copy
        self.stage_free: dict[int, object] = {}     # stage slot -> event after the compute that read it
        self.phase = "decode"     # which counters the work goes to (set per call by experts.Tiers)
        self.copy_timer = {p: Timer(self.cuda) for p in ("prefill", "decode")}
        self.compute_timer = {p: Timer(self.cuda) for p in ("prefill", "decode")}
        self.bytes_copied = {"prefill": 0, "decode": 0}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.arena.values())

    def weights(self, slot: int) -> dict[str, torch.Tensor]:
        return {n: t[slot] for n, t in self.arena.items()}

    # ------------------------------------------------------------------ copies
    def load(self, slot: int, buf: torch.Tensor, li: int | None = None, after=None):
        """Fill `slot` from a RAM buffer (uint8, storage layout). -> CUDA event when the copy is done
        (the buffer must stay untouched until then), None on the CPU (done on return)."""
        src = self.layout.unpack(buf)
        timer = self.copy_timer[self.phase]
        tok = timer.start() if not self.cuda else None
        if not self.cuda:
            for n, t in src.items():
                self.arena[n][slot].copy_(t)
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
                for n, t in src.items():
                    self.arena[n][slot].copy_(t, non_blocking=True)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(self.copy_stream)
            timer.events.append((t0, ev))
            if li is not None:
                self.pending[li] = ev
        self.bytes_copied[self.phase] += self.layout.raw_bytes
        return ev

    def wait(self, li: int) -> None:
        """Before layer li reads its slots: wait for copies into them (CUDA)."""
        ev = self.pending.pop(li, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def stage_slot(self) -> int:
        s = self.stage[self._next_stage % len(self.stage)]
        self._next_stage += 1
        return s

    def run_staged(self, buf: torch.Tensor, x: torch.Tensor, act: Callable) -> tuple[torch.Tensor, object]:
        """Prefill: copy one expert into a stage slot and run it there. -> (y, copy event)."""
        s = self.stage_slot()
        ev = self.load(s, buf, after=self.stage_free.get(s))
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        y = expert_math(self.weights(s), x, act)
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
            self.stage_free[s] = done
        return y, ev

    # ------------------------------------------------------------------ hits
    def run(self, hits: list[tuple[int, int, int]], xs: torch.Tensor, ys: torch.Tensor, act: Callable,
            slot_range: tuple[int, int] | None = None) -> None:
        """hits [(slot, row start, rows)] of xs (rows sorted by expert) -> ys rows."""
        if not hits:
            return
        timer = self.compute_timer[self.phase]
        tok = timer.start()
        if self.grouped and slot_range is not None and len(hits) > 1:
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
        rows = torch.cat([torch.arange(a, a + n) for _, a, n in hits]).to(xs.device, non_blocking=True)
        per_slot = [0] * size
        for s, _, n in hits:
            per_slot[s - base] = n
        offs = torch.tensor(per_slot, dtype=torch.int32).cumsum(0).to(torch.int32).to(xs.device, non_blocking=True)
        xh = xs.index_select(0, rows)
        gu = self.arena["gate_up_proj"][base:base + size].transpose(-2, -1)
        h = torch._grouped_mm(xh, gu, offs=offs)
        gate, up = h.chunk(2, dim=-1)
        dn = self.arena["down_proj"][base:base + size].transpose(-2, -1)
        y = torch._grouped_mm(act(gate, up).contiguous(), dn, offs=offs)
        ys.index_copy_(0, rows, y.to(ys.dtype))
