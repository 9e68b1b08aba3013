"""Every GGML format: torch dequant == gguf-py's numpy dequant, bit for bit.

Inputs are random *valid* blocks: random bytes with the fp16 scale fields set to random
finite non-zero values (so every bit field is exercised), and, where a packer exists,
quantized random floats.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from moetier.quant.formats import FORMATS, dequantize, get_format
from moetier.quant.pack import packer, quantize
from moetier.quant.repack import REPACKED, dequantize_repacked, repack

# byte offsets of the fp16 scale fields inside one block
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
               "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ4_NL": [0],
               "IQ4_XS": [0]}
FP16_FIELDS["IQ1_S"] = [0]
LOSS = {"IQ1_S": 0.7, "IQ1_M": 0.7}                 # 1.56 / 1.75 bits, no importance matrix: the mean error bound
SHAPES = [(7, 256), (3, 5, 512), (1, 768)]          # odd row counts, several blocks per row


def random_blocks(name: str, shape, seed: int = 0) -> np.ndarray:
    """uint8 [..., row_bytes]: random valid storage for a tensor of `shape`."""
    rng = np.random.default_rng(seed)
    fmt = get_format(name)
    if name in ("F32", "F16", "BF16"):
        vals = rng.standard_normal(shape).astype(np.float32)
        return gq.quantize(vals, GGMLQuantizationType[name]).view(np.uint8)
    n_blocks = int(np.prod(shape)) // fmt.block_size
    blocks = rng.integers(0, 256, size=(n_blocks, fmt.type_size), dtype=np.uint8)
    if name == "MXFP4":                              # shared exponent: keep results finite
        blocks[:, 0] = rng.integers(100, 150, size=n_blocks)
    for off in FP16_FIELDS.get(name, []):
        d = rng.choice([-1, 1], n_blocks) * np.exp2(rng.uniform(-12, 1, n_blocks))
        blocks[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if name == "IQ1_M":                              # its fp16 scale is the top nibbles of the 4 scale words
        d = (rng.choice([-1, 1], n_blocks) * np.exp2(rng.uniform(-12, 1, n_blocks))).astype(np.float16).view(np.uint16)
        sc = blocks[:, 48:56].copy().view(np.uint16) & 0x0FFF
        sc |= ((d[:, None] >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF) << 12
        blocks[:, 48:56] = sc.view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def assert_bits_equal(ours: torch.Tensor, ref: np.ndarray):
    assert ours.dtype == torch.float32 and tuple(ours.shape) == ref.shape
    ours = ours.cpu().numpy()
    assert np.isfinite(ref).all()
    bad = ours.view(np.int32) != ref.astype(np.float32).view(np.int32)
    assert not bad.any(), f"{bad.sum()} mismatches, first at {np.argwhere(bad)[0]}"


def gguf_dequant(name: str, raw: np.ndarray) -> np.ndarray:
    return gq.dequantize(raw, GGMLQuantizationType[name])


@pytest.mark.parametrize("name", list(FORMATS))
def test_registry_matches_gguf(name):
    fmt = FORMATS[name]
    assert GGMLQuantizationType[name].value == fmt.type_id
    assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == (fmt.block_size, fmt.type_size)
    assert get_format(fmt.type_id) is get_format(name.lower()) is get_format(GGMLQuantizationType[name])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(FORMATS))
def test_dequant_random_blocks_bit_exact(name, shape):
    raw = random_blocks(name, shape)
    assert_bits_equal(dequantize(torch.from_numpy(raw), name, shape), gguf_dequant(name, raw))


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequant_quantized_floats_bit_exact(name):
    if packer(name) == "libgguf":
        pytest.importorskip("libgguf")
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    raw = quantize(x, name)
    assert raw.dtype == torch.uint8 and raw.shape == (5, get_format(name).nbytes((1, 512)))
    w = dequantize(raw, name, x.shape)
    assert_bits_equal(w, gguf_dequant(name, raw.numpy()))
    assert (w - x).abs().mean() < LOSS.get(name, 0.5) * x.abs().mean()      # and it is a quantization of x


@pytest.mark.parametrize("name", list(FORMATS))
def test_repack_is_lossless(name):
    shape = (3, 7, 512)                                   # [experts, N, K]
    raw = torch.from_numpy(random_blocks(name, shape, seed=2))
    packed = repack(name, raw)
    assert (name in REPACKED) == ("raw" not in packed)
    w = dequantize_repacked(name, packed)
    assert_bits_equal(w, gguf_dequant(name, raw.numpy()))


@pytest.mark.parametrize("name", list(FORMATS))
def test_lone_block_row(name):
    """One row of one block: its fields are contiguous slices at odd byte offsets (IQ3_XXS's u32 words at
    66, Q5_0's at 2), which a dtype view cannot take in place; dequantize and repack still read them."""
    fmt = get_format(name)
    shape = (1, fmt.block_size)
    raw = random_blocks(name, shape, seed=3)
    assert_bits_equal(dequantize(torch.from_numpy(raw), name, shape), gguf_dequant(name, raw))
    assert_bits_equal(dequantize_repacked(name, repack(name, torch.from_numpy(raw))), gguf_dequant(name, raw))


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match="unsupported GGML quantization type"):
        get_format("Q9_9")
    with pytest.raises(ValueError, match="blocks of 256 elements"):
        dequantize(torch.zeros(110, dtype=torch.uint8), "Q3_K", (1, 100))
    with pytest.raises(ValueError, match="needs 68 uint8 bytes"):
        dequantize(torch.zeros(34, dtype=torch.uint8), "Q8_0", (2, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(FORMATS))
def test_dequant_cuda_matches_cpu(name):
    raw = torch.from_numpy(random_blocks(name, (9, 512)))
    cpu = dequantize(raw, name, (9, 512))
    gpu = dequantize(raw.cuda(), name, (9, 512))
    assert torch.equal(cpu.view(torch.int32), gpu.cpu().view(torch.int32))


@pytest.mark.parametrize("shape", SHAPES)
def test_q5_0_as_q8_0_keeps_every_value(shape):
    """Q5_0 rows converted to Q8_0 (what the CPU kernels read for llama.cpp's Q5_0 fallbacks) dequantize to
    gguf-py's Q5_0 values bit for bit."""
    from moetier.quant.legacy import q5_0_as_q8_0
    raw = random_blocks("Q5_0", shape, seed=3)
    q8 = q5_0_as_q8_0(torch.from_numpy(raw))
    assert q8.shape[-1] == raw.shape[-1] // 22 * 34
    assert_bits_equal(dequantize(q8, "Q8_0", shape), gguf_dequant("Q5_0", raw))
