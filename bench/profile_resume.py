"""Where the TTFT of a resumed long prompt goes (issue #7's "repeated prompt from a snapshot"):
prefill a long prompt, warm the resumed path up once, then profile one resumed request (the same
prompt + a new tail) with torch.profiler and print the top ops by device and host time.

    python bench/profile_resume.py MODEL.gguf [--prompt-len 32768] [--tail 64] [--chunk 4096]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_long_context import run, stream_for  # noqa: E402

from moetier.config import EngineConfig  # noqa: E402
from moetier.runtime.engine import Engine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--tail", type=int, default=64)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--shapes-only", action="store_true", help="stop after the new-shape timings")
    a = p.parse_args()
    e = Engine.load(a.model, EngineConfig(max_context=a.prompt_len + 4 * a.tail + 64, progress=False))
    e.prefill_chunk = a.chunk
    v = e.args.vocab_size
    prompt = stream_for(a.model, v, a.prompt_len, seed=1)
    s = e.new_session()
    print("cold", run(e, prompt, s, 1), flush=True)
    for seed in (7, 8):      # two resumed requests: the first compiles what the tail needs
        t0 = time.perf_counter()
        r = run(e, prompt + stream_for(a.model, v, a.tail, seed=seed), s, 1)
        print(f"resumed (seed {seed})", r, f"{time.perf_counter() - t0:.3f} s", flush=True)
    # a new tail length is a new attention shape: what a first call of a shape costs, per SDPA backend
    for name in ("default", "no-cudnn"):
        torch.backends.cuda.enable_cudnn_sdp(name == "default")
        for n in (70, 90):
            n += 1 if name != "default" else 0
            r = run(e, prompt + stream_for(a.model, v, n, seed=n), s, 1)
            r2 = run(e, prompt + stream_for(a.model, v, n, seed=n + 1000), s, 1)
            print(f"new tail length {n}, sdpa {name}: ttft {r['ttft_s']:.4f} s, again {r2['ttft_s']:.4f} s", flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    if a.shapes_only:
        return
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=acts) as prof:
        r = run(e, prompt + stream_for(a.model, v, a.tail, seed=9), s, 1)
    print("profiled resumed", r, flush=True)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
