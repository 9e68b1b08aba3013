"""Qwen3-Next / Qwen3.5-MoE (hybrid gated DeltaNet + gated attention MoE) against transformers,
and the chunked gated delta rule against its token-by-token twin."""
import math

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from helpers import check_against_reference, max_rel_err, ours_logits, tiny_checkpoint
from moetier.models.deltanet import causal_conv, chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule
from moetier.models.qwen3_next import GatedDeltaNet
from moetier.runtime.kv_cache import KVCache, RecurrentState
from moetier.weights.loader import load_model

VOCAB = 131
SIZES = dict(vocab_size=VOCAB, hidden_size=44, num_attention_heads=3, num_key_value_heads=1, head_dim=24,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=10,
             linear_conv_kernel_dim=4, moe_intermediate_size=14, shared_expert_intermediate_size=18,
             num_experts=6, num_experts_per_tok=2, max_position_embeddings=512,
             # eager experts: transformers' default grouped_mm needs 16-byte-aligned strides (odd sizes fail)
             experts_implementation="eager")


def next_config(**kw):
    # 5 layers: DeltaNet, attention, DeltaNet (dense MLP), attention, DeltaNet; partial RoPE 0.25 (6 of 24)
    base = dict(SIZES, num_hidden_layers=5, full_attention_interval=2, mlp_only_layers=[2], intermediate_size=30,
                norm_topk_prob=True)
    base.update(kw)
    return Qwen3NextConfig(**base)


def qwen3_5_config(**kw):
    base = dict(SIZES, num_hidden_layers=4, layer_types=["linear_attention", "full_attention",
                                                         "linear_attention", "linear_attention"])
    base.update(kw)
    return Qwen3_5MoeTextConfig(**base)


def slow_decay(model):
    """transformers draws A in [0.01, 16]: most heads forget within a few tokens. Decays near 1
    make the state carry across chunks, so the tests see the inter-chunk path."""
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(math.log(0.01), math.log(2.0), generator=g))
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=g) - 1.0)


