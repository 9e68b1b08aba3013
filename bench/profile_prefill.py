"""Where a long prefill's time goes, with any placement flags (issue #5: all-RAM 8K prefill >= 9,000 tok/s).

Loads MODEL with the usual engine and memory flags, prefills one random prompt to warm up, then
profiles a second one with torch.profiler and prints, as JSON, the wall time and, on CUDA, how busy
the GPU was: the union of kernel intervals (compute), of host->device copies, and their overlap, so
"copies not overlapped with compute" and "GPU idle while the host works" are numbers, not guesses.
Then the top ops by device time and by host time.

    python bench/profile_prefill.py MODEL.gguf --cpu-moe [--prompt-len 8192] [--gpu-mem 8GiB ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moetier.commands.common import add_model_args, engine_config  # noqa: E402
from moetier.runtime.engine import Engine  # noqa: E402


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in iv)


def overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    i = j = 0
    tot = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        tot += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tot


def device_busy(prof) -> dict:
    """ms of kernels, of H2D copies, both at once, and the span of device activity (from the trace)."""
    kern, copy, streams = [], [], {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        iv = (ev.time_range.start / 1e3, ev.time_range.end / 1e3)     # us -> ms
        name = ev.name.lower()
        (copy if "memcpy" in name and ("htod" in name or "h2d" in name) else kern).append(iv)
        streams.setdefault(getattr(ev, "device_resource_id", None), []).append(iv)
    k, c = union(kern), union(copy)
    span = (max(b for _, b in k + c) - min(a for a, _ in k + c)) if k or c else 0.0
    return {"kernels_ms": round(length(k), 2), "h2d_copies_ms": round(length(c), 2),
            "both_ms": round(overlap(k, c), 2), "device_span_ms": round(span, 2),
            "idle_in_span_ms": round(span - length(union(k + c)), 2),
            "busy_ms_by_stream": {str(s): round(length(union(v)), 2) for s, v in streams.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)              # engine and memory-tier flags
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--rows", type=int, default=25, help="rows of each op table")
    a = p.parse_args()
    a.ctx = a.ctx or a.prompt_len + 64
    e = Engine.load(a.model, engine_config(a))
    g = torch.Generator().manual_seed(0)
    v = e.args.vocab_size

    def prefill(seed: int) -> float:
        g.manual_seed(seed)
        ids = torch.randint(0, v, (a.prompt_len,), generator=g).tolist()
        t0 = time.perf_counter()
        e.complete(prompt_ids=ids, max_tokens=1, ignore_eos=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    warm = prefill(1)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=acts) as prof:
        wall = prefill(2)
    plain = prefill(3)      # the profiler's own overhead shows as wall - plain
    out = {"model": Path(a.model).name, "prompt_len": a.prompt_len, "prefill_chunk": e.prefill_chunk,
           "warm_s": round(warm, 3), "profiled_s": round(wall, 3), "unprofiled_s": round(plain, 3),
           "tok_s": round(a.prompt_len / plain, 1)}
    if torch.cuda.is_available():
        out["device"] = device_busy(prof)
    if e.tiers is not None:
        st = e.memory_stats()["cumulative"]["prefill"]
        out["tiers"] = {"staged_experts": st.get("staged_experts"), "ms": st.get("ms"), "hits": st.get("hits")}
    print(json.dumps(out, indent=1), flush=True)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=a.rows, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=a.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
