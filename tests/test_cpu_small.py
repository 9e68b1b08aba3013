"""kernels/cpu_small.c: an eager CPU token's attention (q/k norm, RoPE, cache write, attention) and its residual add +
norm + softmax router in C, against the torch twins of models/layers.py; the engine's eager decode takes them."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moetier import EngineConfig, SamplingParams
from moetier.kernels import cpu, small_ops
from moetier.models.layers import (Rope, apply_rope, attention, causal_mask, one_token_attention, rms_normalize,
                                   softmax_topk)
from moetier.runtime.engine import Engine
from moetier.runtime.kv_cache import KVCache
from moetier.commands.quantize import quantize
from test_gguf import build_qwen3_moe

pytestmark = pytest.mark.skipif(cpu.backend() != "c", reason="the C kernels did not build")


def attention_twin(qkv, qw, kw, eps, cos, sin, pos, kv, h, hkv, scale):
    """Attention.forward's one-token path in torch ops (q / k norm, RoPE, kv.update, one_token_attention)."""
    dh = kv.k.shape[-1]
    q, k, v = qkv.view(h + 2 * hkv, dh).split([h, hkv, hkv])
    if qw is not None:
        q, k = rms_normalize(q, eps) * qw, rms_normalize(k, eps) * kw
    q, k = apply_rope(q[None], cos, sin), apply_rope(k[None], cos, sin)
    keys, values = kv.update(pos, k, v[None])
    return one_token_attention(q, keys, values, pos, scale).reshape(1, h * dh)


@pytest.mark.parametrize("t,window", [(37, None), (37, 64), (37, 16), (2, None)])
def test_fresh_prompt_attention_is_the_masked_one(t, window):
    """A fresh CPU prompt's attention takes SDPA's is_causal (its own keys, no window cut: 37 within a window of 64),
    the masked SDPA otherwise (a window of 16 cuts 37 tokens); both equal the explicit causal mask's result"""
    g = torch.Generator().manual_seed(t)
    q, k, v = torch.randn(t, 8, 32, generator=g), torch.randn(t, 2, 32, generator=g), torch.randn(t, 2, 32, generator=g)
    mask = causal_mask(t, t, 0, window, "cpu")
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          attn_mask=mask, scale=0.2, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(attention(q, k, v, 0, 0.2, window), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t,h,hkv,dh,rot,norm", [(7, 8, 2, 64, 64, True), (33, 6, 6, 32, 16, False),
                                                 (5, 4, 1, 128, 96, True), (70, 32, 4, 128, 128, True)])
def test_prompt_qk_norm_rope_matches_the_twin(t, h, hkv, dh, rot, norm):
    """A prompt's q / k heads in one C pass (cpu.qk_norm_rope, Attention._fused_qkv's eager CPU path): each head
    RMSNorm'd by its weight (q heads q_norm's, k heads k_norm's; none) and rotated by its token's cos / sin (partial
    RoPE: the rest passed through), from qkv rows with v's columns after them, against rms_normalize * w and
    apply_rope"""
    g = torch.Generator().manual_seed(t)
    qkv = torch.randn(t, (h + 2 * hkv) * dh, generator=g) * 3
    qw, kw = (torch.rand(dh, generator=g) + 0.5, torch.rand(dh, generator=g) + 0.5) if norm else (None, None)
    cos, sin = Rope({"rope_theta": 10000.0}, rot, 4096).span(11, t, torch.float32, "cpu")
    qk = qkv[:, :(h + hkv) * dh].view(t, h + hkv, dh)
    if norm:
        qk = rms_normalize(qk, 1e-6) * torch.cat([qw.expand(h, -1), kw.expand(hkv, -1)])
    want = apply_rope(qk, cos, sin)
    got = small_ops.qk_norm_rope(qkv, h, hkv, dh, qw, kw, 1e-6, cos, sin, lambda: None)
    assert got is not None and got.shape == (t, h + hkv, dh)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("h,hkv,dh,rot,pos,norm,c_core,sharp", [
    (8, 2, 64, 64, 0, True, True, 1), (8, 2, 64, 64, 37, True, True, 1), (6, 6, 32, 16, 5, False, True, 1),
    (4, 1, 128, 96, 300, True, True, 1), (4, 1, 128, 96, 300, True, False, 1),
    (8, 1, 64, 64, 200, True, True, 1),       # runs of 4 heads on 2 threads
    (7, 1, 64, 32, 200, False, True, 1),      # runs of 4 and 3
    (4, 2, 20, 20, 150, True, True, 1),       # dh % 8 != 0: the plain C loops
    (32, 4, 128, 128, 700, True, True, 1),
    (6, 2, 64, 64, 300, False, True, 40)])    # sharp scores: most shifted ones below -87 (exp 0)
