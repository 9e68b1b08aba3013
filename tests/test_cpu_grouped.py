"""The expert-major CPU MoE layer for prefill (kernels/cpu.moe_grouped, cpu_grouped.c) against the float
reference (dequantized weights, F.linear, SwiGLU, weighted sum), in every format and build, and inside
QuantExperts and the memory tiers' expert_ffn."""
from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from helpers import max_rel_err

from moetier.kernels import cpu
from moetier.models.layers import swiglu
from moetier.models.quant_experts import QuantExperts
from moetier.quant.formats import dequantize, get_format
from moetier.quant.pack import quantize as pack

needs_c = pytest.mark.skipif(cpu.backend() != "c", reason="the C kernels did not build")
FORMATS = ["Q4_0", "Q8_0", "Q5_1", "MXFP4", "IQ3_XXS", "IQ4_XS", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", ("Q4_K", "Q6_K"),
           ("Q4_0", "Q8_0"), ("Q8_0", "Q6_K"), "IQ2_XXS", ("IQ2_XS", "IQ2_S"), "Q2_K", ("Q3_K", "Q5_K")]
Q8_FORMATS = ["Q4_0", "Q8_0", "Q5_1", "MXFP4", "IQ3_XXS", "IQ4_XS", "IQ4_NL", ("Q4_0", "Q6_K"), "Q4_K", "Q6_K", ("Q4_K", "Q6_K"),
              "IQ2_XXS", ("IQ2_XS", "IQ2_S"), "Q2_K", "Q3_K", ("Q2_K", "Q3_K")]
LOW_BIT = ["IQ3_S", "IQ1_S", "IQ1_M", ("IQ1_S", "IQ1_M")]    # the q8 row dot per (row, pair); float: C dequantizers
FORMATS += LOW_BIT
Q8_FORMATS += LOW_BIT


def sizes(qtype):
    """odd-ish D, I the formats allow: 256-blocks need multiples of 256, 32-blocks get 96 / 160."""
    big = any(get_format(q).block_size == 256 for q in (qtype if isinstance(qtype, tuple) else (qtype,)))
    return (256, 512) if big else (96, 160)


def layer(qtype, e, d, i, seed=0):
    gq, dq = qtype if isinstance(qtype, tuple) else (qtype, qtype)
    g = torch.Generator().manual_seed(seed)
    shapes = ((gq, (i, d)), (gq, (i, d)), (dq, (d, i)))
    return [pack(torch.randn(e, r, c, generator=g) * 0.1, q) for q, (r, c) in shapes]


