"""CPU block matvec kernels vs the pure-torch twin (kernels.reference.expert_matvec)."""
from __future__ import annotations

import platform

import pytest
import torch

from moetier.kernels import cpu
from moetier.kernels.reference import expert_matvec
from moetier.quant.pack import quantize
from moetier.quant.repack import repack

FAST = sorted(cpu.FAST_TYPES) + sorted(cpu.HALF_TYPES)     # HALF_TYPES: 16-bit float rows, float32 products


def case(qtype: str, n: int, k: int, seed: int = 0):
    """Random rows (never zeros) in `qtype`, x, and the twin's y."""
    g = torch.Generator().manual_seed(seed)
    raw = quantize(torch.randn(n, k, generator=g), qtype)
    x = torch.randn(k, generator=g)
    return raw, x, expert_matvec(qtype, repack(qtype, raw), x)


def assert_close(y: torch.Tensor, ref: torch.Tensor):
    assert torch.isfinite(y).all(), "output not fully written (NaN poison left)"
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(37, 512), (129, 768), (1, 256)])
@pytest.mark.parametrize("qtype", FAST + ["Q4_1"])      # Q4_1: the torch fallback path
def test_matvec_matches_reference(qtype, n, k, threads):
    raw, x, ref = case(qtype, n, k)
    y = torch.full((n,), float("nan"))
    assert cpu.matvec(qtype, raw, x, out=y, threads=threads) is y
    assert_close(y, ref)


@pytest.mark.parametrize("qtype", FAST)
def test_matvec_strided_rows(qtype):
    """Rows of a wider buffer (e.g. one expert's slice of a fused tensor) are read in place."""
    raw, x, ref = case(qtype, 33, 512, seed=1)
    wide = torch.zeros(33, raw.shape[1] + 64, dtype=torch.uint8)
    wide[:, 64:] = raw
    assert_close(cpu.matvec(qtype, wide[:, 64:], x), ref)


@pytest.mark.parametrize("qtype", FAST)
def test_matvec_batch_matches_reference(qtype):
    cases = [case(qtype, 65, 512, seed=s) for s in range(3)]
    y = torch.full((3, 65), float("nan"))
    cpu.matvec_batch(qtype, [c[0] for c in cases], torch.stack([c[1] for c in cases]), out=y)
    for i, (_, _, ref) in enumerate(cases):
        assert_close(y[i], ref)


@pytest.mark.parametrize("qtype", sorted(cpu.NUMBA_TYPES))
def test_numba_kernels_match_reference(qtype):
    pytest.importorskip("numba")
    from moetier.kernels.cpu_numba import matvec_numba
    raw, x, ref = case(qtype, 37, 768, seed=2)
    y = torch.full((37,), float("nan"))
    matvec_numba(qtype, raw.numpy(), x.numpy(), y.numpy())
    assert_close(y, ref)


@pytest.fixture(scope="module", params=["x86-64", "haswell", "alderlake"])
def other_build(request, tmp_path_factory):
    """The C kernels built for other CPUs: x86-64 = the scalar path, haswell = the AVX2 path (this machine's native
    build may take the AVX-512 one), alderlake = AVX2 with AVX-VNNI (256-bit dpbusd, no AVX-512)."""
    if cpu.backend() != "c" or platform.machine() != "x86_64":
        pytest.skip("needs gcc on x86-64")
    flags = set(cpu._cpu_signature().split())
    if request.param in ("haswell", "alderlake") and not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    if request.param == "alderlake" and "avx_vnni" not in flags:
        pytest.skip("this CPU has no AVX-VNNI")
    return cpu.open_library(cpu.build_library(tmp_path_factory.mktemp("kernels"), march=request.param))


@pytest.mark.parametrize("qtype", FAST)
def test_other_c_builds_match_reference(qtype, other_build):
    lib = other_build
    raw, x, ref = case(qtype, 37, 768, seed=3)
    y = torch.full((37,), float("nan"))
    assert_close(cpu.matvec(qtype, raw, x, out=y, lib=lib), ref)


