"""GPU MoE expert kernels (moetier/kernels/triton_moe.py): correctness against the torch twin, then
speed, as achieved HBM GB/s next to the measured copy bandwidth of this GPU.

For each model shape x weight format (bf16 "dense", Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ3_XXS):
  decode  T = 1, 2, 4, 8 tokens: the two fused GEMV kernels (gate_up+act, down+weighted sum) alone
          and together; bytes = the weights of the distinct slots the call reads.
  grouped T = 16 .. 4096 tokens (prefill): align + two tensor-core GEMMs + sum; TFLOP/s and GB/s.
Each call touches a different set of slots (16 rotating routings over a 128-slot arena, several times
the L2), so weights come from HBM, as in a real decode step. Times: CUDA graph replays of the 16
calls (the engine's mode; per call) and triton.testing.do_bench (eager launches, L2 flushed).

    python bench/bench_gpu_kernels.py --variants [--out v.json]   # decode v1 vs v2 vs v3 vs v5 kernels and tiles, every
                                                               # format, Qwen3-30B-A3B T=1 (< 2 min)
    python bench/bench_gpu_kernels.py --variants --only v2,v5pdl --fmt MXFP4   # those variants only
    python bench/bench_gpu_kernels.py --profile-pair --only v5pdl,v5q --fmt Q4_0  # where each pair's time goes
    python bench/bench_gpu_kernels.py [--out results.json] [--fmt dense,Q4_0] [--quick]
    python bench/bench_gpu_kernels.py --sweep [decode|grouped] [--fmt Q4_0]   # best tiles per kernel
    python bench/bench_gpu_kernels.py --interpret              # CPU smoke test of this script (tiny)
    python bench/bench_gpu_kernels.py --compile-sm90 [--only v2_,v3_]  # no GPU: compile the default tiles
                                                               # for sm_90: registers, spills, SASS
                                                               # instructions per weight in the K loop
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

if "--interpret" in sys.argv:                   # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from moetier.kernels import ops
from moetier.kernels import triton_moe as tm
from moetier.quant.repack import k_planes

MODELS = {   # name: (D, I, k, experts, gpt-oss activation with biases)
    "qwen3-30b-a3b": (2048, 768, 8, 128, False),
    "gpt-oss-20b": (2880, 2880, 4, 32, True),
    "tiny": (256, 256, 2, 16, True),           # --interpret smoke test
}
DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
XDT = torch.float16 if DEV == "cpu" else torch.bfloat16    # the interpreter's tl.dot mishandles bf16
ROT = 16                      # routings per graph: distinct slot sets, so L2 cannot serve repeats


class Hopper:
    """Just enough of a driver for Triton to compile for sm_90 on a machine without a GPU (compile_sm90,
    bench/sass_phases.py)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


PLANES_RANDOM = ("Q5_K", "Q6_K", "MXFP4", "IQ3_XXS", "IQ2_XXS", "Q2_K", "Q3_K")    # random_planes' formats


