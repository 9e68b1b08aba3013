"""CPU quantized matvec bandwidth vs the machine's RAM read bandwidth; prints JSON.

For each type and shape, one pass calls the kernel on every matrix of a >= 1 GiB bank of
distinct weights (so no cache holds them) and counts weight bytes read per second. The RAM
read yardsticks (a streaming C sum, torch.sum, numpy.sum over 1 GiB) are timed in the same
rounds, interleaved with the kernels.

Two views, because the dev box is shared (other processes often keep both cores busy):
  per_core   threads=1, bytes per second of the thread's own CPU time (time.thread_time):
             immune to being descheduled, comparable run to run. Yardstick: the C stream sum
             on one thread, same metric.
  wall       threads=N, wall clock, best round (contention only ever slows a round down).
             Yardstick: the best of the N-thread sums in the same rounds.

  F32        the float32 rows (torch.mv, torch's threads): what a format without C kernels runs on, its experts
             dequantized at load (compare us_per_matrix).
  --q8       activations rounded to int8 per 32 values (cpu.matvec(q8=True): the integer kernels of
             cpu.MOE_Q8_TYPES, float ones for the rest), one matrix per call.

    python bench/bench_cpu_kernels.py [--gib 1.0] [--rounds 3] [--threads 2] [--types Q5_K,Q6_K] [--q8]
        [--shapes 5120x2048,2048x4096]    # (N x K each: a decode layer's q/k/v and o_proj, a bank of its own each)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

from moetier.kernels import cpu
from moetier.quant.formats import get_format

SHAPES = [(768, 2048), (2048, 768)]            # (N, K): a gate/up and a down projection
TYPES = ["Q8_0", "Q4_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ3_XXS"]
FP16_OFFSETS = {"Q8_0": [0], "Q4_0": [0], "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2],
                "Q6_K": [208],                                                         # scale fields kept finite
                "MXFP4": [], "IQ3_XXS": [0], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0]}
E8M0_OFFSETS = {"MXFP4": [0]}           # shared exponent bytes kept near 2^0
FP16_OFFSETS.update({"IQ3_S": [0], "IQ1_S": [0], "IQ1_M": [], "IQ4_XS": [0], "Q5_1": [0, 2], "F32": []})
TOP_NIBBLE_FP16 = {"IQ1_M": 48}         # IQ1_M's d: the top nibbles of the 4 u16 scale words at this offset


def weight_bank(qtype: str, gib: float, rng, shape=SHAPES[0]) -> torch.Tensor:
    """[n_matrices, bytes_per_matrix] uint8 of valid blocks of `shape`, >= `gib` GiB. A 16 MiB random
    tile is repeated: the content repeats, the addresses (what caches see) do not."""
    fmt = get_format(qtype)
    per_matrix = fmt.nbytes(shape)
    n_mat = int(np.ceil(gib * 2**30 / per_matrix))
    if qtype == "F32":                    # finite floats (random bytes hold NaNs and subnormals)
        tile = rng.standard_normal(2**22, dtype=np.float32)
        return torch.from_numpy(np.resize(tile, n_mat * per_matrix // 4).view(np.uint8).reshape(n_mat, per_matrix))
    tile = rng.integers(0, 256, size=(2**24 // fmt.type_size, fmt.type_size), dtype=np.uint8)
    for off in FP16_OFFSETS[qtype]:
        d = rng.uniform(0.5, 1.0, size=tile.shape[0]).astype(np.float16)
        tile[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    for off in E8M0_OFFSETS.get(qtype, []):
        tile[:, off] = rng.integers(120, 136, size=tile.shape[0], dtype=np.uint8)
    if qtype in TOP_NIBBLE_FP16:
        off = TOP_NIBBLE_FP16[qtype]
        d = rng.uniform(0.5, 1.0, size=tile.shape[0]).astype(np.float16).view(np.uint16)
        for j in range(4):
            tile[:, off + 2 * j + 1] = (tile[:, off + 2 * j + 1] & 0x0F) | ((d >> (4 * j)) & 0xF) << 4
    n_blocks = n_mat * per_matrix // fmt.type_size
    bank = np.resize(tile, (n_blocks, fmt.type_size))
    return torch.from_numpy(bank.reshape(n_mat, per_matrix))


def timed(fn) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds)."""
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def kernel_pass(qtype, bank, shape, threads, batch, q8=False):
    """Time one pass over all matrices of `bank`, `batch` matrices per call (q8: int8 activations, batch 1)."""
    n, k = shape
    mats = [m.view(n, -1) for m in bank]
    x = torch.randn(batch, k)
    y = torch.empty(batch, n)
    if qtype == "F32":                    # torch's float32 GEMV / GEMM, as DenseExperts runs dequantized experts
        mats = [m.view(torch.float32) for m in mats]
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return timed(lambda: [torch.mv(w, x[i % batch], out=y[i % batch]) for i, w in enumerate(mats)])
        finally:
            torch.set_num_threads(before)
    if batch == 1:
        return timed(lambda: [cpu.matvec(qtype, w, x[0], out=y[0], threads=threads, q8=q8) for w in mats])
    groups = [mats[i:i + batch] for i in range(0, len(mats) - batch + 1, batch)]
    return timed(lambda: [cpu.matvec_batch(qtype, g, x, out=y, threads=threads) for g in groups])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated GGML types")
    ap.add_argument("--q8", action="store_true", help="int8 activations (cpu.matvec(q8=True)), batch 1 only")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                    help="comma-separated NxK matrix shapes (default: a gate/up and a down projection)")
    args = ap.parse_args()
    types = args.types.split(",")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    nt = args.threads
    load0 = round(os.getloadavg()[0], 2)          # other processes sharing the cores skew wall numbers
    rng = np.random.default_rng(0)
    ref = torch.from_numpy(rng.standard_normal(2**28, dtype=np.float32))      # 1 GiB
    one_bank = all(n * k == shapes[0][0] * shapes[0][1] for n, k in shapes)    # views of one bank serve them all
    banks = {(t, s): weight_bank(t, args.gib, rng, s) for t in types for s in (shapes[:1] if one_bank else shapes)}
    if one_bank:
        banks.update({(t, s): banks[t, shapes[0]] for t in types for s in shapes})
    runs = ((1, 1), (nt, 1)) if args.q8 else ((1, 1), (nt, 1), (nt, 8))
    cases = [(t, s, th, b) for t in types for s in shapes for th, b in runs]
    ram = {"c_stream_sum_1t_per_cpu_s": [], f"c_stream_sum_{nt}t": [], f"torch_sum_{nt}t": [], "numpy_sum": []}
    res = {c: [] for c in cases}
    gb = ref.nbytes / 1e9
    for r in range(args.rounds + 1):                                   # round 0 warms up
        wall, cpu_s = timed(lambda: cpu.stream_sum(ref, 1))
        ram["c_stream_sum_1t_per_cpu_s"].append(gb / cpu_s)
        ram[f"c_stream_sum_{nt}t"].append(gb / timed(lambda: cpu.stream_sum(ref, nt))[0])
        ram[f"torch_sum_{nt}t"].append(gb / timed(lambda: ref.sum())[0])
        ram["numpy_sum"].append(gb / timed(lambda: ref.numpy().sum())[0])
        for c in cases:
            t, shape, th, batch = c
            bank = banks[t, shape]
            used = bank.shape[0] // batch * batch * bank.shape[1] / 1e9
            wall, cpu_s = kernel_pass(t, bank, shape, th, batch, args.q8)
            res[c].append(used / (cpu_s if th == 1 else wall))
    ram = {k: v[1:] for k, v in ram.items()}
    per_core_ref = statistics.median(ram["c_stream_sum_1t_per_cpu_s"])
    wall_ref = max(max(ram[f"c_stream_sum_{nt}t"]), max(ram[f"torch_sum_{nt}t"]))
    out = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": nt,
                    "backend": cpu.backend(), "bank_gib": args.gib, "rounds": args.rounds,
                    "activations": "int8 per 32" if args.q8 else "float32",
                    "loadavg_1min_before_after": [load0, round(os.getloadavg()[0], 2)]},
        "ram_read_gbps": {k: {"median": round(statistics.median(v), 2), "max": round(max(v), 2)}
                          for k, v in ram.items()},
        "cases": [],
    }
    for (t, (n, k), th, batch), v in res.items():
        v = v[1:]
        row = {"qtype": t, "N": n, "K": k, "threads": th, "matrices_per_call": batch}
        if th == 1:
            row.update(metric="GB per CPU-second, 1 thread", gbps=round(statistics.median(v), 2),
                       frac_of_ram=round(statistics.median(v) / per_core_ref, 3))
        else:
            row.update(metric="GB/s wall, best round", gbps=round(max(v), 2),
                       frac_of_ram=round(max(v) / wall_ref, 3))
        row["us_per_matrix"] = round(get_format(t).nbytes((n, k)) / (row["gbps"] * 1e3), 1)
        out["cases"].append(row)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
