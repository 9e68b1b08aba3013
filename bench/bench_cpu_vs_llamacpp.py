"""moetier vs llama.cpp (xllamacpp, CPU) on the same GGUF file: decode and prefill tok/s.

    python bench/bench_cpu_vs_llamacpp.py [--model DIR] [--types F32,Q8_0] [--threads N] [--gen 128]
                                          [--cpu-compile auto|on|off] [--rounds 3] [--gguf FILE,...]

Converts MODEL (default: the embedded default model) with `moetier quantize`, then runs the same
prompt through llama.cpp's server (greedy, EOS ignored) and through moetier on that GGUF file.
Both use the same thread count: by default the one `moetier run` picks (engine.default_threads()),
and moetier runs with the EngineConfig defaults (`--cpu-compile auto`: the AOT-compiled decode step
when it is cached, else eager), i.e. what a user gets. Prints one JSON object with both rates, the
moetier/llama.cpp ratios (best of --rounds interleaved rounds each), which moetier decode path ran,
and the load average (the dev box is shared). --gguf: those GGUF files as they are (e.g. a `moetier synth`
model), no conversion; --model and --types are then unused.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def context(prompt_len: int, gen: int) -> int:
    """Both engines' context: 2,048 positions, more for a longer prompt and its generation."""
    return max(2048, prompt_len + gen + 64)


def llama_cpp(path: Path, threads: int, ctx: int = 2048):
    """A llama.cpp server on the GGUF; -> (server, run(prompt, n) -> {decode_tok_s, prefill_tok_s})."""
    import xllamacpp as xlc
    p = xlc.CommonParams()
    p.model.path = str(path)
    p.n_ctx = ctx
    p.n_gpu_layers = 0
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
    server = xlc.Server(p)

    def run(prompt: list[int], n: int) -> dict:
        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        req = urllib.request.Request(server.listening_address + "/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            t = json.loads(r.read())["timings"]
        return {"decode_tok_s": round(t["predicted_per_second"], 1), "prefill_tok_s": round(t["prompt_per_second"], 1)}
    return server, run


def moetier(path: Path, threads: int, cpu_compile: str, prompt: list[int], thp: bool = True, kv_dtype: str = "auto",
            ctx: int = 2048):
    """The Engine on the GGUF with the EngineConfig defaults, its first request run (the warm-up: it makes the CPU
    step's copies); -> (engine, run(prompt, n) -> rates, seconds to load and warm up). thp=False: its copies on 4 KiB
    pages (memory/hugepages.py off while it loads and warms up). kv_dtype: EngineConfig's (bf16: a prompt's attention
    in bf16 on CPUs with bf16 hardware, layers.prompt_in_bf16)."""
    from moetier import EngineConfig, SamplingParams
    from moetier.memory import hugepages
    from moetier.runtime.engine import Engine
    t0, was = time.perf_counter(), hugepages.ENABLED
    hugepages.ENABLED = was and thp
    try:
        eng = Engine.load(path, EngineConfig(device="cpu", threads=threads, progress=False, max_context=ctx,
                                             cpu_compile=cpu_compile, kv_dtype=kv_dtype))
        eng.complete(prompt_ids=prompt, max_tokens=4, params=SamplingParams(temperature=0), ignore_eos=True)
    finally:
        hugepages.ENABLED = was

    def run(prompt: list[int], n: int) -> dict:
        done = eng.complete(prompt_ids=prompt, max_tokens=n, params=SamplingParams(temperature=0), ignore_eos=True)
        return {"decode_tok_s": done.stats["decode_tok_s"], "prefill_tok_s": done.stats["prefill_tok_s"]}
    return eng, run, round(time.perf_counter() - t0, 2)


def best(runs: list[dict]) -> dict:
    """Best of the timed rounds per rate (the box is shared: the best is the least disturbed), plus all."""
    return {k: max(r[k] for r in runs) for k in runs[0]} | {"rounds": [r["decode_tok_s"] for r in runs]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--types", default="F32,Q8_0")
    ap.add_argument("--threads", type=int, default=None, help="both engines (default: moetier's default)")
    ap.add_argument("--cpu-compile", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per engine (best reported)")
    ap.add_argument("--gguf", default=None, help="GGUF files to compare on as they are (comma-separated)")
    ap.add_argument("--thp-ab", action="store_true", help="also a second moetier engine with its CPU copies on 4 KiB "
                    "pages (MOETIER_THP=0's), in the same rounds: thp_gain")
    ap.add_argument("--kv-dtype", default="auto", help="moetier's KV cache storage (llama.cpp keeps its default, f16)")
    a = ap.parse_args()
    from moetier.runtime.engine import default_model_path, default_threads
    src = Path(a.model) if a.model else default_model_path()
    files = [Path(f) for f in a.gguf.split(",")] if a.gguf else []
    for f in files:
        if not f.is_file():
            sys.exit(f"--gguf {f}: no such file")
    threads = a.threads or default_threads()
    load0 = os.getloadavg()[0]
    prompt = [(i * 7919) % 8000 + 100 for i in range(a.prompt_len)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for qt, gguf in [(f.name, f) for f in files] or [(t, None) for t in a.types.split(",")]:
            if gguf is None:
                gguf = Path(tmp) / f"model-{qt}.gguf"
                subprocess.run([sys.executable, "-m", "moetier", "quantize", str(src), "--type", qt, "--out",
                                str(gguf)], check=True, capture_output=True)
            ctx = context(a.prompt_len, a.gen)
            server, run_ref = llama_cpp(gguf, threads, ctx)
            # the warm-up includes loading (or with --cpu-compile on, building) the step
            eng, run_ours, first_s = moetier(gguf, threads, a.cpu_compile, prompt, kv_dtype=a.kv_dtype, ctx=ctx)
            eng4k, run_4k = moetier(gguf, threads, a.cpu_compile, prompt, thp=False, kv_dtype=a.kv_dtype, ctx=ctx)[:2] \
                if a.thp_ab else (None, None)
            run_ref(prompt, a.gen)
            refs, ours, ours4k = [], [], []
            for _ in range(a.rounds):   # interleaved, so a busy moment hits both engines alike
                refs.append(run_ref(prompt, a.gen))
                ours.append(run_ours(prompt, a.gen))
                if run_4k:
                    ours4k.append(run_4k(prompt, a.gen))
            del server
            ref, ours = best(refs), best(ours)
            ours |= {"decode_path": "aoti" if getattr(eng, "_cpu_decode", None) else "eager",
                     "load_and_first_request_s": first_s}
            del eng, eng4k
            rows.append({"type": qt, "llama_cpp": ref, "moetier": ours,
                         "decode_ratio": round(ours["decode_tok_s"] / ref["decode_tok_s"], 3),
                         "prefill_ratio": round(ours["prefill_tok_s"] / ref["prefill_tok_s"], 3)})
            if ours4k:
                o4 = best(ours4k)
                rows[-1] |= {"moetier_4k_pages": o4, "thp_gain": round(ours["decode_tok_s"] / o4["decode_tok_s"], 3)}
    model = ",".join(map(str, files)) or str(src)
    print(json.dumps({"model": model, "threads": threads, "cpu_compile": a.cpu_compile, "kv_dtype": a.kv_dtype,
                      "prompt_len": a.prompt_len,
                      "gen": a.gen, "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)], "results": rows}))


if __name__ == "__main__":
    main()
