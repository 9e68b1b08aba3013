"""Experiment: does torch.compile of the non-expert ops shrink the graphed decode step?

    python bench/bench_compile_gpu.py [--layers 48] [--gen 64]

Same random Qwen3-30B-A3B-shaped bf16 model as bench_dense_gpu.py; decode is replayed as one CUDA
graph either over the eager modules or over torch.compile(model) (the Triton expert op stays a
graph break). Prints one JSON object with tok/s, compile seconds and a logit check.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench_dense_gpu import QWEN3_30B_A3B, random_model
from moetier.runtime.cuda_graph import DecodeGraph
from moetier.runtime.generate import prefill


def decode(fn, model, dtype, gen):
    cache = model.make_cache(64 + gen + 1, dtype, "cuda")
    logits = prefill(model, cache, list(range(64)), "cuda", 8192)
    t0 = time.perf_counter()
    g = DecodeGraph(fn, cache)
    build = time.perf_counter() - t0
    buf = torch.zeros(1, dtype=torch.long, device="cuda")
    firsts = []
    with torch.inference_mode():
        tok = int(torch.argmax(logits))
        for step in range(gen):
            if step == 8:
                torch.cuda.synchronize()
                t = time.perf_counter()
            buf.fill_(tok)
            out = g.step(buf)[-1]
            if step < 4:
                firsts.append(out.float().clone())
            tok = int(torch.argmax(out))
        torch.cuda.synchronize()
    return (gen - 8) / (time.perf_counter() - t), build, torch.stack(firsts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--mode", default="max-autotune-no-cudagraphs")
    a = ap.parse_args()
    dtype = torch.bfloat16
    model, args = random_model(dict(QWEN3_30B_A3B, num_hidden_layers=a.layers), "cuda", dtype)
    eager_rate, eager_build, ref = decode(model, model, dtype, a.gen)
    out = {"layers": a.layers, "eager_modules_graph_tok_s": round(eager_rate, 1)}
    try:
        compiled = torch.compile(model, dynamic=False, mode=a.mode)
        rate, build, got = decode(compiled, model, dtype, a.gen)
        err = float((got - ref).abs().max() / ref.abs().max())
        out.update(compiled_graph_tok_s=round(rate, 1), compile_and_capture_s=round(build, 1),
                   first_logits_rel_err=round(err, 5), mode=a.mode)
    except Exception as e:  # report, do not hide: the experiment's answer may be "it does not compile"
        out["compile_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