def test_decode_attention_matches_the_twin(h, hkv, dh, rot, pos, norm, c_core, sharp, monkeypatch):
    """c_core: the C attention over every key (else past cpu.ATTN_C_MAX_WORK: its prep, then torch's GEMMs)."""
    monkeypatch.setattr(cpu, "ATTN_C_MAX_WORK", 1 << 30 if c_core else 256 * h * dh)
    g = torch.Generator().manual_seed(pos + h)
    qkv = torch.randn(1, (h + 2 * hkv) * dh, generator=g)
    qkv[:, :h * dh] *= sharp
    qw = torch.randn(dh, generator=g) if norm else None
    kw = torch.randn(dh, generator=g) if norm else None
    rope = Rope({"rope_type": "default", "rope_theta": 10000.0}, rot, 4096)
    cos, sin = rope.span(pos, 1, torch.float32, "cpu")
    ours, ref = KVCache(800, (hkv, dh), (hkv, dh), torch.float32, "cpu"), KVCache(800, (hkv, dh), (hkv, dh),
                                                                                   torch.float32, "cpu")
    for c in (ours, ref):          # earlier positions: random keys and values (never zeros)
        c.k[:pos] = torch.randn(pos, hkv, dh, generator=torch.Generator().manual_seed(1))
        c.v[:pos] = torch.randn(pos, hkv, dh, generator=torch.Generator().manual_seed(2))
    scale = 1 / math.sqrt(dh)
    want = attention_twin(qkv, qw, kw, 1e-6, cos, sin, pos, ref, h, hkv, scale)
    got = cpu.decode_attention(qkv, qw, kw, 1e-6, cos, sin, pos, ours.k, ours.v, h, hkv, scale)
    # sharp scores (~40x larger) carry the dot products' float32 rounding, which differs with the summation order
    # (torch's GEMM against the C loops), ~40x larger into the softmax weights: 2.4e-5 on a 0.73 output on a Xeon
    tol = 1e-5 if sharp == 1 else 1e-4
    assert got.shape == want.shape and torch.allclose(got, want, rtol=tol, atol=tol)
    assert torch.allclose(ours.k[:pos + 1], ref.k[:pos + 1], rtol=1e-5, atol=1e-6)
    assert torch.equal(ours.v[:pos + 1], ref.v[:pos + 1])
    assert not ours.k[pos + 1:].any()               # nothing written past the token's row


