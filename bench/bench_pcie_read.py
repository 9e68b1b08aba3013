"""How fast can a GPU kernel read experts straight out of pinned host memory (zero copy over PCIe)?

The decode step could send part of each layer's cache misses over PCIe instead of to the CPU
(issue #3 item 6). This measures the pieces, JSON on stdout:
  copy_engine   torch H2D copy_ of the same bytes (the copy engine's rate)
  gather        a Triton kernel that copies n experts from host addresses (an int64 table, as the
                decode step would have them) into a device staging buffer, per chunk size / warps / n
  with_cpu      the gather rate while CPU threads read RAM (torch.sum over a large tensor), and the
                CPU's read rate alone and during the gather: do the two share one ceiling?
    python bench/bench_pcie_read.py [--expert-bytes 2654208] [--pool-gib 4]
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _gather(addr_ptr, dst_ptr, nbytes, dst_stride, CHUNK: tl.constexpr, VEC: tl.constexpr):
    j = tl.program_id(1)
    src = tl.load(addr_ptr + j).to(tl.pointer_type(tl.int32))
    base = tl.program_id(0) * (CHUNK // 4)
    n4 = nbytes // 4
    for c in range(0, CHUNK // 4, VEC):
        o = base + c + tl.arange(0, VEC)
        m = o < n4
        v = tl.load(src + o, mask=m, cache_modifier=".cg")
        tl.store(dst_ptr + j * (dst_stride // 4) + o, v, mask=m)


@triton.jit
def _gather_base(base_ptr, off_ptr, dst_ptr, n_el, dst_stride, CHUNK: tl.constexpr, VEC: tl.constexpr):
    """Offsets (elements) from one pinned base tensor: Triton knows the alignment and emits 16-byte loads."""
    j = tl.program_id(1)
    off = tl.multiple_of(tl.load(off_ptr + j), 16)
    base = tl.program_id(0) * CHUNK
    for c in range(0, CHUNK, VEC):
        o = base + c + tl.arange(0, VEC)
        m = o < n_el
        v = tl.load(base_ptr + off + o, mask=m)
        tl.store(dst_ptr + j * dst_stride + o, v, mask=m)


def gather_base(pool, offs, dst, nbytes, chunk, vec, warps, dtype):
    """offs: byte offsets from pool's start (int64, device)."""
    el = torch.tensor([], dtype=dtype).element_size()
    d = dst.view(dtype)
    _gather_base[(triton.cdiv(nbytes, chunk), offs.numel())](pool.view(-1).view(dtype), offs // el, d,
                                                             nbytes // el, d.stride(0), CHUNK=chunk // el,
                                                             VEC=vec, num_warps=warps)


