"""GGML storage formats: the registry (type id/name -> block geometry, torch dequantiser) and
`dequantize(raw, qtype, shape)`, the pure-torch reference every kernel is checked against.

A tensor of shape [..., K] is stored row-major as [..., K // block_size] blocks of
`type_size` bytes; blocks never straddle rows, so K must be a multiple of `block_size`.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import iquants, kquants, legacy


@dataclass(frozen=True)
class QuantFormat:
    name: str
    type_id: int          # GGML type id as stored in GGUF tensor infos
    block_size: int       # elements per block
    type_size: int        # bytes per block
    dequant: Callable[[torch.Tensor], torch.Tensor]  # [n, type_size] u8 -> [n, block_size] f32

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size

    def nbytes(self, shape) -> int:
        """Storage bytes of a tensor of `shape` (last dim a multiple of block_size)."""
        check_row(self, shape)
        return math.prod(shape) // self.block_size * self.type_size


_FORMATS = [
    QuantFormat("F32", 0, 1, 4, legacy.dequant_f32),
    QuantFormat("F16", 1, 1, 2, legacy.dequant_f16),
    QuantFormat("Q4_0", 2, 32, 18, legacy.dequant_q4_0),
    QuantFormat("Q4_1", 3, 32, 20, legacy.dequant_q4_1),
    QuantFormat("Q5_0", 6, 32, 22, legacy.dequant_q5_0),
    QuantFormat("Q5_1", 7, 32, 24, legacy.dequant_q5_1),
    QuantFormat("Q8_0", 8, 32, 34, legacy.dequant_q8_0),
    QuantFormat("Q2_K", 10, 256, 84, kquants.dequant_q2_k),
    QuantFormat("Q3_K", 11, 256, 110, kquants.dequant_q3_k),
    QuantFormat("Q4_K", 12, 256, 144, kquants.dequant_q4_k),
    QuantFormat("Q5_K", 13, 256, 176, kquants.dequant_q5_k),
    QuantFormat("Q6_K", 14, 256, 210, kquants.dequant_q6_k),
    QuantFormat("IQ2_XXS", 16, 256, 66, iquants.dequant_iq2_xxs),
    QuantFormat("IQ2_XS", 17, 256, 74, iquants.dequant_iq2_xs),
    QuantFormat("IQ3_XXS", 18, 256, 98, iquants.dequant_iq3_xxs),
    QuantFormat("IQ1_S", 19, 256, 50, iquants.dequant_iq1_s),
    QuantFormat("IQ4_NL", 20, 32, 18, iquants.dequant_iq4_nl),
    QuantFormat("IQ3_S", 21, 256, 110, iquants.dequant_iq3_s),
    QuantFormat("IQ2_S", 22, 256, 82, iquants.dequant_iq2_s),
    QuantFormat("IQ4_XS", 23, 256, 136, iquants.dequant_iq4_xs),
    QuantFormat("IQ1_M", 29, 256, 56, iquants.dequant_iq1_m),
    QuantFormat("BF16", 30, 1, 2, legacy.dequant_bf16),
    QuantFormat("MXFP4", 39, 32, 17, iquants.dequant_mxfp4),
]
FORMATS: dict[str, QuantFormat] = {f.name: f for f in _FORMATS}
BY_ID: dict[int, QuantFormat] = {f.type_id: f for f in _FORMATS}


def get_format(qtype) -> QuantFormat:
    """Look a format up by name ("Q4_K", case-insensitive), GGML type id, or an enum member
    with `.name` (gguf.GGMLQuantizationType)."""
    if isinstance(qtype, QuantFormat):
        return qtype
    if (fmt := FORMATS.get(qtype) if isinstance(qtype, str) else None) is not None:
        return fmt
    key = getattr(qtype, "name", qtype)
    fmt = FORMATS.get(key.upper()) if isinstance(key, str) else BY_ID.get(int(key))
    if fmt is None:
        raise ValueError(f"unsupported GGML quantization type {qtype!r}; moetier reads "
                         f"{', '.join(FORMATS)}. Re-quantize the model to one of these.")
    return fmt


def check_row(fmt: QuantFormat, shape) -> None:
    if not shape or shape[-1] % fmt.block_size:
        raise ValueError(f"{fmt.name} stores rows in blocks of {fmt.block_size} elements; "
                         f"a tensor of shape {tuple(shape)} has a last dimension that is not "
                         f"a multiple of it")


def dequantize(raw: torch.Tensor, qtype, shape) -> torch.Tensor:
    """Stored bytes (uint8, any shape, CPU or CUDA) -> float32 tensor of `shape`.
    Vectorised over all blocks at once; no Python loop over blocks."""
    fmt = get_format(qtype)
    shape = tuple(int(s) for s in shape)
    want = fmt.nbytes(shape)
    if raw.dtype != torch.uint8 or raw.numel() != want:
        raise ValueError(f"{fmt.name} tensor of shape {shape} needs {want} uint8 bytes, got "
                         f"{raw.numel()} of dtype {raw.dtype}")
    blocks = raw.reshape(-1, fmt.type_size)
    return fmt.dequant(blocks).reshape(shape)
