"""The decode step's small fused kernels (kernels/triton_small.py) against their torch twins, run by
Triton's interpreter on CPU (tests/conftest.py) or on CUDA: RMSNorm with a weight per row group, and
the softmax top-k router."""
from __future__ import annotations

import pytest
import torch

from moetier.kernels import small_ops
from moetier.models.layers import RMSNorm, rms_normalize, softmax_topk

triton = pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 384), (3, 200), (2, 5, 64)])
def test_rms_norm_matches_the_twin(dtype, shape):
    if DEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bfloat16 (checked on CUDA)")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEV)
    norm = RMSNorm(shape[-1], 1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g).to(dtype))
    with small_ops.use("triton"):
        got = norm(x)
    want = norm.native(x)
    assert got.dtype == want.dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-5)


def test_rms_norm_weight_per_head():
    """q and k heads in one launch: row r of [T, R, N] takes weight row r % R."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 32, generator=g).to(DEV)
    w = torch.randn(6, 32, generator=g).to(DEV)
    with small_ops.use("triton"):
        got = small_ops.rms_norm(x, w, 1e-6, lambda y: rms_normalize(y, 1e-6) * w)
    torch.testing.assert_close(got, rms_normalize(x, 1e-6) * w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("e,k,normalize", [(128, 8, True), (60, 4, False), (7, 2, True)])
@pytest.mark.parametrize("t", [1, 3])
def test_softmax_topk_matches_the_twin(e, k, normalize, t):
    g = torch.Generator().manual_seed(e + k + t)
    logits = (torch.randn(t, e, generator=g) * 2).to(DEV)
    with small_ops.use("triton"):
        ids, w = small_ops.softmax_topk(logits, k, normalize, softmax_topk)
    want_ids, want_w = softmax_topk(logits, k, normalize)
    assert ids.dtype == torch.long and w.dtype == logits.dtype
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("e,k", [(128, 8), (60, 4)])
def test_softmax_topk_picks_ties_by_the_lower_id_and_nan_rows_stay_in_range(e, k):
    """The kernel ranks every lane at once; its picks are repeated arg-max's: larger probability first, equal
    probabilities by the lower id (logits on a coarse grid tie often). A row of NaN logits gives ids of real lanes."""
    g = torch.Generator().manual_seed(e + k)
    logits = torch.randint(-3, 4, (4, e), generator=g).float() / 2
    logits[3] = float("nan")
    with small_ops.use("triton"):
        ids, w = small_ops.softmax_topk(logits.to(DEV), k, True, softmax_topk)
    p = torch.softmax(logits[:3], dim=-1)
    for t in range(3):
        order = sorted(range(e), key=lambda i: (-p[t, i].item(), i))[:k]
        assert ids[t].tolist() == order
        torch.testing.assert_close(w[t].cpu(), p[t, order] / p[t, order].sum(), rtol=1e-6, atol=1e-7)
    assert ((ids[3] >= 0) & (ids[3] < e)).all() and len(set(ids[3].tolist())) == k


def test_prefill_sized_inputs_use_the_twin():
    x = torch.randn(small_ops.MAX_TOKENS + 1, 16)
    with small_ops.use("triton"):
        assert small_ops.rms_norm(x, None, 1e-6, lambda y: "twin") == "twin"


@pytest.mark.parametrize("qk_norm,rot_frac,h,hkv,dh", [(True, 1.0, 4, 2, 32), (False, 0.5, 6, 2, 16), (True, 1.0, 3, 3, 32)])
@pytest.mark.parametrize("pos", [0, 37, 150])
def test_fused_decode_attention_matches_the_layer(qk_norm, rot_frac, h, hkv, dh, pos):
    """One CUDA-graph decode token through Attention (device `start`): the fused path (norm + RoPE +
    cache write, split-K attention over [0, pos]) vs the unfused layer, logits and the cache."""
    from types import SimpleNamespace

    from moetier.models.layers import Attention, Rope
    from moetier.runtime.kv_cache import KVCache
    g = torch.Generator().manual_seed(pos + h)
    args = SimpleNamespace(hidden_size=48, num_attention_heads=h, num_key_value_heads=hkv, head_dim=dh,
                           attention_bias=False, rms_norm_eps=1e-6)
    att = Attention(args, qk_norm=qk_norm).to(DEV)
    with torch.no_grad():
        for p in att.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    att.fuse_qkv()
    rot = int(dh * rot_frac)
    rope = Rope({"rope_theta": 1000.0}, rot, 4096).to(DEV)
    caches = [KVCache(192, (hkv, dh), (hkv, dh), torch.float32, DEV) for _ in range(2)]
    past_k, past_v = torch.randn(pos, hkv, dh, generator=g), torch.randn(pos, hkv, dh, generator=g)
    caches[0].k.copy_(torch.randn(caches[0].k.shape, generator=g))     # garbage past pos: must stay unread
    caches[0].v.copy_(torch.randn(caches[0].v.shape, generator=g))
    caches[0].k[:pos], caches[0].v[:pos] = past_k.to(DEV), past_v.to(DEV)
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    x = torch.randn(1, 48, generator=g).to(DEV)
    start = torch.tensor(pos, device=DEV)
    cs = rope(start + torch.arange(1, device=DEV), torch.float32)
    with torch.no_grad():
        with small_ops.use("triton"):
            got = att(x, cs, caches[0], start)
        with small_ops.use("torch"):
            want = att(x, cs, caches[1], start)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(caches[0].k[:pos + 1], caches[1].k[:pos + 1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(caches[0].v[:pos + 1], caches[1].v[:pos + 1])


# ---------------------------------------------------------------- fused router, residual add + RMSNorm
def _skip_bf16_on_cpu(dtype):
    if DEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bfloat16 rounding (checked on CUDA)")


def _router_inputs(e, d, dtype, seed, dev=DEV):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, d, generator=g)
    w = torch.randn(e, d, generator=g) / d ** 0.5 * 1.5              # logits ~ N(0, 1.5): no ties, no overflow
    return x.to(dev, dtype), w.to(dev, dtype)


def _twin_router(x, w, k, normalize):
    return softmax_topk(torch.nn.functional.linear(x, w), k, normalize)


def _check_router(ids, w, x, weight, k, normalize):
    want_ids, want_w = _twin_router(x, weight, k, normalize)
    assert ids.dtype == torch.long and w.dtype == x.dtype and ids.shape == w.shape == (1, k)
    assert (ids >= 0).all() and (ids < weight.shape[0]).all() and torch.isfinite(w).all()
    assert ids.tolist() == want_ids.tolist()
    if x.dtype == torch.float32:
        torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-6)
    else:                                                               # one rounding of x's dtype apart
        torch.testing.assert_close(w.float(), want_w.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e,d,k", [(128, 2048, 8), (60, 256, 4)])
@pytest.mark.parametrize("normalize", [True, False])
def test_router_topk_matches_the_twin(dtype, e, d, k, normalize):
    """GEMV + softmax + top-k in one launch (last program of the grid does the top-k); called twice in a
    row on poisoned outputs, so the arrival counter must be back at 0 after each launch."""
    from moetier.kernels import triton_small
    _skip_bf16_on_cpu(dtype)
    x, weight = _router_inputs(e, d, dtype, seed=e + k + normalize)
    for call in range(2):
        ids = torch.full((1, k), -1, dtype=torch.long, device=DEV)
        w = torch.full((1, k), float("nan"), dtype=dtype, device=DEV)
        triton_small.router_topk(x, weight, k, normalize, out=(ids, w))
        _check_router(ids, w, x, weight, k, normalize)
        assert triton_small._router_counter(x.device).item() == 0
    for rows in (1, 4, 8):                                              # other grids, same answer
        got = triton_small.router_topk(x, weight, k, normalize, rows=rows)
        _check_router(*got, x, weight, k, normalize)


@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_router_module_takes_the_fused_path(normalize, monkeypatch):
    """SoftmaxRouter: one token -> the fused kernel (the unfused twin is not called), more tokens or the
    torch backend -> the twin; the answers agree."""
    from moetier.models.layers import SoftmaxRouter
    router = SoftmaxRouter(256, 60, 4, normalize).to(DEV)
    x, weight = _router_inputs(60, 256, torch.float32, seed=3)
    with torch.no_grad():
        router.weight.copy_(weight)
    want = router.native(x)
    calls = []
    monkeypatch.setattr(router, "native", lambda y: calls.append(y.shape) or _twin_router(y, weight, 4, normalize))
    with torch.no_grad(), small_ops.use("triton"):
        ids, w = router(x)
        assert calls == []
        router(torch.cat([x, x]))                                      # two tokens: the twin
        assert calls == [(2, 256)]
    assert ids.tolist() == want[0].tolist()
    torch.testing.assert_close(w, want[1], rtol=1e-6, atol=1e-6)
    with torch.no_grad(), small_ops.use("torch"):
        router(x)
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2048), (3, 200), (2, 5, 64)])
def test_add_rms_norm_matches_add_then_norm(dtype, shape):
    """s is `h + y` bit for bit; normed is the rms_norm kernel's answer on s bit for bit (same math) and
    the RMSNorm twin's within rounding."""
    from moetier.kernels import triton_small
    _skip_bf16_on_cpu(dtype)
    g = torch.Generator().manual_seed(sum(shape))
    h = (torch.randn(*shape, generator=g) * 3).to(DEV, dtype)
    y = torch.randn(*shape, generator=g).to(DEV, dtype)
    norm = RMSNorm(shape[-1], 1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g).to(dtype))
    for call in range(2):
        s = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
        out = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
        triton_small.add_rms_norm(h, y, norm.weight, norm.eps, out=(s, out))
        assert torch.equal(s, h + y)
        assert torch.equal(out, triton_small.rms_norm(h + y, norm.weight, norm.eps))
        torch.testing.assert_close(out.float(), norm.native(h + y).float(),
                                   rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-5)
    with torch.no_grad(), small_ops.use("triton"):
        got = small_ops.add_rms_norm(h, y, norm.weight, norm.eps, lambda a, b: "twin")
    assert got != "twin" and torch.equal(got[0], h + y) and torch.equal(got[1], out)


