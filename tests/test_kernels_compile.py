"""The v5 decode kernels, the dense GEMV, the embedding gather, the decode step's small kernels and the doorbell kernels compile for sm_90 (bench/compile_check.py), on a machine without a
GPU: the Triton interpreter that runs the kernel tests here accepts code the CUDA compiler refuses (a `return`
inside a branch cost a device run in session 9)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_v5_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}     # compile, not interpret
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench" / "compile_check.py")], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    # gate_up (plain, with the fused h quantizer by counters and in registers, both with x's own int8 copy: v5qx), down,
    # gemv x the v5 formats (ptxas checks their inline asm); embed; the decode step's eight small kernels with PDL
    # (attention combine + q8, split, qkv prep, norm + q8, add + norm, add + norm + q8, router, router with the add +
    # norm); the doorbell's ring and hint kernels with the PCIe share, route + ring, route + ring with the add + norm,
    # wait_add with the residual, wait_add with the next block's norm + q8; all but the embedding gather again for sm_80
    # with PDL off (griddepcontrol is sm_90+: kernels.pdl keeps it off on an A100 or an RTX 4090)
    from moetier.kernels.triton_decode_q8 import FORMATS
    # gate_up, + h quantizer (counters, registers), down, gemv a format; v5qx's two in compile_check.XQ_FORMATS
    v5 = 5 * len(FORMATS) + 2 * 2
    assert r.stdout.count("sm80 ") == v5 + 14, r.stdout
    assert r.stdout.count(" ok") == (v5 + 15) + (v5 + 14), r.stdout


def test_pdl_only_where_the_gpu_has_griddepcontrol(monkeypatch):
    """kernels.pdl.supported: programmatic dependent launches only on compute capability 9.0 and later (an sm_89 or
    sm_80 build of a kernel holding griddepcontrol fails in ptxas), never for CPU tensors."""
    from types import SimpleNamespace

    import torch

    from moetier.kernels import pdl
    caps = {0: (8, 9), 1: (9, 0), 2: (8, 0), 3: (10, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    pdl.capable.cache_clear()
    try:
        on = {i: pdl.supported(SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=i))) for i in caps}
        assert on == {0: False, 1: True, 2: False, 3: True}
        assert not pdl.supported(torch.zeros(1))
    finally:
        pdl.capable.cache_clear()


def test_kernel_regs_counts_programs_per_sm_as_sm90_allocates_registers():
    """bench/kernel_regs.py's occupancy: registers given per warp in units of 256 (a thread's count rounded up to 8),
    65,536 an SM, at most 64 warps and 32 programs; the smallest limit wins."""
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend")
    import importlib.util
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("kernel_regs", root / "bench" / "kernel_regs.py")
    kr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kr)
    assert kr.occupancy(247, 8, 2048) == (1, "registers")      # 248 x 256 threads: one program of 8 warps
    assert kr.occupancy(95, 2, 64) == (10, "registers")        # 96 x 64 = 6,144 a program
    assert kr.occupancy(72, 4, 256) == (7, "registers")
    assert kr.occupancy(32, 1, 0) == (32, "programs") and kr.occupancy(24, 4, 0) == (16, "warps")
    assert kr.occupancy(32, 1, 100 << 10) == (2, "shared")


def test_sampler_kernels_compile_for_sm90():
    """kernels.triton_sample's two kernels (MOETIER_SAMPLER=triton) compile for sm_90 (bench/compile_check.py
    --sampler: the shapes a 151,936-token vocabulary gives them, each filter combination)."""
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench" / "compile_check.py"), "--sampler"], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.count(" ok") == 5, r.stdout + r.stderr