@pytest.mark.parametrize("e,k,normalize", [(128, 8, True), (60, 4, False), (16, 16, True)])
def test_router_add_norm_matches_the_twin(e, k, normalize):
    g = torch.Generator().manual_seed(e)
    d = 512
    h, a = torch.randn(1, d, generator=g), torch.randn(1, d, generator=g)
    nw, weight = torch.randn(d, generator=g), torch.randn(e, d, generator=g) / 8
    s, x, ids, w = cpu.router_topk_add_norm(h, a, nw, 1e-6, weight, k, normalize)
    s_ref = h + a
    x_ref = F.rms_norm(s_ref, (d,), nw, 1e-6)
    ids_ref, w_ref = softmax_topk(F.linear(x_ref, weight), k, normalize)
    assert torch.equal(s, s_ref) and torch.allclose(x, x_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(ids, ids_ref) and ids.dtype == torch.long
    assert torch.allclose(w, w_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", [384, 2048, 77])
def test_rms_norm_matches_the_twin(n):
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(1, n, generator=g) * 3, torch.randn(n, generator=g)
    got = cpu.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and torch.allclose(got, F.rms_norm(x, (n,), w, 1e-6), rtol=1e-5, atol=1e-6)
    many = torch.randn(5, n, generator=g)                               # rows: each normed on its own
    assert torch.allclose(cpu.rms_norm(many, w, 1e-5), F.rms_norm(many, (n,), w, 1e-5), rtol=1e-5, atol=1e-6)


def test_router_add_norm_gives_way_on_nan_and_refuses_bad_k():
    h, a, weight = torch.randn(1, 64), torch.randn(1, 64), torch.randn(8, 64)
    h[0, 0] = float("nan")                           # every logit NaN: the C call hands the choice back
    assert cpu.router_topk_add_norm(h, a, torch.ones(64), 1e-6, weight, 2, True) is None
    with pytest.raises(ValueError, match="k=9 outside"):
        cpu.router_topk_add_norm(torch.randn(1, 64), a, torch.ones(64), 1e-6, torch.randn(8, 64), 9, True)
    gate = up = torch.randint(0, 255, (8, 32, 64 // 32 * 34), dtype=torch.uint8)      # Q8_0 blocks (type id 8)
    down = torch.randint(0, 255, (8, 64, 34), dtype=torch.uint8)
    planes = (8, 8, gate, up, down, False)
    assert cpu.moe_block(h, a, torch.ones(64), 1e-6, weight, 2, True, planes) is None
    with pytest.raises(RuntimeError, match="k=9 of 8 experts"):
        cpu.moe_block(torch.randn(1, 64), a, torch.ones(64), 1e-6, weight, 9, True, planes)


def counted(monkeypatch, **names) -> dict:
    """Wrap the kernels.cpu functions named by the values so that calls[key] counts each one's calls."""
    calls = dict.fromkeys(names, 0)
    for key, name in names.items():
        inner = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _i=inner, _k=key, **kw: calls.__setitem__(_k, calls[_k] + 1)
                            or _i(*a, **kw))
    return calls


def test_eager_cpu_decode_takes_the_c_ops_and_matches_the_twins(tmp_path, monkeypatch):
    """The engine's eager CPU decode (a tiny Qwen3-MoE) runs cpu_small.c's attention and router once a layer a token
    and its RMSNorm for each block's input norm and the final one (the prompt's rows too), and its logits are the torch twins'
    (MOETIER_CPU_SMALL=0's) to float32 rounding; forcing the torch backend turns them off."""
    eng = Engine.load(build_qwen3_moe(tmp_path / "model"),
                      EngineConfig(device="cpu", threads=2, progress=False, max_context=128, cpu_compile="off"))
    calls = counted(monkeypatch, attn="decode_attention", router="router_topk_add_norm", norm="rms_norm")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, eng.args.vocab_size, (9,), generator=g)
    toks = torch.randint(0, eng.args.vocab_size, (12,), generator=g)

    def logits(on: bool, force_torch: bool = False):
        monkeypatch.setattr(small_ops, "CPU_SMALL", on)
        c, out = eng.new_session(max_context=64).cache, []
        with torch.inference_mode():
            eng.model(prompt, c)
            for t in toks:
                if force_torch:
                    with small_ops.use("torch"):
                        out.append(eng.model(t[None], c)[-1])
                else:
                    out.append(eng.model(t[None], c)[-1])
        return torch.stack(out)
    want = logits(False)
    assert calls == {"attn": 0, "router": 0, "norm": 0}
    got = logits(True)
    layers = len(eng.model.model.layers)
    # and the prompt's norms (its 9 rows a call: each block's two, the final one; a token's second is the router's)
    assert calls == {"attn": len(toks) * layers, "router": len(toks) * layers,
                     "norm": len(toks) * (layers + 1) + 2 * layers + 1}
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4) and torch.equal(got.argmax(-1), want.argmax(-1))
    logits(True, force_torch=True)
    assert calls["attn"] == len(toks) * layers           # use("torch"): the twins


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "BF16", "Q4_K_M"])
def test_eager_blocks_are_their_separate_calls(tmp_path, monkeypatch, qtype):
    """An eager CPU token of a GGUF file (packed experts; BF16: float32 weights on their 16-bit copies) makes each
    block's attention half (cpu.attn_block: norm, qkv, attention, o) and MoE half (cpu.moe_block: router, experts,
    residual add) in one C call each, with the logits of the separate calls (the planes hidden) bit for bit."""
    # Q4_K_M: 256-wide rows, so q / k take Q4_K and v Q6_K in some layers (three GEMV parts there); Q4_0: llama.cpp's
    # mix keeps an 8-expert model's attn_k / attn_v in Q8_0 (three parts: q Q4_0, k, v)
    kw = dict(hidden_size=256, moe_intermediate_size=256, head_dim=64) if qtype == "Q4_K_M" else {}
    path = quantize(build_qwen3_moe(tmp_path / "model", **kw), qtype, tmp_path / f"m-{qtype}.gguf")
    eng = Engine.load(path, EngineConfig(device="cpu", threads=2, progress=False, max_context=128, cpu_compile="off"))
    eng.complete(prompt_ids=[5, 6, 7], max_tokens=2, params=SamplingParams(temperature=0.0))   # makes the copies
    experts = [blk.mlp.experts for blk in eng.model.model.layers]
    attns = [blk.self_attn for blk in eng.model.model.layers]
    x = torch.randn(1, eng.args.hidden_size)
    assert all(m.cpu_token_planes(x) is not None for m in experts + attns)
    parts = [len(m.cpu_token_planes(x)[0]) for m in attns]                 # q/k/v stacked, or three of their own
    assert parts == [3 if qtype in ("Q4_K_M", "Q4_0") else 1] * len(attns)
    calls = counted(monkeypatch, moe_block="moe_block", attn_block="attn_block")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, eng.args.vocab_size, (9,), generator=g)
    toks = torch.randint(0, eng.args.vocab_size, (10,), generator=g)

    def logits():
        c, out = eng.new_session(max_context=64).cache, []
        with torch.inference_mode():
            eng.model(prompt, c)
            out += [eng.model(t[None], c)[-1] for t in toks]
        return torch.stack(out)
    got = logits()
    assert calls == {"moe_block": len(toks) * len(experts), "attn_block": len(toks) * len(experts)}
    for m in experts + attns:                          # the modules' own calls (the C router, norm, attention)
        monkeypatch.setattr(m, "cpu_token_planes", lambda x: None)
    want = logits()
    assert calls == {"moe_block": len(toks) * len(experts), "attn_block": len(toks) * len(experts)}
    assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", ["Q4_0", "BF16", "Q4_K_M"])
