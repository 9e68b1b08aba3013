"""The doorbell miss server (kernels/doorbell.c moetier_serve_step) against the machine's RAM read
bandwidth; prints JSON.

A MissServer over a pool of distinct experts in RAM with real shapes (default Qwen3-30B-A3B:
48 layers, E=128, D=2048, I=768, k=8, Q4_0; one expert = gate_up [2I, D] + down [D, I], 2.65 MB).
The pool (--gib, default 2 GiB: far beyond the CPU caches, fits the dev box) holds as many experts
as fit; every (layer, expert) of the [L][E] table points at a random pool expert. Each step picks
--misses distinct experts per layer at random (slot -1; the other k - M are GPU hits), writes x / ids
/ w / slots, and pre-rings every bell before calling serve (the server never waits: the GPU's part
is not timed). Weights are a few real quantized experts tiled over the pool.

Reported per type: step ms (best and median over --steps), GB/s of expert bytes read (gate_up + down
of every missed expert, wall clock of serve), the RAM read yardstick (C streaming sum over a 1 GiB
float32 tensor with the same thread count, and torch.sum; best of the rounds) and the fraction.
--variants 6,0: A/B of doorbell.c's serve_ctx.variant (6 = the default, no barriers; 0 = the phases with barriers,
1 = the old per-row loops, 2 = down over the experts' rows, 3 = variant 0's reads without the math: what the access
pattern alone allows, 4 = guided chunks, 5 = phase 3's rows prefetched in phase 1),
rounds interleaved (the dev box is shared and noisy: compare bests); each round's best GB/s sits beside the RAM read
taken just before and after it ("rounds"), since a box's RAM rate can move by a third within minutes.

    python bench/bench_miss_server.py [--types Q4_0,Q8_0,Q4_K] [--threads 2] [--misses 5] [--layers 48]
        [--gib 2] [--steps 10] [--rounds 3] [--variants 0,1] [--float-act] [--pools plain,thp]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetier.kernels import cpu  # noqa: E402
from moetier.kernels import doorbell as db  # noqa: E402
from moetier.kernels.ops import Act  # noqa: E402
from moetier.quant.formats import get_format  # noqa: E402
from moetier.quant.pack import quantize  # noqa: E402


def thp_empty(shape) -> torch.Tensor:
    """uint8 [shape] on 2 MiB transparent huge pages (the pool kind 'thp'; moetier.memory.hugepages)."""
    from moetier.memory import hugepages
    nbytes = 1
    for n in shape:
        nbytes *= n
    return hugepages.empty(nbytes).view(*shape)


def make_pool(qtype: str, n: int, dim: int, hidden: int, gen, kind: str = "plain", tmpl=None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """n experts: uint8 gate_up [n, 2I, row bytes], down [n, D, row bytes] (4 real quantized ones, tiled: tmpl, or
    new ones from gen).
    kind: 'plain' (torch.empty: 4 KiB pages where THP is 'madvise', as the pinned bank's), 'thp' (huge pages), 'x8'
    (plain, then its rows interleaved by 8 in place: kernels.cpu.interleave_inplace, as memory/doorbell.py does the
    RAM bank's experts in the formats that have x8 kernels)."""
    tmpl_gu, tmpl_dn = tmpl or templates(qtype, dim, hidden, gen)
    empty = thp_empty if kind == "thp" else (lambda shape: torch.empty(shape, dtype=torch.uint8))
    gu = empty((n, *tmpl_gu[0].shape))
    dn = empty((n, *tmpl_dn[0].shape))
    for i in range(n):
        gu[i].copy_(tmpl_gu[i % 4])
        dn[i].copy_(tmpl_dn[i % 4])
    if kind == "x8":
        fmt = get_format(qtype)
        for t in (gu, dn):
            cpu.interleave_inplace(t.view(-1, t.shape[-1]), fmt.type_id)
    return gu, dn


def templates(qtype: str, dim: int, hidden: int, gen) -> tuple[list, list]:
    """4 quantized gate_up and down matrices of random weights"""
    return ([quantize(torch.randn(2 * hidden, dim, generator=gen) * 0.1, qtype) for _ in range(4)],
            [quantize(torch.randn(dim, hidden, generator=gen) * 0.1, qtype) for _ in range(4)])


def ram_gbps(ref: torch.Tensor, threads: int) -> tuple[float, float]:
    """(C streaming sum GB/s, torch.sum GB/s) over ref with `threads` threads."""
    gb = ref.numel() * 4 / 1e9
    t0 = time.perf_counter()
    cpu.stream_sum(ref, threads)
    t1 = time.perf_counter()
    ref.sum()
    t2 = time.perf_counter()
    return gb / (t1 - t0), gb / (t2 - t1)


def time_type(args, qtype, act, variants, gen, ref, ram_c, ram_t):
    """Serve steps over a pool of `qtype` experts; -> ({variant: step wall seconds}, bytes per expert, pool
    size). Appends the RAM yardstick of each round to ram_c / ram_t."""
    L, E, D, I, K, M, nt = args.layers, args.experts, args.dim, args.hidden, args.k, args.misses, args.threads
    fmt = get_format(qtype)
    ebytes = (2 * I * (D // fmt.block_size) + D * (I // fmt.block_size)) * fmt.type_size
    n_pool = max(K, min(L * E, int(args.gib * 2**30 // ebytes)))
    where = torch.randint(n_pool, (L, E), generator=gen).tolist()
    req = db.Requests(L, D, K, pin=torch.cuda.is_available())     # pinned, as in the real step
    servers, pools = {}, []
    tmpl = templates(qtype, D, I, gen)      # the same weights in every pool kind
    for kind in args.pools.split(","):      # one pool of each kind, the same expert table (the server keeps pointers:
        # the pools stay referenced here)
        gu, dn = make_pool(qtype, n_pool, D, I, gen, kind, tmpl)
        pools.append((gu, dn))
        s_gu = [[gu[where[li][e]] for e in range(E)] for li in range(L)]
        s_dn = [[dn[where[li][e]] for e in range(E)] for li in range(L)]
        tid = cpu.INTERLEAVED[fmt.type_id] if kind == "x8" else fmt.type_id
        servers[kind] = db.MissServer(req, s_gu, s_dn, tid, D, I, act, threads=nt, q8_act=not args.float_act)
    req.x[:] = torch.randn(L, D, generator=gen)
    seq = 0

    def step(srv):
        """New random misses per layer, bells pre-rung; -> wall seconds of serve."""
        nonlocal seq
        seq += 1
        req.ids[:] = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(L)]).int()
        req.w[:] = torch.rand(L, K, generator=gen)
        slots = torch.arange(K, dtype=torch.int32).repeat(L, 1)
        slots[:, :M] = -1
        req.slots[:] = slots[:, torch.randperm(K, generator=gen)]
        req.bell[::db.BELL_STRIDE] = seq
        t0 = time.perf_counter()
        n = srv.serve(seq)[2]
        wall = time.perf_counter() - t0
        assert n == L * M
        return wall

    if len(servers) > 1:        # every pool kind answers the same step alike (x8: float sums in another order)
        req.ids[:] = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(L)]).int()
        req.w[:] = torch.rand(L, K, generator=gen)
        req.slots[:] = -1
        ys = []
        for srv in servers.values():
            seq += 1
            req.bell[::db.BELL_STRIDE] = seq
            srv.serve(seq)
            ys.append(req.y.clone())
        for kind, y in zip(servers, ys):
            err = float((y - ys[0]).abs().max() / ys[0].abs().max())
            print(f"{qtype} pool {kind}: max |y - y[{next(iter(servers))}]| / max |y| = {err:.2e}", file=sys.stderr)
            if err > 5e-3:          # h re-rounded to int8: a float-order flip moves a value by its dx
                raise SystemExit(f"pool {kind} answers differently ({err:.2e})")
    times = {(kind, v): [] for kind in servers for v in variants}
    rounds = []
    for _ in range(args.rounds):
        rc, rt = ram_gbps(ref, nt)
        best, phases = {}, {}
        for kind, v in times:                               # interleaved: the box is noisy
            srv = servers[kind]
            srv.ctx.variant = v
            step(srv)                                       # warm-up (threads, page tables)
            ts, ph = [], [0.0] * 5
            for _ in range(args.steps):
                ts.append(step(srv))
                ph = [a + b for a, b in zip(ph, srv.phases)]
            times[kind, v] += ts
            best[f"{kind}/{v}"] = round(L * M * ebytes / min(ts) / 1e9, 2)
            # us a layer and thread: gate_up's work, its barrier wait, h + barrier, down's work, finish -> last
            phases[f"{kind}/{v}"] = [round(x / (args.steps * L * nt) * 1e6, 2) for x in ph]
        rc2, rt2 = ram_gbps(ref, nt)                        # the RAM read on both sides of the round
        ram_c += [rc, rc2]
        ram_t += [rt, rt2]
        rounds.append({"ram_c_gbps": [round(rc, 1), round(rc2, 1)], "gbps_best": best, "phase_us": phases})
    return times, ebytes, n_pool, rounds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_0")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--misses", type=int, default=5, help="missed experts per layer")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--gib", type=float, default=2.0, help="weight pool size cap (GiB)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="6", help="serve_ctx.variant values to compare (6 the default: no "
                    "barriers, 0 the phases with barriers, 1 old loops, 2 down over the experts' rows, 3 variant 0's "
                    "reads without the math: the access pattern's ceiling, 4 guided chunks, 5 down prefetched in "
                    "phase 1)")
    ap.add_argument("--float-act", action="store_true", help="float32 activations (q8_act=False)")
    ap.add_argument("--act", default="swiglu", choices=["swiglu", "clamped"])
    ap.add_argument("--pools", default="plain", help="pool kinds to compare: plain (4 KiB pages), thp (huge pages), "
                    "x8 (rows interleaved by 8)")
    args = ap.parse_args()
    L, E, D, I, K, M, nt = args.layers, args.experts, args.dim, args.hidden, args.k, args.misses, args.threads
    torch.set_num_threads(nt)
    variants = [int(v) for v in args.variants.split(",")]
    act = Act() if args.act == "swiglu" else Act("clamped_swiglu", 1.702, 7.0)
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(1 << 28, generator=gen)                  # 1 GiB float32: the RAM yardstick
    out = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": nt},
           "shape": {"L": L, "E": E, "D": D, "I": I, "k": K, "misses": M, "q8_act": not args.float_act}, "results": []}
    ram_c, ram_t = [], []
    for qtype in args.types.split(","):
        times, ebytes, n_pool, rounds = time_type(args, qtype, act, variants, gen, ref, ram_c, ram_t)
        out.setdefault("rounds", {})[qtype] = rounds
        ram = max(max(ram_c), max(ram_t))
        step_bytes = L * M * ebytes
        for (kind, v), ts in times.items():
            best, med = min(ts), statistics.median(ts)
            out["results"].append({"qtype": qtype, "pool": kind, "variant": v, "threads": nt, "pool_experts": n_pool,
                                   "expert_mb": round(ebytes / 1e6, 3), "step_ms_best": round(best * 1e3, 3),
                                   "step_ms_median": round(med * 1e3, 3),
                                   "gbps_best": round(step_bytes / best / 1e9, 2),
                                   "gbps_median": round(step_bytes / med / 1e9, 2),
                                   "fraction_of_ram_best": round(step_bytes / best / 1e9 / ram, 3)})
    out["ram_read_gbps"] = {"c_stream_sum_best": round(max(ram_c), 2), "torch_sum_best": round(max(ram_t), 2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