def test_shape_errors_are_explained():
    raw, x, _ = case("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="hold 64 values, but x has 32"):
        cpu.matvec("Q8_0", raw, x[:32])
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu.matvec("Q8_0", raw, x, out=torch.empty(4, dtype=torch.float64))


@pytest.mark.parametrize("qtype", sorted(cpu.DEQUANT_TYPES))
def test_dequantize_rows_is_bit_exact(qtype):
    """The C dequantizer (CPU prefill of packed experts, released dense weights) equals quant.dequantize and gguf-py's
    dequantizer bit for bit for every format the C kernels read (and F16 / BF16); leading dims, odd row counts."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gq

    from moetier.quant.formats import dequantize, get_format
    g = torch.Generator().manual_seed(7)
    raw = quantize(torch.randn(3 * 37, 512, generator=g), qtype).view(3, 37, -1)
    fmt = get_format(qtype)
    got = cpu.dequantize_rows(qtype, raw)
    assert got.shape == (3, 37, 512) and got.dtype == torch.float32
    assert torch.equal(got, dequantize(raw, fmt, (3, 37, 512)))
    assert torch.equal(got, torch.from_numpy(gq.dequantize(raw.numpy(), GGMLQuantizationType[qtype])))
    assert torch.equal(cpu.dequantize_rows(qtype, raw[1]), dequantize(raw[1], fmt, (37, 512)))


@pytest.mark.parametrize("qtype", ["MXFP4", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S"])
def test_codebook_kernels_see_every_table_entry(qtype):
    """Rows built so every MXFP4 nibble / IQ3_XXS / IQ2 grid row and sign pattern occurs (random floats
    rarely reach all 256 grid rows), with random scales; the C matvec against the torch twin and its dequantizer
    bit for bit (where it has one)."""
    raw, x = table_rows(qtype)
    ref = expert_matvec(qtype, repack(qtype, raw), x)
    y = torch.full((64,), float("nan"))
    assert_close(cpu.matvec(qtype, raw, x, out=y, threads=2), ref)
    if qtype in cpu.DEQUANT_TYPES:
        from moetier.quant.formats import dequantize
        assert torch.equal(cpu.dequantize_rows(qtype, raw), dequantize(raw, qtype, (64, x.numel())))


@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("qtype", ["MXFP4", "IQ3_XXS", ("IQ3_XXS", "Q6_K"), ("Q4_0", "MXFP4"), ("Q4_K", "Q6_K"), "Q5_K",
                                   "IQ2_XXS", ("IQ2_XS", "IQ2_S"), "BF16", "F16", "IQ3_S", ("IQ1_S", "IQ1_M")])
def test_moe_tokens_codebook_formats(qtype, q8):
    """The one-call MoE layer (decode) reads MXFP4 / IQ3_XXS experts (and 16-bit float ones: float activations
    either way) through the same row kernels; with q8 x and the activation are rounded to int8 per 32 values (integer
    dot products)."""
    from moetier.quant.formats import get_format
    gq_, dq_ = qtype if isinstance(qtype, tuple) else (qtype, qtype)
    e, d, i, t, k = 5, 256, 512, 3, 2
    g = torch.Generator().manual_seed(11)
    gate, up = (quantize(torch.randn(e * i, d, generator=g), gq_).view(e, i, -1) for _ in range(2))
    down = quantize(torch.randn(e * d, i, generator=g), dq_).view(e, d, -1)
    x = torch.randn(t, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    fmts = (get_format(gq_), get_format(dq_))
    ref = cpu.moe_tokens_native(fmts, gate, up, down, x, ids, w)
    y = cpu.moe_tokens(fmts, gate, up, down, x, ids, w, q8=q8, threads=2)
    if q8 and gq_ not in cpu.HALF_TYPES:
        assert torch.isfinite(y).all() and ((y - ref).norm() / ref.norm()).item() < 0.03
    else:
        assert_close(y, ref)


def test_build_key_covers_included_files(tmp_path, monkeypatch):
    """An edit to a file cpu_kernels.c #includes (not only cpu_kernels.c itself) builds a new library."""
    if cpu.backend() != "c":
        pytest.skip("needs a C compiler")
    import shutil
    src = tmp_path / "src"
    src.mkdir()
    for f in cpu._SOURCE.parent.glob("cpu*.[ch]"):
        shutil.copy(f, src / f.name)
    monkeypatch.setattr(cpu, "_SOURCE", src / "cpu_kernels.c")
    first = cpu.build_library(tmp_path / "cache", source=src / "cpu_kernels.c")
    with open(src / "cpu_iquants.c", "a") as f:
        f.write("\n/* an edit */\n")
    second = cpu.build_library(tmp_path / "cache", source=src / "cpu_kernels.c")
    assert first != second and second.exists()


Q8_TYPES = ["Q4_0", "Q5_1", "Q8_0", "MXFP4", "IQ3_XXS", "IQ4_XS", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_S", "IQ1_S", "IQ1_M"]   # moetier_matvec_q8's integer row kernels


def assert_q8_close(y: torch.Tensor, ref: torch.Tensor):
    """int8 activations (one scale per 32 values, llama.cpp's Q8_0 for x): ~0.5% relative error."""
    assert torch.isfinite(y).all(), "output not fully written (NaN poison left)"
    assert ((y - ref).norm() / ref.norm()).item() < 0.02
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 0.03


def matvec_q8(lib, qtype, raw, x, threads):
    y = torch.full((raw.shape[0],), float("nan"))
    assert cpu.matvec(qtype, raw, x, out=y, threads=threads, lib=lib, q8=True) is y
    return y


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(37, 512), (129, 768), (1, 256)])
@pytest.mark.parametrize("qtype", Q8_TYPES)
def test_matvec_q8_matches_reference(qtype, n, k, threads):
    if cpu.backend() != "c":
        pytest.skip("needs the C kernels")
    raw, x, ref = case(qtype, n, k, seed=4)
    y = matvec_q8(cpu._lib, qtype, raw, x, threads)
    if n > 1 or qtype not in ("IQ1_S", "IQ1_M"):
        assert_q8_close(y, ref)
    else:   # one dot product's int8 error relative to it has a heavy tail (40 seeds of one 256-row: p90 2.5-6.5% in
        # every format, Q4_0 too); this seed's IQ1_S row lands at 3.1% (its C sum equals an exact int8 emulation)
        assert torch.isfinite(y).all() and ((y - ref).abs() / ref.abs()).item() < 0.1