def test_eager_layers_in_one_call_are_the_block_calls(tmp_path, monkeypatch, qtype):
    """runtime.cpu_step.EagerLayers (every layer's two block calls from one C call) gives the modules' logits bit for
    bit, token after token; a layer whose MoE half stops (NaN router weights: the C router refuses) is finished by the
    modules, with the layers after it; the engine's eager decode takes it (decode_path "eager", the same tokens as with
    MOETIER_CPU_LAYERS=0)."""
    from moetier.runtime.cpu_step import EagerLayers
    kw = dict(hidden_size=256, moe_intermediate_size=256, head_dim=64) if qtype == "Q4_K_M" else {}
    path = quantize(build_qwen3_moe(tmp_path / "model", **kw), qtype, tmp_path / f"m-{qtype}.gguf")
    eng = Engine.load(path, EngineConfig(device="cpu", threads=2, progress=False, max_context=128, cpu_compile="off"))
    done = eng.complete(prompt_ids=[5, 6, 7], max_tokens=6, params=SamplingParams(temperature=0.0), ignore_eos=True)
    assert done.stats["decode_path"] == "eager"
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, eng.args.vocab_size, (9,), generator=g)
    toks = torch.randint(0, eng.args.vocab_size, (8,), generator=g).tolist()

    def logits(layers: bool):
        c, out = eng.new_session(max_context=64).cache, []
        with torch.inference_mode():
            eng.model(prompt, c)
            step = EagerLayers.get(eng.model, c) if layers else None
            assert (step is not None) == layers
            out += [step(t) if layers else eng.model(torch.tensor([t]), c, last_only=True)[-1] for t in toks]
        assert c.length == len(prompt) + len(toks)
        return torch.stack(out)
    assert torch.equal(logits(True), logits(False))
    router = eng.model.model.layers[1].mlp.gate.weight
    keep = router.clone()
    router[0, 0] = float("nan")
    calls = counted(monkeypatch, moe_block="moe_block")
    got, want = logits(True), logits(False)
    router.copy_(keep)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert calls["moe_block"] > 0
    monkeypatch.setenv("MOETIER_CPU_LAYERS", "0")
    again = eng.complete(prompt_ids=[5, 6, 7], max_tokens=6, params=SamplingParams(temperature=0.0), ignore_eos=True)
    assert again.token_ids == done.token_ids
