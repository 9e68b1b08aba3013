"""Programmatic dependent launch (PDL): a kernel launched as a dependent of the one before it may be scheduled while
that one runs, and waits (`griddepcontrol.wait`) before reading its writes. The instructions exist on compute
capability 9.0 (Hopper) and later only: on an A100, an RTX 3090 or 4090, a kernel that holds them does not compile
(ptxas: "griddepcontrol requires .target sm_90"). Every PDL choice of the kernels goes through `supported`.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def capable(index: int) -> bool:
    """CUDA device `index` runs griddepcontrol (sm_90+)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def supported(t: torch.Tensor) -> bool:
    """Kernels on t's device may be launched as programmatic dependents."""
    if not t.is_cuda:
        return False
    return capable(t.device.index if t.device.index is not None else torch.cuda.current_device())