def skewed_route(t, e, k, d, seed=1):
    """expert 0 in every token (many pairs), the last two experts never used, the rest random."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(e - 3, generator=g)[:k - 1]])
                       for _ in range(t)])
    return x, ids, torch.rand(t, k, generator=g) + 0.1


def reference(qtype, gate, up, down, x, ids, w):
    """float64: each pair's expert dequantized, F.linear, SwiGLU, weighted sum."""
    gq, dq = (get_format(q) for q in (qtype if isinstance(qtype, tuple) else (qtype, qtype)))
    e, i, d = gate.shape[0], gate.shape[1], down.shape[1]
    wg, wu = (dequantize(r.contiguous(), gq, (e, i, d)).double() for r in (gate, up))
    wd = dequantize(down.contiguous(), dq, (e, d, i)).double()
    y = torch.zeros(x.shape[0], d, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            ex, xt = int(ids[t, j]), x[t].double()
            h = F.silu(F.linear(xt, wg[ex])) * F.linear(xt, wu[ex])
            y[t] += w[t, j].double() * F.linear(h, wd[ex])
    return y.float()


def rounded_reference(qtype, gate, up, down, x, ids, w, block):
    """float64 on an integer tile's rounding: x and each pair's float32 activation rounded to int8 per `block` values
    (round(v / d), d = max |v| / 127, in float32 as the kernels: a float64 quotient flipped one value of 37K near a
    half), times the dequantized weights. One format for all three matrices. -> (reference [T, D], near [T]): near
    marks the tokens with an activation within 1e-4 of a rounding half, which the kernel's float32 sums (another
    order) may round the other way: one step of one activation, ~1e-3 of the output (seen once in 33 x 5 pairs)."""
    fmt = get_format(qtype)
    e, i, d = gate.shape[0], gate.shape[1], down.shape[1]

    def q8(v):             # as the kernels round: float32 d = max |v| / 127, q = round-half-even(v * (1 / d))
        blocks = v.float().reshape(-1, block)
        dk = blocks.abs().amax(-1, keepdim=True) / 127
        s = blocks * torch.where(dk > 0, 1 / torch.where(dk > 0, dk, 1), 0)
        near = bool(((s - s.floor() - 0.5).abs() < 1e-4).any())
        return (torch.round(s).double() * dk.double()).reshape(v.shape), near
    wg, wu = (dequantize(r.contiguous(), fmt, (e, i, d)).double() for r in (gate, up))
    wd = dequantize(down.contiguous(), fmt, (e, d, i)).double()
    ref = torch.zeros(x.shape[0], d, dtype=torch.float64)
    near = torch.zeros(x.shape[0], dtype=torch.bool)
    for tt in range(x.shape[0]):
        xq, _ = q8(x[tt])                                               # x's own rounding is the kernel's, bit for bit
        for j in range(ids.shape[1]):
            ex = int(ids[tt, j])
            h = (F.silu(wg[ex] @ xq) * (wu[ex] @ xq)).float()          # the kernel's float32 activation, near enough
            hq, hn = q8(h)
            near[tt] |= hn
            ref[tt] += w[tt, j].double() * (wd[ex] @ hq)
    return ref.float(), near


def assert_rounded_close(y, ref, near, tol=1e-5):
    """within tol of the rounded reference, except the `near` tokens: within 1e-2 (one activation step apart)"""
    assert not near.all()
    assert (y - ref)[~near].abs().max() <= tol * ref.abs().max()
    assert max_rel_err(y, ref) < 1e-2


def run(qtype, gate, up, down, x, ids, w, **kw):
    out = torch.full((x.shape[0], down.shape[1]), float("nan"))     # every element must be written
    y = cpu.moe_grouped(qtype, gate, up, down, x, ids, w, out=out, **kw)
    assert y.data_ptr() == out.data_ptr() and not y.isnan().any()
    return y


@needs_c
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("t,k", [(1, 2), (3, 8), (17, 4), (64, 6)])
def test_grouped_matches_float_reference(qtype, t, k):
    d, i = sizes(qtype)
    gate, up, down = layer(qtype, 12, d, i)
    x, ids, w = skewed_route(t, 12, k, d)
    ref = reference(qtype, gate, up, down, x, ids, w)
    y1 = run(qtype, gate, up, down, x, ids, w, threads=1)
    assert max_rel_err(y1, ref) < 1e-5
    assert torch.equal(run(qtype, gate, up, down, x, ids, w, threads=2), y1)     # no dependence on threads


@needs_c
@pytest.mark.parametrize("qtype", Q8_FORMATS)
@pytest.mark.parametrize("t,k", [(3, 8), (5, 3), (64, 6)])
def test_grouped_int8_activations_close(qtype, t, k):
    """q8: x and the activation rounded to int8 per 32 values (llama.cpp's way): ~1% relative error, as moe_tokens;
    256-value formats with an integer tile (AVX2 / AVX-512BW builds): per 256 values (llama.cpp's Q8_K), ~2%."""
    d, i = sizes(qtype)
    gate, up, down = layer(qtype, 12, d, i)
    x, ids, w = skewed_route(t, 12, k, d)
    ref = reference(qtype, gate, up, down, x, ids, w)
    y1 = run(qtype, gate, up, down, x, ids, w, q8=True, threads=1)
    assert (y1 - ref).norm() / ref.norm() < 0.03
    assert torch.equal(run(qtype, gate, up, down, x, ids, w, q8=True, threads=2), y1)
    tok = cpu.moe_tokens(qtype, gate, up, down, x, ids, w, q8=True)          # int8 activations per 32 values
    q8k = any(f in Q8K_FORMATS and cpu.grouped_int8_tile(f) for f in (qtype if isinstance(qtype, tuple) else (qtype,)))
    assert (y1 - tok).norm() / ref.norm() < (0.03 if q8k else 0.01)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """march -> the library built for it, once per module ("native": the session's own library)."""
    libs = {}

    def get(march):
        if march == "native":
            if cpu.backend() != "c":
                pytest.skip("the C kernels did not build")
            return None
        if cpu.backend() != "c" or platform.machine() != "x86_64":
            pytest.skip("needs gcc on x86-64")
        if march == "haswell" and not {"avx2", "fma", "f16c"} <= set(cpu._cpu_signature().split()):
            pytest.skip("this CPU has no AVX2/FMA/F16C")
        if march == "skylake-avx512" and not {"avx512f", "avx512bw", "avx512vl"} <= set(cpu._cpu_signature().split()):
            pytest.skip("this CPU has no AVX-512BW")
        if march == "alderlake" and not {"avx2", "avx_vnni"} <= set(cpu._cpu_signature().split()):
            pytest.skip("this CPU has no AVX-VNNI")
        if march not in libs:
            libs[march] = cpu.open_library(cpu.build_library(tmp_path_factory.mktemp("kernels"), march=march))
        return libs[march]
    return get


# 256-value formats on the unpacked super-block tile (cpu_grouped_sb.c)
SB_FORMATS = ["Q2_K", "Q3_K", "Q5_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]
Q8K_FORMATS = ("Q4_K", "Q6_K", *SB_FORMATS)


@pytest.mark.parametrize("march", ["native", "haswell", "skylake-avx512", "alderlake"])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", *SB_FORMATS])
@pytest.mark.parametrize("t,k", [(1, 1), (7, 3), (33, 5)])
def test_grouped_q8k_tile_matches_its_arithmetic(qtype, t, k, march, build):
    """The Q4_K / Q6_K integer tile (odd pair counts: 1-4 pair tiles on AVX-512, pair loops on AVX2) and the other
    256-value formats' unpacked super-block tile (offsets, mins, per-16 / per-32 scales) against float64 on the same
    rounding: x and the activation rounded to int8 per 256 values (scale max |v| / 127), products of the dequantized
    weights. haswell: the AVX2 tiles (no AVX-512); skylake-avx512: the 4 x 4 tile 64 values a vector without VNNI
    (native on a VNNI box: rows in lanes for >= 8 pairs)."""
    lib = build(march)
    if not cpu.grouped_int8_tile(qtype, lib):
        pytest.skip("no integer tile for this type in this build (needs AVX2)")

    gate, up, down = layer(qtype, 9, 512, 256, seed=3)
    x, ids, w = skewed_route(t, 9, k, 512, seed=4)
    ref, near = rounded_reference(qtype, gate, up, down, x, ids, w, 256)
    y = run(qtype, gate, up, down, x, ids, w, q8=True, threads=1, lib=lib)
    assert_rounded_close(y, ref, near)
    assert torch.equal(run(qtype, gate, up, down, x, ids, w, q8=True, threads=2, lib=lib), y)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "IQ4_NL"])
