"""The graph-safe tiered decode step's pieces (kernels/doorbell.py, doorbell.c), on the CPU.

A thread stands in for the GPU: it writes each layer's request into the host buffers and rings
its bell; MissServer.serve answers from expert weights in RAM. Then the Triton ring / wait_add
kernels themselves (interpreted on CPU) around the experts op, with the server on a thread."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from moetier.kernels import doorbell as db
from moetier.kernels import ops
from moetier.kernels.ops import Act
from moetier.quant.formats import dequantize, get_format
from moetier.quant.pack import quantize

L, E, D, I, K = 3, 6, 256, 256, 4      # Q4_K rows need multiples of 256


def experts(qtype: str, seed: int = 0):
    """[L][E] gate_up [2I, D] / down [D, I] in the storage format, and their float32 values.
    qtype "A+B": gate_up in A, down in B (as llama.cpp's Q4_K_M: Q4_K+Q6_K); then tid is (A id, B id)."""
    if "+" in qtype:
        gq, dq = qtype.split("+")
        s_gu, _, f_gu, _, gid = experts(gq, seed)
        _, s_dn, _, f_dn, did = experts(dq, seed)
        return s_gu, s_dn, f_gu, f_dn, (gid, did)
    g = torch.Generator().manual_seed(seed)
    gu = [[torch.randn(2 * I, D, generator=g) * 0.1 for _ in range(E)] for _ in range(L)]
    dn = [[torch.randn(D, I, generator=g) * 0.1 for _ in range(E)] for _ in range(L)]
    if qtype in ("F32", "BF16", "F16"):
        dt = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[qtype]
        store = lambda t: t.to(dt)                                        # noqa: E731
        value = lambda t: t.float()                                       # noqa: E731
        tid = db.GGML_IDS[dt]
    else:
        store = lambda t: quantize(t, qtype)                              # noqa: E731
        value = lambda t: dequantize(t, qtype, (t.shape[0], t.shape[1] // get_format(qtype).type_size  # noqa: E731
                                                * get_format(qtype).block_size))
        tid = get_format(qtype).type_id
    s_gu = [[store(t) for t in row] for row in gu]
    s_dn = [[store(t) for t in row] for row in dn]
    return s_gu, s_dn, [[value(t) for t in row] for row in s_gu], [[value(t) for t in row] for row in s_dn], tid


def reference(x, ids, w, slots, gu, dn, act):
    y = torch.zeros(D)
    for j in range(K):
        if slots[j] < 0:
            e = int(ids[j])
            gate, up = (gu[e] @ x).chunk(2)
            y += w[j] * (dn[e] @ act(gate, up))
    return y


@pytest.mark.parametrize("qtype,q8", [("F32", False), ("BF16", False), ("F16", False), ("Q8_0", False),
                                      ("Q4_0", False), ("Q4_K", False), ("Q8_0", True), ("Q4_0", True),
                                      ("Q5_K", False), ("Q6_K", False), ("Q4_K+Q6_K", False), ("Q4_0+Q6_K", True),
                                      ("MXFP4", False), ("IQ3_XXS", False), ("IQ3_XXS+Q4_K", False),
                                      ("MXFP4", True), ("IQ3_XXS", True), ("IQ3_XXS+Q4_K", True),
                                      ("Q4_K+Q6_K", True), ("Q5_K", True), ("Q2_K+Q3_K", False), ("Q2_K+Q3_K", True)])
@pytest.mark.parametrize("act", [Act(), Act("clamped_swiglu", 1.702, 0.3)])
def test_miss_server_answers_every_layer(qtype, q8, act):
    """Float activations: float32 rounding of the reference. int8 activations (q8, one scale per 32
    values as llama.cpp quantizes them): within 3% of the output's largest value (measured 0.8-1.2%)."""
    s_gu, s_dn, f_gu, f_dn, tid = experts(qtype)
    req = db.Requests(L, D, K, pin=False)
    srv = db.MissServer(req, s_gu, s_dn, tid, D, I, act, threads=2, q8_act=q8)
    g = torch.Generator().manual_seed(1)
    for seq in (1, 2):              # two steps: the bells are compared with the step number
        def gpu():
            for li in range(L):
                req.x[li] = torch.randn(D, generator=g)
                req.ids[li] = torch.randperm(E, generator=g)[:K].int()
                req.w[li] = torch.rand(K, generator=g)
                req.slots[li] = torch.tensor([[-1, 3, -1, -1], [0, 1, 2, 3], [-1, -1, -1, -1]][li], dtype=torch.int32)
                req.bell[li * db.BELL_STRIDE] = seq
        req.y.fill_(float("nan"))
        th = threading.Thread(target=gpu)
        th.start()
        busy, wait, n = srv.serve(seq)
        th.join()
        assert n == 3 + 0 + 4
        # layer 0 answered -> layer 1's bell is the one pair (layer 1 has no misses: nothing to answer; here
        # all bells ring at once, so the round trip, positive behind a GPU, may be ~0 or below)
        round_s, pairs, prep = srv.detail
        assert pairs == 1 and abs(round_s) < 1.0 and 0.0 <= prep < busy + wait + 1.0
        for li in (0, 2):
            assert int(req.done[li * db.BELL_STRIDE]) == seq
            want = reference(req.x[li], req.ids[li], req.w[li], req.slots[li], f_gu[li], f_dn[li], act)
            err = ((req.y[li] - want).abs().max() / want.abs().max()).item()
            assert err <= (3e-2 if q8 else 2e-5), (qtype, q8, err)
        assert int(req.done[1 * db.BELL_STRIDE]) != seq       # no misses: no answer, the GPU does not wait
        # every layer's row as served, for the bookkeeping (the next replay rewrites req's rows)
        assert torch.equal(srv.log_ids, req.ids) and torch.equal(srv.log_slots, req.slots)
        assert torch.equal(srv.log_w, req.w)


@pytest.mark.parametrize("qtype,q8", [("F32", False), ("BF16", False), ("MXFP4", False), ("MXFP4", True),
                                      ("Q8_0", True)])
def test_miss_server_adds_expert_biases(qtype, q8):
    """gpt-oss experts carry biases: gate_up's [2I] before the (clamped) activation, down's [D] on each
    expert's output before its routing weight. Same tolerances as without biases."""
    act = Act("clamped_swiglu", 1.702, 7.0)
    s_gu, s_dn, f_gu, f_dn, tid = experts(qtype, seed=11)
    g = torch.Generator().manual_seed(12)
    b_gu = [[torch.randn(2 * I, generator=g) for _ in range(E)] for _ in range(L)]
    b_dn = [[torch.randn(D, generator=g) * 0.1 for _ in range(E)] for _ in range(L)]
    req = db.Requests(L, D, K, pin=False)
    srv = db.MissServer(req, s_gu, s_dn, tid, D, I, act, threads=2, q8_act=q8, biases=(b_gu, b_dn))
    req.x[:] = torch.randn(L, D, generator=g)
    req.ids[:] = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L)]).int()
    req.w[:] = torch.rand(L, K, generator=g)
    req.slots[:] = torch.tensor([-1, 2, -1, -1], dtype=torch.int32)
    req.y.fill_(float("nan"))
    req.bell[::db.BELL_STRIDE] = 1
    assert srv.serve(1)[2] == L * 3
    for li in range(L):
        want = torch.zeros(D)
        for j in range(K):
            if req.slots[li, j] < 0:
                e = int(req.ids[li, j])
                gate, up = (f_gu[li][e] @ req.x[li] + b_gu[li][e]).chunk(2)
                want += req.w[li, j] * (f_dn[li][e] @ act(gate, up) + b_dn[li][e])
        err = ((req.y[li] - want).abs().max() / want.abs().max()).item()
        assert err <= (3e-2 if q8 else 2e-5), (qtype, q8, err)


def test_miss_server_rejects_bad_biases():
    s_gu, s_dn, _, _, tid = experts("F32")
    req = db.Requests(L, D, K, pin=False)
    bad = [[torch.zeros(2 * I, dtype=torch.bfloat16) for _ in range(E)] for _ in range(L)]
    with pytest.raises(ValueError, match="contiguous float32"):
        db.MissServer(req, s_gu, s_dn, tid, D, I, Act(), threads=1, biases=(bad, None))


