"""v6 (kernels/triton_decode_v6.py: the int8-activation decode pair in one launch whose programs wait on counters)
against v5pdl (four launches: x quantizer, gate_up, h quantizer, down) at the same tiles: the same integer dots and
the same quantizer, so the same bits.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), which runs
a grid's programs one after another in id order: every quantizer program before any gate_up program, every gate_up
program before any down program, so each spin passes at its first poll. What this checks is the math, the program
roles and index maps, the masks, the per-block h quantizer and the counters' reset; not the memory ordering on a
GPU (bench/bench_gpu_kernels.py --variants compares v6 with the twin there). Wide tiles: the interpreter's time grows
with programs x ops.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from test_kernels_triton import DEV, make_experts, rel_err, routing, run_kernel

from moetier.kernels import ops
from moetier.kernels import triton_decode_q8 as q8
from moetier.kernels import triton_decode_v6 as v6
from moetier.kernels import triton_moe as tm
from moetier.kernels.triton_weights import BLOCK

# (D, I): rows in two power-of-two pieces where it costs little (Q8_0 / Q4_0 / MXFP4 D = 96: 2 + 1 blocks, I = 160:
# 4 + 1, 96: 2 + 1); K-quants at T=1 D = 768 (Q4_K / Q5_K 8 + 4 chunks, Q6_K 4 + 2), at T=3 one super-block
SHAPES = {1: {"K": (768, 256), "32": (96, 160)}, 3: {"K": (256, 256), "32": (96, 96)}}
# gate_up: one program per 32-block of h (test_v6_default_tile: several); down rows masked (D = 96 of 128 / 256)
WIDE = {1: {"cfg_gate_up": (32, 0, 4), "cfg_down": (256, 0, 4)},
        3: {"cfg_gate_up": (32, 0, 4), "cfg_down": (128, 0, 4)}}


@pytest.fixture(autouse=True, scope="module")
def _interpreted():
    if DEV == "cpu" and type(v6._moe_v6_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton_decode_v6 was imported before TRITON_INTERPRET=1 was set; run this file alone")


def shape(fmt: str, t: int) -> tuple[int, int]:
    return SHAPES[t]["K" if BLOCK[fmt] == 256 else "32"]


def counters_zero(t: int, k: int, i: int) -> bool:
    c = q8.arrival_counters(torch.device(DEV), v6.BLOCKS.value + t * k * (i // 32), "decode_v6")
    return bool((c == 0).all())


@pytest.mark.parametrize("fmt", q8.FORMATS)
@pytest.mark.parametrize("t,k", [(1, 3), (3, 2)])
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["swiglu", "clamped+bias"])
def test_v6_equals_v5pdl(fmt, t, k, gpt_oss):
    """Every v5 format, T in {1, 3}, k of 6 slots (a missing slot), SwiGLU and gpt-oss's clamped SwiGLU with biases;
    output poisoned with NaN (run_kernel: every element written); the counters back to 0 after the launch."""
    d, i = shape(fmt, t)
    k = k + (gpt_oss and t == 1)                                       # k = 2, 3, 4 across the cases
    gu, dn, biases = make_experts(fmt, 6, d, i, bias=gpt_oss, seed=t)
    act = ops.Act("clamped_swiglu", 1.702, 7.0) if gpt_oss else "swiglu"
    ids, w = routing(t, k, 6, seed=k)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(5)).to(DEV) * (3.0 if gpt_oss else 1.0)
    want = run_kernel("decode", x, ids, w, gu, dn, fmt, act, biases, variant="v5pdl", **WIDE[t])
    got = run_kernel("decode", x, ids, w, gu, dn, fmt, act, biases, variant="v6", **WIDE[t])
    assert rel_err(got, want) <= 1e-6, (got - want).abs().max().item()
    assert counters_zero(t, k, i)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K"])
def test_v6_twice_reuses_the_counters(fmt):
    """Two launches in a row (as CUDA-graph replays and the next layer do): the last down program's reset leaves the
    counters at 0, so the second launch waits for its own x and h and gives the same bits; a third with another
    routing gives v5pdl's."""
    t, k = 3, 3
    d, i = shape(fmt, t)
    gu, dn, _ = make_experts(fmt, 6, d, i, bias=False, seed=4)
    ids, w = routing(t, k, 6, seed=2)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(6)).to(DEV)
    first = run_kernel("decode", x, ids, w, gu, dn, fmt, "swiglu", None, variant="v6", **WIDE[t])
    assert counters_zero(t, k, i)
    second = run_kernel("decode", x, ids, w, gu, dn, fmt, "swiglu", None, variant="v6", **WIDE[t])
    assert torch.equal(first, second) and counters_zero(t, k, i)
    ids2, w2 = routing(t, k, 6, seed=9, miss=False)
    got = run_kernel("decode", x, ids2, w2, gu, dn, fmt, "swiglu", None, variant="v6", **WIDE[t])
    want = run_kernel("decode", x, ids2, w2, gu, dn, fmt, "swiglu", None, variant="v5pdl", **WIDE[t])
    assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("fmt,dtype", [("Q4_0", torch.float16), ("Q8_0", torch.float32)])
