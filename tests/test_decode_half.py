"""v5half decode (triton_decode_half: h's rows in two halves at down's two K pieces, gate_up and down of each half
their own launches, chained by PDL on CUDA) against v5q: the same bits at equal tiles.

Without CUDA the kernels run in Triton's interpreter (the four launches in order, no PDL). Shapes tiny with I in two
pieces (Q4_0 / MXFP4 / Q8_0 I = 96: 2 + 1 blocks of 32; the K formats I = 768: 512 + 256), 2 tokens x k = 3 of 6
slots (k padded to 4 in down's tile, a missing slot); inputs random (never zeros), a new x each run (an h block left
unwritten cannot pass with the bits of the run before); outputs poisoned with NaN.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from test_kernels_triton import DEV, V3_WIDE, make_experts, rel_err, routing, run_kernel

from moetier.kernels import ops
from moetier.kernels import triton_decode_half as half
from moetier.kernels import triton_moe as tm

gpu = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")     # as test_kernels_triton: reads past a buffer
SHAPES = {"Q4_0": (64, 96), "MXFP4": (64, 96), "Q8_0": (64, 96), "Q4_K": (256, 768), "Q5_K": (256, 768),
          "Q6_K": (256, 768), "IQ3_XXS": (256, 768)}                   # (D, I)
SLOW = pytest.mark.gpu                          # the interpreter takes ~5 s a K-format run: their other cases on CUDA


@pytest.fixture(autouse=True, scope="module")
def _interpreted():
    if DEV == "cpu" and type(tm.v5._gate_up_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton_decode_q8 was imported before TRITON_INTERPRET=1 was set; run this file alone")


def case(fmt: str, gpt_oss: bool):
    d, i = SHAPES[fmt]
    gu, dn, biases = make_experts(fmt, 6, d, i, bias=gpt_oss)
    act = ops.Act("clamped_swiglu", 1.702, 7.0) if gpt_oss else "swiglu"
    return d, gu, dn, biases, act


@gpu
@cuda
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "Q6_K", "MXFP4"])
def test_decode_v5half_at_qwen3_30b_shapes_in_a_graph(fmt):
    """Qwen3-30B-A3B's layer (D 2048, I 768, k = 8 of 10 slots), T = 1, float32 x (as the v5 twin tests: bf16 rounding
    would blur the comparison with the twin), PDL on (first in this file: the device call's time): at v5q's tile in
    both halves the same bits as v5q; at the shipped tiles within 1e-4 of the int8 twin, and the replays of a CUDA
    graph of 3 calls (3 routings) equal to eager calls, twice (PDL in a graph; the counters reset)."""
    d, i, k = 2048, 768, 8
    gu, dn, _ = make_experts(fmt, 10, d, i, bias=False)
    x = torch.randn(1, d, device=DEV)
    rs = [routing(1, k, 10, seed=s, miss=s == 0) for s in range(3)]
    xk, gw, dw, code, alpha, limit, b = ops._kernel_args(x, gu, dn, fmt, ops.Act(), None)
    tile = tm.v5.GATE_UP5Q.get(fmt, tm.v5.GATE_UP5[fmt])

    def call(ids, w, variant="v5half", out=None, **cfg):
        return tm.moe_decode(xk, ids, w, gw, dw, code, alpha, limit, b, out=out, variant=variant, **cfg)
    for ids, w in rs:
        assert torch.equal(call(ids, w, cfg_gate_up=tile), call(ids, w, "v5q", cfg_gate_up=tile))
        want = ops.moe_native(x, ids, w, gu, dn, "swiglu", None, fmt, act_q8=True)
        assert rel_err(call(ids, w), want) <= 1e-4
    eager = [call(ids, w).clone() for ids, w in rs]
    outs = [torch.full_like(xk, float("nan")) for _ in rs]
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for (ids, w), out in zip(rs, outs):
            call(ids, w, out=out)
    for _ in range(2):
        for out in outs:
            out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, e) for o, e in zip(outs, eager))


@pytest.mark.parametrize("fmt,gpt_oss,rows,t", [
    ("Q4_0", True, 16, 1), ("Q4_0", False, 32, 2), ("MXFP4", False, 32, 1), ("Q6_K", False, 128, 1),
    pytest.param("MXFP4", True, 16, 2, marks=SLOW), pytest.param("Q8_0", False, 16, 2, marks=SLOW),
    pytest.param("Q4_K", True, 16, 2, marks=SLOW), pytest.param("Q5_K", False, 128, 2, marks=SLOW),
    pytest.param("Q6_K", True, 16, 2, marks=SLOW), pytest.param("IQ3_XXS", False, 32, 2, marks=SLOW)])
def test_decode_v5half_equals_v5q(fmt, gpt_oss, rows, t):
    """t tokens, both halves at v5q's gate_up tile of `rows` rows (16: h quantized by the last program of a 32-block,
    the counters reset by it: two runs; 32 and more: in registers) and down at V3_WIDE's: the same bits as v5q, since
    down adds its two K pieces' dots as one launch does."""
    d, gu, dn, biases, act = case(fmt, gpt_oss)
    ids, w = routing(t, 3, 6)
    cfg = {"cfg_gate_up": (rows, 0, 4), "cfg_down": V3_WIDE["cfg_down"]}
    _, gw, dw, *_ = ops._kernel_args(torch.zeros(1, d, device=DEV), gu, dn, fmt, ops.as_act(act), biases)
    assert half.supports(gw, dw, d, cfg["cfg_gate_up"])               # not v5q's fallback
    for _ in range(2 if rows < 32 else 1):
        x = torch.randn(t, d, device=DEV) * (3.0 if gpt_oss else 1.0)
        want = run_kernel("decode", x, ids, w, gu, dn, fmt, act, biases, variant="v5q", **cfg)
        got = run_kernel("decode", x, ids, w, gu, dn, fmt, act, biases, variant="v5half", **cfg)
        assert torch.equal(got, want), (cfg, (got - want).abs().max().item())


def test_decode_v5half_tiles_of_its_own_and_one_piece():
    """A tile pair (A, B) (h quantized in registers by A's programs, by the counters in B's) against the int8 twin;
    I of one power-of-two piece (64 = 2 blocks) has nothing to split: v5q's launches, v5q's bits."""
    d, gu, dn, biases, act = case("Q4_0", False)
    ids, w = routing(1, 3, 6)
    x = torch.randn(1, d, device=DEV)
    want = ops.moe_native(x, ids, w, gu, dn, act, biases, "Q4_0", act_q8=True)
    got = run_kernel("decode", x, ids, w, gu, dn, "Q4_0", act, biases, variant="v5half",
                     cfg_gate_up=((32, 0, 4), (8, 0, 2)), cfg_down=V3_WIDE["cfg_down"])
    assert rel_err(got, want) <= 1e-4
    gu, dn, _ = make_experts("Q4_0", 6, d, 64, bias=False)
    _, gw, dw, *_ = ops._kernel_args(x, gu, dn, "Q4_0", ops.Act(), None)
    assert half.first_rows(dw) == 0 and not half.supports(gw, dw, d)
    assert torch.equal(run_kernel("decode", x, ids, w, gu, dn, "Q4_0", act, None, variant="v5half", **V3_WIDE),
                       run_kernel("decode", x, ids, w, gu, dn, "Q4_0", act, None, variant="v5q", **V3_WIDE))


def test_decode_v5half_is_opt_in():
    assert tm.variant_of("Q4_0", "v5half") == "v5half"
    assert "v5half" not in tm.DEFAULT_VARIANT.values()
