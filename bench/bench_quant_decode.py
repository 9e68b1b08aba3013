"""GGUF experts computed on their stored blocks vs dequantized at load: decode tok/s on this device.

    python bench/bench_quant_decode.py [--model DIR|FILE.gguf] [--types Q8_0,Q4_0] [--gen 64] [--llama-cpp]

MODEL (default: the embedded default model) is converted with `moetier quantize` per type (a .gguf
is used as is), loaded twice (packed experts; --dequantize-experts) and run greedily with EOS
ignored; each rate is the best of --reps runs (the shared box is noisy). --llama-cpp adds llama.cpp
(xllamacpp, CPU) on the same file. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def expert_bytes(model) -> int:
    """Bytes the experts hold resident (packed blocks, or float weights)."""
    from moetier.models.layers import DenseExperts
    total = 0
    for m in model.modules():
        if isinstance(m, DenseExperts):
            total += sum(t.numel() * t.element_size() for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
    return total


def moetier_rates(path: Path, prompt: list[int], n: int, threads: int, dequantize: bool, reps: int) -> dict:
    from moetier import EngineConfig, SamplingParams
    from moetier.runtime.engine import Engine
    eng = Engine.load(path, EngineConfig(device="auto", threads=threads, progress=False, max_context=2048,
                                         dequantize_experts=dequantize))
    runs = []
    for _ in range(reps + 1):   # the first warms up (page faults, kernel builds, CUDA graph capture)
        done = eng.complete(prompt_ids=prompt, max_tokens=n, params=SamplingParams(temperature=0), ignore_eos=True)
        runs.append(done.stats)
    runs = runs[1:]
    return {"decode_tok_s": max(r["decode_tok_s"] for r in runs), "prefill_tok_s": max(r["prefill_tok_s"] for r in runs),
            "decode_runs": [r["decode_tok_s"] for r in runs], "expert_mib": round(expert_bytes(eng.model) / 2**20, 2),
            "device": eng.device, "tokens": done.token_ids[:8]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF model directory or .gguf file (default: the embedded model)")
    ap.add_argument("--types", default="Q8_0,Q4_0")
    ap.add_argument("--threads", type=int, default=None, help="torch / C kernel threads (default: moetier's)")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp (xllamacpp) on the same file")
    a = ap.parse_args()
    from moetier.runtime.engine import default_model_path
    src = Path(a.model) if a.model else default_model_path()
    prompt = [(i * 7919) % 8000 + 100 for i in range(a.prompt_len)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for qt in a.types.split(",") if src.suffix != ".gguf" else [src.name]:
            gguf = src if src.suffix == ".gguf" else Path(tmp) / f"model-{qt}.gguf"
            if gguf != src:
                subprocess.run([sys.executable, "-m", "moetier", "quantize", str(src), "--type", qt, "--out", str(gguf)],
                               check=True, capture_output=True)
            packed = moetier_rates(gguf, prompt, a.gen, a.threads, False, a.reps)
            deq = moetier_rates(gguf, prompt, a.gen, a.threads, True, a.reps)
            row = {"type": qt, "packed": packed, "dequantized": deq,
                   "decode_ratio": round(packed["decode_tok_s"] / deq["decode_tok_s"], 3),
                   "same_tokens": packed["tokens"] == deq["tokens"]}
            if a.llama_cpp:
                sys.path.insert(0, str(Path(__file__).parent))
                from bench_cpu_vs_llamacpp import llama_cpp
                ref = llama_cpp(gguf, prompt, a.gen, a.threads or 2)
                row["llama_cpp"] = ref
                row["packed_vs_llama_cpp"] = round(packed["decode_tok_s"] / ref["decode_tok_s"], 3)
            rows.append(row)
    print(json.dumps({"model": str(src), "threads": a.threads, "prompt_len": a.prompt_len, "gen": a.gen,
                      "results": rows}))


if __name__ == "__main__":
    main()
