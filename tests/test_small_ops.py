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


@pytest.mark.parametrize("qk_norm,rot_frac,h,hkv,dh", [(True, 1.0, 4, 2, 32), (False, 0.5, 6, 2, 16), (True, 1.0, 3, 3, 32)])
@pytest.mark.parametrize("pos", [0, 37, 150])
def test_fused_decode_attention_matches_the_layer(qk_norm, rot_frac, h, hkv, dh, pos):
    """One CUDA-graph decode token through Attention (device `start`): the fused path (norm + RoPE +
    cache write, split-K attention over [0, pos]) vs the unfused layer, logits and the cache."""
    from types import SimpleNamespace

    from moetier.models.layers import Attention, Rope
    from moetier.runtime.kv_cache import KVCache
    g = torch.Generator().manual_seed(pos + h)
    args = SimpleNamespace(hidden_size=48, num_attention_heads=h, num_key_value_heads=hkv, head_dim=dh,
                           attention_bias=False, rms_norm_eps=1e-6)
    att = Attention(args, qk_norm=qk_norm).to(DEV)
    with torch.no_grad():
        for p in att.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    att.fuse_qkv()
    rot = int(dh * rot_frac)
    rope = Rope({"rope_theta": 1000.0}, rot, 4096).to(DEV)
    caches = [KVCache(192, (hkv, dh), (hkv, dh), torch.float32, DEV) for _ in range(2)]
    past_k, past_v = torch.randn(pos, hkv, dh, generator=g), torch.randn(pos, hkv, dh, generator=g)
    caches[0].k.copy_(torch.randn(caches[0].k.shape, generator=g))     # garbage past pos: must stay unread
    caches[0].v.copy_(torch.randn(caches[0].v.shape, generator=g))
    caches[0].k[:pos], caches[0].v[:pos] = past_k.to(DEV), past_v.to(DEV)
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    x = torch.randn(1, 48, generator=g).to(DEV)
    start = torch.tensor(pos, device=DEV)
    cs = rope(start + torch.arange(1, device=DEV), torch.float32)
    with torch.no_grad():
        with small_ops.use("triton"):
            got = att(x, cs, caches[0], start)
        with small_ops.use("torch"):
            want = att(x, cs, caches[1], start)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(caches[0].k[:pos + 1], caches[1].k[:pos + 1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(caches[0].v[:pos + 1], caches[1].v[:pos + 1])
