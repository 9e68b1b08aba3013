"""Memory of a CPU-only run: moetier (and moetier with its float copies kept) vs llama.cpp on the same GGUF files.

    python bench/bench_cpu_rss.py FILE.gguf [FILE.gguf ...] [--threads N] [--prompt-len 128] [--gen 16]

Each engine runs in a process of its own: load the file, one request (random prompt ids, greedy, EOS ignored), then
its peak RSS (VmHWM) and its RSS at the end (VmRSS) from /proc/self/status; both count the file's pages the run
touched through its mmap, as both engines map the file. Engines: `moetier` (the defaults: dense weights and token
embeddings multiplied on their blocks, runtime.cpu_compile.dense_copies), `moetier-floats` (MOETIER_FLOAT_COPIES=1:
the float32 copies of the dense weights kept, as before session 42) and `llama.cpp` (xllamacpp's server, CPU).
Prints one JSON object: per file, per engine {peak_rss_mib, end_rss_mib, decode_tok_s, load_s}, and the ratios of
moetier's peak to the others'.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, os, sys, time, random
def rss():
    d = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith(("VmRSS", "VmHWM")))
    return int(d["VmHWM"].split()[0]) >> 10, int(d["VmRSS"].split()[0]) >> 10
path, engine, threads, plen, gen = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
random.seed(0)
prompt = [random.randrange(100, 20000) for _ in range(plen)]
t0 = time.perf_counter()
if engine == "llama.cpp":
    import urllib.request
    import xllamacpp as xlc
    p = xlc.CommonParams()
    p.model.path = path
    p.n_ctx = 2048
    p.n_gpu_layers = 0
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
    server = xlc.Server(p)
    load = time.perf_counter() - t0
    body = json.dumps({"prompt": prompt, "n_predict": gen, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                       "cache_prompt": False}).encode()
    req = urllib.request.Request(server.listening_address + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        decode = json.loads(r.read())["timings"]["predicted_per_second"]
else:
    from moetier import EngineConfig, SamplingParams
    from moetier.runtime.engine import Engine
    eng = Engine.load(path, EngineConfig(device="cpu", threads=threads, progress=False, max_context=2048,
                                         cpu_compile="off"))
    load = time.perf_counter() - t0
    done = eng.complete(prompt_ids=prompt, max_tokens=gen, params=SamplingParams(temperature=0), ignore_eos=True)
    decode = done.stats["decode_tok_s"]
peak, end = rss()
print(json.dumps({"peak_rss_mib": peak, "end_rss_mib": end, "decode_tok_s": round(decode, 1),
                  "load_s": round(load, 2)}))
"""


def run(path: str, engine: str, threads: int, plen: int, gen: int) -> dict:
    env = {**os.environ, "MOETIER_FLOAT_COPIES": "1" if engine == "moetier-floats" else "0"}
    r = subprocess.run([sys.executable, "-c", CHILD, path, engine, str(threads), str(plen), str(gen)], env=env,
                       capture_output=True, text=True, timeout=3600)
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", nargs="+")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--engines", default="moetier,moetier-floats,llama.cpp")
    a = ap.parse_args()
    out = {"threads": a.threads, "prompt_len": a.prompt_len, "gen": a.gen, "files": {}}
    for path in a.gguf:
        res = {e: run(path, e, a.threads, a.prompt_len, a.gen) for e in a.engines.split(",")}
        me = res.get("moetier", {}).get("peak_rss_mib")
        res["peak_ratio"] = {e: round(me / r["peak_rss_mib"], 3) for e, r in res.items()
                             if e != "moetier" and me and r.get("peak_rss_mib")}
        res["file_mib"] = Path(path).stat().st_size >> 20
        out["files"][Path(path).name] = res
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
