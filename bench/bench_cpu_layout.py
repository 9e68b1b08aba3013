"""GGUF rows vs rows interleaved by 8 (kernels.cpu.interleave_rows) in the C int8 matvec; prints JSON.

The miss server and the CPU experts read GGUF rows (moe_rows4_run: one or two rows per register, unpack, dot,
convert and scale per row and block); the compiled CPU step's dense weights are interleaved (moe_x8_group2: 8 rows in
the lanes, one dot per 4-byte group for all of them). This times both layouts on the same bytes, in cache (one
matrix again and again) and from RAM (a bank of distinct matrices larger than every cache), at each thread count:
GB/s of weight bytes, best of the rounds, the layouts interleaved within a round.

    python bench/bench_cpu_layout.py [--types Q4_0,Q8_0] [--threads 1,15] [--gib 2] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import torch

from moetier.kernels import cpu
from moetier.quant.formats import get_format
from moetier.quant.pack import quantize

SHAPES = [(1536, 2048), (2048, 768)]      # (N, K): Qwen3-30B-A3B's gate+up and down of one expert


def blocks(qtype: str, n: int, k: int, rng) -> torch.Tensor:
    """n rows of k random weights quantized to qtype (valid scales in every format)"""
    return quantize(torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32)) * 0.1, qtype)


def rate(fn, nbytes: int, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return nbytes * reps / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K")
    ap.add_argument("--threads", default=str(torch.get_num_threads()))
    ap.add_argument("--gib", type=float, default=2.0, help="the RAM bank per layout")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "results": []}
    for qtype in a.types.split(","):
        fmt = get_format(qtype)
        if not cpu.interleaved_supported(fmt.type_id):
            out["results"].append({"type": qtype, "skipped": "no interleaved kernel in this build"})
            continue
        x8id = cpu.INTERLEAVED[fmt.type_id]
        for n, k in SHAPES:
            one = blocks(qtype, n, k, rng)
            per = one.numel()
            count = max(2, int(a.gib * 2**30 // per))
            bank = one.repeat(count, 1).view(count, n, -1)          # same content, distinct addresses
            bank8 = cpu.interleave_rows(bank.view(count * n, -1), fmt.type_id).view(count, n, -1)
            x = torch.randn(k)
            ref = cpu.qlinear(fmt.type_id, one, x, q8=True, threads=1)
            got = cpu.qlinear(x8id, bank8[0], x, q8=True, threads=1)
            err = float((ref - got).abs().max() / ref.abs().max())
            for th in (int(t) for t in a.threads.split(",")):
                res = {"type": qtype, "shape": [n, k], "threads": th, "x8_vs_rows_max_rel_diff": err}
                best = {}
                for _ in range(a.rounds):
                    for name, qid, w in (("rows", fmt.type_id, bank), ("x8", x8id, bank8)):
                        cache = rate(lambda: cpu.qlinear(qid, w[0], x, q8=True, threads=th), per, 200)
                        i = iter(range(count))
                        ram = rate(lambda: cpu.qlinear(qid, w[next(i)], x, q8=True, threads=th), per, count)
                        b = best.setdefault(name, [0.0, 0.0])
                        b[0], b[1] = max(b[0], cache), max(b[1], ram)
                for name, (c, r) in best.items():
                    res[f"{name}_cache_gbs"], res[f"{name}_ram_gbs"] = round(c, 2), round(r, 2)
                res["x8_over_rows_cache"] = round(best["x8"][0] / best["rows"][0], 3)
                res["x8_over_rows_ram"] = round(best["x8"][1] / best["rows"][1], 3)
                out["results"].append(res)
                print(json.dumps(res), flush=True)
            del bank, bank8
    print(json.dumps(out))


if __name__ == "__main__":
    main()