@pytest.mark.parametrize("march", ["haswell", "alderlake"])
@pytest.mark.parametrize("t,k", [(5, 3), (40, 4)])
def test_grouped_q4_0_rows_in_lanes_match_their_arithmetic(t, k, march, build, qtype):
    """Q4_0 rows x int8 activations per 32 values with 8 rows in the lanes (grp_tile8_nib: 256-bit dpbusd with
    AVX-512 VNNI or AVX-VNNI (alderlake), or AVX2's maddubs summed in int16 (haswell; an expert with >= 16 pairs, here
    expert 0 at 40 tokens, unpacked once:
    grp_rows8_q4_0_avx2)) against float64 on the same rounding (round(v / d), d = max |v| / 127 per 32 values). The
    integer sums are exact; this machine's own build is held to the same reference and to the AVX2 build's values
    within float32 rounding, not to its bits: on an AVX-512 VNNI box the float steps round in another order (8 of 480
    and 116 of 3,840 values differed in the last bit, both builds at 1.3-1.5e-7 of the reference). Q8_0 and IQ4_NL
    rows likewise (their values + 128 in the lanes: VNNI builds; haswell's Q8_0 the 4 x 4 tile); this machine's build
    with AVX-512 VNNI takes 16 rows in the lanes of 512-bit vectors (grp_tile16_nib: the rows here are 32- and 64-row tasks)."""
    lib = build(march)
    if not cpu.grouped_int8_tile(qtype, lib):
        pytest.skip(f"no integer tile for {qtype} in the {march} build")

    gate, up, down = layer(qtype, 9, 96, 160, seed=5)
    x, ids, w = skewed_route(t, 9, k, 96, seed=6)
    ref, near = rounded_reference(qtype, gate, up, down, x, ids, w, 32)
    y = run(qtype, gate, up, down, x, ids, w, q8=True, threads=1, lib=lib)
    assert_rounded_close(y, ref, near)
    assert torch.equal(run(qtype, gate, up, down, x, ids, w, q8=True, threads=2, lib=lib), y)
    if cpu.backend() == "c" and cpu.grouped_int8_tile(qtype):
        own = run(qtype, gate, up, down, x, ids, w, q8=True, threads=1)
        assert max_rel_err(own, ref) < 1e-5 and max_rel_err(own, y) < 1e-6
        assert torch.equal(run(qtype, gate, up, down, x, ids, w, q8=True, threads=2), own)


