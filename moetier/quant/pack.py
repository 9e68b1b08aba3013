"""Quantize (pack) float tensors into GGML block bytes.

gguf-py's numpy quantizers are used where it has them (F32, F16, BF16, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, MXFP4); the K- and i-quants come from `libgguf` (PyPI; the ggml reference
quantizers as a native extension), imported only when such a type is asked for.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gq

from .formats import check_row, get_format

GGUF_PY_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"}
# libgguf's IQ2_XS / IQ2_XXS / IQ1_S are meant to be given an importance matrix; without one they
# still quantize, with somewhat higher error.
IMATRIX_TYPES = {"IQ2_XS", "IQ2_XXS", "IQ1_S"}


def packer(qtype) -> str:
    """Which library packs `qtype`: "gguf-py" or "libgguf"."""
    return "gguf-py" if get_format(qtype).name in GGUF_PY_TYPES else "libgguf"


def quantize(data, qtype, imatrix=None) -> torch.Tensor:
    """float [..., K] (torch or numpy) -> uint8 [..., K // block_size * type_size] (CPU).
    `imatrix` ([K] float importance weights) is passed to libgguf for the K/i-quants."""
    fmt = get_format(qtype)
    if isinstance(data, torch.Tensor):
        data = data.detach().float().cpu().numpy()
    data = np.ascontiguousarray(data, dtype=np.float32)
    check_row(fmt, data.shape)
    if fmt.name in GGUF_PY_TYPES:
        out = gq.quantize(data, GGMLQuantizationType[fmt.name])
    else:
        out = _libgguf_quantize(data, fmt.name, imatrix)
    out = np.ascontiguousarray(out).view(np.uint8)
    return torch.from_numpy(out.reshape(*data.shape[:-1], -1))


def _libgguf_quantize(data: np.ndarray, name: str, imatrix) -> np.ndarray:
    try:
        import libgguf
    except ImportError as e:
        raise ImportError(f"packing {name} needs the 'libgguf' package (pip install libgguf); "
                          f"gguf-py only quantizes {', '.join(sorted(GGUF_PY_TYPES))}") from e
    rows = data.reshape(-1, data.shape[-1])
    return libgguf.quantize_rows(rows, libgguf.GGMLQuantizationType[name], imatrix=imatrix)
