"""Bandwidths of the machine's tiers, measured once by quick micro-benchmarks and cached in
~/.cache/moetier/bandwidth.json (or given by flags). All rates in GB/s (1e9 bytes), flops in GFLOP/s.

  ram_gbs         CPU read bandwidth (a 1 GiB sum on every CPU of the process: measure_ram)
  hbm_gbs         GPU memory read bandwidth (CUDA only)
  pcie_gbs        pinned host -> device copy (CUDA only; measured while the GPU is awake)
  ssd_gbs         parallel preads of the checkpoint after dropping it from the page cache
  cpu_gbs_<dt>    bytes/s torch streams through one expert's gemv on the CPU (what a miss costs)
  cpu_gflops_<dt> one expert over 256 rows on the CPU (what a prefill token costs)
  prefill_int8    per GGML type: whether the CPU prefill's int8 tile beats float activations here
                  (prefill_int8_wins: timed once on first need, for the C kernel build it was timed with)
The CPU figures use one Qwen3-30B-A3B expert (D 2048, I 768, 9 MiB in bf16) whatever the model.
"""
from __future__ import annotations

import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

DEFAULTS = {"ram_gbs": 20.0, "hbm_gbs": 2000.0, "pcie_gbs": 12.0, "ssd_gbs": 2.0,
            "cpu_gbs_bfloat16": 8.0, "cpu_gbs_float32": 12.0,
            "cpu_gflops_bfloat16": 100.0, "cpu_gflops_float32": 100.0}


def cache_path() -> Path:
    return Path.home() / ".cache" / "moetier" / "bandwidth.json"