@pytest.mark.parametrize("qtype", Q8_TYPES)
def test_other_c_builds_matvec_q8(qtype, other_build):
    """haswell: the AVX2 integer kernels (the native build may take AVX-512 ones); x86-64: float fallback."""
    raw, x, ref = case(qtype, 37, 768, seed=6)
    assert_q8_close(matvec_q8(other_build, qtype, raw, x, 2), ref)


IQ2_GRID_ROWS = {"IQ2_XXS": 256, "IQ2_XS": 512, "IQ2_S": 1024}


def iq2_every_grid_row(qtype: str, blocks: torch.Tensor) -> None:
    """Random-byte IQ2 super-blocks [n, type_size] (every sign pattern and scale) -> group g of the n * 32 holds grid
    row g % rows (IQ2_XXS: index bytes of each pair; IQ2_XS: the low 9 bits of each u16; IQ2_S: qs and its qh bits)."""
    idx = torch.arange(blocks.shape[0] * 32) % IQ2_GRID_ROWS[qtype]
    if qtype == "IQ2_XXS":
        blocks[:, 2:66].view(-1, 8, 2, 4)[:, :, 0] = idx.to(torch.uint8).view(-1, 8, 4)
    elif qtype == "IQ2_XS":
        q = blocks[:, 2:66].contiguous().view(torch.int16).int() & 0xFE00 | idx.int().view(-1, 32)
        blocks[:, 2:66] = q.to(torch.int16).view(torch.uint8)
    else:
        blocks[:, 2:34] = (idx & 255).to(torch.uint8).view(-1, 32)
        hi = (idx >> 8).view(-1, 8, 4) << torch.tensor([0, 2, 4, 6])
        blocks[:, 66:74] = hi.sum(-1).to(torch.uint8)


