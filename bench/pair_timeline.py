"""Where a T=1 decode expert pair's time goes, program by program (H200 diagnosis for #4's 60%).

Each gate_up and down program of the shipped v5 kernels stamps the GPU's nanosecond clock (%globaltimer) at its
start, after its PDL wait, once its weights are in, and at its end, with its SM (`triton_decode_q8.stamps`). The 16
pairs of bench_gpu_kernels' rotation (Qwen3-30B-A3B, distinct slots so HBM serves them) are captured in one CUDA graph
and replayed; the last replay's stamps give, per pair: the waves of gate_up, each program's span, when down's
programs start and end, the gap to the next pair, and the pair's span; also the pair's graph time with and without
stamps.

    python bench/pair_timeline.py [--fmt Q4_0,Q4_K] [--variant v5qx] [--out t.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import bench_gpu_kernels as bg  # noqa: E402
from moetier.kernels import triton_decode_q8 as q8  # noqa: E402
from moetier.kernels import triton_moe as tm  # noqa: E402


def pcts(v: torch.Tensor) -> list[float]:
    """min, median, max (microseconds) of nanosecond values."""
    v = v.double().sort().values / 1e3
    return [round(v[0].item(), 2), round(v[len(v) // 2].item(), 2), round(v[-1].item(), 2)]


def occupancy(starts, ends, t0: float, step_ns: int = 250, span_ns: int = 14000) -> list[int]:
    """Programs running in each step_ns bucket after t0 (a text picture of the waves)."""
    out = []
    for b in range(0, span_ns, step_ns):
        lo, hi = t0 + b, t0 + b + step_ns
        out.append(int(((starts < hi) & (ends > lo)).sum().item()))
    return out


def timeline(fmt: str, variant: str | None, gen, cgen) -> dict:
    c = bg.Case("qwen3-30b-a3b", fmt, cgen)
    rs = bg.routings(1, c.k, c.slots, gen)
    x = torch.randn(1, c.d, generator=gen).to(bg.DEV, bg.XDT)
    out = torch.empty_like(x)
    n_gu = c.k * (c.i // q8.GATE_UP5Q.get(fmt, q8.GATE_UP5[fmt])[0])      # v5q / v5qx tiles
    n_dn = c.d // q8.DOWN5[fmt][0]
    gu = torch.zeros(bg.ROT, n_gu, 5, dtype=torch.int64, device=bg.DEV)
    dn = torch.zeros(bg.ROT, n_dn, 5, dtype=torch.int64, device=bg.DEV)

    def call(r, i, w, traced):
        q8.stamps(gu[r], dn[r]) if traced else q8.stamps()
        tm.moe_decode(x, i, w, c.gw, c.dw, c.code, c.act.alpha, c.act.limit, c.b, out=out, variant=variant)
        q8.stamps()

    plain = bg.graph_us([lambda r=r, i=i, w=w: call(r, i, w, False) for r, (i, w) in enumerate(rs)])
    traced = bg.graph_us([lambda r=r, i=i, w=w: call(r, i, w, True) for r, (i, w) in enumerate(rs)])
    torch.cuda.synchronize()
    gu, dn = gu.cpu(), dn.cpu()
    uniq = sum(len(set(i.reshape(-1).tolist()) - {-1}) for i, _ in rs) / bg.ROT
    nbytes = int(uniq * (c.gu_bytes + c.dn_bytes))
    pairs = []
    for r in range(2, bg.ROT - 1):
        g, d, g_next = gu[r], dn[r], gu[r + 1]
        t0 = g[:, 0].min().item()
        first_end = g[:, 3].min().item()
        wave2 = g[:, 0] > first_end - 1            # started after some gate_up program had finished
        busy = g[:, 3] - g[:, 1]
        p = {"pair": r,
             "gate_up": {"start": pcts(g[:, 0] - t0), "after_wait": pcts(g[:, 1] - t0),
                         "loaded": pcts(g[:, 2] - t0), "end": pcts(g[:, 3] - t0),
                         "wait_to_loaded": pcts(g[:, 2] - g[:, 1]), "loaded_to_end": pcts(g[:, 3] - g[:, 2]),
                         "wave2_programs": int(wave2.sum()), "wave1_span": pcts(busy[~wave2]),
                         "wave2_span": pcts(busy[wave2]) if wave2.any() else None,
                         "sms": int(g[:, 4].unique().numel())},
             "down": {"start": pcts(d[:, 0] - t0), "loaded": pcts(d[:, 2] - t0), "after_wait": pcts(d[:, 1] - t0),
                      "end": pcts(d[:, 3] - t0), "after_wait_to_end": pcts(d[:, 3] - d[:, 1]),
                      "sms": int(d[:, 4].unique().numel())},
             "pair_span_us": round((d[:, 3].max().item() - t0) / 1e3, 2),
             "down_wait_over_after_last_gate_up_us": round((d[:, 1].min() - g[:, 3].max()).item() / 1e3, 2),
             "down_after_last_gate_up_us": round((d[:, 3].max() - g[:, 3].max()).item() / 1e3, 2),
             "next_gate_up_go_after_down_us": round((g_next[:, 1].min() - d[:, 3].max()).item() / 1e3, 2),
             "occupancy_gate_up_250ns": occupancy(g[:, 0], g[:, 3], t0),
             "occupancy_down_250ns": occupancy(d[:, 0], d[:, 3], t0)}
        pairs.append(p)
    res = {"fmt": fmt, "variant": variant or tm.variant_of(fmt, None), "pair_us": round(plain, 2),
           "pair_us_traced": round(traced, 2), "MB": round(nbytes / 1e6, 2), "pairs": pairs}
    bg.log(json.dumps({k: v for k, v in res.items() if k != "pairs"}))
    for p in pairs[:3]:
        bg.log(json.dumps(p))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default="Q4_0")
    ap.add_argument("--variant", default=None, help="tm.moe_decode's variant (default: the format's)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gen, cgen = torch.Generator().manual_seed(0), torch.Generator(device=bg.DEV).manual_seed(0)
    res = [timeline(f, a.variant, gen, cgen) for f in a.fmt.split(",")]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