@pytest.mark.parametrize("q8", [False, True])
def test_miss_server_formats_per_layer(q8):
    """Q4_K_M: gate_up Q4_K in every layer, down Q4_K in layer 0 and Q6_K in layers 1, 2 (row bytes
    differ per layer): one [L, 2] table of type ids; float activations: float32 rounding; int8 (cpu_kq_q8.c): 3%."""
    gu, dn4, f_gu, f_dn4, (gid, d4) = experts("Q4_K+Q4_K")
    _, dn6, _, f_dn6, (_, d6) = experts("Q4_K+Q6_K")
    s_dn, f_dn = [dn4[0], dn6[1], dn6[2]], [f_dn4[0], f_dn6[1], f_dn6[2]]
    req = db.Requests(L, D, K, pin=False)
    srv = db.MissServer(req, gu, s_dn, [(gid, d4), (gid, d6), (gid, d6)], D, I, Act(), threads=2, q8_act=q8)
    g = torch.Generator().manual_seed(4)
    req.x[:] = torch.randn(L, D, generator=g)
    req.ids[:] = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L)]).int()
    req.w[:] = torch.rand(L, K, generator=g)
    req.slots[:] = -1
    req.y.fill_(float("nan"))
    req.bell[::db.BELL_STRIDE] = 1
    assert srv.serve(1)[2] == L * K
    for li in range(L):
        want = reference(req.x[li], req.ids[li], req.w[li], req.slots[li], f_gu[li], f_dn[li], Act())
        assert ((req.y[li] - want).abs().max() / want.abs().max()).item() <= (3e-2 if q8 else 2e-5)


def test_miss_server_times_out_with_a_clear_error():
    s_gu, s_dn, _, _, tid = experts("F32")
    req = db.Requests(L, D, K, pin=False)
    srv = db.MissServer(req, s_gu, s_dn, tid, D, I, Act(), threads=1, timeout_s=0.05)
    with pytest.raises(RuntimeError, match="MoE layer 0 never rang its doorbell"):
        srv.serve(7)


def test_a_step_may_wait_longer_for_its_bells():
    """An eager warm-up step compiles kernels between bells (10 s passed on a cold Triton cache): serve(seq,
    timeout_s) waits that long for this step only; the next step has the server's timeout again."""
    import threading
    s_gu, s_dn, _, _, tid = experts("F32")
    req = db.Requests(L, D, K, pin=False)
    srv = db.MissServer(req, s_gu, s_dn, tid, D, I, Act(), threads=1, timeout_s=0.05)
    g = torch.Generator().manual_seed(5)
    req.x[:] = torch.randn(L, D, generator=g)
    req.ids[:] = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L)]).int()
    req.w[:] = torch.rand(L, K, generator=g)
    req.slots[:] = -1
    late = threading.Timer(0.3, lambda: req.bell[::db.BELL_STRIDE].fill_(1))
    late.start()
    assert srv.serve(1, timeout_s=30.0)[2] == L * K
    late.join()
    assert srv.ctx.timeout_ns == int(0.05 * 1e9)
    with pytest.raises(RuntimeError, match="never rang its doorbell within 0 s"):
        srv.serve(2)


def test_missing_ram_pointer_is_an_error():
    s_gu, s_dn, _, _, tid = experts("F32")
    s_gu[1][2] = None
    s_dn[1][2] = None
    req = db.Requests(L, D, K, pin=False)
    srv = db.MissServer(req, s_gu, s_dn, tid, D, I, Act(), threads=1, timeout_s=1.0)
    req.ids[:] = torch.tensor([2, 0, 1, 3], dtype=torch.int32)
    req.slots[:] = -1
    req.bell[::db.BELL_STRIDE] = 1
    with pytest.raises(RuntimeError, match="not in the RAM bank"):
        srv.serve(1)


def interpreted(monkeypatch, seed: int):
    """F32 experts, the request buffers and a 2-thread server, with the Triton kernels interpreted."""
    if torch.cuda.is_available():
        pytest.skip("the interpreted variant runs on CPU-only machines; tests/test_memory_gpu.py covers CUDA")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    s_gu, s_dn, f_gu, f_dn, tid = experts("F32", seed=seed)
    req = db.Requests(L, D, K, pin=False)
    return s_gu, s_dn, f_gu, f_dn, req, db.MissServer(req, s_gu, s_dn, tid, D, I, Act(), threads=2)


def dense(x, ids, w, gu, dn):
    """All k experts of one token in float32."""
    return sum(w[j] * (dn[e] @ Act()(*(gu[e] @ x).chunk(2))) for j, e in enumerate(ids.tolist()))


@pytest.mark.skipif(db.triton is None, reason="needs triton (interpreted on CPU)")
def test_ring_hits_wait_add_round_trip(monkeypatch):
    """The Triton kernels on CPU tensors (interpreter): ring -> experts op over 'GPU' slots -> wait_add,
    with the C server on a thread, equals the dense computation of all k experts."""
    s_gu, s_dn, f_gu, f_dn, req, srv = interpreted(monkeypatch, seed=3)
    g = torch.Generator().manual_seed(5)
    # the 'GPU' cache holds experts 0 and 4 of every layer in slots 2 * li, 2 * li + 1
    table = torch.full((L, E), -1, dtype=torch.int32)
    arena_gu, arena_dn = torch.zeros(2 * L, 2 * I, D), torch.zeros(2 * L, D, I)
    for li in range(L):
        for j, e in enumerate((0, 4)):
            table[li, e] = 2 * li + j
            arena_gu[2 * li + j], arena_dn[2 * li + j] = f_gu[li][e], f_dn[li][e]
    seq = torch.zeros(1, dtype=torch.int64)
    slots = torch.zeros(L, K, dtype=torch.int64)
    xs = [torch.randn(1, D, generator=g) for _ in range(L)]
    ids = [torch.tensor([[0, 1, 4, 5]]), torch.tensor([[4, 0, 2, 3]]), torch.tensor([[0, 4, 1, 2]])]
    ws = [torch.rand(1, K, generator=g) for _ in range(L)]
    server = threading.Thread(target=srv.serve, args=(1,))
    server.start()
    outs = []
    for li in range(L):
        db.ring(xs[li], ids[li], ws[li], table[li], seq, slots[li], req, li, bump=li == 0)
        hits = ops.moe_decode(xs[li], slots[li].view(1, K), ws[li], arena_gu, arena_dn, Act(), fmt="f32")
        out = torch.full_like(xs[li], float("nan"))
        db.wait_add(hits, slots[li], seq, req, li, out, max_spin=1 << 30)
        outs.append(out)
    server.join()
    assert int(seq) == 1 and int(req.err[0]) == 0
    for li in range(L):
        want = dense(xs[li][0], ids[li][0], ws[li][0], f_gu[li], f_dn[li])
        torch.testing.assert_close(outs[li][0], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert slots[li].tolist() == table[li][ids[li][0]].tolist()


@pytest.mark.skipif(db.triton is None, reason="needs triton (interpreted on CPU)")
@pytest.mark.parametrize("normalize", [True, False])
def test_route_ring_is_the_router_then_the_ring(monkeypatch, normalize):
    """The router's last program rings the doorbell (route_ring, one launch) and wait_add adds the block's residual:
    the same ids, weights, device slots, host request rows, bell and output as router_topk, ring, wait_add and
    `residual + out` in four launches (interpreted, float32: bit for bit)."""
    from moetier.kernels import triton_small
    s_gu, s_dn, f_gu, f_dn, req, srv = interpreted(monkeypatch, seed=11)
    g = torch.Generator().manual_seed(12)
    table = torch.full((L, E), -1, dtype=torch.int32)
    table[:, 2] = torch.arange(L, dtype=torch.int32)         # expert 2 of every layer cached in slot li
    arena_gu, arena_dn = torch.zeros(L, 2 * I, D), torch.zeros(L, D, I)
    for li in range(L):
        arena_gu[li], arena_dn[li] = f_gu[li][2], f_dn[li][2]
    xs = [torch.randn(1, D, generator=g) for _ in range(L)]
    res = [torch.randn(1, D, generator=g) for _ in range(L)]
    gates = [torch.randn(E, D, generator=g) for _ in range(L)]
    runs = []
    for fused in (False, True):
        req.bell.zero_()
        req.done.zero_()
        seq = torch.zeros(1, dtype=torch.int64)
        slots = torch.full((L, K), 99, dtype=torch.int64)
        server = threading.Thread(target=srv.serve, args=(1,))
        server.start()
        outs, picks, rows = [], [], []
        for li in range(L):
            if fused:
                ids, w = db.route_ring(xs[li], gates[li], K, normalize, table[li], seq, slots[li], req, li, bump=li == 0)
            else:
                ids, w = triton_small.router_topk(xs[li], gates[li], K, normalize)
                db.ring(xs[li], ids, w, table[li], seq, slots[li], req, li, bump=li == 0)
            rows.append([t[li].clone() for t in (req.x, req.ids, req.w, req.slots)] + [int(req.bell[li * db.BELL_STRIDE])])
            hits = ops.moe_decode(xs[li], slots[li].view(1, K), w, arena_gu, arena_dn, Act(), fmt="f32")
            out = torch.full_like(xs[li], float("nan"))
            if fused:
                db.wait_add(hits, slots[li], seq, req, li, out, max_spin=1 << 30, residual=res[li])
            else:
                db.wait_add(hits, slots[li], seq, req, li, out, max_spin=1 << 30)
                out = res[li] + out
            outs.append(out)
            picks.append((ids.clone(), w.clone(), slots[li].clone()))
        server.join()
        assert int(seq) == 1 and int(req.err[0]) == 0
        runs.append((outs, picks, rows))
    (o0, p0, r0), (o1, p1, r1) = runs
    for li in range(L):
        assert torch.equal(o0[li], o1[li]) and torch.isfinite(o1[li]).all()
        assert all(torch.equal(a, b) for a, b in zip(p0[li], p1[li]))
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(r0[li], r1[li]))
        assert r1[li][-1] == 1 and r1[li][1].tolist() == p1[li][0][0].tolist()
        assert p1[li][2].tolist() == table[li][p1[li][0][0]].tolist()