def table_rows(qtype: str, seed: int = 5):
    """64 rows of 4 blocks in which every MXFP4 nibble / IQ3_XXS or IQ2 grid row and sign pattern occurs, random
    scales."""
    from moetier.quant.formats import get_format
    fmt = get_format(qtype)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (64, 4 * fmt.type_size), dtype=torch.uint8, generator=g)
    if qtype == "MXFP4":
        raw.view(-1, 17)[:, 0] = torch.randint(118, 136, (raw.numel() // 17,), dtype=torch.uint8, generator=g)
    elif qtype in IQ2_GRID_ROWS:
        blocks = raw.view(-1, fmt.type_size)
        blocks[:, :2] = (torch.rand(blocks.shape[0], 1, generator=g) * 2 - 1).half().view(torch.uint8)
        iq2_every_grid_row(qtype, blocks)
    else:
        blocks = raw.view(-1, 98)
        blocks[:, :2] = torch.rand(blocks.shape[0], 1, generator=g).half().view(torch.uint8)
        blocks[:, 2:66] = torch.arange(256, dtype=torch.uint8).repeat(blocks.shape[0] // 4, 1).view(-1, 64)
    return raw, torch.randn(4 * fmt.block_size, generator=g)


@pytest.mark.parametrize("qtype", ["MXFP4", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S"])
def test_codebook_q8_kernels_see_every_table_entry(qtype, other_build):
    """Every grid row / sign pattern / nibble through the integer kernels: the native build and haswell's AVX2."""
    raw, x = table_rows(qtype)
    ref = expert_matvec(qtype, repack(qtype, raw), x)
    for lib in (cpu._lib, other_build):
        assert_q8_close(matvec_q8(lib, qtype, raw, x, 2), ref)


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "IQ2_XS", "IQ2_S"])
def test_iq2_q8_native_matches_avx2_exactly(qtype, tmp_path):
    """The IQ2 int8 kernels: the native build (dpbusd where it has AVX-512 VNNI) against haswell's maddubs sums, every
    grid row, sign pattern and scale, odd row count and 3 super-blocks a row: the same int32 sums (43 x 127 pairs
    cannot saturate int16), so equal up to float rounding."""
    if cpu.backend() != "c" or platform.machine() != "x86_64":
        pytest.skip("needs gcc on x86-64")
    if not {"avx2", "fma", "f16c"} <= set(cpu._cpu_signature().split()):
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    avx2 = cpu.open_library(cpu.build_library(tmp_path, march="haswell"))
    raw, x = table_rows(qtype, seed=12)
    raw, x = raw[:63, :3 * raw.shape[1] // 4], x[:768] * 10          # large x: int8 values near +-127
    y_native, y_avx2 = (matvec_q8(lib, qtype, raw, x, 1) for lib in (cpu._lib, avx2))
    torch.testing.assert_close(y_native, y_avx2, rtol=1e-5, atol=1e-5 * y_avx2.abs().max().item())


@pytest.mark.parametrize("n,nsb", [(64, 4), (37, 3), (5, 8)])
def test_iq3_xxs_q8_native_matches_avx2_exactly(n, nsb, tmp_path):
    """The native build's IQ3_XXS int8 kernel (on AVX-512 VBMI/GFNI: table permutes, not gathers) against the
    haswell build's AVX2 one: the same integer dot products and scales, so equal up to float summation order,
    far tighter than the 2% both hold against the float reference. Every grid row, random sign fields (with
    their parity bits) and scales; rows of 3 and 8 super-blocks (the gate / down shapes' lengths)."""
    if cpu.backend() != "c" or platform.machine() != "x86_64":
        pytest.skip("needs gcc on x86-64")
    if not {"avx2", "fma", "f16c"} <= set(cpu._cpu_signature().split()):
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    avx2 = cpu.open_library(cpu.build_library(tmp_path, march="haswell"))
    g = torch.Generator().manual_seed(11)
    raw = torch.randint(0, 256, (n, nsb * 98), dtype=torch.uint8, generator=g)
    blocks = raw.view(-1, 98)
    blocks[:, :2] = (torch.rand(blocks.shape[0], 1, generator=g) + 0.1).half().view(torch.uint8)
    blocks[:, 2:66] = torch.randperm(256, generator=g).to(torch.uint8).repeat(blocks.shape[0] // 4 + 1)[
        :blocks.shape[0] * 64].view(-1, 64)
    x = torch.randn(nsb * 256, generator=g)
    y_native, y_avx2 = (matvec_q8(lib, "IQ3_XXS", raw, x, 1) for lib in (cpu._lib, avx2))
    torch.testing.assert_close(y_native, y_avx2, rtol=1e-5, atol=1e-5 * y_avx2.abs().max().item())




@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", ["IQ3_S", "IQ1_S", "IQ1_M"])
def test_low_bit_codebooks_see_every_bit_pattern(qtype, threads, other_build):
    """Random-byte super-blocks (129 rows of 4: every grid row, sign bit, delta sign and scale, near certainly; not only
    what the quantizer emits) with random finite fp16 d: the float rows to float rounding and the int8 ones within
    the int8 activations' error, through the native build and the other builds (AVX2; scalar, whose q8 is float)."""
    from test_quant_formats import random_blocks
    raw = torch.from_numpy(random_blocks(qtype, (129, 1024), seed=9))
    x = torch.randn(1024, generator=torch.Generator().manual_seed(9))
    ref = expert_matvec(qtype, repack(qtype, raw), x)
    for lib in (cpu._lib, other_build):
        y = torch.full((raw.shape[0],), float("nan"))
        assert_close(cpu.matvec(qtype, raw, x, out=y, threads=threads, lib=lib), ref)
        assert_q8_close(matvec_q8(lib, qtype, raw, x, threads), ref)


K_SCALE_OFFSETS = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}   # fp16 d / dmin


def random_byte_rows(qtype: str, n: int = 37, nsb: int = 3, seed: int = 8):
    """n rows of nsb K-quant super-blocks of random bytes (every qs / qh / hmask bit pattern, every 4- or 6-bit scale
    and min, Q3_K / Q6_K's negative scales) with random finite fp16 d / dmin, and x."""
    from moetier.quant.formats import get_format
    fmt = get_format(qtype)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, nsb * fmt.type_size), dtype=torch.uint8, generator=g)
    blocks = raw.view(-1, fmt.type_size)
    for off in K_SCALE_OFFSETS[qtype]:
        d = (torch.rand(blocks.shape[0], generator=g) * 2 - 1).half()
        blocks[:, off:off + 2] = d.view(torch.uint8).view(-1, 2)
    return raw, torch.randn(nsb * fmt.block_size, generator=g)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_kquant_kernels_see_every_bit_pattern(qtype, threads, other_build):
    """Random-byte super-blocks (not only what the quantizer emits) through the native build (AVX-512 VBMI byte
    construction where the CPU has it) and the other builds (AVX2, scalar), odd row count, NaN-poisoned out;
    and through the int8-activation kernels (cpu_kq_q8.c; the x86-64 build's q8 falls back to the float rows)."""
    raw, x = random_byte_rows(qtype)
    ref = expert_matvec(qtype, repack(qtype, raw), x)
    for lib in (cpu._lib, other_build):
        y = torch.full((raw.shape[0],), float("nan"))
        assert_close(cpu.matvec(qtype, raw, x, out=y, threads=threads, lib=lib), ref)
        assert_q8_close(matvec_q8(lib, qtype, raw, x, threads), ref)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K"])
def test_q23_k_four_rows_match_one_row(qtype, other_build):
    """Q2_K / Q3_K int8 rows: the 4-row kernel (moe_rows_run_q8, the miss server's) gives each row's one-row result bit
    for bit (the x side shared, the same int32 dots, scales and fma order), in the native and the other builds; the C
    dequantizer reads every random byte pattern as the torch twin does, bit for bit."""
    from moetier.quant.formats import dequantize, get_format
    raw, x = random_byte_rows(qtype, n=13, nsb=2, seed=12)
    for lib in (cpu._lib, other_build):
        rows = matvec_q8(lib, qtype, raw, x, 1)
        one = torch.cat([matvec_q8(lib, qtype, raw[i:i + 1], x, 1) for i in range(raw.shape[0])])
        assert torch.equal(rows, one)
    assert torch.equal(cpu.dequantize_rows(qtype, raw), dequantize(raw, get_format(qtype), (13, 512)))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(8, 64), (40, 768), (136, 384)])    # 1, 5 (odd: one group alone), 17 groups of 8
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "IQ4_NL", "Q5_1", "Q4_K", "MXFP4", "IQ4_XS"])
def test_interleaved_matvec(qtype, n, k, threads):
    """Rows interleaved by 8 (the compiled step's copies, the miss server's RAM bank): the layout round-trips (in torch
    and in place in C), the matvec writes every row, matches the GGUF rows' int8 kernel to float rounding (the same
    int32 sums) and the reference within the int8 activations' error; qlinear_native reads the layout too. Q4_K: k
    rounded up to whole super-blocks."""
    from moetier.quant.formats import get_format
    k = -(-k // get_format(qtype).block_size) * get_format(qtype).block_size
    tid = get_format(qtype).type_id
    if not cpu.interleaved_supported(tid):
        pytest.skip(f"this build reads no interleaved {qtype} rows")
    raw, x, ref = case(qtype, n, k, seed=8)
    x8 = cpu.interleave_rows(raw, tid)
    assert x8.shape == raw.shape and not torch.equal(x8, raw) and torch.equal(cpu.deinterleave_rows(x8, tid), raw)
    inplace = raw.clone()
    cpu.interleave_inplace(inplace, tid, threads=threads)
    assert torch.equal(inplace, x8)
    cpu.interleave_inplace(inplace, tid, inverse=True, threads=threads)
    assert torch.equal(inplace, raw)
    y = torch.full((1, n), float("nan"))
    y[:] = cpu.qlinear(cpu.INTERLEAVED[tid], x8, x[None], q8=True, threads=threads)
    assert_q8_close(y[0], ref)
    rows = cpu.qlinear(qtype, raw, x[None], q8=True, threads=threads)
    torch.testing.assert_close(y, rows, rtol=1e-5, atol=1e-5 * rows.abs().max().item())
    torch.testing.assert_close(cpu.qlinear_native(cpu.INTERLEAVED[tid], x8, x[None]), cpu.qlinear_native(qtype, raw, x[None]))
    with pytest.raises(ValueError, match="int8 activations"):
        cpu.qlinear(cpu.INTERLEAVED[tid], x8, x[None], q8=False)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "IQ4_NL", "Q5_1", "Q4_K", "MXFP4", "IQ4_XS"])