def _add_norm_inputs(d, dtype, seed, dev=DEV):
    """h, a [1, d] and a norm weight [d] (random, never zeros)."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(1, d, generator=g) * 3).to(dev, dtype)
    a = torch.randn(1, d, generator=g).to(dev, dtype)
    nw = (1 + 0.3 * torch.randn(d, generator=g)).to(dev, dtype)
    return h, a, nw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e,d,k", [(128, 2048, 8), (6, 200, 2), (6, 1536, 2)])
@pytest.mark.parametrize("normalize", [True, False])
def test_router_topk_add_norm_is_add_norm_then_router(dtype, e, d, k, normalize):
    """The residual add + RMSNorm made by the router's launch: s, x, ids, w bit for bit as add_rms_norm then
    router_topk (two launches), called twice on poisoned outputs (the arrival counter is back at 0 after each).
    D = 200 runs in the interpreter only: on CUDA add_rms_norm sums its squares over one warp there, and
    router_add_norm_fits keeps the fused path off."""
    from moetier.kernels import triton_small
    _skip_bf16_on_cpu(dtype)
    if DEV == "cuda" and not triton_small.router_add_norm_fits(e, d):
        pytest.skip("below 1024 add_rms_norm reduces over 1 warp: not bit for bit on CUDA, not used there")
    h, a, nw = _add_norm_inputs(d, dtype, seed=e + d + k + normalize)
    _, weight = _router_inputs(e, d, dtype, seed=e + k + 7 * normalize)
    want_s, want_x = triton_small.add_rms_norm(h, a, nw, 1e-6)
    want = (want_s, want_x, *triton_small.router_topk(want_x, weight, k, normalize))
    for call in range(2):
        out = (torch.full_like(h, float("nan")), torch.full_like(h, float("nan")),
               torch.full((1, k), -1, dtype=torch.long, device=DEV), torch.full((1, k), float("nan"), dtype=dtype,
                                                                                 device=DEV))
        got = triton_small.router_topk_add_norm(h, a, nw, 1e-6, weight, k, normalize, out=out)
        assert all(g is o for g, o in zip(got, out))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), call
        assert triton_small._router_counter(h.device).item() == 0
    _check_router(*got[2:], want_x, weight, k, normalize)                # and the twin's answer
    assert torch.equal(got[0], h + a)


def test_router_topk_add_norm_refuses_what_it_cannot_do_bit_for_bit(monkeypatch):
    """x in more than one chunk of the router's tile (D = 4096 at E = 128, or an explicit small tile), outputs that
    alias the inputs; router_add_norm_ok's gate: one token, D >= 1024, the kernels on, MOETIER_ROUTER_ADD_NORM."""
    from moetier.kernels import triton_small
    assert triton_small.router_add_norm_fits(128, 2048) and triton_small.router_add_norm_fits(8, 4096)
    assert not triton_small.router_add_norm_fits(128, 4096) and not triton_small.router_add_norm_fits(128, 512)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32     # (the GPU engines' usual dtype there)
    h, a, nw = _add_norm_inputs(2048, dt, seed=1)
    _, weight = _router_inputs(128, 2048, dt, seed=2)
    with pytest.raises(ValueError, match="one chunk"):
        triton_small.router_topk_add_norm(h, a, nw, 1e-6, weight, 8, True, rows=8)
    with pytest.raises(ValueError, match="alias"):
        triton_small.router_topk_add_norm(h, a, nw, 1e-6, weight, 8, True, out=(h, torch.empty_like(h)))
    ok = small_ops.router_add_norm_ok
    with small_ops.use("triton"):
        assert ok(h, a, nw, weight, 8)
        assert not ok(torch.cat([h, h]), torch.cat([a, a]), nw, weight, 8)              # two tokens
        assert not ok(h[:, :512], a[:, :512], nw[:512], weight[:, :512].contiguous(), 8)   # one warp's norm
        assert not ok(h, a.double(), nw, weight, 8)
        # float32 one launch too (session 21: bit for bit on the H200; this assertion said otherwise until session 26)
        assert ok(h.float(), a.float(), nw.float(), weight.float(), 8)
        monkeypatch.setenv("MOETIER_ROUTER_ADD_NORM", "0")
        assert not ok(h, a, nw, weight, 8)
        monkeypatch.delenv("MOETIER_ROUTER_ADD_NORM")
    with small_ops.use("torch"):
        assert not ok(h, a, nw, weight, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2048, 96])