@pytest.fixture
def amx():
    """AMX on for the test (skipped where the CPU, build or OS has none), the process's state restored after"""
    if cpu.backend() != "c" or not cpu.amx():
        pytest.skip("no AMX tile here (needs amx_int8 and the kernel's permission)")
    yield
    cpu.amx(True)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "IQ4_NL", "IQ4_XS", ("Q4_0", "Q8_0")])
@pytest.mark.parametrize("t,k", [(40, 4), (23, 6)])
def test_grouped_amx_tile_is_the_vnni_tile_bit_for_bit(qtype, t, k, amx):
    """The 32-value formats' AMX tile (TDPBUSD on 16 rows x a group of 16 pairs, cpu_grouped.c grp_amx_tile) gives
    the AVX-512 VNNI tile's bits: the same integer sums, the same float steps in the same order. Expert 0 has every
    token (40: groups of 16, 16, 8; 23: 16, 7), the others 5-20 pairs (under 9: the VNNI tile); K 96 / 160 are odd
    block counts (the three blocks in flight end early); both sides (x's groups, h's) and both row counts of tasks;
    and against float64 on the tile's rounding."""
    d, i = (256, 512) if "IQ4_XS" in qtype else (96, 160)
    gate, up, down = layer(qtype, 9, d, i, seed=7)
    x, ids, w = skewed_route(t, 9, k, d, seed=8)
    y = run(qtype, gate, up, down, x, ids, w, q8=True, threads=2)
    assert cpu.amx(False) is False
    vnni = run(qtype, gate, up, down, x, ids, w, q8=True, threads=2)
    cpu.amx(True)
    assert torch.equal(y, vnni)
    assert torch.equal(run(qtype, gate, up, down, x, ids, w, q8=True, threads=1), y)
    if not isinstance(qtype, tuple):
        ref, near = rounded_reference(qtype, gate, up, down, x, ids, w, 32)
        assert_rounded_close(y, ref, near)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "IQ4_NL", "IQ4_XS"])
