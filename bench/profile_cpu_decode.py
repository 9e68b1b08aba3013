"""Where a CPU-only decode token's time goes (no GPU): the C kernels (one-token linears on GGML blocks, packed
experts), torch's GEMMs, the other torch ops, and what no op accounts for (Python, waits), per thread count.

Loads MODEL on the CPU once (`--cpu-compile off`: the eager step, or `on`: the compiled one), then for each of
--threads: sets the thread count (torch's pool and the C kernels read the same number), warms up with one request
and profiles one of --gen decoded tokens (a 2-token prompt, so the profile is the decode), after a run without the
profiler that times the C kernels' Python entry points (`unprofiled`: the profiler's own cost per op inflates the
small ops' share). Prints JSON: tok/s, ms
per token by group and the bytes the token reads (bench_core.bytes_per_token) over its time (GB/s), beside the RAM
read rate of that thread count (memory.bandwidth.measure_ram).

    python bench/profile_cpu_decode.py MODEL.gguf [--threads 16,8] [--gen 24] [--cpu-compile off]
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
from moetier import EngineConfig, SamplingParams  # noqa: E402
from moetier.kernels import cpu as cpu_kernels  # noqa: E402
from moetier.runtime.engine import Engine  # noqa: E402
from moetier.tools.bench_core import bytes_per_token  # noqa: E402

GROUPS = {"qlinear": "qlinear (C, GGML blocks)", "moetier::moe_tokens": "experts (C)", "aten::mm": "torch GEMM",
          "aten::addmm": "torch GEMM", "aten::bmm": "torch GEMM"}


def _labelled_qlinear() -> None:
    """cpu_kernels.qlinear_op, which the eager linears call (runtime.cpu_compile._on_blocks), under a profiler label: it
    is a ctypes call, no torch op."""
    inner = cpu_kernels.qlinear_op

    def qlinear_op(*a, **k):
        with torch.profiler.record_function("qlinear"):
            return inner(*a, **k)
    cpu_kernels.qlinear_op = qlinear_op


def profile_once(eng, gen: int) -> dict:
    prompt = [101, 2024]
    eng.complete(prompt_ids=prompt, max_tokens=4, params=SamplingParams(temperature=0), ignore_eos=True)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        done = eng.complete(prompt_ids=prompt, max_tokens=gen, params=SamplingParams(temperature=0), ignore_eos=True)
    wall = time.perf_counter() - t0
    n = max(1, done.stats["generated_tokens"] - 1)
    by = defaultdict(float)
    top = []
    for ev in prof.key_averages():
        if ev.key.startswith("ProfilerStep") or ev.key in ("aten::linear", "aten::matmul"):
            continue
        by[GROUPS.get(ev.key, "other torch ops")] += ev.self_cpu_time_total / 1e3
        top.append((ev.self_cpu_time_total / 1e3, ev.key, ev.count))
    per = {k: round(v / n, 3) for k, v in by.items()}
    per["not in any op (Python, waits)"] = round(wall * 1e3 / n - sum(by.values()) / n, 3)
    top.sort(reverse=True)
    return {"decode_tok_s": done.stats["decode_tok_s"], "ms_per_token": per,
            "top_ops": [{"op": k, "ms_per_token": round(v / n, 3), "calls_per_token": round(c / n, 2)}
                        for v, k, c in top[:12]]}


def timed_once(eng, gen: int) -> dict:
    """The decode of `gen` tokens without the profiler (whose ~10 us an op inflated the small ops' share 3x on the
    Xeon): perf_counter around each call of the C kernels' Python entry points; -> ms a token in each, and the rest
    (torch ops, Python, waits)."""
    from moetier.runtime import cpu_compile
    spent = defaultdict(float)
    targets = [(cpu_kernels, "qlinear_op", "qlinear (C, GGML blocks)"), (cpu_compile, "fused_experts", "experts (C)"),
               (cpu_kernels, "decode_attention", "attention (C)"), (cpu_kernels, "router_topk_add_norm",
                                                                    "add + norm + router (C)")]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in targets]
    for (mod, name, label), (_, _, inner) in zip(targets, saved):
        def timed(*a, _inner=inner, _label=label, **k):
            t = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                spent[_label] += time.perf_counter() - t
        setattr(mod, name, timed)
    prompt = [101, 2024]
    try:
        eng.complete(prompt_ids=prompt, max_tokens=4, params=SamplingParams(temperature=0), ignore_eos=True)
        spent.clear()
        done = eng.complete(prompt_ids=prompt, max_tokens=gen, params=SamplingParams(temperature=0), ignore_eos=True)
    finally:
        for mod, name, inner in saved:
            setattr(mod, name, inner)
    n = max(1, done.stats["generated_tokens"] - 1)
    ms = 1e3 / done.stats["decode_tok_s"]
    per = {k: round(v * 1e3 / n, 3) for k, v in spent.items()}     # the prefill's calls are few: n spreads them
    per["the rest (torch ops, Python, waits)"] = round(ms - sum(per.values()), 3)
    return {"decode_tok_s": done.stats["decode_tok_s"], "ms_per_token": round(ms, 3), "timed_ms_per_token": per}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", default="16")
    ap.add_argument("--gen", type=int, default=24)
    ap.add_argument("--cpu-compile", default="off", choices=("off", "on"))
    a = ap.parse_args()
    from moetier.memory.bandwidth import measure_ram
    counts = [int(t) for t in a.threads.split(",")]
    eng = Engine.load(a.model, EngineConfig(device="cpu", threads=counts[0], progress=False, max_context=1024,
                                            cpu_compile=a.cpu_compile))
    _labelled_qlinear()
    rows = []
    for t in counts:
        torch.set_num_threads(t)
        r = {"unprofiled": timed_once(eng, a.gen), **profile_once(eng, a.gen)}
        b = bytes_per_token(eng, 16)     # after a decode: the GGML copies the step reads exist
        total = sum(b.values())
        ms = 1e3 / r["decode_tok_s"]
        rows.append({"threads": t, "ram_read_gbs": round(measure_ram(), 1), "token_gbs": round(total / ms / 1e6, 1),
                     **r})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"model": a.model, "cpu_compile": a.cpu_compile, "bytes_per_token": b, "runs": rows}))


if __name__ == "__main__":
    main()
