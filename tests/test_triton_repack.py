"""kernels/triton_repack.py (the PCIe share's staging rows -> stage-slot planes) against quant.repack,
bit for bit, under the Triton interpreter on CPU: every field format, odd row counts, a used row, an
unused one (stage offset -1: untouched) and slots outside the stage range untouched."""
import pytest
import torch

triton = pytest.importorskip("triton")

from moetier.kernels.triton_repack import repack_rows, supported  # noqa: E402
from moetier.quant.formats import get_format  # noqa: E402
from moetier.quant.repack import repack  # noqa: E402

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q2_K"]


def test_supported_formats():
    assert all(supported(f) for f in FORMATS) and not supported("IQ3_XXS") and not supported("Q3_K")


@pytest.mark.parametrize("fmt", FORMATS)
def test_repack_rows_equals_quant_repack(monkeypatch, fmt):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    f = get_format(fmt)
    rows, K = 5, 512
    rb = K // f.block_size * f.type_size
    off = 64
    n, S, stage0 = 3, 6, 2
    g = torch.Generator().manual_seed(0)
    staging = torch.randint(0, 256, (n, off + rows * rb + 32), dtype=torch.uint8, generator=g)
    one = repack(fmt, torch.zeros(1, rows, rb, dtype=torch.uint8))
    planes = {k: torch.empty((S, rows, v.shape[-1]), dtype=v.dtype) for k, v in one.items()}
    for v in planes.values():
        v.view(torch.uint8).fill_(0x55)
    before = {k: v.clone() for k, v in planes.items()}
    soff = torch.tensor([0, -1, 5], dtype=torch.int64)
    got = {k: v.to(dev) for k, v in planes.items()}
    repack_rows(fmt, staging.to(dev), soff.to(dev), off, rows, rb, got, stage0)
    planes = {k: v.cpu() for k, v in got.items()}
    for j in range(n):
        s = stage0 + j
        if soff[j] < 0:
            assert all(same(planes[k][s], before[k][s]) for k in planes), j
            continue
        want = repack(fmt, staging[j, off:off + rows * rb].view(rows, rb)[None])
        for k, v in want.items():
            assert same(planes[k][s], v[0].contiguous()), (fmt, k, j)
    assert all(same(planes[k][s], before[k][s]) for k in planes for s in (0, 1, 5))    # outside the stage rows


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