def test_rms_norm_q8_is_the_norm_then_the_quantizer(dtype, n):
    """One launch for the decode block's input norm and the qkv GEMV's int8 input: the rms_norm kernel's output
    and triton_decode_q8.quantize of it, bit for bit (n = 96: three 32-blocks, not a power of two)."""
    from moetier.kernels import triton_decode_q8, triton_small
    _skip_bf16_on_cpu(dtype)
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(1, n, generator=g) * 3).to(DEV, dtype)
    w = torch.randn(n, generator=g).to(DEV, dtype)
    want = triton_small.rms_norm(x, w, 1e-6)
    wq = triton_decode_q8.quantize(want)
    with small_ops.use("triton"):
        y, pre = small_ops.rms_norm_q8(x, w, 1e-6, lambda a: "twin")
    assert torch.equal(y, want) and all(torch.equal(a, b) for a, b in zip(pre, wq))
    assert pre[0].abs().max() == 127 and torch.isfinite(pre[1]).all()
    with small_ops.use("torch"):
        assert small_ops.rms_norm_q8(x, w, 1e-6, lambda a: "twin") == ("twin", None)
    with small_ops.use("triton"):
        assert small_ops.rms_norm_q8(x[:, :n - 16], w[:n - 16], 1e-6, lambda a: "twin") == ("twin", None)


