"""CPU buffers on transparent huge pages (2 MiB), for the weights a CPU decode token streams.

Where the kernel's THP mode is `madvise` (the default of most distributions, and of the dev and H200 boxes), torch's
buffers use 4 KiB pages: a TLB miss every 4 KiB of a streamed weight, and in a virtual machine each miss walks two
page tables. `empty` maps anonymous memory advised MADV_HUGEPAGE before any page is touched, so the pages fault in
2 MiB at a time. Measured: docs/perf-log.md, session 25. MOETIER_THP=0 turns it off (plain torch buffers); where
the OS has no MADV_HUGEPAGE (not Linux) the buffers are plain too.

    buf = empty(nbytes)     # uint8 [nbytes], starting on a 2 MiB boundary
    t2 = copy(t)            # t's values in such a buffer (t's shape and dtype), t itself when under MIN_BYTES
"""
from __future__ import annotations

import mmap
import os

import torch

HUGE = 2 << 20
MIN_BYTES = 4 << 20     # smaller buffers hold at most one whole huge page
ENABLED = os.environ.get("MOETIER_THP", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def empty(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] on an anonymous private mapping advised for huge pages (plain torch.empty when disabled); the
    mapping lives as long as the tensor (its storage holds the mmap object)."""
    if not ENABLED:
        return torch.empty(nbytes, dtype=torch.uint8)
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:         # a kernel without THP: 4 KiB pages, still a valid buffer
        pass
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE
    return whole[skip:skip + nbytes]


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of t on huge pages; t itself when it is smaller than MIN_BYTES or THP is off."""
    nbytes = t.numel() * t.element_size()
    if not ENABLED or nbytes < MIN_BYTES or t.device.type != "cpu":
        return t
    out = empty(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes of t's range that /proc/self/smaps reports as AnonHugePages (0 where unreadable): for tests and benches."""
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    a, b = (int(v, 16) for v in head.split("-"))
                    inside = a < hi and b > lo
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