def random_planes(fmt: str, slots: int, n: int, k: int, gen, device: str = DEV) -> dict:
    """Random repack planes of `fmt` (PLANES_RANDOM: Q5_K, Q6_K, ...): random quant bits, scales sized so
    that rows give O(1) dot products. Valid input for the kernels and their twin alike."""
    def ints(cols, lo=0, hi=256, dtype=torch.uint8):
        return torch.randint(lo, hi, (slots, n, cols), device=device, generator=gen, dtype=torch.int32).to(dtype)

    def scale(cols, v):
        return (torch.rand(slots, n, cols, device=device, generator=gen) * v / math.sqrt(k)).half()
    if fmt == "Q5_K":
        return {"qs": ints(k // 2), "qh": ints(k // 8), **k_planes(scale(k // 256, 1 / 512), scale(k // 256, 1 / 64),
                                                                   ints(k // 32, 0, 64), ints(k // 32, 0, 64))}
    if fmt == "Q6_K":
        return {"ql": ints(k // 2), "qh": ints(k // 4), "sc": ints(k // 16, -32, 32, torch.int8),
                "d": scale(k // 256, 1 / 256)}
    if fmt == "MXFP4":
        return {"qs": ints(k // 2), "e": ints(k // 32, 118, 122)}
    if fmt in ("IQ3_XXS", "IQ2_XXS"):
        sg = ints(k // 32, -2 ** 31, 2 ** 31 - 1, torch.int32)
        return {"qs": ints(k // (4 if fmt == "IQ3_XXS" else 8)), "sg": sg, "sc": ints(k // 32, 0, 16),
                "d": scale(k // 256, 1 / 16)}
    if fmt == "Q2_K":                                  # d plane: (d, dmin) a super-block
        pair = torch.stack([scale(k // 256, 1 / 16), scale(k // 256, 1 / 16)], dim=-1).flatten(-2)
        return {"qs": ints(k // 4), "sc": ints(k // 16), "d": pair.contiguous()}
    if fmt == "Q3_K":
        return {"qs": ints(k // 4), "hm": ints(k // 8), "sc": ints(k // 16, -32, 32, torch.int8),
                "d": scale(k // 256, 1 / 64)}
    raise ValueError(f"no random planes for {fmt}")


def random_raw(fmt: str, slots: int, n: int, k: int, gen, device: str = DEV) -> dict:
    """Random GGML rows of a format read as stored: random bytes, each block's fp16 d (bytes 0, 1; IQ1_M's: its
    scales' top nibbles) set to a finite value sized so that rows give O(1) dot products."""
    _, block, size = tm.RAW_FORMATS[fmt]
    nb = k // block
    raw = torch.randint(0, 256, (slots, n, nb, size), device=device, generator=gen, dtype=torch.int32).to(torch.uint8)
    d = (torch.rand(slots, n, nb, device=device, generator=gen) * 4 / (64 * math.sqrt(k)) + 1e-4).half()
    bits = d.view(torch.int16).int() & 0xFFFF
    if fmt == "IQ1_M":                           # nibble j of d: the top nibble of scale word j (bytes 48 + 2j, +1)
        for j in range(4):
            hi = raw[..., 49 + 2 * j].int()
            raw[..., 49 + 2 * j] = ((hi & 0x0F) | (((bits >> (4 * j)) & 0xF) << 4)).to(torch.uint8)
    else:
        raw[..., 0], raw[..., 1] = (bits & 0xFF).to(torch.uint8), (bits >> 8).to(torch.uint8)
    return {"raw": raw.reshape(slots, n, nb * size)}


def make_weights(fmt: str, slots: int, n: int, k: int, gen: torch.Generator | None, device: str = DEV):
    """Random [slots, n, k] weights in the kernel layout, built on the GPU (quantized formats by a
    vectorised torch quantizer: same block layout as GGML, values need not match gguf-py's rounding;
    the newer formats as random planes or random GGML rows)."""
    if fmt in PLANES_RANDOM:
        return random_planes(fmt, slots, n, k, gen, device)
    if fmt in tm.RAW_FORMATS:
        return random_raw(fmt, slots, n, k, gen, device)
    w = torch.randn(slots, n, k, device=device, generator=gen, dtype=torch.float32) / math.sqrt(k)
    if fmt == "dense":
        return w.to(XDT)
    if fmt in ("Q8_0", "Q4_0"):
        b = w.view(slots, n, k // 32, 32)
        amax = b.abs().amax(-1)
        if fmt == "Q8_0":
            d = amax / 127
            q = torch.round(b / d.clamp_min(1e-12)[..., None]).clamp(-128, 127).to(torch.int8)
            return {"qs": q.view(slots, n, k), "d": d.half()}
        idx = b.abs().argmax(-1, keepdim=True)                        # GGML: d = signed max / -8
        d = torch.gather(b, -1, idx)[..., 0] / -8
        q = torch.floor(b / torch.where(d == 0, 1e-12, d)[..., None] + 8.5).clamp(0, 15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)                     # byte j: element j, j + 16
        return {"qs": packed.reshape(slots, n, k // 2), "d": d.half()}
    # Q4_K: 256-superblocks of 8 x 32 sub-blocks, 6-bit scales/mins, fp16 d/dmin
    b = w.view(slots, n, k // 256, 8, 32)
    lo, hi = b.amin(-1).clamp(max=0), b.amax(-1)
    scale, mn = (hi - lo) / 15, -lo
    d, dmin = scale.amax(-1) / 63, mn.amax(-1) / 63
    sc = torch.round(scale / d.clamp_min(1e-12)[..., None]).clamp(0, 63)
    mq = torch.round(mn / dmin.clamp_min(1e-12)[..., None]).clamp(0, 63)
    dl, ml = (d[..., None] * sc), (dmin[..., None] * mq)
    q = torch.round((b + ml[..., None]) / dl.clamp_min(1e-12)[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.view(slots, n, k // 256, 4, 2, 32)                          # chunk c: sub-blocks 2c (low), 2c+1 (high)
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(slots, n, k // 2)
    return {"qs": packed, **k_planes(d, dmin, sc.to(torch.uint8).reshape(slots, n, -1),
                                     mq.to(torch.uint8).reshape(slots, n, -1))}


def nbytes(weight) -> int:
    ts = [weight] if isinstance(weight, torch.Tensor) else list(weight.values())
    return sum(t.numel() * t.element_size() for t in ts)


def routings(t: int, k: int, slots: int, gen) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ROT routings: each token takes k distinct slots of a group of 4k (tokens overlap as in real
    batches); consecutive routings use disjoint groups, so a slot's next use is several calls away."""
    groups, size = max(1, slots // (4 * k)), min(slots, 4 * k)
    out = []
    for r in range(ROT):
        pool = (r % groups) * size + torch.randperm(size, generator=gen)
        ids = torch.stack([pool[torch.randperm(size, generator=gen)[:k]] for _ in range(t)])
        out.append((ids.int().to(DEV), (torch.rand(t, k, generator=gen) + 0.1).to(torch.bfloat16).to(DEV)))
    return out


def graph_us(calls) -> float:
    """Per-call time of `calls` captured in one CUDA graph, replayed (microseconds)."""
    if DEV == "cpu":
        return _time(lambda: [c() for c in calls]) * 1e6 / len(calls)
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    reps = max(3, int(0.2 / max(1e-6, _time(g.replay))))
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1e3 / (reps * len(calls))


def _time(fn) -> float:
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def eager_us(calls) -> float:
    if DEV == "cpu":
        return graph_us(calls)
    it = itertools.cycle(calls)
    return do_bench(lambda: next(it)(), warmup=25, rep=100) * 1e3


def hbm_copy_GBps() -> float:
    if DEV == "cpu":
        return float("nan")
    a = torch.empty(1 << 28, dtype=torch.float32, device=DEV)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=10, rep=50)
    return 2 * a.numel() * 4 / (ms * 1e-3) / 1e9


@triton.jit
def _read_kernel(src, out, N: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Read N int32 words (every program UNROLL blocks of BLOCK, all loads first) and store one xor per program."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * UNROLL
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for u in tl.static_range(UNROLL):
        o = base + u * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src + o, mask=o < N, other=0, eviction_policy="evict_first")
    tl.store(out + tl.program_id(0), tl.xor_sum(acc, axis=0))


def read_ceiling_us(nbytes: int, regions: int = ROT) -> dict:
    """Per-call time of one launch that only reads `nbytes` (a fresh region each call, ROT regions: HBM, not L2),
    graph replays, at a few program sizes: what one kernel over this working set can reach at best."""
    n = nbytes // 4
    buf = torch.randint(0, 1 << 30, (regions, n), dtype=torch.int32, device=DEV)
    res = {}
    for block, unroll, warps in ((1024, 4, 4), (2048, 4, 8), (1024, 8, 4), (512, 4, 2)):
        grid = triton.cdiv(n, block * unroll)
        out = torch.empty(grid, dtype=torch.int32, device=DEV)
        us = graph_us([lambda r=r: _read_kernel[(grid,)](buf[r], out, N=n, BLOCK=block, UNROLL=unroll, num_warps=warps)
                       for r in range(regions)])
        res[f"{block}x{unroll}w{warps}"] = round(us, 2)
    return res


def profile_pair(fmts, gen, cgen, copy_bw: float, variant: str = "v5pdl") -> list[dict]:
    """Where the decode pair's time goes (Qwen3-30B-A3B, T=1): the pair's graph time per call, each kernel's own
    device time per call (torch.profiler over graph replays: the gaps are the rest), and the read ceiling of one
    launch over the same bytes."""
    from torch.profiler import ProfilerActivity, profile
    out = []
    for fmt in fmts:
        c = Case("qwen3-30b-a3b", fmt, cgen)
        calls, uniq = pair_calls(c, gen, variant)
        us = graph_us(calls)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in calls:
                f()
        reps = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                g.replay()
            torch.cuda.synchronize()
        kern = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t and e.count >= reps * len(calls):
                kern[e.key[:60]] = round(t / (reps * len(calls)), 2)
        nbytes = int(uniq * (c.gu_bytes + c.dn_bytes))
        r = {"fmt": fmt, "variant": variant, "pair_us": round(us, 2), "MB": round(nbytes / 1e6, 2),
             "frac_of_copy": round(nbytes / (us * 1e-6) / 1e9 / copy_bw, 3), "kernel_us_per_call": kern,
             "kernels_sum_us": round(sum(kern.values()), 2), "read_ceiling_us": read_ceiling_us(nbytes)}
        best = min(r["read_ceiling_us"].values())
        r["read_ceiling_frac_of_copy"] = round(nbytes / (best * 1e-6) / 1e9 / copy_bw, 3)
        log(f"  {fmt} {variant}: {r}")
        out.append(r)
    return out


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def pair_calls(c, gen, variant: str, cfg_gu=None, cfg_dn=None):
    """ROT closures of the T=1 decode pair (moe_decode's own launches for v5q / v5qx, else decode_calls' gate_up then
    down, at tiles cfg_gu / cfg_dn: None the shipped ones) and the mean distinct slots per call."""
    if variant in ("v5q", "v5qx"):       # v5q: x quantizer, gate_up (+ h quantizer), down; v5qx: v5q without the x
                                          # quantizer (gate_up's programs quantize x)
        rs = routings(1, c.k, c.slots, gen)
        x = torch.randn(1, c.d, generator=gen).to(DEV, XDT)
        out = torch.empty_like(x)
        uniq = sum(len(set(i.reshape(-1).tolist()) - {-1}) for i, _ in rs) / ROT
        return [lambda i=i, w=w: tm.moe_decode(x, i, w, c.gw, c.dw, c.code, c.act.alpha, c.act.limit, c.b, out=out,
                                               cfg_gate_up=cfg_gu, cfg_down=cfg_dn, variant=variant)
                for i, w in rs], uniq
    gu, dn, uniq = decode_calls(c, 1, gen, cfg_gu, cfg_dn, variant=variant)
    return [lambda a=a, b=b: (a(), b()) for a, b in zip(gu, dn)], uniq


class Case:
    """One model shape and format: the arena, activation, and kernel arguments."""

    def __init__(self, model: str, fmt: str, gen):
        self.model, self.fmt = model, fmt
        self.d, self.i, self.k, self.slots, gpt = MODELS[model]
        self.gu = make_weights(fmt, self.slots, 2 * self.i, self.d, gen)
        self.dn = make_weights(fmt, self.slots, self.d, self.i, gen)
        self.act = ops.Act("clamped_swiglu", 1.702, 7.0) if gpt else ops.Act()
        self.biases = ((torch.randn(self.slots, 2 * self.i, device=DEV, generator=gen).to(XDT),
                        torch.randn(self.slots, self.d, device=DEV, generator=gen).to(XDT)) if gpt else None)
        self.gw, self.dw = tm.Weights(self.gu, fmt), tm.Weights(self.dn, fmt)
        self.code = tm.ACT_CODES[self.act.kind]
        self.b = self.biases or (None, None)
        self.gu_bytes, self.dn_bytes = nbytes(self.gu) // self.slots, nbytes(self.dn) // self.slots

    def check(self, t: int, gen) -> float:
        """Max relative error of the kernels against the torch twin (gen: a CPU generator)."""
        ids, w = routings(t, self.k, self.slots, gen)[0]
        x = torch.randn(t, self.d, generator=gen).to(DEV, XDT)
        want = ops.moe_native(x, ids, w, self.gu, self.dn, self.act, self.biases, self.fmt)
        fn = tm.moe_decode if t <= ops.MAX_DECODE_TOKENS else tm.moe_grouped
        got = fn(x, ids, w, self.gw, self.dw, self.code, self.act.alpha, self.act.limit, self.b)
        return rel_err(got, want)


def decode_calls(c: Case, t: int, gen, cfg_gu=None, cfg_dn=None, variant=None):
    """ROT closures for each decode kernel (inputs prepared) and the mean distinct slots per call."""
    rs = routings(t, c.k, c.slots, gen)
    x = torch.randn(t, c.d, generator=gen).to(DEV, XDT)
    v2 = tm.variant_of(c.fmt, variant) != "v1"            # as tm.moe_decode: v2, v3 keep h in float32
    h = torch.empty(t * c.k, c.i, device=DEV, dtype=torch.float32 if v2 else XDT)
    out = torch.empty_like(x)
    flat = [(ids.reshape(-1), w.reshape(-1)) for ids, w in rs]
    uniq = sum(len(set(ids.reshape(-1).tolist()) - {-1}) for ids, _ in rs) / ROT
    gu = [lambda ids=ids: tm.decode_gate_up(x, ids, c.gw, c.code, c.act.alpha, c.act.limit, c.b[0], h, cfg_gu, variant)
          for ids, _ in flat]
    dn = [lambda ids=ids, w=w: tm.decode_down(h, ids, w, c.dw, c.b[1], out, cfg_dn, variant) for ids, w in flat]
    return gu, dn, uniq


def bench_decode(c: Case, t: int, gen) -> dict:
    gu_calls, dn_calls, uniq = decode_calls(c, t, gen)
    both = [lambda a=a, b=b: (a(), b()) for a, b in zip(gu_calls, dn_calls)]
    r = {"op": "decode", "T": t, "unique_slots": uniq}
    for name, calls, per in (("gate_up", gu_calls, c.gu_bytes), ("down", dn_calls, c.dn_bytes),
                             ("total", both, c.gu_bytes + c.dn_bytes)):
        us = graph_us(calls)
        r[f"{name}_us"] = round(us, 2)
        r[f"{name}_GBps"] = round(uniq * per / (us * 1e-6) / 1e9, 1)
    r["total_eager_us"] = round(eager_us(both), 2)
    r["MB"] = round(uniq * (c.gu_bytes + c.dn_bytes) / 1e6, 2)
    return r


def bench_grouped(c: Case, t: int, gen, cfg=None) -> dict:
    rs = routings(t, c.k, c.slots, gen)[:4]
    x = torch.randn(t, c.d, generator=gen).to(DEV, XDT)
    calls = [lambda ids=ids, w=w: tm.moe_grouped(x, ids, w, c.gw, c.dw, c.code, c.act.alpha, c.act.limit, c.b, cfg=cfg)
             for ids, w in rs]
    uniq = sum(len(set(ids.reshape(-1).tolist()) - {-1}) for ids, _ in rs) / len(rs)
    us = graph_us(calls)
    flops = 2 * t * c.k * 3 * c.d * c.i
    r = {"op": "grouped", "T": t, "unique_slots": uniq, "total_us": round(us, 1),
         "TFLOPs": round(flops / (us * 1e-6) / 1e12, 1),
         "GBps": round(uniq * (c.gu_bytes + c.dn_bytes) / (us * 1e-6) / 1e9, 1)}
    if c.fmt == "dense" and c.biases is None and hasattr(torch, "_grouped_mm"):
        r["torch_grouped_mm_us"] = round(graph_us([lambda ids=ids: torch_grouped_mm(c, x, ids) for ids, _ in rs]), 1)
    return r


def torch_grouped_mm(c: Case, x, ids):
    """Baseline: what memory.fast uses today (torch._grouped_mm over all slots, no weighting/sum)."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat)
    counts = torch.zeros(c.slots, dtype=torch.int32, device=DEV)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[order // c.k]
    hh = torch._grouped_mm(xs, c.gu.transpose(-2, -1), offs=offs)
    g, u = hh.chunk(2, dim=-1)
    return torch._grouped_mm((torch.nn.functional.silu(g) * u).contiguous(), c.dn.transpose(-2, -1), offs=offs)


# --variants: alternatives to the shipped v2 tiles (triton_decode.GATE_UP / DOWN): (BN, BK, warps, stages)
ALT_TILES = {"gate_up": [(16, 1024, 4), (16, 512, 4, 2), (32, 512, 8)],
             "down": [(8, 256, 4, 2), (16, 1024, 8), (4, 1024, 4)]}
# v3 (triton_decode.GATE_UP3 / DOWN3 are the defaults): (BN, 0, warps); bk, stages unused (one step)
ALT_TILES_V3 = {"gate_up": [(2, 0, 2), (8, 0, 4), (8, 0, 8)],
                "down": [(2, 0, 4), (8, 0, 4), (8, 0, 8)]}
ALT_TILES_V5 = {"gate_up": [(4, 0, 2), (8, 0, 4), (16, 0, 4), (16, 0, 8), (2, 0, 1), (8, 0, 2)],
                "down": [(4, 0, 4), (8, 0, 4), (16, 0, 4), (16, 0, 8), (8, 0, 2), (32, 0, 8)]}
# The v5pdl pair at combinations of tiles (--only v5tiles): with PDL the two kernels overlap, so a tile's time alone
# does not give the pair's. One warp per few rows: fewer SASS instructions a weight word (Q4_0 sm_90, session 16:
# gate_up (4, 0, 2) 19.0 a word, (2, 0, 1) 14.8, (4, 0, 1) 13.0 (96 registers); down (4, 0, 4) 23.0, (4, 0, 2)
# 18.2, (8, 0, 2) 16.0 (168 registers)): the math after the loads is shorter, if the occupancy holds.
PAIR_TILES_V5 = {"gate_up": [None, (2, 0, 1), (4, 0, 1), (8, 0, 2)], "down": [None, (4, 0, 2), (2, 0, 2), (8, 0, 2)]}
# v5q at wider gate_up tiles (--only v5qtiles): from 32 rows each program quantizes its own 32-blocks of h in registers
# (no counters, no quantizer launch for down); 8 and 16 rows: the counters' last program
PAIR_TILES_V5Q = [(32, 0, 16), (16, 0, 8), (64, 0, 16), (16, 0, 16), (32, 0, 8), (32, 0, 4), (16, 0, 4), (8, 0, 4),
                  (64, 0, 8), (32, 0, 2)]     # session 34: 16 warps (bench/kernel_regs.py: 127 registers, no spills)
# The default variant's shipped gate_up (v5qx for Q4_0) with other down tiles (--only v5qxdown): down's programs load
# their weights before their PDL wait only where they are resident beside gate_up's; fewer or lighter programs may all
# be (session 35). The env V5QX_PAIRS="GU/DN GU/DN ..." (each a tile "rows.0.warps" or "-" for the shipped one)
# replaces the list with those pairs.
PAIR_TILES_V5QX_DOWN = [(None, t) for t in ((2, 0, 2), (4, 0, 2), (8, 0, 2), (8, 0, 4), (16, 0, 4), (16, 0, 8),
                                            (4, 0, 8), (8, 0, 8), (2, 0, 1), (4, 0, 1))]


def v5qx_pairs() -> list:
    """PAIR_TILES_V5QX_DOWN, or the (gate_up, down) tiles of the env V5QX_PAIRS."""
    spec = os.environ.get("V5QX_PAIRS", "").split()
    tile = lambda t: None if t == "-" else tuple(int(v) for v in t.split("."))      # noqa: E731
    return [tuple(tile(t) for t in p.split("/")) for p in spec] or PAIR_TILES_V5QX_DOWN


# v5q at (gate_up, down) tiles that fill the H200's SMs in about whole waves without spilling (--only v5qwave; from
# bench/kernel_regs.py, session 27: the shipped Q4_0 gate_up holds one 255-register program an SM, 192 programs in
# 1.45 waves; Q4_K's and Q6_K's downs spill 512 / 744 bytes a thread. Those counts came from compiles without the
# launch's pointer alignment: the JIT gave the Q4_0 gate_up 128 registers, two programs an SM: session 35)
PAIR_TILES_WAVE = {"Q4_0": [((8, 0, 2), None)],
                   "Q4_K": [(None, (4, 0, 4)), (None, (8, 0, 8)), ((4, 0, 4), (4, 0, 4))],
                   "Q6_K": [(None, (8, 0, 4)), (None, (4, 0, 4)), (None, (8, 0, 8))]}
VARIANT_FMTS = "Q4_K,Q8_0,Q4_0,Q6_K,Q5_K,MXFP4,IQ3_XXS,dense"      # most used first (time budget)


def compiled_kernels() -> list[dict]:
    """Registers and spills of each decode kernel as this process's launches compiled them (the JIT's own
    specialization: pointer alignment and integer divisibility, which bench/kernel_regs.py can only assume)."""
    rows = []
    for name, fn in (("gate_up", tm.v5._gate_up_kernel), ("down", tm.v5._down_kernel)):
        for cache in fn.device_caches.values():
            for k in cache[0].values():
                k._init_handles()          # n_regs / n_spills are filled when the module is loaded
                rows.append({"kernel": name, "regs": k.n_regs, "spills": k.n_spills, "warps": k.metadata.num_warps,
                             "shared": k.metadata.shared})
    return rows


def time_kernel(c: Case, gen, kind: str, variant: str, cfg) -> dict:
    """Per-call time and GB/s of one decode kernel (T=1) at one tile (None: the shipped one)."""
    gu, dn, uniq = decode_calls(c, 1, gen, cfg_gu=cfg if kind == "gate_up" else None,
                                cfg_dn=cfg if kind == "down" else None, variant=variant)
    if kind == "down":                                    # h must hold real activations
        for f in gu:
            f()
    us = graph_us(gu if kind == "gate_up" else dn)
    gbps = uniq * (c.gu_bytes if kind == "gate_up" else c.dn_bytes) / (us * 1e-6) / 1e9
    return {"us": round(us, 2), "GBps": round(gbps, 1)}


def variants(model: str, fmts, gen, cgen, copy_bw: float, budget_s: float, only: str = "") -> list[dict]:
    """Qwen3-30B-A3B decode T=1 in passes over the formats, each step skipped once budget_s has passed
    (Triton compiles dominate): 1. v1 (Q8_0/Q4_0/Q4_K, dense), v2 and v3 (Q8_0/Q4_0/Q4_K), both
    kernels back to back at the shipped tiles, with the error against the twin; 2. v2pdl / v3pdl
    (down as a programmatic dependent launch) likewise; 3. each kernel alone, shipped tiles; 4. v3 at
    ALT_TILES_V3; 5. v2 at ALT_TILES. Then per format and variant the best gate_up + best down. v5 / v5pdl / v5q
    right after the baselines. only: these variants, nothing else."""
    t_start, out = time.perf_counter(), []
    wanted = set(filter(None, only.split(",")))
    cases = {fmt: Case(model, fmt, cgen) for fmt in fmts}

    def late(what: str) -> bool:
        if time.perf_counter() - t_start > budget_s:
            log(f"  {what}: skipped (time budget)")
            out.append({"skipped": what})
            return True
        return False

    def pair(c: Case, v: str, tiles=(None, None), sweep: str = ""):
        tag = "shipped tiles" if tiles == (None, None) else f"tiles {tiles}"
        swept = sweep in wanted
        if (wanted and v not in wanted and not swept) or late(f"{c.fmt} {v} pair {tag}"):
            return
        try:
            x = torch.randn(1, c.d, generator=gen).to(DEV, XDT)
            ids, w = routings(1, c.k, c.slots, gen)[0]
            want = ops.moe_native(x, ids, w, c.gu, c.dn, c.act, c.biases, c.fmt)
            got = tm.moe_decode(x, ids, w, c.gw, c.dw, c.code, c.act.alpha, c.act.limit, c.b, cfg_gate_up=tiles[0],
                                cfg_down=tiles[1], variant=v)
            calls, uniq = pair_calls(c, gen, v, *tiles)
            us = graph_us(calls)
            gb = uniq * (c.gu_bytes + c.dn_bytes) / (us * 1e-6) / 1e9
            r = {"us": round(us, 2), "GBps": round(gb, 1), "frac_of_copy": round(gb / copy_bw, 3),
                 "max_rel_err": round(rel_err(got, want), 5)}
            if v.startswith("v5"):              # int8 activations: also against the twin that quantizes alike
                q8 = ops.moe_native(x, ids, w, c.gu, c.dn, c.act, c.biases, c.fmt, act_q8=True)
                r["max_rel_err_q8_twin"] = round(rel_err(got, q8), 6)
        except Exception as e:  # noqa: BLE001 (report, go on)
            r = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
        out.append({"fmt": c.fmt, "variant": v, "kernel": "pair_default" if tiles == (None, None) else "pair_tiles",
                    **({} if tiles == (None, None) else {"tiles": repr(tiles)}), **r})
        log(f"  {c.fmt} {v} gate_up + down, {tag}: {r}")

    def alone(c: Case, v: str, kind: str, cfg):
        if (wanted and v not in wanted) or late(f"{c.fmt} {v} {kind} {cfg or 'default'}"):
            return
        try:
            r = time_kernel(c, gen, kind, v, cfg)
        except Exception as e:  # noqa: BLE001 (out of resources: report, go on)
            r = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
        out.append({"fmt": c.fmt, "variant": v, "kernel": kind, "tile": repr(cfg) if cfg else "default",
                     "bytes_per_slot": c.gu_bytes if kind == "gate_up" else c.dn_bytes, **r,
                     "frac_of_copy": round(r["GBps"] / copy_bw, 3) if "GBps" in r else None})
        log(f"  {c.fmt} {v} {kind} {cfg or 'default'}: {r}")

    def has(fmt, v):
        try:
            return tm.variant_of(fmt, v) == v
        except ValueError:
            return False
    def v3(fmt):                                  # formats with their own v3 kernels (others run v2)
        return fmt in tm.v2.V3_FORMATS
    for c in cases.values():
        for v in ("v1", "v2", "v3"):
            if has(c.fmt, v) and (v != "v3" or v3(c.fmt)):
                pair(c, v)
    def v5(fmt):                                  # formats with dp4a kernels (others run v3)
        return fmt in tm.v5.FORMATS
    for c in cases.values():                      # v5 first after the baselines: the candidate (session 8)
        for v in ("v5", "v5pdl", "v5q", "v5qx") if v5(c.fmt) else ():   # v5q: h quantized inside gate_up (session
                                                                        # 10); v5qx: and x (session 30)
            pair(c, v)
    for c in cases.values():                      # --only v5tiles: the v5pdl pair at combinations of tiles
        for gt in PAIR_TILES_V5["gate_up"] if "v5tiles" in wanted and v5(c.fmt) else ():
            for dt in PAIR_TILES_V5["down"]:
                if (gt, dt) != (None, None):
                    pair(c, "v5pdl", (gt, dt), "v5tiles")
    for c in cases.values():                      # --only v5qwave: v5q at the tiles of whole waves
        for tiles in PAIR_TILES_WAVE.get(c.fmt, []) if "v5qwave" in wanted else ():
            pair(c, "v5q", tiles, "v5qwave")
    for c in cases.values():                      # --only v5qtiles: v5q at wider gate_up tiles (h in registers)
        for gt in PAIR_TILES_V5Q if "v5qtiles" in wanted and v5(c.fmt) else ():
            pair(c, "v5q", (gt, None), "v5qtiles")
    for c in cases.values():                      # --only v5qxtiles: v5qx at the same tiles (fewer programs, fewer
        for gt in PAIR_TILES_V5Q if "v5qxtiles" in wanted and v5(c.fmt) else ():    # copies of x: session 30)
            pair(c, "v5qx", (gt, None), "v5qxtiles")
    # --only v5qxdown: the format's default pair (v5qx for Q4_0; env V5QX_VARIANTS: these, e.g. "v5q,v5qx") at
    # v5qx_pairs' tiles; env V5QX_SPLIT_AB: each one with gate_up's row in one piece and in two (MOETIER_V5_SPLIT 0 /
    # V5QX_SPLIT_AB / 0 / V5QX_SPLIT_AB, read at each launch: "1" the shipped split formats, or a list, e.g. "Q4_K")
    for c in cases.values():
        for tiles in v5qx_pairs() if "v5qxdown" in wanted and v5(c.fmt) else ():
            on = os.environ.get("V5QX_SPLIT_AB")
            for split in ("0", on, "0", on) if on else (None,):
                if split is not None:
                    os.environ["MOETIER_V5_SPLIT"] = split
                    log(f"  MOETIER_V5_SPLIT={split}")
                for v in os.environ.get("V5QX_VARIANTS", tm.DEFAULT_VARIANT.get(c.fmt, "v5pdl")).split(","):
                    pair(c, v, tiles, "v5qxdown")
            os.environ.pop("MOETIER_V5_SPLIT", None)
    # --only regab: gate_up (and down) under register caps against none, interleaved none / caps / none / caps (env
    # REGAB_CAP, default "{fmt}:128", e.g. "{fmt}:128,{fmt}/down:128"; REGAB_VARIANTS, default the format's default
    # variant and v5qx; REGAB_FMT, default Q4_K,Q6_K: those of --fmt): triton_decode_q8.v5_maxnreg
    regab = set(os.environ.get("REGAB_FMT", "Q4_K,Q6_K").split(",")) if "regab" in wanted else set()
    for c in cases.values():
        caps = os.environ.get("REGAB_CAP", "{fmt}:128").replace("{fmt}", c.fmt)
        for cap in ("", caps) * 2 if c.fmt in regab and v5(c.fmt) else ():
            os.environ["MOETIER_V5_MAXNREG"] = cap
            log(f"  MOETIER_V5_MAXNREG={cap}")
            default = tm.DEFAULT_VARIANT.get(c.fmt, "v5pdl")
            for v in os.environ.get("REGAB_VARIANTS", ",".join(dict.fromkeys((default, "v5qx")))).split(","):
                pair(c, v, sweep="regab")
                out[-1]["maxnreg"] = cap
        os.environ.pop("MOETIER_V5_MAXNREG", None)
    if wanted & {"v5qx", "v5qxtiles", "v5qxdown", "v5q", "v5pdl"} and DEV == "cuda":
        out.append({"compiled": compiled_kernels()})
        log(f"  compiled: {out[-1]['compiled']}")
    for c in cases.values():
        for v in ("v2pdl", "v3pdl"):
            if has(c.fmt, v) and (v != "v3pdl" or v3(c.fmt)):
                pair(c, v)
    for c in cases.values():
        for kind in ("gate_up", "down") if v5(c.fmt) else ():
            for cfg in ALT_TILES_V5[kind]:
                alone(c, "v5", kind, cfg)
    for c in cases.values():
        for v in ("v1", "v2", "v3"):
            for kind in ("gate_up", "down") if has(c.fmt, v) and (v != "v3" or v3(c.fmt)) else ():
                alone(c, v, kind, None)
    for c in cases.values():
        for kind in ("gate_up", "down") if v3(c.fmt) else ():
            for cfg in ALT_TILES_V3[kind]:
                alone(c, "v3", kind, cfg)
    for c in cases.values():
        for kind in ("gate_up", "down") if has(c.fmt, "v2") else ():
            for cfg in ALT_TILES[kind]:
                alone(c, "v2", kind, cfg)
    for fmt in fmts:
        for v in ("v1", "v2", "v3", "v5"):
            best = {k: min((o for o in out if o.get("fmt") == fmt and o.get("variant") == v and o.get("kernel") == k
                            and "us" in o), key=lambda o: o["us"], default=None) for k in ("gate_up", "down")}
            if all(best.values()):
                us = best["gate_up"]["us"] + best["down"]["us"]
                gb = (best["gate_up"]["GBps"] * best["gate_up"]["us"] + best["down"]["GBps"] * best["down"]["us"]) / us
                out.append({"fmt": fmt, "variant": v, "kernel": "total_best", "us": round(us, 2), "GBps": round(gb, 1),
                            "frac_of_copy": round(gb / copy_bw, 3), "tiles": [best["gate_up"]["tile"], best["down"]["tile"]]})
                log(f"  {fmt} {v} best gate_up + best down: {us:.1f} us, {gb:.0f} GB/s = {gb / copy_bw:.0%} of copy")
    log(f"variants: {time.perf_counter() - t_start:.0f} s")
    return out


def sweep(c: Case, gen, what: str = "all") -> dict:
    """Decode tiles (T=1) and grouped tiles (T=512): the fastest of a small grid per kernel."""
    elem = {"dense": 2, "Q8_0": 1, "Q4_0": 0.5, "Q4_K": 0.5, "Q5_K": 0.625, "Q6_K": 0.75, "MXFP4": 0.5,
            "IQ3_XXS": 0.4, "IQ2_XXS": 0.29, "Q2_K": 0.33, "Q3_K": 0.45}[c.fmt]
    words = (True,)                      # quantized formats: v2 tiles (BN, BK, warps, stages; words unused)

    def tiles(bns, bks, k_len, rows, lo, hi):               # bytes per K step within [lo, hi]
        for bn, bk, nw, wd, ns in itertools.product(bns, bks, (4, 8), words, (1, 3)):
            if lo <= rows * bn * bk * elem <= hi and (ns == 1 or bk < k_len):
                yield tm.DecodeTile(bn, bk, nw, ns, wd)
    grids = {"gate_up": list(tiles((8, 16, 32), (256, 512, 1024, 2048), c.d, 2, 4096, 65536)),
             "down": list(tiles((2, 4, 8), (256, 512, 1024), c.i, c.k, 2048, 65536))}
    best = {}
    for kind, grid in grids.items() if what in ("decode", "all") else ():
        res = []
        for cfg in grid:
            try:
                gu, dn, uniq = decode_calls(c, 1, gen, cfg_gu=cfg if kind == "gate_up" else None,
                                            cfg_dn=cfg if kind == "down" else None)
                us = graph_us(gu if kind == "gate_up" else dn)
                gbps = uniq * (c.gu_bytes if kind == "gate_up" else c.dn_bytes) / (us * 1e-6) / 1e9
                res.append((us, cfg))
                log(f"  {c.fmt} {kind} {cfg}: {us:.2f} us {gbps:.0f} GB/s")
            except Exception as e:  # noqa: BLE001 (e.g. out of resources: skip the tile)
                log(f"  {c.fmt} {kind} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
        best[f"decode_{kind}"] = repr(min(res)[1]) if res else None
    if what not in ("grouped", "all"):
        return best
    res = []
    for cfg in itertools.starmap(tm.GroupedTile, itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))):
        try:
            r = bench_grouped(c, 512, gen, cfg=cfg)
            res.append((r["total_us"], cfg))
            log(f"  {c.fmt} grouped {cfg}: {r['total_us']} us {r['TFLOPs']} TFLOP/s")
        except Exception as e:  # noqa: BLE001
            log(f"  {c.fmt} grouped {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
    best["grouped"] = repr(min(res)[1]) if res else None
    return best


def compile_sm90(fmts, only: str = "") -> list[dict]:
    """Compile each kernel at its default tiles for sm_90 on a machine without a GPU (Triton's
    bundled ptxas; the driver is stubbed) and report registers / spill bytes from cuobjdump."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.runtime import driver

    driver.set_active(Hopper())
    nvbin = Path(triton.__file__).parent / "backends/nvidia/bin"
    d, i, k, s = 2048, 768, 8, 4
    out = []
    for fmt in fmts:
        gu, dn = (tm.Weights(make_weights(fmt, s, n, kk, None, device="cpu"), fmt) for n, kk in ((2 * i, d), (d, i)))
        x, h = torch.empty(1, d, dtype=torch.bfloat16), torch.empty(k, i, dtype=torch.bfloat16)
        ids, w = torch.zeros(k, dtype=torch.int32), torch.empty(k, dtype=torch.bfloat16)
        sp, bs = torch.empty(1024, dtype=torch.int32), torch.empty(64, dtype=torch.int32)
        hh, y = torch.empty(1024, i, dtype=torch.bfloat16), torch.empty(1024, d, dtype=torch.bfloat16)
        g = tm.GROUPED.get(fmt, tm.GROUPED["Q4_K"])
        grp = {"BM": 64, "BN": g.bn, "BK": g.bk, "PREC": "tf32", "num_warps": g.warps, "num_stages": g.stages}
        jobs, step = [], {}   # (name, kernel, args, constexprs, weights per K step per program); K step
        if fmt in tm.V1_FORMATS:
            t1, t2 = tm.DECODE_GATE_UP[fmt], tm.DECODE_DOWN[fmt]
            def dec(t, kk, fmt=fmt):
                return {"BN": t.bn, "BK": tm._bk(t.bk, kk, fmt), "WORDS": t.words, "NS": t.stages, "num_warps": t.warps}
            jobs += [("v1_decode_gate_up", tm._decode_gate_up_kernel, (x, d, ids, *gu.args(), x, 0, h, 1.0, 7.0),
                      dict(I=i, D=d, KTOP=k, FMT=gu.code, ACT=0, HAS_BIAS=False, **dec(t1, d)), 2 * t1.bn * min(t1.bk, d)),
                     ("v1_decode_down", tm._decode_down_kernel, (h, ids, w, *dn.args(), x, 0, x, d),
                      dict(D=d, I=i, KTOP=k, FMT=dn.code, HAS_BIAS=False, **dec(t2, i)), k * t2.bn * tm._bk(t2.bk, i, fmt))]
            step.update(v1_decode_gate_up=min(t1.bk, d), v1_decode_down=tm._bk(t2.bk, i, fmt))
        if fmt != "dense":
            v2 = tm.v2
            t1, t2 = v2.GATE_UP[fmt], v2.DOWN[fmt]
            bsz = v2.STEP_BLOCK[fmt]
            def dec2(t, kk, fmt=fmt, bsz=bsz):
                return {"BS": bsz, "BN": t.bn, "NB": tm.v2._nb(t.bk, kk, fmt), "NS": t.stages, "PDL": False,
                        "num_warps": t.warps}
            h32 = torch.empty(k, i, dtype=torch.float32)                  # v2 keeps h in float32
            jobs += [("v2_decode_gate_up", v2._gate_up_kernel,
                      (x, d, ids, *gu.v2_args(), x, 0, h32, 1.0, 7.0, v2.ONE_BITS),
                      dict(I=i, D=d, KTOP=k, FMT=gu.code, ACT=0, HAS_BIAS=False, **dec2(t1, d)),
                      2 * t1.bn * v2._nb(t1.bk, d, fmt) * bsz),
                     ("v2_decode_down", v2._down_kernel, (h32, ids, w, *dn.v2_args(), x, 0, x, d, v2.ONE_BITS),
                      dict(D=d, I=i, KTOP=k, FMT=dn.code, HAS_BIAS=False, **dec2(t2, i)),
                      k * t2.bn * v2._nb(t2.bk, i, fmt) * bsz)]
            step.update(v2_decode_gate_up=v2._nb(t1.bk, d, fmt) * bsz, v2_decode_down=v2._nb(t2.bk, i, fmt) * bsz)
        if fmt in tm.v2.V3_FORMATS:                       # v3: one step of whole rows per program (no K loop)
            v2 = tm.v2
            h32 = torch.empty(k, i, dtype=torch.float32)
            bsz = v2.STEP_BLOCK[fmt]
            for tag, t1, t2 in [("", v2.GATE_UP3[fmt], v2.DOWN3[fmt])] + [
                    (f"_{a[0]}x{a[2]}", tuple(a), tuple(b)) for a, b in zip(*ALT_TILES_V3.values())]:
                t1, t2 = v2.Tile(*t1[:4]), v2.Tile(*t2[:4])
                gp, dp = v2.v3_pieces(d, fmt), v2.v3_pieces(i, fmt)
                jobs += [(f"v3_decode_gate_up{tag}", v2._gate_up_kernel_v3,
                          (x, d, ids, *gu.v2_args(), x, 0, h32, 1.0, 7.0, v2.ONE_BITS),
                          dict(I=i, D=d, KTOP=k, FMT=gu.code, ACT=0, HAS_BIAS=False, BS=bsz, BN=t1.bn, NB1=gp[0],
                               NB2=gp[1], PDL=False, num_warps=t1.warps), 2 * t1.bn * d),
                         (f"v3_decode_down{tag}", v2._down_kernel_v3, (h32, ids, w, *dn.v2_args(), x, 0, x, d, v2.ONE_BITS),
                          dict(D=d, I=i, KTOP=k, KP=triton.next_power_of_2(k), FMT=dn.code, HAS_BIAS=False, BS=bsz,
                               BN=t2.bn, NB1=dp[0], NB2=dp[1], PDL=False, num_warps=t2.warps), k * t2.bn * i)]
                step.update({f"v3_decode_gate_up{tag}": d, f"v3_decode_down{tag}": i})
        if fmt in tm.v5.FORMATS:                          # v5 / v5q (PDL on: sm_90)
            jobs += v5_jobs(fmt, gu, dn, d, i, k)
        jobs += [("grouped_gate_up", tm._grouped_gate_up_kernel,
                  (x, d, sp, bs, *gu.args(), *gu.extra_args(), x, 0, hh, 1000, 1.0, 7.0),
                  dict(I=i, D=d, KTOP=k, FMT=gu.code, ACT=0, HAS_BIAS=False, **grp), 0),
                 ("grouped_down", tm._grouped_down_kernel, (hh, sp, bs, w, *dn.args(), *dn.extra_args(), x, 0, y, 1000),
                  dict(D=d, I=i, FMT=dn.code, HAS_BIAS=False, **grp), 0)]
        for name, fn, args, kw, per_iter in jobs:
            if only and not any(o in name for o in only.split(",")):
                continue
            t0 = time.perf_counter()
            kern = fn.warmup(*args, grid=(1,), **kw)
            secs = time.perf_counter() - t0
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kern.asm["cubin"])
                f.flush()
                usage = subprocess.run([str(nvbin / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                                       text=True, check=True).stdout
                sass = subprocess.run([str(nvbin / "cuobjdump"), "-sass", f.name], capture_output=True,
                                      text=True, check=True).stdout
            if os.environ.get("SASS_DIR"):                            # keep the listing to grep
                Path(os.environ["SASS_DIR"], f"{fmt}_{name}.sass").write_text(sass)
                Path(os.environ["SASS_DIR"], f"{fmt}_{name}.ttgir").write_text(kern.asm["ttgir"])
                Path(os.environ["SASS_DIR"], f"{fmt}_{name}.llir").write_text(kern.asm["llir"])
            regs, stack = (int(re.search(p + r":(\d+)", usage).group(1)) for p in ("REG", "STACK"))
            r = {"fmt": fmt, "kernel": name, "regs": regs, "spill_stack_bytes": stack,
                 "shared_bytes": kern.metadata.shared, "compile_s": round(secs, 1), **sass_loop(sass),
                 **sass_waits(sass, 32 * kw["num_warps"])}
            if per_iter:       # per K step, or per program when the K loop was unrolled away (one step)
                weights = per_iter if r["k_loop"] else per_iter * max(1, (d if "gate_up" in name else i) // step[name])
                r["instr_per_weight_per_thread"] = round(r["loop_instructions"] * 32 * kw["num_warps"] / weights, 2)
            out.append(r)
            log(json.dumps(out[-1]))
    return out


def v5_jobs(fmt: str, gu, dn, d: int, i: int, k: int) -> list:
    """compile_sm90's jobs for the v5 kernels at their shipped tiles: v5pdl's gate_up and down, v5q's gate_up (h
    quantized)."""
    q8 = tm.v5
    xw, xd = torch.empty(1, d // 4, dtype=torch.int32), torch.empty(1, d // 32)
    ids, wt = torch.zeros(k, dtype=torch.int32), torch.empty(k, dtype=torch.bfloat16)
    h = torch.empty(k, i)
    hq, hd = torch.empty(k, i, dtype=torch.int8), torch.empty(k, i // 32)
    out = torch.empty(1, d, dtype=torch.bfloat16)
    gp, dp = tm.v2.v3_pieces(d, fmt), tm.v2.v3_pieces(i, fmt)
    base = dict(FMT=gu.code, HAS_BIAS=False, BS=tm.v2.STEP_BLOCK[fmt], PDL=True, EMU=False)
    gu_args = (xw, xd, xd, ids, *q8._planes(gu), h, 0, h, 1.0, 7.0, hq, hd, hd, ids, xd, 0, xw)
    dn_args = (hq.view(torch.int32), hd, hd, ids, wt, *q8._planes(dn), out, 0, out, d)

    xb = torch.empty(1, d, dtype=torch.bfloat16)
    gx_args = gu_args[:-3] + (xb, d, torch.empty(64, d, dtype=torch.int8))

    def gate_up(name, tile, qh, xq=False, **opt):
        return (name, q8._gate_up_kernel, gx_args if xq else gu_args, dict(base, I=i, D=d, KTOP=k, ACT=0, BN=tile.bn,
                NB1=gp[0], NB2=gp[1], ROUND=1, QH=qh, XQ=xq, NBP=triton.next_power_of_2(d // 32), tr_ptr=xd,
                TRACE=False, num_warps=tile.warps, **opt), 0)

    def down(name, tile):
        return (name, q8._down_kernel, dn_args, dict(base, D=d, I=i, KTOP=k, KP=triton.next_power_of_2(k), BN=tile.bn,
                NB1=dp[0], NB2=dp[1], TRIGGER=True, tr_ptr=out, TRACE=False, num_warps=tile.warps), 0)
    t5, tq, td = (tm.v2.Tile(*c[:4]) for c in (q8.GATE_UP5[fmt], q8.GATE_UP5Q.get(fmt, q8.GATE_UP5[fmt]),
                                               q8.DOWN5[fmt]))
    qh = q8.h_quantizer(tq.bn)
    return [gate_up("v5_gate_up", t5, 0), gate_up("v5q_gate_up", tq, qh), gate_up("v5qx_gate_up", tq, qh, True),
            gate_up("v5qx128_gate_up", tq, qh, True, maxnreg=128), down("v5_down", td)]


def sass_loop(sass: str) -> dict:
    """The largest loop of a SASS listing (a backward BRA; the K loop of a GEMV kernel), else the
    whole kernel: its instructions and global loads by width (to compare variants per weight)."""
    import re
    ins = [(int(m.group(1), 16), m.group(2)) for line in sass.splitlines()
           if (m := re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line))]
    loops = [(int(t.group(1), 16), a) for a, text in ins
             if (t := re.search(r"\bBRA\s+0x([0-9a-f]+)", text)) and int(t.group(1), 16) < a]
    lo, hi = max(loops, key=lambda r: r[1] - r[0]) if loops else (0, 1 << 62)
    body = [text for a, text in ins if lo <= a <= hi]
    loads = {}
    for text in body:
        if (m := re.search(r"\bLDG\.E(\.[A-Z0-9.]+)?", text)):
            key = "LDG" + (m.group(1) or ".32")
            loads[key] = loads.get(key, 0) + 1
    ops = {}                                        # whole kernel: shared memory / barriers / shuffles
    for a, text in ins:
        if (m := re.match(r"(?:@!?U?P\w+\s+)?(STS|LDSM|LDS|BAR|SHFL)\b", text)):
            ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    return {"sass_instructions": len(ins), "k_loop": bool(loops), "loop_instructions": len(body), "loop_loads": loads,
            "smem_ops": ops}


def sass_waits(sass: str, threads: int) -> dict:
    """Latency cover of the 128-bit global loads up to the first ATOMG (kernels without one: all), from the
    scoreboards in each instruction's control bits (sm_70+: second word >> 41,
    write barrier bits 5-7, wait mask bits 11-16): per load, the instructions from issue to the first wait
    on its scoreboard (any load on a scoreboard is retired by a wait on it), and the 128-bit loads in
    flight at each wait that retires some, as KB per SM (threads per program, one program per SM)."""
    import re
    lines = sass.splitlines()
    ins = []
    for i, line in enumerate(lines[:-1]):
        if (m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;?\s*/\* 0x[0-9a-f]{16} \*/", line)) and \
                (h := re.search(r"/\* (0x[0-9a-f]{16}) \*/", lines[i + 1])):
            ctl = int(h.group(1), 16) >> 41
            ins.append((m.group(1), (ctl >> 5) & 7, (ctl >> 11) & 63))
    pend, dist, kb = {}, [], []
    for k, (text, wbar, wait) in enumerate(ins):
        if "ATOMG" in text:
            break
        for sb in range(6):
            if wait >> sb & 1 and pend.get(sb):
                wide = [i for i, w in pend[sb] if w]
                if wide:
                    dist += [k - i for i in wide]
                    kb.append(sum(w for v in pend.values() for _, w in v) * 16 * threads // 1024)
                pend[sb] = []
        if (m := re.match(r"(?:@!?U?P\w+\s+)?LDG(\S*)", text)):
            pend.setdefault(wbar, []).append((k, ".128" in m.group(1)))
    return {"ldg128_to_arrive": len(dist), "ldg128_issue_to_wait_instr": round(sum(dist) / max(1, len(dist))),
            "ldg128_KB_in_flight_per_SM_at_waits": kb}


QLINEAR_SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "lm_head": (151936, 2048)}   # Qwen3-30B-A3B [N, K]
QLINEAR_TILES = [(2048, 2), (512, 1), (1024, 1), (1024, 2), (2048, 1), (2048, 4), (4096, 2), (4096, 4), (4096, 8),
                 (8192, 4), (8192, 8)]      # (words per program, warps); the shipped one first


def qlinear_bench(fmts, gen, copy_bw: float, budget_s: float, shapes=None) -> list[dict]:
    """Dense decode GEMVs on GGML blocks (triton_qlinear.gemv) at the model's attention and lm_head shapes, T=1,
    against cuBLAS on the bf16 weights (the --dequantize-dense path): each tile with its quantizer launch, and with
    x's int8 copy given (`pre`: the engine's qkv and o GEMVs get it from the norm / the attention's combine). Weight
    copies rotate through > 2x the L2 so every call reads HBM. Tiles: WORDS_PER_PROGRAM x warps."""
    from moetier.kernels import triton_decode_q8 as q8
    from moetier.kernels import triton_qlinear as tq
    t_start, out = time.perf_counter(), []
    saved = tq.WORDS_PER_PROGRAM, tq.WARPS
    for name, (n, k) in (shapes or QLINEAR_SHAPES).items():
        for fmt in ["dense", *fmts]:
            if time.perf_counter() - t_start > budget_s:
                out.append({"skipped": f"{name} {fmt}"})
                continue
            per = n * k * 2 if fmt == "dense" else None
            w0 = make_weights(fmt, 1, n, k, gen)
            per = per or nbytes(w0)
            n_copies = 1 if DEV == "cpu" else -(-120_000_000 // per)
            copies = [w0] + [make_weights(fmt, 1, n, k, gen) for _ in range(n_copies - 1)]
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(DEV, XDT)
            y = torch.empty(1, n, device=DEV, dtype=XDT)
            pre = q8.quantize(x)
            for tile, given in [(None, False)] if fmt == "dense" else [(t, g) for t in QLINEAR_TILES
                                                                    for g in (False, True)]:
                try:
                    if fmt == "dense":
                        calls = [lambda w=w: torch.mm(x, w[0].t(), out=y) for w in copies]
                    else:
                        tq.WORDS_PER_PROGRAM, tq.WARPS = tile
                        calls = [lambda w=w: tq.gemv(x, w, fmt, out=y, pre=pre if given else None) for w in copies]
                    us = graph_us(calls)
                    r = {"us": round(us, 2), "GBps": round(per / (us * 1e-6) / 1e9, 1), "pre": given}
                    r["frac_of_copy"] = round(r["GBps"] / copy_bw, 3)
                    if fmt != "dense":          # against the twin that quantizes x alike
                        r["max_rel_err_q8_twin"] = round(rel_err(tq.gemv(x, w0, fmt),
                                                                 ops.qlinear_native(x, w0, fmt, act_q8=True)), 6)
                except Exception as e:  # noqa: BLE001 (report, go on)
                    r = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
                finally:
                    tq.WORDS_PER_PROGRAM, tq.WARPS = saved
                out.append({"shape": name, "n": n, "k": k, "fmt": fmt, "tile": tile, "bytes": per, **r})
                log(f"  qlinear {name} [{n}, {k}] {fmt} {tile or 'cuBLAS bf16'}{' pre' if given else ''}: {r}")
            del copies
            if DEV == "cuda":
                torch.cuda.empty_cache()
    return out


def qkv_mixed_bench(gen, n_qk: int = 4608, n_v: int = 512, k: int = 2048) -> dict:
    """Q4_K_M's qkv in its layers with a Q6_K attn_v (Qwen3-30B-A3B: q + k [4608, 2048] Q4_K, v [512, 2048] Q6_K),
    T=1, graph replays over rotated weight copies: each part's GEMV with its own quantizer and a cat (before session
    22) against ops.qlinear_parts (one quantizer, both GEMVs into one buffer) and against it with x's int8 copy given
    (what the fused norm hands it)."""
    from types import SimpleNamespace

    from moetier.kernels import triton_decode_q8 as q8
    from moetier.kernels import triton_qlinear as tq
    per = nbytes(make_weights("Q4_K", 1, n_qk, k, gen)) + nbytes(make_weights("Q6_K", 1, n_v, k, gen))
    sets = [[SimpleNamespace(planes=make_weights(f, 1, n, k, gen), fmt=f, bias=None, out_features=n)
             for f, n in (("Q4_K", n_qk), ("Q6_K", n_v))] for _ in range(1 if DEV == "cpu" else -(-120_000_000 // per))]
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(DEV, XDT)
    pre = q8.quantize(x)
    ways = {"own quantizers + cat": lambda ps: torch.cat([tq.gemv(x, p.planes, p.fmt) for p in ps], dim=-1),
            "qlinear_parts": lambda ps: ops.qlinear_parts(x, ps),
            "qlinear_parts, x's copy given": lambda ps: ops.qlinear_parts(x, ps, pre)}
    want = ways["own quantizers + cat"](sets[0])
    res = {"bytes": per}
    for name, way in ways.items():
        us = graph_us([lambda ps=ps, way=way: way(ps) for ps in sets])
        res[name] = {"us": round(us, 2), "same_bits": bool(torch.equal(way(sets[0]), want))}
        log(f"  qkv mixed (Q4_K [{n_qk}, {k}] + Q6_K [{n_v}, {k}]) {name}: {res[name]}")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fmt", default="dense,Q8_0,Q4_0,Q4_K,Q5_K,Q6_K,MXFP4,IQ3_XXS")
    ap.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b")
    ap.add_argument("--quick", action="store_true", help="T=1 decode and T=512 grouped only")
    ap.add_argument("--sweep", nargs="?", const="all", choices=("decode", "grouped", "all"),
                    help="search tile sizes (default model: qwen3-30b-a3b only)")
    ap.add_argument("--variants", action="store_true",
                    help="decode v1 vs v2 and tiles, Qwen3-30B-A3B T=1, every format (fmt order: --fmt)")
    ap.add_argument("--budget", type=float, default=80.0, help="--variants: seconds after which the "
                    "remaining measurements are skipped (compiles dominate; the whole run stays < 2 min)")
    ap.add_argument("--qlinear", action="store_true", help="dense GEMVs on GGML blocks (QuantLinear) at the "
                    "attention / lm_head shapes vs cuBLAS bf16, several tiles (--fmt: the quantized formats)")
    ap.add_argument("--profile-pair", action="store_true", help="where the T=1 pair's time goes: each kernel's "
                    "device time, the gaps, and the read ceiling of one launch over the same bytes (--fmt)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test (Triton interpreter, tiny shapes)")
    ap.add_argument("--compile-sm90", action="store_true", help="no GPU needed: compile for sm_90, report registers")
    ap.add_argument("--only", default="", help="--variants / --profile-pair: these variants (e.g. v2,v5pdl); "
                    "--qlinear: these shapes (qkv,o,lm_head); "
                    "--compile-sm90: kernels whose names contain one of these "
                    "comma-separated strings (e.g. v2_,v3_)")
    a = ap.parse_args()
    if a.compile_sm90:
        print(json.dumps(compile_sm90(a.fmt.split(","), a.only), indent=1))
        return
    global ROT
    if a.interpret:
        a.models, a.quick, ROT = "tiny", True, 2
    elif a.sweep and a.models == ap.get_default("models"):
        a.models = "qwen3-30b-a3b"
    elif not torch.cuda.is_available():
        sys.exit("bench_gpu_kernels needs a CUDA GPU (or --interpret for a CPU smoke test)")
    gen = torch.Generator(device="cpu").manual_seed(0)
    cgen = torch.Generator(device=DEV).manual_seed(0)
    dev = torch.cuda.get_device_properties(0) if DEV == "cuda" else None
    copy_bw = hbm_copy_GBps()
    res = {"device": dev.name if dev else "cpu (interpreter)", "sms": dev.multi_processor_count if dev else 0,
           "torch": torch.__version__,
           "triton": triton.__version__, "hbm_copy_GBps": round(copy_bw, 1), "cases": []}
    log(f"{res['device']}: HBM copy (read + write) {copy_bw:.0f} GB/s")
    if a.qlinear:
        from moetier.kernels.triton_qlinear import supports
        fmts = [f for f in ("Q4_0,Q8_0,Q4_K,Q6_K" if a.fmt == ap.get_default("fmt") else a.fmt).split(",")
                if supports(f, 4096)]
        shapes = {"tiny": (40, 256)} if a.interpret else {k: v for k, v in QLINEAR_SHAPES.items()
                                                          if not a.only or k in a.only.split(",")}
        res["qlinear"] = qlinear_bench(fmts, cgen, copy_bw, a.budget, shapes)
        res["qkv_mixed"] = qkv_mixed_bench(cgen, *((64, 32, 256) if a.interpret else ()))
        a.models = ""
    if a.profile_pair:
        fmts = ("Q4_0,Q8_0,Q4_K,Q6_K" if a.fmt == ap.get_default("fmt") else a.fmt).split(",")
        res["profile_pair"] = [r for v in (a.only or "v5pdl").split(",")
                               for r in profile_pair(fmts, gen, cgen, copy_bw, v)]
        a.models = ""
    if a.variants:
        fmts = (VARIANT_FMTS if a.fmt == ap.get_default("fmt") else a.fmt).split(",")
        res["variants"] = variants("tiny" if a.interpret else "qwen3-30b-a3b", fmts, gen, cgen, copy_bw, a.budget,
                                   a.only)
        a.models = ""
    for model in filter(None, a.models.split(",")):
        for fmt in a.fmt.split(","):
            if MODELS[model][0] % tm.BLOCK[fmt] or MODELS[model][1] % tm.BLOCK[fmt]:
                continue
            c = Case(model, fmt, cgen)
            if a.sweep:
                res["cases"].append({"model": model, "fmt": fmt, "best": sweep(c, gen, a.sweep)})
                log(json.dumps(res["cases"][-1]))
                continue
            errs = {t: round(c.check(t, gen), 5) for t in ((1, 9) if a.interpret else (1, 4, 64))}
            ok = all(e <= 2e-2 for e in errs.values())
            log(f"{model} {fmt}: max rel err vs torch twin {errs} {'ok' if ok else 'MISMATCH'}")
            for t in ((1,) if a.quick else (1, 2, 4, 8)):
                r = bench_decode(c, t, gen)
                r.update(model=model, fmt=fmt, max_rel_err=errs, frac_of_copy=round(r["total_GBps"] / copy_bw, 3))
                res["cases"].append(r)
                log(f"  decode T={t}: {r['total_us']} us ({r['gate_up_us']} + {r['down_us']}), "
                    f"{r['total_GBps']} GB/s = {r['frac_of_copy']:.0%} of copy; eager {r['total_eager_us']} us")
            for t in ((16 if a.interpret else 512,) if a.quick else (16, 64, 512, 4096)):
                r = bench_grouped(c, t, gen)
                r.update(model=model, fmt=fmt, max_rel_err=errs)
                res["cases"].append(r)
                log(f"  grouped T={t}: {r['total_us']} us, {r['TFLOPs']} TFLOP/s, {r['GBps']} GB/s"
                    + (f"; torch._grouped_mm {r['torch_grouped_mm_us']} us" if "torch_grouped_mm_us" in r else ""))
            del c
            if DEV == "cuda":
                torch.cuda.empty_cache()
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
