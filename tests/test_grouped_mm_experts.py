"""models.layers.grouped_mm_experts (the bf16 prefill of DenseExperts / QuantExperts on CUDA and of a
fully staged tiered layer) against the per-expert reference, on the CPU (torch._grouped_mm runs there too)."""
import pytest
import torch

from moetier.models.layers import DenseExperts, grouped_experts, grouped_mm_experts, swiglu

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")


@pytest.mark.parametrize("t,k", [(37, 4), (1, 2), (64, 8)])
def test_matches_the_per_expert_path(t, k):
    g = torch.Generator().manual_seed(t * 10 + k)
    E, D, I = 16, 64, 32
    ex = DenseExperts(E, D, I)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(E, 2 * I, D, generator=g) / D ** 0.5)
        ex.down_proj.copy_(torch.randn(E, D, I, generator=g) / I ** 0.5)
    x = torch.randn(t, D, generator=g)
    # distinct experts per token; experts 0-3 never chosen (empty groups)
    ids = torch.stack([torch.randperm(E - 4, generator=g)[:k] + 4 for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    want = grouped_experts(x, ids, w, E, ex.expert)
    xb, wb = x.bfloat16(), w.bfloat16()
    got, counts = grouped_mm_experts(xb, ids, wb, ex.gate_up_proj.detach().bfloat16(),
                                     ex.down_proj.detach().bfloat16(), swiglu)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=E))
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < 3e-2, err