def test_v6_default_tile(fmt, dtype):
    """The shipped tile (default_tile: small gate_up programs, several per 32-block of h; one num_warps), fp16 x
    (h rounded to fp16 as v5 does), against v5pdl at its own tiles (the same rows' sums in the interpreter)."""
    d, i = 96, 160
    gu, dn, _ = make_experts(fmt, 6, d, i, bias=False, dtype=dtype, seed=3)
    ids, w = routing(1, 2, 6, dtype=dtype)
    x = torch.randn(1, d, generator=torch.Generator().manual_seed(8)).to(DEV, dtype)
    tile = v6.default_tile(fmt, fmt)
    assert 32 % tile.gate_up_bn == 0 and tile.gate_up_bn < 32                   # several programs per h block
    want = run_kernel("decode", x, ids, w, gu, dn, fmt, "swiglu", None, variant="v5pdl")
    got = run_kernel("decode", x, ids, w, gu, dn, fmt, "swiglu", None, variant="v6")
    assert rel_err(got, want) <= 1e-6


def test_v6_pre_quantized_x():
    """pre_x: x quantized before the launch (a fused norm's int8 copy, as `quantize` makes it): no quantizer
    programs, no wait for x, the same result."""
    fmt, t, d, i = "Q8_0", 3, 96, 160
    gu, dn, _ = make_experts(fmt, 6, d, i, bias=False, seed=5)
    ids, w = routing(t, 2, 6)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(9)).to(DEV)
    xk, gw, dw, code, alpha, limit, b = ops._kernel_args(x, gu, dn, fmt, ops.Act(), None)
    flat_ids, flat_w = ids.reshape(-1).contiguous(), w.reshape(-1).contiguous()
    tile = v6.Tile6(32, 64, 4)
    runs = []
    for pre in (None, q8.quantize(xk)):
        out = torch.full_like(x, float("nan"))
        runs.append(v6.moe_v6(xk, flat_ids, flat_w, gw, dw, code, alpha, limit, b, out, tile, pre_x=pre))
        assert torch.isfinite(out).all() and counters_zero(t, 2, i)
    assert torch.equal(runs[0], runs[1])


def test_v6_variant_and_fallback(monkeypatch):
    """variant "v6" is opt-in (not a default); moe_decode runs v5pdl where v6 does not run (v6.supports: v5 reads
    both projections; forced off here, since v5 now reads every quantized format), same bits; a gate_up tile whose
    rows do not divide 32 is refused with a message."""
    assert tm.variant_of("Q4_0", "v6") == "v6" and "v6" not in tm.DEFAULT_VARIANT.values()
    with pytest.raises(ValueError, match="the variants are"):
        tm.variant_of("Q4_0", "v7")
    with pytest.raises(ValueError, match="v2 every quantized"):
        tm.variant_of("dense", "v6")
    d, i = 96, 96
    gu, dn, _ = make_experts("Q8_0", 4, d, i, bias=False)
    ids, w = routing(1, 2, 4)
    x = torch.randn(1, d, generator=torch.Generator().manual_seed(1)).to(DEV)
    want = run_kernel("decode", x, ids, w, gu, dn, "Q8_0", "swiglu", None, variant="v5pdl", **WIDE[3])
    with monkeypatch.context() as m:
        m.setattr(v6, "supports", lambda *a: False)
        m.setattr(v6, "moe_v6", None)                                  # would fail if called
        assert torch.equal(run_kernel("decode", x, ids, w, gu, dn, "Q8_0", "swiglu", None, variant="v6", **WIDE[3]),
                           want)
    with pytest.raises(ValueError, match="divide 32"):
        run_kernel("decode", x, ids, w, gu, dn, "Q8_0", "swiglu", None, variant="v6", cfg_gate_up=(64, 0, 4))
