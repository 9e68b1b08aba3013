"""Byte-level helpers shared by the dequantisers: fp16/u32 fields, bit fields, small tables.

Every helper takes `[n_blocks, nbytes]` uint8 slices of a block tensor and works on CPU or
CUDA. Multi-byte fields are read with `view_bytes` (a contiguous, aligned copy + dtype view), so
they work at any byte offset (GGUF blocks are packed, e.g. Q5_0's u32 sits at offset 2 of a 22-byte block).
"""
from __future__ import annotations

import torch

_tables: dict[tuple[str, torch.device], torch.Tensor] = {}


def view_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., s * m] uint8 -> [..., m] `dtype` (s = its item size) at any byte offset. A slice that
    counts as contiguous (one block's field: size-1 dims) keeps its storage offset and strides under
    `.contiguous()`, and a dtype view needs both divisible by s: such a slice is copied afresh first."""
    b = b.contiguous()
    if b.storage_offset() % dtype.itemsize or any(st % dtype.itemsize for st in b.stride()[:-1]):
        b = b.clone(memory_format=torch.contiguous_format)         # fresh storage, row-major strides
    return b.view(dtype)


def f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2m] uint8 -> [n, m] float32 (little-endian IEEE half, exact)."""
    return view_bytes(b, torch.float16).float()


def i16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2m] uint8 -> [n, m] int32 holding the unsigned 16-bit values."""
    return view_bytes(b, torch.int16).int() & 0xFFFF


def i32(b: torch.Tensor) -> torch.Tensor:
    """[n, 4m] uint8 -> [n, m] int32 (bit pattern of the u32; use `>>` then `&` only)."""
    return view_bytes(b, torch.int32)


def shifts(x: torch.Tensor, amounts, mask: int) -> torch.Tensor:
    """[..., m] -> [..., len(amounts), m]: `(x >> s) & mask` for each shift s.
    Pass `x.unsqueeze(-1)` to put the shift axis last instead ([..., m, len, 1])."""
    amounts = tuple(amounts)
    s = table(f"shifts{amounts}{x.dtype}", x.device,
              lambda: torch.tensor(amounts, dtype=x.dtype).view(-1, 1))   # cached: no per-call H2D copy
    return (x.unsqueeze(-2) >> s) & mask


def table(name: str, device: torch.device, build) -> torch.Tensor:
    """A constant lookup table, built once on CPU by `build()` and cached per device."""
    key = (name, torch.device(device))
    if key not in _tables:
        cpu_key = (name, torch.device("cpu"))
        if cpu_key not in _tables:
            _tables[cpu_key] = build()
        _tables[key] = _tables[cpu_key].to(device)
    return _tables[key]