def test_rms_norm_q8_returns_what_the_writer_of_x_made():
    """made_norm_q8: the kernel that wrote x (the tiered decode's wait_add) made rms_norm_q8(x, w, eps) too; the call
    returns those tensors for that weight tensor and eps only (another weight of equal values or another eps: the
    kernel runs), and only where the kernel would run (else the twin)."""
    from moetier.kernels import triton_small
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 256, generator=g).to(DEV)
    w = torch.randn(256, generator=g).to(DEV)
    made = triton_small.rms_norm_q8(x, w, 1e-6)
    small_ops.made_norm_q8(x, w, 1e-6, *made)
    with small_ops.use("triton"):
        y, pre = small_ops.rms_norm_q8(x, w, 1e-6, lambda a: "twin")
        assert y is made[0] and pre is made[1]
        for w2, eps in ((w.clone(), 1e-6), (w, 1e-5)):
            y2, pre2 = small_ops.rms_norm_q8(x, w2, eps, lambda a: "twin")
            want = triton_small.rms_norm_q8(x, w2, eps)
            assert y2 is not made[0] and torch.equal(y2, want[0])
            assert all(torch.equal(a, b) for a, b in zip(pre2, want[1]))
    with small_ops.use("torch"):
        assert small_ops.rms_norm_q8(x, w, 1e-6, lambda a: "twin") == ("twin", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2048, 96])