def gather(addrs: torch.Tensor, dst: torch.Tensor, nbytes: int, chunk: int, vec: int, warps: int) -> None:
    n = addrs.numel()
    _gather[(triton.cdiv(nbytes, chunk), n)](addrs, dst.view(torch.int32), nbytes, dst.stride(0), CHUNK=chunk,
                                             VEC=vec, num_warps=warps)


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--expert-bytes", type=int, default=2654208)    # Qwen3-30B-A3B expert in Q4_0
    ap.add_argument("--pool-gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=40)
    a = ap.parse_args()
    eb = a.expert_bytes
    n_pool = int(a.pool_gib * 2**30) // eb
    pool = torch.empty(n_pool, eb, dtype=torch.uint8, pin_memory=True)
    pool.view(torch.int32).random_()
    dev = torch.device("cuda")
    dst = torch.empty(8, eb, dtype=torch.uint8, device=dev)
    g = torch.Generator().manual_seed(0)
    out = {"expert_bytes": eb, "pool_experts": n_pool}

    def pick(n):
        idx = torch.randperm(n_pool, generator=g)[:n]
        return torch.tensor([pool[i].data_ptr() for i in idx.tolist()], dtype=torch.int64).to(dev)

    # the copy engine on the same bytes
    res = []
    for n in (1, 4, 8):
        srcs = [pool[i] for i in torch.randperm(n_pool, generator=g)[:n].tolist()]
        s = timed(lambda: [dst[i].copy_(srcs[i], non_blocking=True) for i in range(n)], a.reps)
        res.append({"n": n, "us": round(s * 1e6, 1), "GBps": round(n * eb / s / 1e9, 2)})
    out["copy_engine"] = res

    # zero-copy gather kernel variants
    res = []
    addr_sets = {n: [pick(n) for _ in range(8)] for n in (1, 2, 4, 8)}
    for n in (1, 2, 4, 8):
        for chunk in (16384, 65536, 262144):
            for vec, warps in ((1024, 4), (2048, 8), (512, 4)):
                k = [0]

                def run():
                    gather(addr_sets[n][k[0] % 8], dst, eb, chunk, vec, warps)
                    k[0] += 1
                try:
                    s = timed(run, a.reps)
                except Exception as e:   # noqa: BLE001 - a variant that does not compile is reported
                    res.append({"n": n, "chunk": chunk, "vec": vec, "warps": warps, "error": str(e)[:200]})
                    continue
                res.append({"n": n, "chunk": chunk, "vec": vec, "warps": warps, "us": round(s * 1e6, 1),
                            "GBps": round(n * eb / s / 1e9, 2)})
    addrs = pick(4)
    gather(addrs, dst, eb, 65536, 1024, 4)
    torch.cuda.synchronize()
    host_idx = [int((x - pool.data_ptr()) // eb) for x in addrs.tolist()]
    ok = all(torch.equal(dst[i].cpu(), pool[h]) for i, h in enumerate(host_idx))
    res2 = []
    for n in (2, 4, 8):
        offs = [(torch.tensor(x, device=dev) - pool.data_ptr()) for x in addr_sets[n]]
        for dtype in (torch.int32, torch.int64):
            for chunk in (16384, 65536):
                for vec, warps in ((1024, 4), (2048, 8), (256, 4), (4096, 8)):
                    k = [0]

                    def run():
                        gather_base(pool, offs[k[0] % 8], dst, eb, chunk, vec, warps, dtype)
                        k[0] += 1
                    try:
                        s = timed(run, a.reps)
                    except Exception as e:   # noqa: BLE001
                        res2.append({"n": n, "dtype": str(dtype), "error": str(e)[:200]})
                        continue
                    res2.append({"n": n, "dtype": str(dtype), "chunk": chunk, "vec": vec, "warps": warps,
                                 "us": round(s * 1e6, 1), "GBps": round(n * eb / s / 1e9, 2)})
    offs4 = (addrs - pool.data_ptr())
    dst.zero_()
    gather_base(pool, offs4, dst, eb, 65536, 1024, 4, torch.int32)
    torch.cuda.synchronize()
    ok2 = all(torch.equal(dst[i].cpu(), pool[h]) for i, h in enumerate(host_idx))
    out["gather_base"] = res2
    out["gather_base_correct"] = ok2
    out["best_base"] = max((r for r in res2 if "GBps" in r), key=lambda r: r["GBps"])
    out["gather"] = res
    out["gather_correct"] = ok
    best = max((r for r in res if "GBps" in r and r["n"] == 4), key=lambda r: r["GBps"])
    out["best_n4"] = best

    # CPU reading RAM at the same time
    big = torch.empty(int(4 * 2**30) // 4, dtype=torch.float32).uniform_()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    def cpu_rate(seconds: float) -> float:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            big.sum()
            n += 1
        return n * big.numel() * 4 / (time.perf_counter() - t0) / 1e9
    offs4s = [(x - pool.data_ptr()) for x in addr_sets[4]]
    out["with_cpu"] = []
    for threads in (16, 8):
        torch.set_num_threads(threads)
        alone = cpu_rate(1.5)
        box = {}
        th = threading.Thread(target=lambda: box.setdefault("r", cpu_rate(2.5)))
        th.start()
        time.sleep(0.3)
        t_end = time.perf_counter() + 1.8
        k, bytes_, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() < t_end:
            for _ in range(20):
                gather_base(pool, offs4s[k % 8], dst, eb, 16384, 1024, 4, torch.int32)
                k += 1
            torch.cuda.synchronize()
            bytes_ += 20 * 4 * eb
        g_rate = bytes_ / (time.perf_counter() - t0) / 1e9
        th.join()
        out["with_cpu"].append({"cpu_threads": threads, "cpu_alone_GBps": round(alone, 2),
                                "cpu_during_gather_GBps": round(box["r"], 2),
                                "gather_during_cpu_GBps": round(g_rate, 2)})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
