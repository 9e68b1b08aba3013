"""Where a decode token's time goes, with any placement flags (issue #5: all-GPU >= 400 tok/s, and the
GPU's serial part of every tiered step).

Loads MODEL with the usual engine and memory flags, runs one request to warm up (this captures the
CUDA-graph decode step), then profiles a request of --gen decoded tokens with torch.profiler (CUPTI
reports the kernels a graph replay launches) and prints JSON: wall ms per token, the device's busy
ms per token (union of kernel intervals) and its idle share, kernel launches per token and per
layer, and the kernels by total device time with their calls and mean us per token. The table
answers "which kernels, how many, how long" for the step; the idle share answers "how much is
launch gaps, waits on the host (doorbells) and Python".

    python bench/profile_decode.py MODEL.gguf [--gen 32] [--cpu-moe | --gpu-mem 8GiB ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_prefill import length, union  # noqa: E402

from moetier.commands.common import add_model_args, engine_config  # noqa: E402
from moetier.runtime.engine import Engine  # noqa: E402


def kernel_table(prof, tokens: int, rows: int) -> tuple[list[dict], list[tuple[float, float]]]:
    """Device kernels (and copies) of the profile: per name calls and us per token; their intervals."""
    by = defaultdict(lambda: [0, 0.0])
    iv = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        a, b = ev.time_range.start / 1e3, ev.time_range.end / 1e3        # us -> ms
        iv.append((a, b))
        s = by[ev.name[:90]]
        s[0] += 1
        s[1] += (b - a) * 1e3
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:rows]
    return [{"kernel": k, "calls_per_token": round(n / tokens, 2), "us_per_token": round(us / tokens, 2),
             "us_per_call": round(us / n, 2)} for k, (n, us) in top], iv


def timeline(prof, n: int) -> list[str]:
    """n consecutive device events from 3/4 into the trace (the decode part of the request), in start order:
    "start +length (gap) name", times in us from the first listed event."""
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    if not ev:
        return []
    i0 = max(0, min(len(ev) - n, len(ev) * 3 // 4))
    t0, end, rows = ev[i0].time_range.start, None, []
    for e in ev[i0:i0 + n]:
        a, b = e.time_range.start, e.time_range.end
        gap = "" if end is None else f" ({a - end:+.1f})"
        rows.append(f"{a - t0:8.1f} +{b - a:5.1f}{gap} {e.name[:70]}")
        end = b if end is None else max(end, b)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)              # engine and memory-tier flags
    p.add_argument("--prompt-len", type=int, default=8, help="short: its prefill shares the profile")
    p.add_argument("--gen", type=int, default=32, help="decoded tokens profiled")
    p.add_argument("--rows", type=int, default=30, help="rows of the kernel table")
    p.add_argument("--timeline", type=int, default=0,
                   help="also list this many consecutive device events from the middle of the decode (start us, "
                        "length us, gap after the previous one): one layer's chain of kernels in order")
    a = p.parse_args()
    a.ctx = a.ctx or a.prompt_len + a.gen + 64
    e = Engine.load(a.model, engine_config(a))
    v = e.args.vocab_size
    g = torch.Generator().manual_seed(0)

    def request(seed: int) -> tuple[float, int]:
        g.manual_seed(seed)
        ids = torch.randint(0, v, (a.prompt_len,), generator=g).tolist()
        done = e.complete(prompt_ids=ids, max_tokens=a.gen, ignore_eos=True)
        st = done.stats
        return st.get("decode_tok_s") or 0.0, st.get("completion_tokens") or a.gen

    request(1)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        tok_s, n = request(2)
    wall = time.perf_counter() - t0
    plain, _ = request(3)
    layers = e.args.num_hidden_layers
    out = {"model": Path(a.model or "default").name, "tokens": n, "layers": layers, "decode_tok_s_profiled": tok_s,
           "decode_tok_s": plain, "ms_per_token": round(1e3 / plain, 3) if plain else None,
           "request_s": round(wall, 3)}
    if torch.cuda.is_available():
        table, iv = kernel_table(prof, n, a.rows)
        busy = length(union(iv))
        # the decode part of the trace: the profiled request also holds its prefill; count per token from
        # the kernel calls of the decode step (the table) and report busy over the whole request
        launches = sum(r["calls_per_token"] for r in table)
        out["device"] = {"busy_ms_request": round(busy, 2), "span_ms_request": round(max(b for _, b in iv) - min(x for x, _ in iv), 2),
                         "launches_per_token_top_rows": round(launches, 1),
                         "launches_per_layer_top_rows": round(launches / layers, 2)}
        out["kernels"] = table
        if a.timeline:
            out["timeline"] = timeline(prof, a.timeline)
    if e.tiers is not None:
        out["graph"] = e.memory_stats().get("graph")
    print(json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    main()
