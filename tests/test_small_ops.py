"""The decode step's small fused kernels (kernels/triton_small.py) against their torch twins, run by
Triton's interpreter on CPU (tests/conftest.py) or on CUDA: RMSNorm with a weight per row group, and
the softmax top-k router."""
from __future__ import annotations

import pytest
import torch

from moetier.kernels import small_ops
from moetier.models.layers import RMSNorm, rms_normalize, softmax_topk

triton = pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 384), (3, 200), (2, 5, 64)])
def test_rms_norm_matches_the_twin(dtype, shape):
    if DEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bfloat16 (checked on CUDA)")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEV)
    norm = RMSNorm(shape[-1], 1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g).to(dtype))
    with small_ops.use("triton"):
        got = norm(x)
    want = norm.native(x)
    assert got.dtype == want.dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-5)


def test_rms_norm_weight_per_head():
    """q and k heads in one launch: row r of [T, R, N] takes weight row r % R."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 32, generator=g).to(DEV)
    w = torch.randn(6, 32, generator=g).to(DEV)
    with small_ops.use("triton"):
        got = small_ops.rms_norm(x, w, 1e-6, lambda y: rms_normalize(y, 1e-6) * w)
    torch.testing.assert_close(got, rms_normalize(x, 1e-6) * w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("e,k,normalize", [(128, 8, True), (60, 4, False), (7, 2, True)])
@pytest.mark.parametrize("t", [1, 3])
def test_softmax_topk_matches_the_twin(e, k, normalize, t):
    g = torch.Generator().manual_seed(e + k + t)
    logits = (torch.randn(t, e, generator=g) * 2).to(DEV)
    with small_ops.use("triton"):
        ids, w = small_ops.softmax_topk(logits, k, normalize, softmax_topk)
    want_ids, want_w = softmax_topk(logits, k, normalize)
    assert ids.dtype == torch.long and w.dtype == logits.dtype
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)


def test_prefill_sized_inputs_use_the_twin():
    x = torch.randn(small_ops.MAX_TOKENS + 1, 16)
    with small_ops.use("triton"):
        assert small_ops.rms_norm(x, None, 1e-6, lambda y: "twin") == "twin"