def test_add_norm_q8_is_the_add_then_the_next_blocks_norm(dtype, n, monkeypatch):
    """The residual add after a decode block's MoE makes the next block's input norm and its int8 copy in the same
    launch and notes them on the sum (the default); the next block's rms_norm_q8 then returns them, bit for bit
    `h + y` then rms_norm_q8. Off (MOETIER_ADD_NORM_Q8=0), or where the next attention takes no int8 copy: a plain
    add."""
    from types import SimpleNamespace

    from moetier.kernels import triton_small
    from moetier.models.layers import RMSNorm
    _skip_bf16_on_cpu(dtype)
    g = torch.Generator().manual_seed(n + 1)
    h = (torch.randn(1, n, generator=g) * 3).to(DEV, dtype)
    y = torch.randn(1, n, generator=g).to(DEV, dtype)
    norm = RMSNorm(n, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g))
    takes_q8 = SimpleNamespace(q8_input=lambda t: True)
    want_s = h + y
    want = triton_small.rms_norm_q8(want_s, norm.weight, norm.eps)
    monkeypatch.delenv("MOETIER_ADD_NORM_Q8", raising=False)      # on by default
    with small_ops.use("triton"), torch.no_grad():
        s = small_ops.add_norm_q8(h, y, (norm, takes_q8))
        x, pre = small_ops.rms_norm_q8(s, norm.weight, norm.eps, lambda a: "twin")
        assert torch.equal(s, want_s) and x is s.moetier_norm_q8[2]
        assert torch.equal(x, want[0]) and all(torch.equal(a, b) for a, b in zip(pre, want[1]))
        plain = small_ops.add_norm_q8(h, y, (norm, SimpleNamespace(q8_input=lambda t: False)))
        assert torch.equal(plain, want_s) and not hasattr(plain, "moetier_norm_q8")
    monkeypatch.setenv("MOETIER_ADD_NORM_Q8", "0")
    with small_ops.use("triton"), torch.no_grad():
        off = small_ops.add_norm_q8(h, y, (norm, takes_q8))
    assert torch.equal(off, want_s) and not hasattr(off, "moetier_norm_q8")


def test_add_rms_norm_falls_back_to_the_twin():
    h, y, w = torch.randn(small_ops.MAX_TOKENS + 1, 16), torch.randn(small_ops.MAX_TOKENS + 1, 16), torch.ones(16)
    twin = lambda a, b: "twin"                                          # noqa: E731
    with small_ops.use("triton"):
        assert small_ops.add_rms_norm(h, y, w, 1e-6, twin) == "twin"                 # prefill-sized
        assert small_ops.add_rms_norm(h[:2], y[:2].double(), w, 1e-6, twin) == "twin"  # mixed dtypes
        assert small_ops.router_topk(h[:2], torch.randn(8, 16), 2, True, lambda x: "twin") == "twin"
    with small_ops.use("torch"):
        assert small_ops.add_rms_norm(h[:1], y[:1], w, 1e-6, twin) == "twin"
        assert small_ops.router_topk(h[:1], torch.randn(8, 16), 2, True, lambda x: "twin") == "twin"


def test_decoder_block_fused_add_norm_matches_the_unfused_block():
    """base.Block with the fused residual add + norm (Triton) against the same block on the twins."""
    from types import SimpleNamespace

    from moetier.models.base import Block
    from moetier.models.layers import Attention, Rope, SoftmaxMoE
    from moetier.runtime.kv_cache import KVCache
    g = torch.Generator().manual_seed(7)
    args = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           attention_bias=False, rms_norm_eps=1e-6)
    blk = Block(args, Attention(args, qk_norm=True), SoftmaxMoE(64, 8, 2, True, 32)).to(DEV)
    with torch.no_grad():
        for p in blk.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    rope = Rope({"rope_theta": 1000.0}, 16, 512).to(DEV)
    x = torch.randn(1, 64, generator=g).to(DEV)
    start = torch.tensor(5, device=DEV)
    cs = rope(start + torch.arange(1, device=DEV), torch.float32)
    outs = []
    for backend in ("triton", "torch"):
        kv = KVCache(32, (2, 16), (2, 16), torch.float32, DEV)
        with torch.no_grad(), small_ops.use(backend):
            outs.append(blk(x, cs, kv, start))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)


