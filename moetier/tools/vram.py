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
    """Replay alloc/free events of device 0: -> (peak bytes seen in the trace, {site: bytes} live then)."""
    live, peak, at_peak = {}, 0, {}
    for ev in snapshot["device_traces"][0]:
        a = ev["action"]
        if a == "alloc":
            live[ev["addr"]] = (ev["size"], site(ev.get("frames", [])))
        elif a in ("free_requested", "free_completed") and ev["addr"] in live:
            if a == "free_requested":
                live.pop(ev["addr"])
        else:
            continue
        total = sum(s for s, _ in live.values())
        if total > peak:
            peak, at_peak = total, dict(live)
    by = defaultdict(int)
    for size, where in at_peak.values():
        by[where] += size
    return peak, dict(sorted(by.items(), key=lambda kv: -kv[1]))