def test_interleaved_other_builds(qtype, other_build):
    """haswell (AVX2, no VNNI: maddubs sums; Q8_0 through the sign trick) gives the native build's result to float
    rounding (the same int32 sums); a build without int8 activations (x86-64) refuses the layouts instead of misreading
    them."""
    from moetier.quant.formats import get_format
    tid = get_format(qtype).type_id
    if not cpu.interleaved_supported(tid):
        pytest.skip(f"this build reads no interleaved {qtype} rows")
    raw, x, _ = case(qtype, 40, 768, seed=9)
    x8 = cpu.interleave_rows(raw, tid)
    y = torch.full((40,), float("nan"))
    rc = other_build.moetier_matvec_q8(cpu.INTERLEAVED[tid], x8.data_ptr(), x8.stride(0), 40, 768, x.data_ptr(),
                                       y.data_ptr(), 2)
    if not other_build.moetier_x8_supported(tid):
        assert rc != 0
        return
    want = cpu.qlinear(cpu.INTERLEAVED[tid], x8, x[None], q8=True)[0]
    assert rc == 0 and torch.isfinite(y).all()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_interleave_inplace_refuses_what_it_cannot_lay_out():
    """A type without the layout (Q6_K), a row count not a multiple of 8, or a non-contiguous view: a clear error, the
    bytes untouched."""
    from moetier.quant.formats import get_format
    if cpu.backend() != "c":
        pytest.skip("the C kernels are not built")
    raw, _, _ = case("Q6_K", 16, 256, seed=10)
    keep = raw.clone()
    with pytest.raises(ValueError, match="cannot be interleaved"):
        cpu.interleave_inplace(raw, get_format("Q6_K").type_id)
    q4, _, _ = case("Q4_0", 12, 64, seed=10)
    with pytest.raises(ValueError, match="cannot be interleaved"):
        cpu.interleave_inplace(q4, get_format("Q4_0").type_id)
    with pytest.raises(ValueError, match="contiguous"):
        cpu.interleave_inplace(q4[:, :18], get_format("Q4_0").type_id)
    assert torch.equal(raw, keep)
