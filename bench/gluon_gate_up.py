"""Experiment for #4 (not used by the engine): Q4_0 gate_up and down at T=1 as Gluon kernels that stream the weights
through a ring of shared-memory stages filled by TMA, in about one persistent program an SM (docs/perf-log.md,
session 31, Next item 1). Triton's own pipeliner copied the broadcast activation loads into shared memory as well
and was 2.7-25x slower (session 31, item 2); here only the weight tiles go through shared memory and x stays in
registers. Run on the H200 in session 32: the values are wrong (relative error ~1) and even as a stream gate_up is
no faster than v5pdl's (6.19 us alone against 6.50 with its quantizer; read ceiling 4.6): kept as the record, not
developed (perf-log session 32, item 1).

    python bench/gluon_gate_up.py --compile    # no GPU: compile both kernels for sm_90, print their shared memory
    python bench/gluon_gate_up.py              # H200: check against v5pdl's gate_up and pair, time them (graph replays)

A program takes items (pair, 8 rows of h): the 8 gate rows and the 8 matching up rows of the pair's slot, 16 x 1 KB of
q words and their fp16 block scales, one TMA stage; NS stages in flight; h = silu(gate) * up as float32 (rounded to x's
dtype, as gate_up_v5's), without its int8 copy (a first test of the streaming alone). Down: items of 16 rows of D over
all k experts, one stage an expert (its rows padded to 32 blocks by TMA's zero fill), h's int8 copy from `quantize`;
the pair is then v5pdl's four launches (x quantizer, gate_up, h quantizer, down) without PDL.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

R = 8           # rows of gate (and of up) an item
NB = 64         # Q4_0 blocks a row of D = 2048
W = 4 * NB      # int32 q words a row


@gluon.jit
def _dp4a(a, b, c):
    return gl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _issue(j, pid, q_desc, d_desc, ids_ptr, bars, qg, qu, dg, du, I: gl.constexpr, NRB: gl.constexpr,
           NPROG: gl.constexpr, NS: gl.constexpr, RR: gl.constexpr):
    """TMA loads of this program's j-th item (item pid + j * NPROG) into stage j % NS."""
    item = pid + j * NPROG
    p = item // NRB
    r0 = (item % NRB) * RR
    s = gl.maximum(gl.load(ids_ptr + p), 0)        # a skipped pair (-1) loads slot 0; its h is not stored
    g0 = s * (2 * I) + r0
    st = j % NS
    bar = bars.index(st)
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 2 * d_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [g0, 0], bar, qg.index(st))
    tma.async_copy_global_to_shared(q_desc, [g0 + I, 0], bar, qu.index(st))
    tma.async_copy_global_to_shared(d_desc, [g0, 0], bar, dg.index(st))
    tma.async_copy_global_to_shared(d_desc, [g0 + I, 0], bar, du.index(st))


@gluon.jit
def _rows_dot(words, d, xl, xh, dx, xs, L3: gl.constexpr):
    """Q4_0 rows [RR, NB, 4] words (4 of a block in one thread) . x: [RR] float32 (v5's arithmetic)."""
    r = _dp4a((words >> 4) & 0x0F0F0F0F, xh, _dp4a(words & 0x0F0F0F0F, xl, gl.zeros_like(words)))
    bs = gl.sum(r, axis=2).to(gl.float32)                              # [RR, NB] integer sums, exact
    v = (bs * dx - 8.0 * xs) * d.to(gl.float32)
    return gl.sum(v, axis=1)