def _moe_block(d, e, k, seed):
    from types import SimpleNamespace

    from moetier.models.base import Block
    from moetier.models.layers import Attention, SoftmaxMoE
    g = torch.Generator().manual_seed(seed)
    args = SimpleNamespace(hidden_size=d, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           attention_bias=False, rms_norm_eps=1e-6)
    blk = Block(args, Attention(args, qk_norm=True), SoftmaxMoE(d, e, k, True, 32)).to(DEV)
    with torch.no_grad():
        for p in blk.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        blk.mlp.gate.weight.mul_(4 / d ** 0.5)                          # logits ~ N(0, 1.2): no ties
    return blk


def test_decoder_block_routes_with_the_add_norm_in_the_router_launch(monkeypatch):
    """base.Block -> SoftmaxMoE.add_norm_forward at D = 1024: the router's launch makes the residual add and the
    post-attention norm (add_rms_norm is not called), and the block's output is bit for bit the two-launch path's
    (MOETIER_ROUTER_ADD_NORM=0)."""
    from moetier.kernels import triton_small
    from moetier.models.layers import Rope
    from moetier.runtime.kv_cache import KVCache
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32     # (the GPU engines' usual dtype there)
    blk = _moe_block(1024, 8, 2, seed=9).to(dt)
    rope = Rope({"rope_theta": 1000.0}, 16, 512).to(DEV)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(10)).to(DEV, dt)
    start = torch.tensor(5, device=DEV)
    cs = rope(start + torch.arange(1, device=DEV), dt)
    calls = []
    for name in ("add_rms_norm", "router_topk", "router_topk_add_norm"):
        monkeypatch.setattr(triton_small, name, lambda *a, _f=getattr(triton_small, name), _n=name, **kw:
                            calls.append(_n) or _f(*a, **kw))
    outs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("MOETIER_ROUTER_ADD_NORM", fused)
        kv = KVCache(32, (2, 16), (2, 16), dt, DEV)
        calls.clear()
        with torch.no_grad(), small_ops.use("triton"):
            outs[fused] = blk(x, cs, kv, start)
        assert calls == (["router_topk_add_norm"] if fused == "1" else ["add_rms_norm", "router_topk"]), calls
    assert torch.equal(outs["1"], outs["0"]) and torch.isfinite(outs["1"]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e,d,k,normalize", [(128, 2048, 8, True), (60, 256, 4, False)])
def test_gpu_router_and_add_norm_in_a_cuda_graph(dtype, e, d, k, normalize):
    """Both kernels captured once, replayed 3 times on new inputs copied into the static ones."""
    from moetier.kernels import triton_small
    x, weight = _router_inputs(e, d, dtype, seed=11, dev="cuda")
    h = torch.randn(1, d, device="cuda").to(dtype)
    y = torch.randn(1, d, device="cuda").to(dtype)
    nw = torch.randn(d, device="cuda").to(dtype)
    triton_small.router_topk(x, weight, k, normalize)                      # compile before capture
    triton_small.add_rms_norm(h, y, nw, 1e-6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, w = triton_small.router_topk(x, weight, k, normalize)
        s, out = triton_small.add_rms_norm(h, y, nw, 1e-6)
    for seed in range(3):
        xs, _ = _router_inputs(e, d, dtype, seed=100 + seed, dev="cuda")
        x.copy_(xs), h.copy_(torch.randn_like(h)), y.copy_(torch.randn_like(y))
        ids.fill_(-1), w.fill_(float("nan")), s.fill_(float("nan")), out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_router(ids, w, x, weight, k, normalize)
        assert torch.equal(s, h + y)
        assert torch.equal(out, triton_small.rms_norm(h + y, nw, 1e-6))
    assert triton_small._router_counter(x.device).item() == 0
