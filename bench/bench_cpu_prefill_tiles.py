"""The CPU prefill MoE layer (kernels.cpu.moe_grouped) per expert format: float activations (each row dequantized
once a call, a float FMA tile) against int8 activations (the format's integer tile, where the build has one), in one
process, interleaved, best of --rounds. JSON lines on stdout, one per format, with the ratio float / int8.

    python bench/bench_cpu_prefill_tiles.py --threads 1 --types Q2_K,Q3_K,IQ2_XXS
    --march haswell: an AVX2 build of the kernels (no AVX-512); --source F: cpu_kernels.c from F (a variant's copy),
    timed as another int8 column (int8_variant) in the same rounds.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from moetier.kernels import cpu
from moetier.quant.pack import quantize

TYPES = ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
         "IQ1_S", "IQ1_M", "IQ4_XS"]


def layer(fmt: str, e: int, d: int, i: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate, up = (quantize(torch.randn(e * i, d, generator=g) * 0.1, fmt).view(e, i, -1) for _ in range(2))
    down = quantize(torch.randn(e * d, i, generator=g) * 0.1, fmt).view(e, d, -1)
    return gate, up, down


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--march", default="native")
    ap.add_argument("--source", help="a variant cpu_kernels.c, its int8 tile timed too")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    lib = None if a.march == "native" else cpu.open_library(cpu.build_library(tmp / "m", march=a.march))
    variant = a.source and cpu.open_library(cpu.build_library(tmp / "v", march=a.march, source=Path(a.source)))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(a.tokens, a.dim, generator=g)
    ids = torch.stack([torch.randperm(a.experts, generator=g)[:a.k] for _ in range(a.tokens)])
    w = torch.rand(a.tokens, a.k, generator=g) + 0.1
    for fmt in a.types.split(","):
        gate, up, down = layer(fmt, a.experts, a.dim, a.inter)
        runs = [("float", False, lib), ("int8", True, lib)] + ([("int8_variant", True, variant)] if variant else [])
        best = {key: float("inf") for key, _, _ in runs}
        for _ in range(a.rounds):
            for key, q8, lb in runs:
                t0 = time.perf_counter()
                cpu.moe_grouped(fmt, gate, up, down, x, ids, w, q8=q8, threads=a.threads, lib=lb)
                best[key] = min(best[key], time.perf_counter() - t0)
        row = {"type": fmt, "march": a.march, "int8_tile": cpu.grouped_int8_tile(fmt, lib), "threads": a.threads,
               "shape": [a.experts, a.dim, a.inter, a.tokens, a.k]}
        row.update({f"{key}_ms": round(v * 1e3, 2) for key, v in best.items()})
        row.update({f"float_over_{key}": round(best["float"] / v, 3) for key, v in best.items() if key != "float"})
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
