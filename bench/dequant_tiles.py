"""The prefill's expert dequantizer (kernels.triton_dequant) at several tiles: GB/s moved (planes read + bf16
written) against the HBM copy rate, for one Qwen3-30B-A3B layer's 128 experts (gate_up [1536, 2048], down
[2048, 768]). All on the GPU, a 512-token prefill spends ~40% of its device time here (docs/perf-log.md,
session 33). Prints JSON.

    python bench/dequant_tiles.py [--fmt Q4_0]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu_kernels import hbm_copy_GBps, make_weights  # noqa: E402
from moetier.kernels.triton_dequant import dequantize  # noqa: E402

TILES = [(16, 256, 4), (16, 512, 4), (32, 256, 4), (32, 512, 8), (16, 1024, 4), (8, 512, 2), (64, 256, 8),
         (16, 256, 2), (32, 1024, 8), (8, 1024, 4)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fmt", default="Q4_0")
    a = p.parse_args()
    copy = hbm_copy_GBps()
    out = {"fmt": a.fmt, "hbm_copy_GBps": round(copy, 1), "shapes": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in {"gate_up": (1536, 2048), "down": (2048, 768)}.items():
        planes = make_weights(a.fmt, 128, n, k, gen)
        idx = torch.arange(128, device="cuda")
        moved = sum(v.numel() * v.element_size() for v in planes.values()) + 128 * n * k * 2
        ref = dequantize(a.fmt, planes, idx, torch.bfloat16)
        res = {}
        for tile in TILES:
            try:
                got = dequantize(a.fmt, planes, idx, torch.bfloat16, tile=tile)
                same = bool(torch.equal(got, ref))
                ms = do_bench(lambda t=tile: dequantize(a.fmt, planes, idx, torch.bfloat16, tile=t), warmup=5, rep=40)
                res[str(tile)] = {"us": round(ms * 1e3, 1), "GBps": round(moved / (ms * 1e-3) / 1e9, 1),
                                  "frac_of_copy": round(moved / (ms * 1e-3) / 1e9 / copy, 3), "same": same}
            except Exception as e:  # noqa: BLE001
                res[str(tile)] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            print(name, tile, res[str(tile)], file=sys.stderr, flush=True)
        out["shapes"][name] = res
        del planes, ref
        torch.cuda.empty_cache()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
