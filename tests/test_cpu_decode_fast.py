"""The CPU decode fast paths (one-token attention, cached RoPE tables, fused q/k/v, fused RMSNorm,
the T=1 expert sum, greedy sampling) against their general twins on random inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import max_rel_err

from moetier.config import ModelArgs
from moetier.models.layers import (
    Attention,
    DenseExperts,
    RMSNorm,
    Rope,
    gathered_experts,
    grouped_experts,
    one_token_attention,
)
from moetier.runtime.kv_cache import KVCache
from moetier.runtime.sampling import Sampler, SamplingParams


def _sdpa(q, k, v, scale, mask=None):
    """The general path: SDPA over [H, T, Dh] with GQA, optional key mask [S]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("h,hkv,s", [(6, 2, 257), (4, 4, 1), (8, 1, 33)])
def test_one_token_attention_matches_sdpa(h, hkv, s):
    g = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(n, hh, 16, generator=g) for n, hh in ((1, h), (s, hkv), (s, hkv)))
    assert max_rel_err(one_token_attention(q, k, v, s - 1, 0.25), _sdpa(q, k, v, 0.25)) < 1e-5
    # a tensor start (compiled decode) attends over a longer view with keys past start masked
    kk, vv = torch.cat([k, torch.randn(7, hkv, 16, generator=g)]), torch.cat([v, torch.randn(7, hkv, 16, generator=g)])
    ours = one_token_attention(q, kk, vv, torch.tensor(s - 1), 0.25)
    assert max_rel_err(ours, _sdpa(q, k, v, 0.25)) < 1e-5


def test_rope_span_matches_forward():
    rope = Rope({"rope_theta": 10000.0}, 32, 4096)
    for start, t in [(0, 1), (5, 3), (300, 1), (1000, 40)]:   # crosses the first table size (256)
        cos, sin = rope.span(start, t, torch.float32, "cpu")
        ref_cos, ref_sin = rope(start + torch.arange(t), torch.float32)
        assert torch.allclose(cos, ref_cos, atol=1e-6) and torch.allclose(sin, ref_sin, atol=1e-6)


def test_rmsnorm_fp32_fast_path_matches_formula():
    norm = RMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x = torch.randn(3, 5, 48)
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert max_rel_err(norm(x), ref) < 1e-6


@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv_matches_separate(bias):
    args = ModelArgs("qwen3_moe", 100, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, attention_bias=bias)
    torch.manual_seed(0)
    attn = Attention(args, qk_norm=True)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    rope = Rope({"rope_theta": 10000.0}, 16, 128)
    x = torch.randn(5, 64)
    outs = []
    for fuse in (False, True):
        if fuse:
            attn.fuse_qkv()
        kv = KVCache(16, (2, 16), (2, 16), torch.float32, "cpu")
        with torch.no_grad():
            prefill = attn(x[:4], rope.span(0, 4, torch.float32, "cpu"), kv, 0)
            step = attn(x[4:], rope.span(4, 1, torch.float32, "cpu"), kv, 4)
        outs.append(torch.cat([prefill, step]))
    assert max_rel_err(outs[1], outs[0]) < 1e-5
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()   # views: no second copy


def test_one_token_experts_matches_gathered():
    g = torch.Generator().manual_seed(1)
    ex = DenseExperts(8, 48, 32)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.2)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.2)
        x = torch.randn(1, 48, generator=g)
        ids = torch.tensor([[5, 2]])
        w = torch.softmax(torch.randn(1, 2, generator=g), -1)
        assert max_rel_err(grouped_experts(x, ids, w, 8, ex.expert), gathered_experts(x, ids, w, ex)) < 1e-5


def test_greedy_fast_path_matches_penalty_path():
    g = torch.Generator().manual_seed(2)
    fast = Sampler(SamplingParams(temperature=0), 100, "cpu", [1, 2])
    slow = Sampler(SamplingParams(temperature=0, repetition_penalty=1.0 + 1e-12), 100, "cpu", [1, 2])
    for _ in range(20):
        logits = torch.randn(100, generator=g)
        assert fast(logits) == slow(logits) == int(torch.argmax(logits))


def test_compiled_step_not_built_in_auto(tiny_model_dir, tmp_path, monkeypatch):
    """auto never builds: without a cached package the engine decodes eagerly (and still right)."""
    from moetier import EngineConfig
    from moetier.runtime import cpu_compile
    from moetier.runtime.engine import Engine
    monkeypatch.setattr(cpu_compile, "CACHE_DIR", tmp_path)
    eng = Engine.load(tiny_model_dir, EngineConfig(device="cpu", progress=False, max_context=64))
    done = eng.complete(prompt_ids=[3, 4, 5], max_tokens=4, params=SamplingParams(temperature=0), ignore_eos=True)
    assert eng._cpu_decode is False and len(done.token_ids) == 4
    assert not any(tmp_path.iterdir())
    assert cpu_compile.package_key(eng.model) == cpu_compile.package_key(eng.model)


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_fused_qkv_model_matches_transformers(tmp_path, arch):
    """What Engine.load does on the CPU (fuse_qkv: one GEMM, q/k normed and rotated together), checked
    against transformers: qk-norm (both), q/k/v biases and partial RoPE (GLM)."""
    from helpers import ours_logits, tiny_checkpoint

    from moetier.weights.loader import load_model
    if arch == "qwen3_moe":
        from test_arch_qwen3_moe import config
        from transformers import Qwen3MoeForCausalLM as cls
        ref = tiny_checkpoint(tmp_path, cls, config(), scale=4.0)
    else:
        from test_arch_deepseek_v3 import random_correction_bias
        from test_arch_glm4_moe import config
        from transformers import Glm4MoeForCausalLM as cls
        ref = tiny_checkpoint(tmp_path, cls, config(), scale=4.0, init=random_correction_bias)
    model, _, _ = load_model(tmp_path)
    for m in model.modules():
        if isinstance(m, Attention):
            m.fuse_qkv()
    tokens = torch.randint(0, 131, (13,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens[None]).logits[0]
    assert max_rel_err(ours_logits(model, tokens, 7), want) <= 1e-4


def test_compiled_step_falls_back_outside_the_export(tiny_model_dir):
    """KV stored in another dtype than the exported one, or a context under 2 positions: eager."""
    from moetier import EngineConfig
    from moetier.runtime.cpu_compile import CpuDecode
    from moetier.runtime.engine import Engine
    eng = Engine.load(tiny_model_dir, EngineConfig(device="cpu", progress=False, max_context=64))
    step = CpuDecode(eng.model, runner=None, path=None)   # a runner call would fail: must not happen
    step.kv_dtype = torch.float16                          # as if exported for fp16 KV
    cache, ref = eng.model.make_cache(64, torch.float32, "cpu"), eng.model.make_cache(64, torch.float32, "cpu")
    with torch.inference_mode():
        eng.model(torch.tensor([3, 4, 5]), cache)
        eng.model(torch.tensor([3, 4, 5]), ref)
        assert torch.equal(step(cache, 6), eng.model(torch.tensor([6]), ref))
        step.kv_dtype = torch.float32
        tiny = eng.model.make_cache(1, torch.float32, "cpu")
        assert step(tiny, 3).shape[-1] == eng.args.vocab_size and tiny.length == 1
    assert cache.length == ref.length == 4
