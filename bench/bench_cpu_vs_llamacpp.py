"""moetier vs llama.cpp (xllamacpp, CPU) on the same GGUF file: decode and prefill tok/s.

    python bench/bench_cpu_vs_llamacpp.py [--model DIR] [--types F32,Q8_0] [--threads 2] [--gen 128]

Converts MODEL (default: the embedded default model) with `moetier quantize`, then runs the same
prompt through llama.cpp's server (greedy, EOS ignored) and through moetier on that GGUF file.
Prints one JSON object with both rates and moetier/llama.cpp ratios.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path


def llama_cpp(path: Path, prompt: list[int], n: int, threads: int) -> dict:
    import xllamacpp as xlc
    p = xlc.CommonParams()
    p.model.path = str(path)
    p.n_ctx = 2048
    p.n_gpu_layers = 0
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
    server = xlc.Server(p)
    try:
        out = {}
        for rep in range(2):  # first is warm-up
            body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                               "cache_prompt": False}).encode()
            req = urllib.request.Request(server.listening_address + "/completion", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                t = json.loads(r.read())["timings"]
            out = {"decode_tok_s": round(t["predicted_per_second"], 1), "prefill_tok_s": round(t["prompt_per_second"], 1)}
        return out
    finally:
        del server


def moetier_rates(path: Path, prompt: list[int], n: int, threads: int) -> dict:
    from moetier import EngineConfig, SamplingParams
    from moetier.runtime.engine import Engine
    eng = Engine.load(path, EngineConfig(device="cpu", threads=threads, progress=False, max_context=2048))
    done = None
    for _ in range(2):
        done = eng.complete(prompt_ids=prompt, max_tokens=n, params=SamplingParams(temperature=0), ignore_eos=True)
    return {"decode_tok_s": done.stats["decode_tok_s"], "prefill_tok_s": done.stats["prefill_tok_s"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--types", default="F32,Q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    a = ap.parse_args()
    from moetier.runtime.engine import default_model_path
    src = Path(a.model) if a.model else default_model_path()
    prompt = [(i * 7919) % 8000 + 100 for i in range(a.prompt_len)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for qt in a.types.split(","):
            gguf = Path(tmp) / f"model-{qt}.gguf"
            subprocess.run([sys.executable, "-m", "moetier", "quantize", str(src), "--type", qt, "--out", str(gguf)],
                           check=True, capture_output=True)
            ref = llama_cpp(gguf, prompt, a.gen, a.threads)
            ours = moetier_rates(gguf, prompt, a.gen, a.threads)
            rows.append({"type": qt, "llama_cpp": ref, "moetier": ours,
                         "decode_ratio": round(ours["decode_tok_s"] / ref["decode_tok_s"], 3),
                         "prefill_ratio": round(ours["prefill_tok_s"] / ref["prefill_tok_s"], 3)})
    print(json.dumps({"model": str(src), "threads": a.threads, "prompt_len": a.prompt_len, "gen": a.gen,
                      "results": rows}))


if __name__ == "__main__":
    main()