def check_long_prefill(path, ref, prefill: int, steps: int = 3, seed: int = 3):
    """Prefill `prefill` tokens in one call, then decode `steps` more: logits within 1e-4 of transformers."""
    model, _, _ = load_model(path)
    tokens = torch.randint(0, VOCAB, (prefill + steps,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = ref(tokens[None]).logits[0]
    err = max_rel_err(ours_logits(model, tokens, prefill), want)
    assert err <= 1e-4, f"prefill {prefill}: max rel err {err:.2e}"
    return model, tokens, want


# ---------------------------------------------------------------- the delta rule itself
def random_rule_inputs(t: int, h: int = 3, dk: int = 12, dv: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(t, h, dk, generator=g)) * dk ** -0.5
    k = l2norm(torch.randn(t, h, dk, generator=g))
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * torch.tensor([0.02, 0.5, 3.0])     # slow, medium, fast heads
    beta = torch.rand(t, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("t,chunk", [(1, 8), (8, 8), (29, 8), (64, 64), (77, 64), (130, 16)])
def test_chunk_rule_matches_recurrent(t, chunk):
    args = random_rule_inputs(t, seed=t)
    want_out, want_state = recurrent_gated_delta_rule(*args)
    out, state = chunk_gated_delta_rule(*args, chunk=chunk)
    assert out.shape == want_out.shape and out.dtype == torch.float32
    assert max_rel_err(out, want_out) < 1e-5
    assert max_rel_err(state, want_state) < 1e-5


def test_chunk_rule_split_equals_whole():
    """A prompt prefilled in two calls (engine chunks, prefix reuse) continues from the state."""
    q, k, v, g, beta, s0 = random_rule_inputs(50, seed=3)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk=16)
    a, s_a = chunk_gated_delta_rule(q[:21], k[:21], v[:21], g[:21], beta[:21], s0, chunk=16)
    b, s_b = chunk_gated_delta_rule(q[21:], k[21:], v[21:], g[21:], beta[21:], s_a, chunk=16)
    assert max_rel_err(torch.cat([a, b]), whole) < 1e-5 and max_rel_err(s_b, s_whole) < 1e-5


def test_causal_conv_carries_its_inputs():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 7, generator=g), torch.randn(7, 1, 4, generator=g)
    whole, tail = causal_conv(x, torch.zeros(3, 7), w)
    y1, prev = causal_conv(x[:5], torch.zeros(3, 7), w)
    y2, prev2 = causal_conv(x[5:6], prev, w)
    y3, prev3 = causal_conv(x[6:], prev2, w)
    assert torch.allclose(torch.cat([y1, y2, y3]), whole, atol=1e-6) and torch.equal(prev3, tail)
    assert torch.equal(tail, x[-3:])


# ---------------------------------------------------------------- whole models vs transformers
@pytest.mark.parametrize("fused", [False, True])
def test_qwen3_next_matches_transformers(tmp_path, fused):
    cfg = next_config()
    ref = tiny_checkpoint(tmp_path, Qwen3NextForCausalLM, cfg, fused=fused, scale=4.0, init=slow_decay)
    model = check_against_reference(tmp_path, ref, VOCAB)
    kinds = [type(e) for e in model.make_cache(8, torch.float32, "cpu").layers]
    assert kinds == [RecurrentState, KVCache, RecurrentState, KVCache, RecurrentState]
    assert not hasattr(model.model.layers[2].mlp, "experts")            # mlp_only_layers
    # lengths that are, and are not, a multiple of the 64-token chunk
    for n in (64, 77):
        check_long_prefill(tmp_path, ref, n)


def test_qwen3_next_small_chunks_and_split_prefill(tmp_path, monkeypatch):
    """Several chunks (the last one partial), and a prompt prefilled in two calls, as the engine does."""
    cfg = next_config(tie_word_embeddings=True, norm_topk_prob=False, num_key_value_heads=3)
    ref = tiny_checkpoint(tmp_path, Qwen3NextForCausalLM, cfg, seed=4, scale=4.0, init=slow_decay)
    monkeypatch.setattr(GatedDeltaNet, "chunk", 16)
    model, tokens, want = check_long_prefill(tmp_path, ref, 77, seed=5)
    cache = model.make_cache(len(tokens), torch.float32, "cpu")
    with torch.no_grad():
        got = torch.cat([model(tokens[:40], cache), model(tokens[40:], cache)])
    assert max_rel_err(got, want) <= 1e-4


@pytest.mark.parametrize("fused", [False, True])
def test_qwen3_5_moe_matches_transformers(tmp_path, fused):
    ref = tiny_checkpoint(tmp_path, Qwen3_5MoeForCausalLM, qwen3_5_config(), seed=2, fused=fused, scale=4.0,
                          init=slow_decay)
    model = check_against_reference(tmp_path, ref, VOCAB, seed=3)
    assert hasattr(model.model.layers[0].linear_attn, "in_proj_qkv")
    assert model.model.layers[0].mlp.gate.normalize                     # no norm_topk_prob: always renormalised
    check_long_prefill(tmp_path, ref, 77)


def test_static_position_decode_matches(tmp_path):
    """The CUDA-graph form of a decode step (start as a 0-d tensor, caller advances) gives the same
    logits as the plain one: DeltaNet layers ignore the position, attention masks the whole cache."""
    tiny_checkpoint(tmp_path, Qwen3NextForCausalLM, next_config(), scale=4.0, init=slow_decay)
    model, _, _ = load_model(tmp_path)
    tokens = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(6))
    want = ours_logits(model, tokens, 15)[15:]
    cache = model.make_cache(len(tokens) + 4, torch.float32, "cpu")
    for entry in cache.layers:   # KVCache is torch.empty: a NaN in an unwritten (masked) slot
        if isinstance(entry, KVCache):   # would still reach the output through 0 * NaN
            entry.k.zero_()
            entry.v.zero_()
    got = []
    with torch.no_grad():
        model(tokens[:15], cache)
        for i in range(15, 20):
            got.append(model(tokens[i:i + 1], cache, pos=torch.tensor(cache.length)))
            cache.advance(1)
    assert max_rel_err(torch.cat(got), want) < 1e-5
