"""v4 decode (triton_decode_v4: the whole MoE layer of one token in one persistent launch) against the
torch twin (kernels.ops.moe_native).

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported): programs run one after another there, so the launcher runs phase 1 then phase 2 (PHASES=1,
2) instead of the grid barrier. The `gpu` tests run PHASES=3 (the barrier) at Qwen3-30B-A3B shapes,
eagerly and as a CUDA graph replayed several times (the barrier's generation counter across replays).
Inputs random (never zeros), fixed seeds; outputs poisoned with NaN.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from test_kernels_triton import DEV, make_experts, rel_err, routing

from moetier.kernels import ops
from moetier.kernels import triton_decode_v4 as v4
from moetier.kernels import triton_moe as tm

gpu = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True, scope="module")
def _interpreted():
    if DEV == "cpu" and type(v4._moe_v4_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton_decode_v4 was imported before TRITON_INTERPRET=1 was set; run this file alone")


def misses(ids: torch.Tensor, cols) -> torch.Tensor:
    ids = ids.clone()
    ids[0, list(cols)] = -1
    return ids


def run_v4(x, ids, w, gu, dn, fmt, act="swiglu", biases=None, **kw):
    """moe_decode(variant="v4") (or moe_v4 directly with kw) into a NaN-poisoned output."""
    xk, gw, dw, code, alpha, limit, b = ops._kernel_args(x, gu, dn, fmt, ops.as_act(act), biases)
    out = torch.full_like(x, float("nan"))                     # every element must be written
    if kw:
        got = v4.moe_v4(xk, ids.reshape(-1).contiguous(), w.reshape(-1).contiguous(), gw, dw, out, **kw)
    else:
        got = tm.moe_decode(xk, ids, w, gw, dw, code, alpha, limit, b, out=out, variant="v4")
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    return got


@pytest.mark.parametrize("fmt", v4.V4_FORMATS)
@pytest.mark.parametrize("k", [4, 8])
def test_v4_matches_twin(fmt, k):
    """D = 256, I = 96 (3 blocks of 32: K of the down rows in two pieces, 2 + 1; phase-1 items' rows
    masked at the tail), k of 12 slots with two misses (-1), default programs (8 on CPU)."""
    d, i = 256, 96
    gu, dn, _ = make_experts(fmt, 12, d, i, bias=False, seed=3)
    ids, w = routing(1, k, 12, seed=4 + k)
    ids = misses(ids, (1, k - 1))
    torch.manual_seed(k)
    x = torch.randn(1, d, device=DEV)
    want = ops.moe_native(x, ids, w, gu, dn, "swiglu", None, fmt)
    assert rel_err(run_v4(x, ids, w, gu, dn, fmt), want) <= 1e-4


@pytest.mark.parametrize("fmt", v4.V4_FORMATS)
@pytest.mark.parametrize("programs, chunk", [(3, 1), (5, 2), (64, None)])
def test_v4_programs_and_chunks(fmt, programs, chunk):
    """Odd program counts (uneven items per program, output rows split with a masked tail), phase-2
    chunks of 1 or 2 experts (k = 6, padded to 8: the last chunk partly masked), more programs than rows
    need; the expert of one chunk skipped."""
    torch.manual_seed(7)
    d, i, k = 256, 96, 6
    gu, dn, _ = make_experts(fmt, 12, d, i, bias=False, seed=5)
    ids, w = routing(1, k, 12, seed=6)
    ids = misses(ids, (2,))
    x = torch.randn(1, d, device=DEV)
    want = ops.moe_native(x, ids, w, gu, dn, "swiglu", None, fmt)
    assert rel_err(run_v4(x, ids, w, gu, dn, fmt, num_programs=programs, chunk=chunk), want) <= 1e-4


def test_v4_all_missing_gives_zero():
    torch.manual_seed(0)
    gu, dn, _ = make_experts("Q4_0", 4, 64, 96, bias=False)
    ids = torch.full((1, 4), -1, dtype=torch.int32, device=DEV)
    w = torch.rand(1, 4, device=DEV) + 0.1
    got = run_v4(torch.randn(1, 64, device=DEV), ids, w, gu, dn, "Q4_0")
    assert torch.equal(got, torch.zeros_like(got))


def test_v4_bf16_activations():
    """x in bf16: h rounded to bf16 between the projections as the twin does; out in bf16."""
    torch.manual_seed(1)
    gu, dn, _ = make_experts("Q8_0", 12, 256, 96, bias=False, seed=8)
    ids, w = routing(1, 8, 12, seed=9, dtype=torch.bfloat16)
    x = torch.randn(1, 256, device=DEV).to(torch.bfloat16)
    want = ops.moe_native(x, ids, w, gu, dn, "swiglu", None, "Q8_0")
    assert rel_err(run_v4(x, ids, w, gu, dn, "Q8_0"), want) <= 1e-2


@pytest.mark.parametrize("case", ["tokens", "bias", "clamped", "format"])
def test_v4_falls_back_to_v3(case):
    """What v4 does not read (T > 1, biases, GPT-OSS activation, Q4_K) runs v3 and matches the twin."""
    torch.manual_seed(2)
    fmt = "Q4_K" if case == "format" else "Q4_0"
    d, i = (256, 256) if fmt == "Q4_K" else (64, 96)
    gu, dn, biases = make_experts(fmt, 6, d, i, bias=case == "bias")
    act = ops.Act("clamped_swiglu", 1.702, 7.0) if case in ("bias", "clamped") else "swiglu"
    ids, w = routing(3 if case == "tokens" else 1, 2, 6)
    x = torch.randn(ids.shape[0], d, device=DEV)
    xk, gw, dw, code, *_ = ops._kernel_args(x, gu, dn, fmt, ops.as_act(act), biases)
    assert not v4.supports(xk, gw, dw, code, biases or (None, None))
    want = ops.moe_native(x, ids, w, gu, dn, act, biases, fmt)
    assert rel_err(run_v4(x, ids, w, gu, dn, fmt, act, biases), want) <= 1e-4


def test_v4_needs_aligned_scale_planes():
    """The fp16 block scales are read as int32 words (triton_decode_v4._wload): a scale plane that does not
    start on 4 bytes is not v4's (moe_decode then runs v3)."""
    import copy
    torch.manual_seed(5)
    gu, dn, _ = make_experts("Q4_0", 4, 64, 96, bias=False)
    x = torch.randn(1, 64, device=DEV)
    xk, gw, dw, code, *_ = ops._kernel_args(x, gu, dn, "Q4_0", ops.Act(), None)
    assert v4.supports(xk, gw, dw, code, (None, None))
    odd = copy.copy(gw)
    d = gw.v2_planes[1]
    shifted = torch.empty(d.numel() + 1, dtype=d.dtype, device=d.device)[1:].view(d.shape)
    odd.v2_planes = [gw.v2_planes[0], shifted, *gw.v2_planes[2:]]
    assert shifted.data_ptr() % 4 == 2 and not v4.supports(xk, odd, dw, code, (None, None))