@gluon.jit
def gate_up_kernel(q_desc, d_desc, ids_ptr, xw_ptr, xd_ptr, xs_ptr, h_ptr, I: gl.constexpr, KTOP: gl.constexpr,
                   NS: gl.constexpr, NPROG: gl.constexpr, RR: gl.constexpr, NBK: gl.constexpr,
                   ROUND: gl.constexpr, num_warps: gl.constexpr):
    """grid (NPROG,): h[pair, n] = silu(gate row n . x) * (up row n . x) for the T=1 decode (pairs = KTOP), x as
    int8 words (xw_ptr: int32 [D / 4], `quantize`'s; xd / xs its scales per 32-block)."""
    NRB: gl.constexpr = I // RR
    NITEMS: gl.constexpr = KTOP * NRB
    pid = gl.program_id(0)
    n_mine = (NITEMS - pid + NPROG - 1) // NPROG
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [num_warps, 1, 1], [2, 1, 0])
    LB: gl.constexpr = gl.SliceLayout(2, L3)                           # [RR, NB]
    LR: gl.constexpr = gl.SliceLayout(1, LB)                           # [RR]
    qg = gl.allocate_shared_memory(gl.int32, [NS, RR, 4 * NBK], q_desc.layout)
    qu = gl.allocate_shared_memory(gl.int32, [NS, RR, 4 * NBK], q_desc.layout)
    dg = gl.allocate_shared_memory(gl.float16, [NS, RR, NBK], d_desc.layout)
    du = gl.allocate_shared_memory(gl.float16, [NS, RR, NBK], d_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(bars.index(i), count=1)
    for j in gl.static_range(NS - 1):                                  # the ring's first stages
        if j < n_mine:
            _issue(j, pid, q_desc, d_desc, ids_ptr, bars, qg, qu, dg, du, I, NRB, NPROG, NS, RR)
    # x once: word e of a block b (e < 4) meets x words 8b + e (low nibbles) and 8b + 4 + e (high)
    LX: gl.constexpr = gl.SliceLayout(0, L3)                           # [NB, 4]
    b2 = gl.arange(0, NBK, layout=gl.SliceLayout(1, LX))[:, None]
    e2 = gl.arange(0, 4, layout=gl.SliceLayout(0, LX))[None, :]
    xl = gl.load(xw_ptr + b2 * 8 + e2)[None, :, :]
    xh = gl.load(xw_ptr + b2 * 8 + 4 + e2)[None, :, :]
    bb = gl.arange(0, NBK, layout=gl.SliceLayout(0, LB))
    dx = gl.load(xd_ptr + bb)[None, :]
    xs = gl.load(xs_ptr + bb)[None, :]
    rows = gl.arange(0, RR, layout=LR)
    for j in range(n_mine):
        nxt = j + NS - 1
        if nxt < n_mine:
            gl.thread_barrier()                    # every warp has read stage nxt % NS (item j - 1) before it refills
            _issue(nxt, pid, q_desc, d_desc, ids_ptr, bars, qg, qu, dg, du, I, NRB, NPROG, NS, RR)
        st = j % NS
        mbarrier.wait(bars.index(st), (j // NS) & 1)
        g = _rows_dot(qg.index(st).reshape([RR, NBK, 4]).load(L3), dg.index(st).load(LB), xl, xh, dx, xs, L3)
        u = _rows_dot(qu.index(st).reshape([RR, NBK, 4]).load(L3), du.index(st).load(LB), xl, xh, dx, xs, L3)
        h = g / (1.0 + gl.exp(-g)) * u
        if ROUND == 1:
            h = h.to(gl.bfloat16).to(gl.float32)
        item = pid + j * NPROG
        p = item // NRB
        ok = gl.load(ids_ptr + p) >= 0
        gl.store(h_ptr + p * I + (item % NRB) * RR + rows, h, mask=(rows >= 0) & ok)
    for i in gl.static_range(NS):
        mbarrier.invalidate(bars.index(i))


RD = 16         # rows of D a down item
NBD = 32        # down's blocks a row, padded to a power of two (I = 768: 24; TMA fills the rest with zeros)


@gluon.jit
def _issue_down(t, pid, q_desc, d_desc, ids_ptr, bars, qb, db, D: gl.constexpr, KTOP: gl.constexpr,
                NPROG: gl.constexpr, NS: gl.constexpr, RR: gl.constexpr):
    """TMA loads of this program's t-th stage (item pid + (t // KTOP) * NPROG, expert t % KTOP) into stage t % NS."""
    item = pid + (t // KTOP) * NPROG
    s = gl.maximum(gl.load(ids_ptr + t % KTOP), 0)
    st = t % NS
    bar = bars.index(st)
    mbarrier.expect(bar, q_desc.block_type.nbytes + d_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [s * D + item * RR, 0], bar, qb.index(st))
    tma.async_copy_global_to_shared(d_desc, [s * D + item * RR, 0], bar, db.index(st))


@gluon.jit
def down_kernel(q_desc, d_desc, ids_ptr, w_ptr, hw_ptr, hd_ptr, hs_ptr, out_ptr, D: gl.constexpr, I: gl.constexpr,
                KTOP: gl.constexpr, NS: gl.constexpr, NPROG: gl.constexpr, RR: gl.constexpr, NBK: gl.constexpr,
                num_warps: gl.constexpr):
    """grid (NPROG,): out[n] = sum_j w[j] * (down_j row n . h[j]) for the T=1 decode, h as int8 words (hw_ptr: int32
    [KTOP, I / 4], `quantize`'s; hd / hs its scales per 32-block). An item is RR rows of D over all KTOP experts, one
    TMA stage an expert, accumulated in registers (no atomics)."""
    NITEMS: gl.constexpr = D // RR
    NBR: gl.constexpr = I // 32                                        # real blocks a row (NBK: padded)
    pid = gl.program_id(0)
    n_mine = (NITEMS - pid + NPROG - 1) // NPROG
    n_st = n_mine * KTOP
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [num_warps, 1, 1], [2, 1, 0])
    LB: gl.constexpr = gl.SliceLayout(2, L3)
    LR: gl.constexpr = gl.SliceLayout(1, LB)
    LX: gl.constexpr = gl.SliceLayout(0, L3)
    qb = gl.allocate_shared_memory(gl.int32, [NS, RR, 4 * NBK], q_desc.layout)
    db = gl.allocate_shared_memory(gl.float16, [NS, RR, NBK], d_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(bars.index(i), count=1)
    for t in gl.static_range(NS - 1):
        if t < n_st:
            _issue_down(t, pid, q_desc, d_desc, ids_ptr, bars, qb, db, D, KTOP, NPROG, NS, RR)
    b2 = gl.arange(0, NBK, layout=gl.SliceLayout(1, LX))[:, None]
    e2 = gl.arange(0, 4, layout=gl.SliceLayout(0, LX))[None, :]
    mx = (b2 < NBR) & (e2 >= 0)
    bb = gl.arange(0, NBK, layout=gl.SliceLayout(0, LB))
    rows = gl.arange(0, RR, layout=LR)
    acc = gl.zeros([RR], gl.float32, LR)
    for t in range(n_st):
        nxt = t + NS - 1
        if nxt < n_st:
            gl.thread_barrier()
            _issue_down(nxt, pid, q_desc, d_desc, ids_ptr, bars, qb, db, D, KTOP, NPROG, NS, RR)
        j = t % KTOP
        xl = gl.load(hw_ptr + j * (I // 4) + b2 * 8 + e2, mask=mx, other=0)[None, :, :]
        xh = gl.load(hw_ptr + j * (I // 4) + b2 * 8 + 4 + e2, mask=mx, other=0)[None, :, :]
        dx = gl.load(hd_ptr + j * NBR + bb, mask=bb < NBR, other=0.0)[None, :]
        xs = gl.load(hs_ptr + j * NBR + bb, mask=bb < NBR, other=0.0)[None, :]
        wj = gl.where(gl.load(ids_ptr + j) >= 0, gl.load(w_ptr + j).to(gl.float32), 0.0)
        st = t % NS
        mbarrier.wait(bars.index(st), (t // NS) & 1)
        acc += wj * _rows_dot(qb.index(st).reshape([RR, NBK, 4]).load(L3), db.index(st).load(LB), xl, xh, dx, xs,
                              L3)
        if j == KTOP - 1:
            item = pid + (t // KTOP) * NPROG
            gl.store(out_ptr + item * RR + rows, acc.to(out_ptr.dtype.element_ty))
            acc = gl.zeros([RR], gl.float32, LR)
    for i in gl.static_range(NS):
        mbarrier.invalidate(bars.index(i))


def _tma(t: torch.Tensor, rows: int, cols: int):
    """A TMA descriptor of plane t ([slots, rows of the matrix, .], contiguous) as a [slots x rows, .] matrix, boxes
    of rows x cols (cols past a row's end read as zeros)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    if not t.is_contiguous():
        raise ValueError("gluon_gate_up reads contiguous planes (a [slots x rows, .] view for TMA)")
    t2 = t.view(-1, t.shape[-1])
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * t.element_size(), rank=2)
    return TensorDescriptor.from_tensor(t2, [rows, cols], layout)


def down_descriptors(q: torch.Tensor, d: torch.Tensor):
    """TMA descriptors of the down planes (q int32 [slots, D, I / 8], d fp16 [slots, D, I / 32]), boxes of RD rows x
    the padded row (4 NBD words, NBD scales: TMA fills past the row with zeros)."""
    return _tma(q, RD, 4 * NBD), _tma(d, RD, NBD)


def launch_down(hq, ids, w, q, d, out, nprog: int, ns: int, warps: int = 4, descs=None):
    qd, dd = descs or down_descriptors(q, d)
    dim, i = out.shape[1], hq[0].shape[1]
    down_kernel[(min(nprog, dim // RD),)](qd, dd, ids, w, hq[0].view(torch.int32), hq[1], hq[2], out, D=dim, I=i,
                                          KTOP=ids.numel(), NS=ns, NPROG=min(nprog, dim // RD), RR=RD, NBK=NBD,
                                          num_warps=warps)
    return out


def descriptors(q: torch.Tensor, d: torch.Tensor):
    """TMA descriptors of the gate_up planes (q int32 words [slots, 2I, W], d fp16 [slots, 2I, NB]), boxes of R
    whole rows."""
    return _tma(q, R, q.shape[-1]), _tma(d, R, d.shape[-1])


def launch(xq, ids, q, d, h, nprog: int, ns: int, rnd: int, warps: int = 4, descs=None):
    qd, dd = descs or descriptors(q, d)
    i, k = h.shape[1], ids.numel()
    gate_up_kernel[(nprog,)](qd, dd, ids, xq[0].view(torch.int32), xq[1], xq[2], h, I=i, KTOP=k, NS=ns, NPROG=nprog,
                             RR=R, NBK=NB, ROUND=rnd, num_warps=warps)
    return h


def compile_only(ns: int, nprog: int) -> dict:
    """sm_90 builds of both kernels without a GPU: the argument types from CPU stand-ins."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    def build(fn, descs: dict, const: dict, floats: tuple) -> int:
        sig = {n: "constexpr" if n in const else mangle_type(descs[n]) if n in descs else
               "*bf16" if n == "out_ptr" else "*fp32" if n in floats else "*i32" for n in fn.arg_names}
        src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
        return int(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).metadata.shared)
    slots, i = 4, 768
    qd, dd = descriptors(torch.zeros(slots, 2 * i, W, dtype=torch.int32),
                         torch.zeros(slots, 2 * i, NB, dtype=torch.float16))
    gate_up = build(gate_up_kernel, {"q_desc": qd, "d_desc": dd},
                    dict(I=i, KTOP=8, NS=ns, NPROG=nprog, RR=R, NBK=NB, ROUND=1, num_warps=4),
                    ("xd_ptr", "xs_ptr", "h_ptr"))
    qd, dd = down_descriptors(torch.zeros(slots, 2048, i // 8, dtype=torch.int32),
                              torch.zeros(slots, 2048, i // 32, dtype=torch.float16))
    down = build(down_kernel, {"q_desc": qd, "d_desc": dd},
                 dict(D=2048, I=i, KTOP=8, NS=ns, NPROG=128, RR=RD, NBK=NBD, num_warps=4),
                 ("hd_ptr", "hs_ptr", "w_ptr"))
    return {"ns": ns, "nprog": nprog, "gate_up_shared": gate_up, "down_shared": down}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="no GPU: compile for sm_90 only")
    ap.add_argument("--ns", default="3,4,6")
    ap.add_argument("--nprog", default="132,264")
    a = ap.parse_args()
    if a.compile:
        for ns in map(int, a.ns.split(",")):
            print(json.dumps(compile_only(ns, 132)))
        return 0
    return run_gpu([int(s) for s in a.ns.split(",")], [int(p) for p in a.nprog.split(",")])


def run_gpu(stages, nprogs) -> int:
    """Against the shipped v5 gate_up (decode_gate_up, variant v5pdl: the same x quantizer launch, h in float32), on
    bench_gpu_kernels' Q4_0 cases: max error, then per-call graph-replay time of each over ROT routings."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_gpu_kernels as bk
    from moetier.kernels import triton_decode_q8 as q8
    from moetier.kernels import triton_moe as tm
    gen = torch.Generator().manual_seed(0)
    c = bk.Case("qwen3-30b-a3b", "Q4_0", torch.Generator(device=bk.DEV).manual_seed(0))
    q, d = c.gw.v2_planes[0], c.gw.v2_planes[1]
    descs = descriptors(q, d)
    rs = bk.routings(1, c.k, c.slots, gen)
    x = torch.randn(1, c.d, generator=gen).to(bk.DEV, bk.XDT)
    xq = q8.quantize(x)
    rnd = q8.ROUND.get(x.dtype, 0)
    out = []
    h_ref = torch.empty(c.k, c.i, device=bk.DEV)
    h = torch.empty_like(h_ref)
    ids0 = rs[0][0].reshape(-1).contiguous()
    tm.decode_gate_up(x, ids0, c.gw, c.code, c.act.alpha, c.act.limit, None, h_ref, variant="v5pdl")
    ref_us = bk.graph_us([lambda ids=ids.reshape(-1).contiguous(): tm.decode_gate_up(
        x, ids, c.gw, c.code, c.act.alpha, c.act.limit, None, h_ref, variant="v5pdl") for ids, _ in rs])
    uniq = sum(len(set(i.reshape(-1).tolist()) - {-1}) for i, _ in rs) / len(rs)
    nbytes = int(uniq * c.gu_bytes)
    out.append({"kernel": "v5pdl gate_up (with its x quantizer)", "us": round(ref_us, 2), "MB": round(nbytes / 1e6, 2),
                "read_ceiling_us": bk.read_ceiling_us(nbytes)})
    for ns in stages:
        for nprog in nprogs:
            try:
                launch(xq, ids0, q, d, h, nprog, ns, rnd, descs=descs)
                err = ((h - h_ref).abs().max() / h_ref.abs().max()).item()
                us = bk.graph_us([lambda ids=ids.reshape(-1).contiguous(): (
                    q8.quantize(x), launch(xq, ids, q, d, h, nprog, ns, rnd, descs=descs)) for ids, _ in rs])
                alone = bk.graph_us([lambda ids=ids.reshape(-1).contiguous(): launch(
                    xq, ids, q, d, h, nprog, ns, rnd, descs=descs) for ids, _ in rs])
                r = {"kernel": "gluon gate_up (with the x quantizer)", "ns": ns, "nprog": nprog, "us": round(us, 2),
                     "alone_us": round(alone, 2), "max_rel_err": round(err, 6)}
            except Exception as e:  # noqa: BLE001 (report, go on)
                r = {"kernel": "gluon gate_up", "ns": ns, "nprog": nprog, "error": f"{type(e).__name__}: {e}"[:300]}
            out.append(r)
            print(r, file=sys.stderr, flush=True)
    # the pair: x quantizer, gate_up, h quantizer, down (v5pdl's four launches, here without PDL) against v5pdl's pair
    qdn, ddn = c.dw.v2_planes[0], c.dw.v2_planes[1]
    ddescs = down_descriptors(qdn, ddn)
    y_ref = torch.empty_like(x)
    y = torch.empty_like(x)
    ids0, w0 = rs[0][0].reshape(-1).contiguous(), rs[0][1].reshape(-1).contiguous()
    tm.moe_decode(x, rs[0][0], rs[0][1], c.gw, c.dw, c.code, c.act.alpha, c.act.limit, out=y_ref, variant="v5pdl")
    pair_ref = bk.graph_us([lambda i=i, w=w: tm.moe_decode(x, i, w, c.gw, c.dw, c.code, c.act.alpha, c.act.limit,
                                                           out=y_ref, variant="v5pdl") for i, w in rs])
    pb = int(uniq * (c.gu_bytes + c.dn_bytes))
    copy_bw = bk.hbm_copy_GBps()
    out.append({"kernel": "v5pdl pair", "us": round(pair_ref, 2), "MB": round(pb / 1e6, 2),
                "read_ceiling_us": bk.read_ceiling_us(pb)})

    def gpair(i, w, ns, nprog):
        launch(q8.quantize(x), i, q, d, h, nprog, ns, rnd, descs=descs)
        return launch_down(q8.quantize(h), i, w, qdn, ddn, y, nprog, ns, descs=ddescs)
    for ns in stages:
        for nprog in nprogs:
            try:
                gpair(ids0, w0, ns, nprog)
                err = ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()
                us = bk.graph_us([lambda i=i.reshape(-1).contiguous(), w=w.reshape(-1).contiguous(): gpair(
                    i, w, ns, nprog) for i, w in rs])
                r = {"kernel": "gluon pair", "ns": ns, "nprog": nprog, "us": round(us, 2),
                     "frac_of_copy": round(pb / (us * 1e-6) / 1e9 / copy_bw, 3), "max_rel_err": round(err, 6)}
            except Exception as e:  # noqa: BLE001 (report, go on)
                r = {"kernel": "gluon pair", "ns": ns, "nprog": nprog, "error": f"{type(e).__name__}: {e}"[:300]}
            out.append(r)
            print(r, file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
