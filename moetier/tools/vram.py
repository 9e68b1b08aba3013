"""Where GPU memory went at its peak: a replay of torch's allocator history (issue #3: the budget is a
hard limit). Start recording with `record()`, then `live_at_peak(torch.cuda.memory._snapshot())`."""
from __future__ import annotations

from collections import defaultdict

import torch


def record() -> None:
    """Start torch's allocator history with Python stacks (costly: diagnostics only)."""
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")


def site(frames: list[dict]) -> str:
    """The innermost frame in moetier (else the innermost frame) as file:line function."""
    for f in frames:
        if "moetier" in f.get("filename", ""):
            name = f["filename"].split("moetier/")[-1]
            return f"{name}:{f.get('line')} {f.get('name')}"
    return f"{frames[0].get('filename', '?')}:{frames[0].get('line')}" if frames else "?"


def live_at_peak(snapshot: dict) -> tuple[int, dict]:
    """Replay alloc/free events of device 0: -> (peak bytes seen in the trace, {site: bytes} live then).
    One pass keeps a running total and notes where the peak is; a second pass up to there names the blocks."""
    trace = snapshot["device_traces"][0]
    size, total, peak, at = {}, 0, 0, -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            size[ev["addr"]] = ev["size"]
            total += ev["size"]
            if total > peak:
                peak, at = total, i
        elif ev["action"] == "free_requested" and ev["addr"] in size:
            total -= size.pop(ev["addr"])
    live = {}
    for ev in trace[:at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    by = defaultdict(int)
    for ev in live.values():
        by[site(ev.get("frames", []))] += ev["size"]
    return peak, dict(sorted(by.items(), key=lambda kv: -kv[1]))