@pytest.mark.parametrize("t,n", [(37, 48), (16, 44), (70, 80)])
def test_qgemm_amx_tile_is_the_vnni_tile_bit_for_bit(qtype, t, n, amx):
    """cpu.qgemm (a dense projection of a prompt) on the AMX tile: the tokens in groups of 16 (37: 16, 16, 5), tasks
    of 48 rows (48) and of 64 and 16 (80), a 44-row one (44: not 16-row blocks, the other tiles), equal to the VNNI tile and within 1e-5 of
    float64 on x rounded per 32 values"""
    k = 256 if qtype == "IQ4_XS" else 96
    g = torch.Generator().manual_seed(13)
    wq = pack(torch.randn(n, k, generator=g) / 16, qtype)
    x = torch.randn(t, k, generator=g)
    y = cpu.qgemm(qtype, wq, x, threads=2)
    cpu.amx(False)
    vnni = cpu.qgemm(qtype, wq, x, threads=2)
    cpu.amx(True)
    assert torch.equal(y, vnni) and not y.isnan().any()
    blocks = x.reshape(-1, 32)
    dk = blocks.abs().amax(-1, keepdim=True) / 127
    xq = (torch.round(blocks * (1 / dk)).double() * dk.double()).reshape(t, k)
    want = xq @ dequantize(wq, get_format(qtype), (n, k)).double().T
    assert max_rel_err(y, want.float()) < 1e-5


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", ("Q4_K", "Q6_K")])
@pytest.mark.parametrize("t,k", [(3, 8), (5, 3), (64, 6)])
def test_avx2_build_q8k_tile(qtype, t, k, build):
    """An AVX2 build without AVX-512 (haswell) has the Q4_K / Q6_K integer tile too: int8 activations per 256 values
    (~2% from the float reference, as the AVX-512 tile), results independent of the thread count."""
    lib = build("haswell")
    assert all(cpu.grouped_int8_tile(f, lib) for f in ("Q4_K", "Q6_K"))
    d, i = sizes(qtype)
    gate, up, down = layer(qtype, 12, d, i)
    x, ids, w = skewed_route(t, 12, k, d)
    ref = reference(qtype, gate, up, down, x, ids, w)
    y1 = run(qtype, gate, up, down, x, ids, w, q8=True, threads=1, lib=lib)
    assert (y1 - ref).norm() / ref.norm() < 0.03
    assert torch.equal(run(qtype, gate, up, down, x, ids, w, q8=True, threads=2, lib=lib), y1)
    if cpu.grouped_int8_tile("Q4_K") and cpu.grouped_int8_tile("Q6_K"):      # this build's own tile: the same rounding
        y = run(qtype, gate, up, down, x, ids, w, q8=True, threads=1)
        assert (y1 - y).norm() / ref.norm() < 1e-3


@needs_c
@pytest.mark.parametrize("q8", [False, True])
def test_grouped_long_rows(q8):
    """D = 2048: the float tile runs K in GRP_KC chunks, the q8 tile over 64 blocks; 96 tokens on 4 of 40 experts."""
    gate, up, down = layer("Q4_0", 40, 2048, 256)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 2048, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] * 10 for _ in range(96)])
    w = torch.rand(96, 2, generator=g)
    ref = reference("Q4_0", gate, up, down, x, ids, w)
    y = run("Q4_0", gate, up, down, x, ids, w, q8=q8, threads=2)
    assert ((y - ref).norm() / ref.norm() < 0.03) if q8 else max_rel_err(y, ref) < 1e-5


@needs_c
def test_grouped_rejects_bad_ids():
    gate, up, down = layer("Q8_0", 6, 96, 160)
    x, ids, w = skewed_route(4, 6, 2, 96)
    with pytest.raises(RuntimeError, match="expert ids"):
        cpu.moe_grouped("Q8_0", gate, up, down, x, ids + 6, w)


@pytest.fixture(scope="module", params=["x86-64", "haswell", "alderlake"])
def other_build(request, build):
    """x86-64: the scalar path; haswell: AVX2 without VNNI (the maddubs / sign-trick int8 dots, the AVX2 Q8_K tile);
    alderlake: AVX2 with AVX-VNNI (256-bit dpbusd: Q4_0 rows in lanes, the q8 dots without the sign trick)."""
    return build(request.param)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "IQ3_XXS", ("Q4_K", "Q6_K")])
