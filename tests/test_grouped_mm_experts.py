"""models.layers.grouped_mm_experts (the bf16 prefill of DenseExperts / QuantExperts on CUDA and of a
fully staged tiered layer) against the per-expert reference, on the CPU (torch._grouped_mm runs there too)."""
import pytest
import torch

from moetier.models.layers import DenseExperts, add_pairs, grouped_experts, grouped_mm_experts, swiglu

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


@pytest.mark.parametrize("t,k", [(37, 4), (1, 8), (5, 1)])
def test_add_pairs_sums_each_tokens_rows_in_fp32(t, k):
    """add_pairs' CUDA branch (fp32_sum, run here on the CPU): the weighted rows of sorted pairs (any permutation `order`
    of the T*k pairs, rows = order // k) go back to their tokens, each token's k rows summed in fp32 and rounded once:
    the float64 sum within one bf16 rounding, and the CPU's index_add_ within its k roundings."""
    g = torch.Generator().manual_seed(t * 10 + k)
    d = 48
    order = torch.randperm(t * k, generator=g)
    rows = order // k
    ys = (torch.randn(t * k, d, generator=g) * torch.rand(t * k, 1, generator=g) * 4).bfloat16()
    x = torch.randn(t, d, generator=g).bfloat16()
    got = add_pairs(x, rows, order, ys, k, fp32_sum=True)
    want = torch.zeros(t, d, dtype=torch.float64).index_add_(0, rows, ys.double())
    assert got.dtype == torch.bfloat16 and got.shape == (t, d)
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-30).all()
    cpu = add_pairs(x, rows, order, ys, k, fp32_sum=False)
    assert ((cpu.double() - want).abs() <= want.abs() * k * 2 ** -8 + 1e-2).all()