def test_v4_variant_and_env_default(monkeypatch):
    assert tm.variant_of("Q4_0", "v4") == "v4" and tm.variant_of("Q6_K", "v4") == "v4"   # Q6_K: v3's fallback
    with pytest.raises(ValueError):
        tm.variant_of("dense", "v4")
    monkeypatch.setenv("MOETIER_DECODE_VARIANT", "v4")
    torch.manual_seed(3)
    assert tm.variant_of("Q8_0", None) == "v4"
    gu, dn, _ = make_experts("Q4_0", 12, 256, 96, bias=False, seed=10)
    ids, w = routing(1, 4, 12, seed=11)
    x = torch.randn(1, 256, device=DEV)
    want = ops.moe_native(x, ids, w, gu, dn, "swiglu", None, "Q4_0")
    xk, gw, dw, code, alpha, limit, b = ops._kernel_args(x, gu, dn, "Q4_0", ops.Act(), None)
    calls = []
    monkeypatch.setattr(v4, "moe_v4", lambda *a, **kw: _count(calls, a, kw))
    got = tm.moe_decode(xk, ids, w, gw, dw, code, alpha, limit, b)
    assert calls and rel_err(got, want) <= 1e-4


_moe_v4 = v4.moe_v4


def _count(calls, a, kw):
    calls.append(1)
    return _moe_v4(*a, **kw)


# ------------------------------------------------------------------ real GPU: PHASES=3, the barrier
@gpu
@cuda
@pytest.mark.parametrize("fmt", v4.V4_FORMATS)
def test_gpu_v4_qwen3_shapes_and_graph_replays(fmt, monkeypatch):
    """Qwen3-30B-A3B: D=2048, I=768, k=8 of 128 slots (a miss), bf16; eager (MOETIER_V4_CHECK: raises
    if a program gave up at the barrier), then a CUDA graph replayed 3 times with new ids / w / x."""
    torch.manual_seed(4)
    monkeypatch.setenv("MOETIER_V4_CHECK", "1")
    d, i, s = 2048, 768, 128
    gu, dn, _ = make_experts(fmt, s, d, i, bias=False, dtype=torch.bfloat16)
    ids, w = routing(1, 8, s, dtype=torch.bfloat16)
    x = torch.randn(1, d, device=DEV, dtype=torch.bfloat16)
    want = ops.moe_native(x, ids, w, gu, dn, "swiglu", None, fmt)
    assert rel_err(run_v4(x, ids, w, gu, dn, fmt), want) <= 2e-2
    monkeypatch.delenv("MOETIER_V4_CHECK")
    xk, gw, dw, code, alpha, limit, b = ops._kernel_args(x, gu, dn, fmt, ops.Act(), None)
    out = torch.empty_like(x)
    tm.moe_decode(xk, ids, w, gw, dw, code, alpha, limit, b, out=out, variant="v4")     # compiled
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tm.moe_decode(xk, ids, w, gw, dw, code, alpha, limit, b, out=out, variant="v4")
    for seed in range(3):
        new_ids, new_w = routing(1, 8, s, seed=seed + 20, dtype=torch.bfloat16)
        ids.copy_(new_ids), w.copy_(new_w), xk.copy_(torch.randn_like(xk))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert rel_err(out, ops.moe_native(xk, ids, w, gu, dn, "swiglu", None, fmt)) <= 2e-2