@pytest.mark.parametrize("q8", [False, True])
def test_other_builds_match_reference(qtype, q8, other_build):
    d, i = sizes(qtype)
    gate, up, down = layer(qtype, 12, d, i)
    x, ids, w = skewed_route(17, 12, 4, d)
    ref = reference(qtype, gate, up, down, x, ids, w)
    y = run(qtype, gate, up, down, x, ids, w, q8=q8, threads=2, lib=other_build)
    assert ((y - ref).norm() / ref.norm() < 0.03) if q8 else max_rel_err(y, ref) < 1e-5


@needs_c
@pytest.mark.parametrize("qtype", ["Q4_0", ("Q4_K", "Q6_K")])
def test_quant_experts_prefill_takes_the_grouped_kernel(qtype, monkeypatch):
    d, i = sizes(qtype)
    gate, up, down = layer(qtype, 12, d, i)
    ex = QuantExperts(qtype, gate, up, down)
    assert ex.grouped_cpu
    x, ids, w = skewed_route(17, 12, 4, d)
    want = ex.forward_native(x, ids, w)
    real, calls = cpu.moe_grouped, []

    def spy(*a, **kw):
        calls.append(a[4].shape[0])
        return real(*a, **kw)
    monkeypatch.setattr(cpu, "moe_grouped", spy)
    assert max_rel_err(ex(x, ids, w), want) < 1e-5 and calls == [17]
    assert max_rel_err(ex(x.bfloat16(), ids, w).float(), ex.forward_native(x.bfloat16(), ids, w).float()) < 2e-2


@needs_c
@pytest.mark.parametrize("qtype", ["Q4_0", "IQ3_XXS", ("Q4_K", "Q6_K")])
def test_expert_ffn_rows_take_the_grouped_kernel(qtype):
    """The memory tiers' CPU misses: one expert on n rows (expert_ffn) is moe_grouped with E = 1."""
    d, i = sizes(qtype)
    gu, dn = (get_format(q) for q in (qtype if isinstance(qtype, tuple) else (qtype, qtype)))
    g = torch.Generator().manual_seed(7)
    gate_up = pack(torch.randn(2 * i, d, generator=g) * 0.1, gu.name)
    down = pack(torch.randn(d, i, generator=g) * 0.1, dn.name)
    x = torch.randn(9, d, generator=g)
    got = cpu.expert_ffn(qtype, gate_up, down, x, swiglu)
    assert max_rel_err(got, cpu.expert_ffn_native(qtype, gate_up, down, x, swiglu)) < 1e-5


@needs_c
@pytest.mark.parametrize("qtype", Q8K_FORMATS)
@pytest.mark.parametrize("t", [5, 17])
def test_qgemm_q8k_tiles_on_odd_rows(qtype, t):
    """cpu.qgemm (the experts' tile with one expert) in the 256-value formats over 44 rows (one task:
    the rows-in-lanes tile's 16-row blocks padded, the 4 x 4 tile's last rows): float64 on the tile's rounding (x int8
    per 256 values in float32), within 1e-5; 5 rows of x take the 4 x 4 tile, 17 the rows-in-lanes one (AVX-512
    VNNI builds, >= 8 pairs)."""
    if not cpu.grouped_int8_tile(qtype):
        pytest.skip("no integer tile for this type in this build (needs AVX2)")
    g = torch.Generator().manual_seed(12)
    w = pack(torch.randn(44, 512, generator=g) / 16, qtype)
    x = torch.randn(t, 512, generator=g)
    blocks = x.reshape(-1, 256)
    dk = blocks.abs().amax(-1, keepdim=True) / 127
    xq = (torch.round(blocks * (1 / dk)).double() * dk.double()).reshape(t, 512)
    want = xq @ dequantize(w, get_format(qtype), (44, 512)).double().T
    y = cpu.qgemm(qtype, w, x, threads=2)
    assert y.shape == (t, 44) and not y.isnan().any()
    assert max_rel_err(y, want.float()) < 1e-5