@pytest.mark.skipif(db.triton is None, reason="needs triton (interpreted on CPU)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e,d,k", [(6, 256, 4), (128, 2048, 8)])
@pytest.mark.parametrize("normalize", [True, False])
def test_route_ring_add_norm_is_add_norm_then_route_ring(dtype, e, d, k, normalize):
    """route_ring_add_norm (the residual add + RMSNorm made by the router + ring launch) against add_rms_norm then
    route_ring: the same s, x, ids, w, device slots, host request rows (x, ids, w, slots) and bell, bit for bit, over
    L layers (layer 0 bumps seq), the host rows poisoned before each variant. On CPU interpreted (float32); on CUDA
    with pinned host rows, D >= 1024 (triton_small.router_add_norm_fits)."""
    from moetier.kernels import triton_small
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bfloat16 rounding (checked on CUDA)")
    if dev == "cuda" and not triton_small.router_add_norm_fits(e, d):
        pytest.skip("below 1024 add_rms_norm reduces over 1 warp: not bit for bit on CUDA, not used there")
    g = torch.Generator().manual_seed(e + d + normalize)
    req = db.Requests(L, d, k, pin=dev == "cuda")
    table = torch.full((L, e), -1, dtype=torch.int32)
    table[:, ::2] = torch.arange(L * ((e + 1) // 2), dtype=torch.int32).view(L, -1)     # even experts cached
    table = table.to(dev)
    hs = [(torch.randn(1, d, generator=g) * 3).to(dev, dtype) for _ in range(L)]
    as_ = [torch.randn(1, d, generator=g).to(dev, dtype) for _ in range(L)]
    nws = [(1 + 0.3 * torch.randn(d, generator=g)).to(dev, dtype) for _ in range(L)]
    gates = [(torch.randn(e, d, generator=g) * 1.5 / d ** 0.5).to(dev, dtype) for _ in range(L)]
    runs = []
    for fused in (False, True):
        for t, v in ((req.x, float("nan")), (req.w, float("nan")), (req.ids, -7), (req.slots, -7), (req.bell, 0)):
            t.fill_(v)
        seq = torch.zeros(1, dtype=torch.int64, device=dev)
        slots = torch.full((L, k), 99, dtype=torch.int64, device=dev)
        got = []
        for li in range(L):
            if fused:
                s, x, ids, w = db.route_ring_add_norm(hs[li], as_[li], nws[li], 1e-6, gates[li], k, normalize,
                                                      table[li], seq, slots[li], req, li, bump=li == 0)
            else:
                s, x = triton_small.add_rms_norm(hs[li], as_[li], nws[li], 1e-6)
                ids, w = db.route_ring(x, gates[li], k, normalize, table[li], seq, slots[li], req, li, bump=li == 0)
            if dev == "cuda":
                torch.cuda.synchronize()
            rows = [t[li].clone() for t in (req.x, req.ids, req.w, req.slots)]
            got.append([t.clone().cpu() for t in (s, x, ids, w, slots[li])] + rows
                       + [int(req.bell[li * db.BELL_STRIDE])])
        assert int(seq) == 1
        runs.append(got)
    for li, (a, b) in enumerate(zip(*runs)):
        assert all(torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v for u, v in zip(a, b)), li
        s, x, ids, w, sl, hx, hids, hw, hsl, bell = b
        assert torch.equal(s, (hs[li] + as_[li]).cpu()) and torch.equal(hx, x[0].float()) and bell == 1
        assert hids.tolist() == ids[0].tolist() and sl.tolist() == table[li].cpu()[ids[0]].tolist() == hsl.tolist()
        assert torch.equal(hw, w[0].float()) and torch.isfinite(x).all()


def q8_input(d: int, g: torch.Generator) -> torch.Tensor:
    """x [d] (d >= 256, a multiple of 32) for the int8 copy: random blocks at scales 1e-3 .. 1e3, block 1 all
    negative, blocks 2 and 3 at ties of x * (1 / d) (amax 127: d = 1, 2.5 -> 2, -0.5 -> 0; amax 254: d = 2,
    5 -> 2.5 -> 2, 7 -> 4), block 4 zeros (d = 0: q = 0), block 5 values whose x * (1 / d) rounds to another
    integer than x / d (the prep multiplies by 1 / d rounded once)."""
    scale = 10.0 ** torch.randint(-3, 4, (d // 32, 1), generator=g).float()
    x = (torch.randn(d // 32, 32, generator=g) * scale).view(-1)
    x[32:64] = -x[32:64].abs()
    ties = torch.arange(32) - 15.5
    x[64:96], x[64] = ties, 127.0
    x[96:128], x[96] = 2 * ties, -254.0
    x[128:160] = 0.0
    x[160:192] = torch.from_numpy(apart_from_division())
    return x


def apart_from_division() -> np.ndarray:
    """32 float32 values, amax 139.7 first, whose rint(x * (1 / d)) differs from rint(x / d) (d = amax / 127):
    near (n + 0.5) d, a few ulps apart, found by search."""
    f = np.float32
    amax = f(139.7)
    d = f(amax / f(127))
    inv = f(1) / d
    out = [amax]
    for n in range(-126, 126):
        x = f((n + 0.5) * np.float64(d))
        for _ in range(3):
            for y in (x, -x):
                if len(out) < 32 and abs(y) < amax and np.rint(y * inv) != np.rint(y / d):
                    out.append(y)
            x = np.nextafter(x, f(np.inf))
    assert len(out) == 32
    return np.array(out, dtype=np.float32)


@pytest.mark.skipif(db.triton is None, reason="needs triton (interpreted on CPU)")
@pytest.mark.parametrize("kernel", ["ring", "route_ring", "route_ring_add_norm"])
@pytest.mark.parametrize("d", [256, 2048])
def test_ring_writes_the_prep_int8_copy_of_x(kernel, d):
    """Requests.q8: every ring kernel writes x's int8 copy, scales and sums as the C server's prep makes them from the
    request's float x (doorbell.quantize_q8: moe_quantize_q8), bit for bit, for every layer; the float x as before.
    x with ties at .5 and blocks from 1e-3 to 1e3 (route_ring_add_norm: x is its own RMSNorm). Interpreted on CPU
    (the magic-number rounding), on CUDA with pinned rows (cvt.rni)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if db.quantize_q8(torch.ones(32)) is None:
        pytest.skip("the C kernels are built without int8 activations")
    e, k = 8, 4
    g = torch.Generator().manual_seed(d)
    req = db.Requests(L, d, k, pin=dev == "cuda", q8=True)
    req.qx.fill_(99)
    req.dx.fill_(float("nan"))
    req.sx.fill_(float("nan"))
    table = torch.tensor([0, -1, 1, -1, -1, 2, -1, -1], dtype=torch.int32, device=dev)
    seq = torch.zeros(1, dtype=torch.int64, device=dev)
    slots = torch.zeros(L, k, dtype=torch.int64, device=dev)
    xs = []
    for li in range(L):
        x = q8_input(d, g)[None].to(dev)
        gate = (torch.randn(e, d, generator=g) / d ** 0.5).to(dev)
        if kernel == "ring":
            db.ring(x, torch.tensor([[0, 3, 5, 6]], device=dev), torch.rand(1, k, generator=g).to(dev), table, seq,
                    slots[li], req, li, bump=li == 0)
        elif kernel == "route_ring":
            db.route_ring(x, gate, k, True, table, seq, slots[li], req, li, bump=li == 0)
        else:
            a, nw = torch.randn(1, d, generator=g).to(dev), (1 + torch.randn(d, generator=g)).to(dev)
            x = db.route_ring_add_norm(x, a, nw, 1e-6, gate, k, True, table, seq, slots[li], req, li,
                                       bump=li == 0)[1]
        xs.append(x)
    if dev == "cuda":
        torch.cuda.synchronize()
    for li in range(L):
        assert torch.equal(req.x[li], xs[li][0].float().cpu()), li
        qx, dx, sx = db.quantize_q8(req.x[li])
        assert torch.equal(req.qx[li], qx) and torch.equal(req.dx[li], dx) and torch.equal(req.sx[li], sx), li
        assert int(req.bell[li * db.BELL_STRIDE]) == 1
    if kernel != "route_ring_add_norm":      # the ties went to even; the zero block quantized to zeros
        assert req.qx[0, 64:96].tolist() == [127] + [round(v) for v in (torch.arange(1, 32) - 15.5).tolist()]
        assert req.qx[0, 96:128].tolist() == [-127] + [round(v) for v in (torch.arange(1, 32) - 15.5).tolist()]
        assert (req.qx[0, 128:160] == 0).all() and req.dx[0, 4] == 0 and req.sx[0, 4] == 0


def served_y(req, srv, ring_li) -> torch.Tensor:
    """y of step 1 after ring_li(li) wrote each layer's request (the bells ring): the server on this thread."""
    req.bell.zero_()
    req.y.fill_(float("nan"))
    for li in range(L):
        ring_li(li)
    srv.serve(1)
    return req.y.clone()


@pytest.mark.skipif(db.triton is None, reason="needs triton (interpreted on CPU)")
@pytest.mark.parametrize("variant", [0, 1, 6, 8])
@pytest.mark.parametrize("qtype,x8", [("Q4_0", False), ("Q5_1", False), ("Q4_K+Q6_K", False), ("IQ4_XS", False),
                                      ("Q4_0", True), ("Q4_K", True)])
def test_miss_server_on_the_ring_int8_copy_changes_no_bit(monkeypatch, qtype, x8, variant):
    """The server's y from the ring's int8 copy of x (Requests.q8: thread 0 quantizes nothing) equals its y from its
    own quantization of the float x (MOETIER_RING_Q8=0's path) bit for bit, in the phases with barriers (0), the
    per-row loops (1) and the dataflow (6), on GGML rows and rows interleaved by 8 (x8: moe_x8_rows reads the sums);
    with the copy the float x is not read (poisoned after the ring: y stays the same). The ring kernels interpreted."""
    from moetier.kernels import cpu
    if db.triton is None or torch.cuda.is_available():
        pytest.skip("the interpreted variant runs on CPU-only machines; tests/test_memory_gpu.py covers CUDA")
    if x8 and variant == 1:
        pytest.skip("the per-row loops refuse interleaved rows")
    if variant == 8 and (qtype, x8) != ("Q4_0", True):
        pytest.skip("variant 8 (6 with a barrier at each bell): one case")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    s_gu, s_dn, _, _, tid = experts(qtype, seed=31)
    if not db.ring_q8_useful(tid):
        pytest.skip("the C kernels are built without int8 activations")
    if x8:
        tid = tuple(tid) if isinstance(tid, tuple) else (tid, tid)
        for table, t in zip((s_gu, s_dn), tid):
            for m in (m for row in table for m in row):
                cpu.interleave_inplace(m, t)
        tid = tuple(cpu.INTERLEAVED[t] for t in tid)
    g = torch.Generator().manual_seed(32)
    xs = [q8_input(D, g)[None] for _ in range(L)]
    ids = [torch.randperm(E, generator=g)[:K][None] for _ in range(L)]
    ws = [torch.rand(1, K, generator=g) for _ in range(L)]
    table = torch.full((L, E), -1, dtype=torch.int32)
    table[:, 1] = 0                                                    # expert 1 a hit: the others miss
    ys = []
    for q8 in (False, True):
        req = db.Requests(L, D, K, pin=False, q8=q8)
        srv = db.MissServer(req, s_gu, s_dn, tid, D, I, Act(), threads=2)
        srv.ctx.variant = variant
        seq, slots = torch.zeros(1, dtype=torch.int64), torch.zeros(L, K, dtype=torch.int64)

        def ring_li(li):
            db.ring(xs[li], ids[li], ws[li], table[li], seq, slots[li], req, li, bump=li == 0)
            if q8:
                req.x[li] = float("nan")
        ys.append(served_y(req, srv, ring_li))
    assert torch.isfinite(ys[0]).all() and torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("threads", [3, 4])
def test_threads_starting_layers_at_their_bells_change_no_bit(threads):
    """Variant 8 (variant 6 with the ring's int8 copy, every thread reading each layer's bell and misses itself and
    starting at once: no barrier) with the layers' scratches alternating by parity. With every bell rung before serve
    (the worst case: a fast thread may run ahead, held only by the parity guard), Qwen3-30B-A3B's expert shapes, 14
    layers (0, 5, 10 without misses), five steps: y equals variant 6's (thread 0's prep and a barrier at each bell)
    bit for bit. Without the parity or without the guard this failed (3 and 4 threads on the 2-core dev box)."""
    n_layers, d, h, e, k = 14, 2048, 768, 6, 4
    g = torch.Generator().manual_seed(43)
    gu = [quantize(torch.randn(2 * h, d, generator=g) * 0.05, "Q4_0") for _ in range(e)]
    dn = [quantize(torch.randn(d, h, generator=g) * 0.05, "Q4_0") for _ in range(e)]
    tid = get_format("Q4_0").type_id
    if not db.ring_q8_useful(tid):
        pytest.skip("the C kernels are built without int8 activations")
    missed = [li for li in range(n_layers) if li % 5]
    ys = {}
    for variant in (6, 8):
        req = db.Requests(n_layers, d, k, pin=False, q8=True)
        srv = db.MissServer(req, [gu] * n_layers, [dn] * n_layers, tid, d, h, Act(), threads=threads)
        srv.ctx.variant = variant
        g.manual_seed(44)
        for seq in range(1, 6):
            req.bell.zero_()
            req.y.fill_(float("nan"))
            for li in range(n_layers):
                x = torch.randn(d, generator=g)
                req.x[li] = x
                req.qx[li], req.dx[li], req.sx[li] = db.quantize_q8(x)
                req.ids[li] = torch.randperm(e, generator=g)[:k].int()
                req.w[li] = torch.rand(k, generator=g)
                req.slots[li] = torch.arange(k, dtype=torch.int32) if li % 5 == 0 else -1
                req.slots[li, 0] = 0                                                # one hit in the others
                req.bell[li * db.BELL_STRIDE] = seq
            srv.serve(seq)
            ys[variant, seq] = req.y[missed].clone()
    for seq in range(1, 6):
        assert torch.isfinite(ys[8, seq]).all() and torch.equal(ys[8, seq], ys[6, seq]), seq


@pytest.mark.skipif(db.triton is None, reason="needs triton (interpreted on CPU)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [256, 2048])
def test_wait_add_norm_is_wait_add_then_rms_norm_q8(dtype, d):
    """wait_add_norm (wait_add with the residual in one program, then the next layer's input norm and its int8 copy)
    against wait_add then triton_small.rms_norm_q8: out, x, q, dx, xs bit for bit, for layers that missed (the CPU's
    y already answered) and one that did not (y poisoned: not added). Interpreted on CPU (float32); on CUDA with
    pinned rows."""
    from moetier.kernels import triton_small
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bfloat16 rounding (checked on CUDA)")
    k = 4
    g = torch.Generator().manual_seed(d)
    req = db.Requests(L, d, k, pin=dev == "cuda")
    req.y.copy_(torch.randn(L, d, generator=g))
    req.y[1] = float("nan")
    seq = torch.tensor([3], dtype=torch.int64, device=dev)
    req.done[::db.BELL_STRIDE] = 3
    slots = torch.tensor([[0, -1, 2, -1], [0, 1, 2, 3], [-1, -1, -1, -1]], device=dev)
    for li in range(L):
        hits = (torch.randn(1, d, generator=g) * 0.3).to(dev, dtype)
        res = (torch.randn(1, d, generator=g) * 2).to(dev, dtype)
        nw = (1 + 0.3 * torch.randn(d, generator=g)).to(dev, dtype)
        want = torch.full_like(hits, float("nan"))
        db.wait_add(hits, slots[li], seq, req, li, want, max_spin=1 << 20, residual=res)
        want_x, want_pre = triton_small.rms_norm_q8(want, nw, 1e-6)
        out = torch.full_like(hits, float("nan"))
        x, pre = db.wait_add_norm(hits, slots[li], seq, req, li, out, res, nw, 1e-6, max_spin=1 << 20)
        assert torch.equal(out, want) and torch.isfinite(out).all() and torch.equal(x, want_x), li
        assert all(torch.equal(a, b) for a, b in zip(pre, want_pre)), li
        assert int(req.err[0]) == 0


@pytest.mark.skipif(db.triton is None, reason="needs triton (interpreted on CPU)")
@pytest.mark.parametrize("share,n_p", [(0.5, 2), (1.0, 2), (1.0, 4), (0.3, 4)])
def test_ring_pcie_share_round_trip(monkeypatch, share, n_p):
    """The PCIe share (interpreted): the ring gives the first round(share * misses) misses (at most
    n_p) stage slots and their bank offsets, `gather` copies those experts' bytes from the bank into
    staging rows, the experts op computes hits + stage slots, the C server the remaining misses
    (it skips stage slots as it skips hits), wait_add sums: equal to the dense computation."""
    s_gu, s_dn, f_gu, f_dn, req, srv = interpreted(monkeypatch, seed=7)
    g = torch.Generator().manual_seed(8)
    # the bank: every expert's bytes (gate_up then down) in one buffer; expert 5 of each layer is not there
    eb = (2 * I * D + D * I) * 4
    bank = torch.zeros(L * E * eb, dtype=torch.uint8)
    poff = torch.full((L, E), -1, dtype=torch.int64)
    for li in range(L):
        for e in range(E - 1):
            o = (li * E + e) * eb
            bank[o:o + eb] = torch.cat([s_gu[li][e].reshape(-1), s_dn[li][e].reshape(-1)]).view(torch.uint8)
            poff[li, e] = o
    table = torch.full((L, E), -1, dtype=torch.int32)
    table[:, 0] = torch.arange(L, dtype=torch.int32)               # expert 0 cached in slot li
    n_slots = L + n_p
    arena_gu, arena_dn = torch.zeros(n_slots, 2 * I, D), torch.zeros(n_slots, D, I)
    for li in range(L):
        arena_gu[li], arena_dn[li] = f_gu[li][0], f_dn[li][0]
    seq = torch.zeros(1, dtype=torch.int64)
    slots = torch.zeros(L, K, dtype=torch.int64)
    stage_off = torch.zeros(n_p, dtype=torch.int64)
    staging = torch.zeros(n_p, eb, dtype=torch.uint8)
    xs = [torch.randn(1, D, generator=g) for _ in range(L)]
    ids = [torch.tensor([[0, 1, 2, 3]]), torch.tensor([[5, 4, 0, 3]]), torch.tensor([[1, 2, 3, 4]])]
    ws = [torch.rand(1, K, generator=g) for _ in range(L)]
    server = threading.Thread(target=srv.serve, args=(1,))
    server.start()
    outs, staged = [], []
    for li in range(L):
        db.ring(xs[li], ids[li], ws[li], table[li], seq, slots[li], req, li, bump=li == 0,
                pcie=(poff[li], stage_off, share, L))
        staging.fill_(0xFF)
        db.gather(bank, stage_off, staging)
        for j in range(n_p):            # the repack step of the real path: raw rows -> stage slots
            if stage_off[j] >= 0:
                assert torch.equal(staging[j], bank[int(stage_off[j]):int(stage_off[j]) + eb])
                row = staging[j].view(torch.float32)
                arena_gu[L + j], arena_dn[L + j] = row[:2 * I * D].view(2 * I, D), row[2 * I * D:].view(D, I)
        staged.append(int((slots[li] >= L).sum()))
        hits = ops.moe_decode(xs[li], slots[li].view(1, K), ws[li], arena_gu, arena_dn, Act(), fmt="f32")
        out = torch.full_like(xs[li], float("nan"))
        db.wait_add(hits, slots[li], seq, req, li, out, max_spin=1 << 30)
        outs.append(out)
    server.join()
    assert int(req.err[0]) == 0
    misses = [3, 3, 4]      # layer 1: expert 5 is not in the bank, so only 4 and 3 can go over PCIe
    can = [3, 2, 4]
    assert staged == [min(n_p, c, int(m * share + 0.5)) for m, c in zip(misses, can)]
    for li in range(L):
        want = dense(xs[li][0], ids[li][0], ws[li][0], f_gu[li], f_dn[li])
        torch.testing.assert_close(outs[li][0], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("variant", [0, 2, 5, 6])
@pytest.mark.parametrize("qtype,q8,threads", [("Q4_0", True, 2), ("Q4_K+Q6_K", True, 3), ("F32", False, 2)])
def test_prefetch_of_guessed_misses_changes_nothing(qtype, q8, threads, variant):
    """The GPU's guess of each layer's misses (hint rows, flagged with the step): the server loads the guessed rows
    between layers, which must not change one bit of y (a wrong or stale guess included: layer 2's flag is an older
    step's), and counts guesses per layer with a fresh flag: guessed experts, right ones, misses (variant 2 loads
    its own down rows)."""
    s_gu, s_dn, f_gu, f_dn, tid = experts(qtype, seed=21)
    g = torch.Generator().manual_seed(22)
    ys = []
    for hints in (False, True):
        req = db.Requests(L, D, K, pin=False)
        srv = db.MissServer(req, s_gu, s_dn, tid, D, I, Act(), threads=threads, q8_act=q8, hints=hints)
        srv.ctx.variant = variant
        g.manual_seed(22)
        req.x[:] = torch.randn(L, D, generator=g)
        req.ids[:] = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L)]).int()
        req.w[:] = torch.rand(L, K, generator=g)
        req.slots[:] = torch.tensor([[-1, 3, -1, -1], [-1, -1, 0, 1], [-1, -1, -1, -1]], dtype=torch.int32)
        # layer 1's guess: two of its misses (one twice), one wrong expert, one out of range;
        # layer 2's: its whole set, but from step 0
        wrong = next(e for e in range(E) if e not in req.ids[1].tolist())
        req.hint[1] = torch.tensor([int(req.ids[1, 1]), int(req.ids[1, 0]), wrong, E + 3], dtype=torch.int32)
        req.hint[1, 3] = int(req.ids[1, 1]) if threads == 3 else E + 3
        req.hint[2] = req.ids[2]
        req.hint_flag[1 * db.BELL_STRIDE] = 1
        req.hint_flag[2 * db.BELL_STRIDE] = 0
        req.y.fill_(float("nan"))

        def gpu():      # each bell 20 ms after the layer before is answered: the threads prefetch in between
            for li in range(L):
                t0 = time.perf_counter()
                while li and int(req.done[(li - 1) * db.BELL_STRIDE]) != 1 and time.perf_counter() - t0 < 5:
                    time.sleep(0.001)
                time.sleep(0.02 if li else 0.0)
                req.bell[li * db.BELL_STRIDE] = 1
        th = threading.Thread(target=gpu)
        th.start()
        assert srv.serve(1)[2] == 3 + 2 + 4
        th.join()
        ys.append(req.y.clone())
        if hints:
            assert srv.guesses == (3, 2, 2)      # 3 valid guesses in layer 1, 2 right, 2 misses there
            assert srv.prefetched > 0           # layer 1's guessed rows, in the 20 ms before its bell
            assert min(srv.phases) >= 0 and srv.phases[0] > 0 and srv.phases[3] > 0    # gate_up, down timed
            work, last, cpus = srv.per_thread[:, :threads]      # per thread: each of the 3 layers had one last thread
            assert (work > 0).all() and last.sum() == L and (cpus >= 0).all()
            assert (srv.per_thread[:, threads:] <= 0).all()      # the rows of threads beyond the team: untouched
        else:
            assert srv.guesses == (0, 0, 0) and srv.prefetched == 0
    assert torch.equal(ys[0], ys[1])
    for li in range(L):
        want = reference(req.x[li], req.ids[li], req.w[li], req.slots[li], f_gu[li], f_dn[li], Act())
        err = ((ys[1][li] - want).abs().max() / want.abs().max()).item()
        assert err <= (3e-2 if q8 else 2e-5), (qtype, li, err)


def test_trace_gives_each_threads_timeline_and_the_stragglers_split(monkeypatch):
    """MOETIER_MISS_TRACE=1: the step's timeline per layer (bell seen <= begin <= last finish; per thread start <= end
    of its gate_up claims <= finish <= the layer's last finish, which is one thread's finish; threads beyond the
    team and layers without misses zero), y unchanged, and late_thread_split's straggler figures from it."""
    s_gu, s_dn, f_gu, f_dn, tid = experts("Q4_0", seed=23)
    g = torch.Generator().manual_seed(24)
    x, ids = torch.randn(L, D, generator=g), torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L)])
    w = torch.rand(L, K, generator=g)
    slots = torch.tensor([[-1, 3, -1, -1], [2, 1, 0, 4], [-1, -1, -1, -1]], dtype=torch.int32)    # layer 1: all hits
    ys, threads = [], 3
    for trace in ("0", "1"):
        monkeypatch.setenv("MOETIER_MISS_TRACE", trace)
        req = db.Requests(L, D, K, pin=False)
        srv = db.MissServer(req, s_gu, s_dn, tid, D, I, Act(), threads=threads, q8_act=True)
        assert (srv.trace is None) == (trace == "0")
        req.x[:], req.ids[:], req.w[:], req.slots[:] = x, ids.int(), w, slots
        req.y.fill_(float("nan"))
        req.bell[::db.BELL_STRIDE] = 1                   # every bell rung ahead
        assert srv.serve(1)[2] == 3 + 0 + 4
        ys.append(req.y.clone())
    assert torch.equal(ys[0][[0, 2]], ys[1][[0, 2]])
    t = srv.trace.numpy()
    assert (t[1, 3:] == 0).all() and t[1, 2] == 0              # layer 1 had no misses: no thread ran it
    for li in (0, 2):
        seen, begin, end = t[li, :3]
        per = t[li, 3:].reshape(-1, 3)
        assert 0 < seen <= begin <= end
        assert (per[threads:] == 0).all()
        start, gu_end, fin = per[:threads].T
        assert (begin <= start + 1e-6).all() and (start <= gu_end).all()
        assert (gu_end <= fin).all() and (fin <= end).all()
        assert fin.max() == end
    n, late = db.late_thread_split(t, threads)
    assert n == 2 and late["tail"] >= 0
    assert late["tail"] == pytest.approx(late["start"] + late["gate_up"] + late["down"])


@pytest.mark.skipif(db.triton is None, reason="needs triton (interpreted on CPU)")
def test_hint_kernel_writes_the_guessed_misses(monkeypatch):
    """hint (interpreted): the guessed experts the GPU table does not hold, -1 for those it does, then the flag =
    the device's step number."""
    _, _, _, _, req, _ = interpreted(monkeypatch, seed=4)
    table = torch.tensor([[3, -1, -1, 0, -1, 2]] * L, dtype=torch.int32)
    seq = torch.tensor([7], dtype=torch.int64)
    guess = torch.tensor([[5, 1, 3, 4]])
    db.hint(guess, table[2], seq, req, 2)
    assert req.hint[2].tolist() == [-1, 1, -1, 4]
    assert int(req.hint_flag[2 * db.BELL_STRIDE]) == 7 and int(req.hint_flag[1 * db.BELL_STRIDE]) == 0
    # with the PCIe share, the experts the ring would send over PCIe (lowest ids among the misses the bank can
    # serve; expert 4 has no bank offset) are not the CPU's: not guessed for it
    table[2] = torch.tensor([3, -1, -1, 0, -1, -1])
    poff = torch.tensor([0, 16, 32, 48, -1, 80])
    for share, want in ((0.5, [-1, -1, -1, 4]), (0.3, [5, -1, -1, 4]), (0.0, [5, 1, -1, 4])):
        db.hint(guess, table[2], seq, req, 2, pcie=(poff, share, 2))
        assert req.hint[2].tolist() == want, share
        # the ring picks the same experts for the stage slots (stage0 = 10 + rank by id)
        slots, stage_off = torch.zeros(4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
        db.ring(torch.randn(1, D), guess, torch.rand(1, 4), table[2], seq, slots, req, 2, bump=False,
                pcie=(poff, stage_off, share, 10))
        staged = [e for e, s in zip(guess[0].tolist(), slots.tolist()) if s >= 10]
        assert sorted(staged) == sorted(e for e, w in zip(guess[0].tolist(), want) if w < 0 and table[2, e] < 0)
        assert all(s == 10 + sorted(staged).index(e) for e, s in zip(guess[0].tolist(), slots.tolist()) if s >= 10)


def test_bank_offsets_are_from_the_lowest_buffer():
    """The PCIe share addresses the bank as one base + byte offsets: buffers from separate allocations,
    some below the first, all get offsets >= 0 that land on their bytes; experts not held get -1."""
    from moetier.memory.doorbell import bank_offsets
    from moetier.memory.store import alloc_buffers
    chunks = [alloc_buffers(3, 4096, pin=False) for _ in range(4)]
    bufs = [b for c in reversed(chunks) for b in c]              # the first buffer is not the lowest
    for i, b in enumerate(bufs):
        b.fill_(i)
    where = np.array([[0, 5, -1, 11], [3, -1, 7, 1]])
    base, offs = bank_offsets(bufs, where)
    assert base.data_ptr() == min(b.data_ptr() for b in bufs)
    assert (offs[where < 0] == -1).all() and (offs[where >= 0] >= 0).all()
    for (li, e), idx in np.ndenumerate(where):
        if idx >= 0:
            assert offs[li, e] == bufs[idx].data_ptr() - base.data_ptr()


def test_step_bookkeeping_thread_runs_in_inference_mode():
    """The graphed step's bookkeeping runs on a thread, and inference mode is thread-local: without
    entering it there, the first admission into a buffer made under inference mode failed on the H200
    ("Inplace update to inference tensor outside InferenceMode")."""
    from moetier.memory.doorbell import GraphTiers, _Server
    seen = []
    gt = object.__new__(GraphTiers)
    gt._account = lambda *step: seen.append(torch.is_inference_mode_enabled())
    with torch.inference_mode():
        buf = torch.zeros(4)
    th = _Server(lambda: gt._account_thread(None, None, None, 0.0))
    th.join()
    assert seen == [True]

    def write():
        with torch.inference_mode():
            buf.add_(1)
    _Server(write).join()
    assert buf.tolist() == [1.0] * 4


def test_step_bookkeeping_runs_during_the_next_serve():
    """A graphed step's bookkeeping runs on the worker while the next step is served (never between a serve and
    the next launch, where its Python held the GIL the main thread needed): step n is accounted for during serve
    n + 1 with the request rows as serve n left them, and drain() accounts for the last one; a worker error
    surfaces at the next step."""
    from types import SimpleNamespace

    from moetier.memory.doorbell import STEP_TIMING, GraphTiers, _Worker
    req = db.Requests(2, 8, 2, pin=False)
    seen, during = [], []

    class FakeServer:
        detail, guesses, prefetched, first_bell, phases = (0.0, 0, 0.0), (0, 0, 0), 0.0, 0.0, (0.0,) * 5
        log_ids, log_slots, log_w = req.ids.clone(), req.slots.clone(), req.w.clone()
        per_thread = torch.zeros(3, db.TIMED_THREADS, dtype=torch.float64)
        trace = None

        def serve(self, seq, timeout_s=None):
            time.sleep(0.05)                      # the accounting of step seq - 1 happens in here
            during.append(list(seen))
            self.log_ids.fill_(seq)               # this step's rows as served
            req.ids.fill_(-seq)                   # req's rows: the bookkeeping reads the server's log instead
            return 0.001, 0.0, 1
    gt = object.__new__(GraphTiers)
    gt.host_seq, gt._pending, gt._worker, gt.counting = 0, None, _Worker(), True
    gt.server, gt.req = FakeServer(), req
    gt.timing, gt._t_served = dict.fromkeys(STEP_TIMING, 0), 0.0
    gt.thread_timing, gt.thread_cpus = np.zeros((2, db.TIMED_THREADS)), np.full(db.TIMED_THREADS, -1.0)
    gt.tiers = SimpleNamespace(stats=SimpleNamespace(prefetch={"predicted": 0, "correct": 0, "actual": 0}))
    gt._account = lambda ids, slots, w, busy, trace: seen.append(int(ids[0, 0]))
    for _ in range(3):
        gt.after_step()
    assert during == [[], [1], [1, 2]] and seen == [1, 2]
    gt.drain()
    assert seen == [1, 2, 3] and gt._pending is None and gt.timing["steps"] == 3
    assert gt.timing["outside_n"] == 2 and gt._t_served == 0.0    # between serves 1-2 and 2-3; drain ends the run

    def boom(*a):
        raise ValueError("bookkeeping failed")
    gt._account = boom
    gt.after_step()
    with pytest.raises(ValueError, match="bookkeeping failed"):
        gt.after_step()


def test_worker_lets_go_of_finished_work_and_closes():
    """The bookkeeping worker keeps no reference to a function it ran (one holds the tiers: kept, a closed
    engine's GPU arenas stayed allocated under the next one), and close() ends the thread; work submitted after it
    runs at once."""
    import gc
    import weakref

    from moetier.memory.doorbell import _Worker
    w = _Worker()

    class Tiers:
        pass
    held = Tiers()
    ref = weakref.ref(held)
    w.submit(lambda: held)
    w.wait()
    del held
    gc.collect()
    assert ref() is None
    w.close()
    w._thread.join(5)
    assert not w._thread.is_alive()
    ran = []
    w.submit(lambda: ran.append(1))
    assert ran == [1]
    w.wait()


# ---- the chunked runs (doorbell.c layer_runs, variant 0) against the old per-row loops (variant 1) ----
def odd_experts(qtype: str, dim: int, hidden: int, n_exp: int, seed: int):
    """[1][n_exp] gate_up [2 hidden, dim] / down [dim, hidden] stored as qtype ("A+B": gate_up A, down B), float
    values, type id(s)."""
    g = torch.Generator().manual_seed(seed)
    gq, dq = qtype.split("+") if "+" in qtype else (qtype, qtype)

    def one(t, q):
        if q == "F32":
            return t, t, db.GGML_IDS[torch.float32]
        f = get_format(q)
        s = quantize(t, q)
        return s, dequantize(s, q, t.shape), f.type_id
    gu = [one(torch.randn(2 * hidden, dim, generator=g) * 0.1, gq) for _ in range(n_exp)]
    dn = [one(torch.randn(dim, hidden, generator=g) * 0.1, dq) for _ in range(n_exp)]
    tid = (gu[0][2], dn[0][2])
    return [[t[0] for t in gu]], [[t[0] for t in dn]], [t[1] for t in gu], [t[1] for t in dn], tid


def serve_both(srv, req, variants=(0, 1)):
    """y of one step per variant (same request)."""
    ys = []
    for seq, v in enumerate(variants, start=1):
        srv.ctx.variant = v
        req.y.fill_(float("nan"))
        req.bell[::db.BELL_STRIDE] = seq
        srv.serve(seq)
        ys.append(req.y.clone())
    return ys


def odd_request(req, n_exp: int, k: int, misses: int, seed: int) -> None:
    """Layer 0's request: random x, k of n_exp experts with weights, `misses` of them missed (slot -1)."""
    g = torch.Generator().manual_seed(seed)
    req.x[0] = torch.randn(req.x.shape[1], generator=g)
    req.ids[0] = torch.randperm(n_exp, generator=g)[:k].int()
    req.w[0] = torch.rand(k, generator=g)
    slots = torch.arange(k, dtype=torch.int32)
    slots[torch.randperm(k, generator=g)[:misses]] = -1
    req.slots[0] = slots


def odd_reference(req, f_gu, f_dn) -> torch.Tensor:
    """Layer 0's y in float32 from the experts' float values."""
    want = torch.zeros(req.x.shape[1])
    for j in range(req.ids.shape[1]):
        if req.slots[0, j] < 0:
            e = int(req.ids[0, j])
            want += req.w[0, j] * (f_dn[e] @ Act()(*(f_gu[e] @ req.x[0]).chunk(2)))
    return want


def odd_case(qtype, dim, hidden, misses, threads, q8, lib=None, seed=0, variants=(0, 1)):
    """One layer, k = 8 with `misses` missed experts: y of each variant (the new and the old loops), and the float
    reference."""
    n_exp, k = 10, 8
    s_gu, s_dn, f_gu, f_dn, tid = odd_experts(qtype, dim, hidden, n_exp, seed)
    req = db.Requests(1, dim, k, pin=False)
    srv = db.MissServer(req, s_gu, s_dn, tid, dim, hidden, Act(), threads=threads, q8_act=q8)
    if lib is not None:
        srv.lib = lib
    odd_request(req, n_exp, k, misses, seed + 1)
    ys = serve_both(srv, req, variants)
    want = odd_reference(req, f_gu, f_dn)
    return (*(y[0] for y in ys), want)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("misses", [1, 3, 7])
@pytest.mark.parametrize("qtype,dim,hidden,q8", [
    ("Q4_0", 224, 160, True), ("Q8_0", 224, 160, True),       # rows / pairs do not split evenly over the chunks
    ("Q4_0", 224, 160, False), ("F32+Q4_0", 98, 96, True),     # D = 98: runs of down end in 1-3 single rows
    ("Q4_K+Q6_K", 512, 256, True), ("MXFP4", 224, 160, True), ("F32", 100, 50, False),
    ("Q4_K", 512, 256, True), ("Q6_K", 512, 256, True), ("Q5_K", 512, 256, True),
    ("Q4_K+Q6_K", 256, 512, True), ("Q6_K+Q4_K", 768, 256, True),   # gate_up 3 x 256 wide, down 768 rows
    ("Q4_K+F32", 256, 98, True), ("F32+Q6_K", 98, 256, True)])  # 98 rows: runs end in 1-3 K-quant rows
def test_chunked_runs_match_the_row_loops(qtype, dim, hidden, q8, misses, threads):
    """The chunked runs (4-row kernels sharing x, per-thread contiguous chunks with stealing, down per expert
    over a slice of y, h quantized by all threads) give the per-row loops' y bit for bit (same per-row
    arithmetic and order of additions), for odd miss counts and shapes that split unevenly; and the reference
    within the usual tolerances. Variant 2 (down over the m x D rows into per-expert partials, summed in expert
    order after a barrier), variant 4 (guided chunks: halving parts of each thread's home), variant 5 (phase 3's
    rows prefetched during phase 1) and variant 6 (no barriers: each expert's h ready as its rows end) too."""
    new, old, v2, v4, v5, v6, want = odd_case(qtype, dim, hidden, misses, threads, q8, variants=(0, 1, 2, 4, 5, 6))
    assert torch.equal(new, old), (new - old).abs().max().item()
    assert torch.equal(v2, new), (v2 - new).abs().max().item()
    assert torch.equal(v4, new), (v4 - new).abs().max().item()
    assert torch.equal(v5, new), (v5 - new).abs().max().item()
    assert torch.equal(v6, new), (v6 - new).abs().max().item()
    err = ((new - want).abs().max() / want.abs().max()).item()
    assert err <= (3e-2 if q8 else 2e-5), err


def doorbell_build(tmp_path_factory, march):
    """doorbell.c built for another CPU (haswell: the AVX2 kernels; x86-64: no SIMD, float activations only)."""
    import ctypes
    import platform
    from pathlib import Path

    from moetier.kernels import cpu
    if platform.machine() != "x86_64" or not {"avx2", "fma", "f16c"} <= set(cpu._cpu_signature().split()):
        pytest.skip("needs an x86-64 CPU with AVX2/FMA/F16C")
    lib = ctypes.CDLL(str(cpu.build_library(tmp_path_factory.mktemp("doorbell"), march=march,
                                            source=Path(db.__file__).with_name("doorbell.c"))))
    lib.moetier_serve_step.argtypes = [ctypes.POINTER(db._Ctx), ctypes.c_int64]
    return lib


@pytest.fixture(scope="module")
def avx2_doorbell(tmp_path_factory):
    """this machine's native build may take the AVX-512 4-row kernel: the AVX2 one too"""
    return doorbell_build(tmp_path_factory, "haswell")


@pytest.fixture(scope="module")
def scalar_doorbell(tmp_path_factory):
    return doorbell_build(tmp_path_factory, "x86-64")


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("qtype,misses", [("Q4_0", 3), ("Q8_0", 7), ("Q4_0", 1), ("Q8_0", 1), ("MXFP4", 3),
                                          ("Q4_K", 3), ("Q6_K", 1), ("Q5_K", 3), ("Q4_K+Q6_K", 7),
                                          ("Q4_K+Q6_K", 1)])
def test_chunked_runs_avx2_build(qtype, misses, threads, avx2_doorbell):
    """The AVX2 build: its 4-row kernels against its per-row loops (bit for bit) and the native build (the integer
    dot products are exact on both: equal; K-quants: the native build's AVX-512 two-rows-per-register kernels of
    cpu_kq_q8.c against the AVX2 ones, same per-row arithmetic)."""
    dim, hidden = (512, 256) if "K" in qtype else (224, 160)
    new, old, want = odd_case(qtype, dim, hidden, misses, threads, True, lib=avx2_doorbell)
    assert torch.equal(new, old)
    native, _, _ = odd_case(qtype, dim, hidden, misses, threads, True)
    assert torch.equal(new, native)
    assert ((new - want).abs().max() / want.abs().max()).item() <= 3e-2


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K+Q6_K", "F32"])
def test_chunked_runs_scalar_build(qtype, threads, scalar_doorbell):
    """Without AVX2 (x86-64: no int8 kernels, q8_act falls back to float activations) the chunked runs call the
    one-row float kernels: the old loops' y bit for bit, the reference to float32 rounding."""
    lib = scalar_doorbell
    dim, hidden = (512, 256) if "K" in qtype else (224, 160)
    new, old, want = odd_case(qtype, dim, hidden, 3, threads, True, lib=lib)
    assert torch.equal(new, old)
    assert ((new - want).abs().max() / want.abs().max()).item() <= 2e-5


# ---- the RAM bank's rows interleaved by 8 (memory/doorbell.py interleave_bank; doorbell.c moe_x8_rows) ----
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("misses", [1, 3, 8])
@pytest.mark.parametrize("qtype,dim,hidden", [("Q4_0", 224, 160), ("Q8_0", 224, 160), ("IQ4_NL", 224, 160),
                                               ("Q5_1", 224, 160), ("Q4_0+Q8_0", 224, 160), ("F32+Q4_0", 224, 160),
                                               ("Q4_K", 512, 256), ("Q4_K+Q6_K", 768, 256), ("MXFP4", 224, 160),
                                               ("IQ4_XS", 512, 256)])
def test_interleaved_rows_answer_as_the_ggml_rows(qtype, dim, hidden, misses, threads):
    """The same experts with their Q4_0 / Q8_0 / IQ4_NL / Q5_1 / Q4_K / MXFP4 / IQ4_XS rows interleaved in place
    and the interleaved type ids: the x8 kernels' float sums differ from the row kernels' (one lane per row), and h is
    rounded to int8 after gate_up, so a value may land on the other side of a rounding: y within 5e-3 of the
    GGML rows' y (measured ~1e-4), the float reference within the int8 tolerance; variants 2, 4, 5, 6 give variant 0's y
    bit for bit, as with GGML rows. A type without an interleaved kernel (F32, Q6_K) keeps its rows."""
    from moetier.kernels import cpu
    if not cpu.interleaved_supported(get_format("Q4_0").type_id):
        pytest.skip("the C kernels are built without int8 activations")
    n_exp, k = 10, 8
    s_gu, s_dn, f_gu, f_dn, tid = odd_experts(qtype, dim, hidden, n_exp, seed=3)
    req = db.Requests(1, dim, k, pin=False)
    odd_request(req, n_exp, k, misses, seed=4)
    plain = db.MissServer(req, s_gu, s_dn, tid, dim, hidden, Act(), threads=threads, q8_act=True)
    (rows,) = serve_both(plain, req, (0,))
    x8_tid = []
    for table, t in zip((s_gu, s_dn), tid):
        if t in cpu.INTERLEAVED:
            for m in table[0]:
                cpu.interleave_inplace(m, t)
            t = cpu.INTERLEAVED[t]
        x8_tid.append(t)
    srv = db.MissServer(req, s_gu, s_dn, tuple(x8_tid), dim, hidden, Act(), threads=threads, q8_act=True)
    v0, v2, v4, v5, v6 = serve_both(srv, req, (0, 2, 4, 5, 6))
    assert torch.equal(v2, v0) and torch.equal(v4, v0) and torch.equal(v5, v0) and torch.equal(v6, v0)
    assert ((v0 - rows).abs().max() / rows.abs().max()).item() <= 5e-3
    want = odd_reference(req, f_gu, f_dn)
    assert ((v0 - want).abs().max() / want.abs().max()).item() <= 3e-2


def test_interleaved_rows_refuse_the_row_loops_and_float_activations():
    """Variant 1 (one row per call) and float activations have no interleaved kernel: the step is refused."""
    from moetier.kernels import cpu
    if not cpu.interleaved_supported(get_format("Q4_0").type_id):
        pytest.skip("the C kernels are built without int8 activations")
    s_gu, s_dn, _, _, tid = odd_experts("Q4_0", 224, 160, 10, seed=3)
    for table in (s_gu, s_dn):
        for m in table[0]:
            cpu.interleave_inplace(m, tid[0])
    x8 = cpu.INTERLEAVED[tid[0]]
    for q8, variant in ((True, 1), (False, 0)):
        req = db.Requests(1, 224, 8, pin=False)
        req.ids[0] = torch.arange(8, dtype=torch.int32)
        req.slots[0] = -1
        srv = db.MissServer(req, s_gu, s_dn, x8, 224, 160, Act(), threads=2, q8_act=q8)
        srv.ctx.variant = variant
        req.bell[0] = 1
        with pytest.raises(RuntimeError):
            srv.serve(1)