def _best(fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


RAM_METHOD = "max(stream, torch.sum) on every CPU"   # a cached ram_gbs measured otherwise is measured again


def process_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; all CPUs where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def measure_ram(nbytes: int | None = None) -> float:
    """CPU read bandwidth: the faster of a streaming C sum and torch.sum, both on every CPU this process may use
    (the miss server's threads), best of 3, over nbytes (default 1 GiB, past the H200 box's 300 MiB L3; at most an
    eighth of the free RAM). torch.sum on torch's default 8 threads of that 16-CPU box read 63 GB/s where the miss
    server then streamed 86: a "bound" the engine beat."""
    from ..kernels import cpu
    if nbytes is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            free = 8 << 30
        nbytes = max(64 << 20, min(1 << 30, free // 8))
    nbytes -= nbytes % 256                  # stream_sum: a multiple of 64 floats
    a = torch.ones(nbytes // 4, dtype=torch.float32)
    n, before = process_cpus(), torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        a.sum()
        t_torch = _best(lambda: a.sum())
    finally:
        torch.set_num_threads(before)
    cpu.stream_sum(a, n)
    t_stream = _best(lambda: cpu.stream_sum(a, n))
    return nbytes / min(t_torch, t_stream) / 1e9


def measure_cpu_expert(dtype: torch.dtype, dim: int = 2048, hidden: int = 768,
                       cold_bytes: int = 160 << 20) -> tuple[float, float]:
    """(GB/s through a decode expert, GFLOP/s of a prefill-sized expert matmul) in `dtype`.
    The gemv cycles through enough experts (`cold_bytes`) that they do not sit in the L3 cache."""
    per = 3 * dim * hidden * dtype.itemsize
    experts = [(torch.randn(2 * hidden, dim).to(dtype), torch.randn(dim, hidden).to(dtype))
               for _ in range(max(2, cold_bytes // per))]
    x1 = torch.randn(1, dim).to(dtype)

    def expert(x, w):
        g, u = F.linear(x, w[0]).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, w[1])

    for w in experts:
        expert(x1, w)
    t = _best(lambda: [expert(x1, w) for w in experts], 2) / len(experts)
    xb = torch.randn(256, dim).to(dtype)
    expert(xb, experts[0])
    tb = _best(lambda: expert(xb, experts[0]), 2)
    return per / t / 1e9, 256 * 6 * dim * hidden / tb / 1e9


def gpu_test_bytes(budget: int | None) -> int:
    """Each of measure_gpu's two device buffers: 512 MiB, or a quarter of a smaller --gpu-mem budget (the
    budget is a hard limit, even for the moment this runs inside Engine.load; an H200 test found 1 GiB
    allocated under a 256 MiB budget)."""
    return 512 << 20 if not budget else max(8 << 20, min(512 << 20, budget // 4))


def measure_hbm(device: str = "cuda", nbytes: int = 512 << 20) -> float:
    """GPU memory read GB/s: the best of ten sums of an nbytes buffer, after ~0.2 s of them (a card fresh from idle may
    clock low: one H200 box read 1,955 GB/s where the others read 3,720-3,840 (session 27), another 1,473 before a
    bench whose decode then ran as fast as on a box that read 3,938 (session 30); the causes were not found there, and
    bench reads it again after its runs: hbm_recheck)."""
    a = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    torch.cuda.synchronize()

    def hbm():
        a.sum()
        torch.cuda.synchronize()
    t_end = time.perf_counter() + 0.2
    while time.perf_counter() < t_end:
        hbm()
    return nbytes / _best(hbm, 10) / 1e9


def measure_gpu(device: str = "cuda", nbytes: int = 512 << 20) -> tuple[float, float]:
    """(HBM GB/s, pinned host->device GB/s)."""
    hbm_gbs = measure_hbm(device, nbytes)
    a = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy():
        a.mul_(1.0)              # keep the GPU busy: idle cards train links down (LESSONS.md section 3)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
    copy()
    return hbm_gbs, nbytes / _best(copy, 5) / 1e9


def measure_ssd(path: Path, nbytes: int = 512 << 20, threads: int = 4, block: int = 4 << 20) -> float | None:
    """Parallel preads of up to `nbytes` of `path` after asking the kernel to drop it from the page
    cache. None when the file is too small or sparse (a header-only plan file) to say anything."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    size = min(st.st_size, nbytes)
    if size < 64 << 20 or st.st_blocks * 512 < 0.9 * st.st_size:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
        offsets = list(range(0, size - block + 1, block))

        def read(off):
            buf = bytearray(block)
            return os.preadv(fd, [buf], off)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            total = sum(ex.map(read, offsets))
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def measure(device: str = "cpu", keys: set[str] | None = None, checkpoint_file: Path | None = None,
            dim: int = 2048, hidden: int = 768, gpu_budget: int | None = None) -> dict:
    """Measure `keys` (default: everything that applies here). gpu_budget: the GPU test's buffers fit in it."""
    keys = keys or {"ram_gbs", "cpu", "gpu", "ssd_gbs"}
    out = {"host": socket.gethostname(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
           "threads": torch.get_num_threads()}
    if "ram_gbs" in keys:
        out["ram_gbs"], out["ram_method"] = round(measure_ram(), 2), RAM_METHOD
    if keys & {"cpu", "cpu_gbs_bfloat16", "cpu_gflops_bfloat16"}:
        for dt in (torch.bfloat16, torch.float32):
            gbs, gflops = measure_cpu_expert(dt, dim, hidden)
            name = str(dt).removeprefix("torch.")
            out[f"cpu_gbs_{name}"], out[f"cpu_gflops_{name}"] = round(gbs, 2), round(gflops, 1)
    if keys & {"gpu", "hbm_gbs", "pcie_gbs"} and device.startswith("cuda") and torch.cuda.is_available():
        out["hbm_gbs"], out["pcie_gbs"] = (round(v, 1) for v in measure_gpu(device, gpu_test_bytes(gpu_budget)))
    if "ssd_gbs" in keys and checkpoint_file is not None:
        ssd = measure_ssd(checkpoint_file)     # None for a sparse or small file: nothing is cached then
        if ssd is not None:
            out["ssd_gbs"] = round(ssd, 2)
    return out


def _read_cache() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _write_cache(cached: dict) -> None:
    try:
        cache_path().parent.mkdir(parents=True, exist_ok=True)
        cache_path().write_text(json.dumps(cached, indent=1))
    except OSError:
        pass


# measure_prefill_int8's layer: experts, D, I, tokens, experts per token (32 pairs per expert, ~10 MB of Q4_0 rows)
INT8_TILE_SHAPE = (4, 1024, 512, 64, 2)


def measure_prefill_int8(fmt: str) -> dict:
    """ms of one prefill MoE call (kernels.cpu.moe_grouped, random INT8_TILE_SHAPE layer in `fmt`) with float
    activations and with int8 ones, best of 3 interleaved, on torch's threads: ~0.1-0.2 s in all."""
    from ..kernels import cpu
    from ..quant.pack import quantize
    e, d, i, t, k = INT8_TILE_SHAPE
    g = torch.Generator().manual_seed(0)
    gate, up = (quantize(torch.randn(e * i, d, generator=g), fmt).view(e, i, -1) for _ in range(2))
    down = quantize(torch.randn(e * d, i, generator=g), fmt).view(e, d, -1)
    x = torch.randn(t, d, generator=g)
    ids = torch.arange(t * k).remainder(e).view(t, k)
    w = torch.full((t, k), 1.0 / k)
    times = {"float_ms": float("inf"), "int8_ms": float("inf")}
    for _ in range(3):
        for key, q8 in (("float_ms", False), ("int8_ms", True)):
            t0 = time.perf_counter()
            cpu.moe_grouped(fmt, gate, up, down, x, ids, w, q8=q8)
            times[key] = min(times[key], (time.perf_counter() - t0) * 1e3)
    return {key: round(v, 3) for key, v in times.items()}


def prefill_int8_wins(fmt: str) -> bool:
    """Whether `fmt`'s int8 prefill tile beats float activations on this machine: measure_prefill_int8 once per
    type, cached in bandwidth.json with the C kernel build it was timed with (a new build or CPU times it again).
    Q4_0's tile won by 12-15% on a Zen 4 and lost by 18% on a Sapphire Rapids-class Xeon (docs/perf-log.md)."""
    from ..kernels import cpu
    build = cpu.build_library().stem
    cached = _read_cache()
    seen = cached.get("prefill_int8", {})
    if seen.get("build") != build:
        seen = {"build": build}
    if fmt not in seen:
        seen[fmt] = measure_prefill_int8(fmt)
        seen[fmt]["int8"] = seen[fmt]["int8_ms"] < seen[fmt]["float_ms"]
        _write_cache({**_read_cache(), "prefill_int8": seen})
    return bool(seen[fmt]["int8"])


def bandwidths(device: str = "cpu", checkpoint_file: Path | None = None, overrides: dict | None = None,
               use_cache: bool = True, gpu_budget: int | None = None) -> dict:
    """Cached measurements (measuring what is missing), then the flags' overrides, then defaults.
    Each value's source is in result["source"][key]: flag | measured | assumed."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    cached = _read_cache() if use_cache else {}
    if cached.get("ram_method") != RAM_METHOD:
        cached.pop("ram_gbs", None)
    wanted = {"ram_gbs", "cpu_gbs_bfloat16", "cpu_gflops_bfloat16"}
    if device.startswith("cuda"):
        wanted |= {"hbm_gbs", "pcie_gbs"}
    if checkpoint_file is not None:
        wanted.add("ssd_gbs")
    missing = {k for k in wanted if k not in cached and k not in overrides}
    if device.startswith("cuda") and not torch.cuda.is_available():
        missing -= {"hbm_gbs", "pcie_gbs"}          # a plan for a GPU this machine lacks: flags or assumed
    if missing:
        fresh = measure(device, missing, checkpoint_file, gpu_budget=gpu_budget)
        cached = {**cached, **fresh}
        if use_cache:
            _write_cache(cached)
    out, source = {}, {}
    for k in set(DEFAULTS) | set(cached) | set(overrides):
        if k in overrides:
            out[k], source[k] = overrides[k], "flag"
        elif k in cached:
            out[k], source[k] = cached[k], "measured"
        else:
            out[k], source[k] = DEFAULTS[k], "assumed"
    out["source"] = source
    return out
