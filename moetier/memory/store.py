"""The RAM bank and the SSD tier.

`SsdReader` reads one expert's pieces straight from the checkpoint files with os.preadv into a
caller's preallocated buffer (a pool of reader threads; preadv releases the GIL), optionally
with O_DIRECT through an aligned bounce buffer. It never touches the checkpoint's mmap, so
streamed experts do not grow the process's RSS (only the page cache, which the kernel reclaims).

`RamBank` holds experts in their storage dtype as flat buffers (pinned when CUDA is present):
all of them when the RAM budget allows, else an LRU cache over the SSD tier. Free bank slots
take any read; once full, only decode reads evict (LESSONS.md section 2: an LRU fed by decode
reads beat one fed by prompts). Prompt reads that find no free slot go through scratch buffers.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from .layout import EXPERT_ALIGN, ExpertLayout

CHUNK_BYTES = 1 << 30   # the bank is allocated in chunks of about this size (pinning one 50 GB block fails)


class SsdReader:
    """Expert reads from the checkpoint into caller buffers: submit() -> Future[bytes read]."""

    def __init__(self, layout: ExpertLayout, threads: int = 4, direct: bool = False):
        self.layout, self.direct = layout, direct
        self.fds: dict[str, int] = {}
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="moetier-ssd")
        self.local = threading.local()
        self.bytes = 0          # bytes delivered
        self.reads = 0          # experts read
        self.busy_s = 0.0       # summed time inside preadv (all threads)

    def _fd(self, path: str) -> int:
        with self.lock:
            fd = self.fds.get(path)
            if fd is None:
                flags = os.O_RDONLY | (os.O_DIRECT if self.direct and hasattr(os, "O_DIRECT") else 0)
                fd = self.fds[path] = os.open(path, flags)
            return fd

    def read(self, li: int, e: int, buf: torch.Tensor) -> int:
        """Fill buf (uint8, >= expert bytes) with expert e of MoE layer li; -> bytes read."""
        t0 = time.perf_counter()
        dest = buf.numpy()
        n = 0
        for p in self.layout.parts(li, e):
            view = dest[p.buf_offset:p.buf_offset + p.nbytes]
            if self.direct:
                self._read_direct(self._fd(p.path), view, p.file_offset)
            else:
                _pread_full(self._fd(p.path), memoryview(view), p.file_offset)
            n += p.nbytes
        dt = time.perf_counter() - t0
        with self.lock:
            self.bytes += n
            self.reads += 1
            self.busy_s += dt
        return n

    def _read_direct(self, fd: int, view: np.ndarray, offset: int) -> None:
        """O_DIRECT needs aligned offset, length and address: read the aligned superset into a
        page-aligned bounce buffer (one per thread), then copy the wanted bytes."""
        a = offset // EXPERT_ALIGN * EXPERT_ALIGN
        b = -(-(offset + len(view)) // EXPERT_ALIGN) * EXPERT_ALIGN
        bounce = getattr(self.local, "bounce", None)
        if bounce is None or len(bounce) < b - a:
            bounce = self.local.bounce = mmap.mmap(-1, b - a)
        got = _pread_full(fd, memoryview(bounce)[:b - a], a, allow_short=True)
        if got < offset - a + len(view):
            raise OSError(f"short read at offset {offset}: the checkpoint file is truncated")
        view[:] = np.frombuffer(bounce, dtype=np.uint8, count=len(view), offset=offset - a)

    def submit(self, li: int, e: int, buf: torch.Tensor) -> Future:
        return self.pool.submit(self.read, li, e, buf)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        with self.lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()


def _pread_full(fd: int, mv: memoryview, offset: int, allow_short: bool = False) -> int:
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n == 0:
            if allow_short:
                return done
            raise OSError(f"unexpected end of file at offset {offset + done}: the checkpoint is truncated")
        done += n
    return done


def alloc_buffers(n: int, nbytes: int, pin: bool) -> list[torch.Tensor]:
    """n uint8 buffers of nbytes each, carved from chunks of ~1 GiB (pinned when asked).
    Pages are touched only when written, so RSS grows as the bank fills."""
    out: list[torch.Tensor] = []
    per_chunk = max(1, CHUNK_BYTES // nbytes)
    while len(out) < n:
        m = min(per_chunk, n - len(out))
        chunk = torch.empty(m * nbytes, dtype=torch.uint8, pin_memory=pin)
        out.extend(chunk[i * nbytes:(i + 1) * nbytes] for i in range(m))
    return out


class RamBank:
    """Experts in RAM (storage format). where[li, e] = bank slot or -1."""

    def __init__(self, layout: ExpertLayout, capacity: int, reader: SsdReader, pin: bool,
                 scratch: int, disk_layers: set[int] = frozenset()):
        self.layout, self.reader = layout, reader
        self.capacity = capacity
        self.disk_layers = set(disk_layers)       # layers never kept in RAM (--override-tensor ...=disk)
        self.slots = alloc_buffers(capacity, layout.expert_bytes, pin)
        if scratch < 1:
            raise ValueError("the RAM bank needs at least one scratch buffer for streamed reads")
        self.scratch = alloc_buffers(scratch, layout.expert_bytes, pin)
        self.free_scratch = list(range(scratch))
        self.where = np.full((layout.num_layers, layout.num_experts), -1, dtype=np.int32)
        self.owner = [(-1, -1)] * capacity
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.lru: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.inflight: dict[tuple[int, int], Future] = {}   # reads into bank slots (demand or prefetch)
        self.busy: dict[tuple, object] = {}                  # ("bank"|"scratch", i) -> CUDA event of a copy reading it
        self.prefetched: set[tuple[int, int]] = set()
        self.x8: dict[str, int] | None = None     # params whose rows the miss server interleaved (memory/doorbell.py)
        # every expert the bank is meant for fits (set by the placement; pinned fast-tier experts excluded)
        self.all_resident = capacity >= layout.num_layers * layout.num_experts and not self.disk_layers
        self.stats = {"ram_hits": 0, "ssd_reads": 0, "evictions": 0, "prefetch_reads": 0,
                      "prefetch_used": 0, "wait_s": 0.0}


    def resident(self, li: int) -> int:
        return int((self.where[li] >= 0).sum())

    # ------------------------------------------------------------------ filling
    def preload(self, order: list[tuple[int, int]]) -> None:
        """Read experts into free slots, in order, until the bank is full (parallel reads)."""
        futures = []
        for li, e in order:
            if not self.free_slots:
                break
            if li in self.disk_layers or self.where[li, e] >= 0:
                continue
            s = self._claim_free(li, e)
            futures.append(self.reader.submit(li, e, self.slots[s]))
        for f in futures:
            f.result()

    def _claim_free(self, li: int, e: int) -> int:
        s = self.free_slots.pop()
        self._assign(s, li, e)
        return s

    def _assign(self, s: int, li: int, e: int) -> None:
        self.where[li, e] = s
        self.owner[s] = (li, e)
        self.lru[(li, e)] = s

    def _evict(self, protect: set[tuple[int, int]]) -> int | None:
        """Free the least recently used slot not in `protect` and not being read; -> slot."""
        for key, s in self.lru.items():
            if key in protect:
                continue
            fut = self.inflight.get(key)
            if fut is not None:
                if not fut.done():
                    continue
                del self.inflight[key]      # a finished prefetch nobody used
            self._wait_busy(("bank", s))
            del self.lru[key]
            self.where[key] = -1
            self.owner[s] = (-1, -1)
            self.prefetched.discard(key)
            self.stats["evictions"] += 1
            return s
        return None

    # ------------------------------------------------------------------ reads
    def prefetch(self, li: int, e: int, protect: set[tuple[int, int]] = frozenset()) -> bool:
        """Start reading expert e of layer li into the bank early (evicting the LRU); -> started?"""
        key = (li, e)
        if self.where[li, e] >= 0 or key in self.inflight or li in self.disk_layers or self.capacity == 0:
            return False
        s = self.free_slots.pop() if self.free_slots else self._evict(set(protect))
        if s is None:
            return False
        self._assign(s, li, e)
        self.lru.move_to_end(key, last=False)   # a guess: first to go if it is not used
        self.inflight[key] = self.reader.submit(li, e, self.slots[s])
        self.prefetched.add(key)
        self.stats["prefetch_reads"] += 1
        return True

    def fetch(self, li: int, experts: list[int], admit: bool, depth: int = 4):
        """Yield (e, buf, tier, handle) for each expert in order; tier is 'ram' (it was in the bank) or
        'ssd' (read for this use, or by a prefetch). Reads run up to `depth` ahead of the consumer;
        a scratch buffer is reused once the consumer has moved on. admit: a decode read may evict
        the LRU slot (prompt reads only take free slots, else scratch)."""
        protect = {(li, e) for e in experts}
        items = []          # [e, source 'bank'|'scratch'|None, index, future]
        for e in experts:
            s = int(self.where[li, e])
            if s >= 0:
                self.lru.move_to_end((li, e))
                items.append([e, "bank", s, self.inflight.get((li, e))])
            else:
                items.append([e, None, -1, None])
        started = 0
        try:
            for i, item in enumerate(items):
                while started < len(items) and (started <= i or started < i + depth):
                    if not self._start(li, items[started], admit, protect):
                        break
                    started += 1
                if started <= i:
                    raise RuntimeError("no scratch buffer free for an expert read")   # scratch >= 1 prevents it
                e, src, idx, fut = item
                key = (li, e)
                tier = "ram"
                if key in self.prefetched:
                    self.prefetched.discard(key)
                    self.stats["prefetch_used"] += 1
                    tier = "ssd"
                if fut is not None:
                    t0 = time.perf_counter()
                    fut.result()
                    self.stats["wait_s"] += time.perf_counter() - t0
                    self.inflight.pop(key, None)
                    tier = "ssd"
                self.stats["ssd_reads" if tier == "ssd" else "ram_hits"] += 1
                yield e, (self.slots[idx] if src == "bank" else self.scratch[idx]), tier, (src, idx)
                if src == "scratch":
                    item[1] = None
                    self.free_scratch.append(idx)
        finally:    # the consumer stopped early (or a read failed): wait for reads, give buffers back
            for item in items[:started]:
                if item[3] is not None:
                    try:
                        item[3].result()
                    except Exception:
                        pass
                    self.inflight.pop((li, item[0]), None)
                if item[1] == "scratch":
                    item[1] = None
                    self.free_scratch.append(item[2])

    def _start(self, li: int, item: list, admit: bool, protect: set) -> bool:
        """Give a not-yet-resident expert a buffer and start its read; False if none is free."""
        if item[1] is not None:
            return True
        e = item[0]
        s = None
        if li not in self.disk_layers and self.capacity:
            if self.free_slots:
                s = self.free_slots.pop()
            elif admit:
                s = self._evict(protect)
        if s is not None:
            self._assign(s, li, e)
            item[1], item[2] = "bank", s
            item[3] = self.inflight[(li, e)] = self.reader.submit(li, e, self.slots[s])
            return True
        if not self.free_scratch:
            return False
        k = self.free_scratch.pop()
        self._wait_busy(("scratch", k))
        item[1], item[2] = "scratch", k
        item[3] = self.reader.submit(li, e, self.scratch[k])
        return True

    def mark_busy(self, handle: tuple, event) -> None:
        """A GPU copy reads the buffer `handle` until `event`: do not overwrite it before."""
        self.busy[handle] = event

    def _wait_busy(self, handle: tuple) -> None:
        ev = self.busy.pop(handle, None)
        if ev is not None:
            ev.synchronize()

    def slot_of(self, li: int, e: int) -> int:
        return int(self.where[li, e])
