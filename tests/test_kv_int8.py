"""int8 KV cache (one fp16 scale per 32 values) and KV offload: round-trip bound, KL and top-1
agreement on the embedded default model, greedy tokens, graph-mode writes, MLA latents, memory."""
import argparse
import collections
import functools
import json
import textwrap

import pytest
import torch

from moetier import EngineConfig, SamplingParams
from moetier.commands.common import add_model_args, engine_config
from moetier.errors import UserError
from moetier.runtime.engine import Engine
from moetier.runtime.generate import greedy_tokens
from moetier.runtime.kv_cache import (
    Cache,
    CastKVCache,
    Int8KVCache,
    KVCache,
    OffloadKVCache,
    dequantize_int8,
    kv_layer,
    quantize_int8,
    session_cache,
)


def kl_and_agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-position KL(ref || got) [T] and the fraction of positions with the same argmax."""
    lp, lq = ref.float().log_softmax(-1), got.float().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return kl, (ref.argmax(-1) == got.argmax(-1)).float().mean().item()


def teacher_forced_logits(model, ids: torch.Tensor, cache: Cache, chunk: int = 128) -> torch.Tensor:
    """Logits [T, V] of every position, fed in chunks so later chunks read earlier ones from the cache."""
    with torch.inference_mode():
        return torch.cat([model(ids[i:i + chunk], cache) for i in range(0, len(ids), chunk)]).float()


def docs_text() -> str:
    """Long English prose from the Python docs (stdlib module docstrings): no file or network needed."""
    return "\n\n".join(m.__doc__ for m in (argparse, json, textwrap, collections, functools))


# ---------------------------------------------------------------- the format
@pytest.mark.parametrize("d", [128, 64, 40, 8])        # 40: a group of 32 and one of 8; 8: one small group
def test_round_trip_error_is_at_most_half_a_scale(d):
    g = torch.Generator().manual_seed(d)
    # magnitudes from 1e-3 to 1e3 per row, and an outlier per row: every group gets its own scale
    x = torch.randn(64, 3, d, generator=g) * 10 ** (torch.rand(64, 3, 1, generator=g) * 6 - 3)
    x[:, :, 5] *= 30
    q, scale = quantize_int8(x)
    groups = -(-d // 32)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.dtype == torch.float16 and scale.shape == (64, 3, groups)
    back = dequantize_int8(q, scale, torch.float32)
    per_value_scale = scale.float().repeat_interleave(32, dim=-1)[..., :d]
    err = (back - x).abs()
    assert (err <= per_value_scale / 2 * (1 + 1e-5)).all(), (err / per_value_scale).max()
    assert q.abs().max() == 127                          # the range is used
    # all-zero groups stay exactly zero, and the dequantized dtype follows the request
    z = torch.zeros(2, d)
    assert dequantize_int8(*quantize_int8(z), torch.bfloat16).eq(0).all()
    assert dequantize_int8(q, scale, torch.bfloat16).dtype == torch.bfloat16


def test_int8_cache_update_contract():
    """Eager writes at an int start return [0, end); graph-mode writes at a tensor start return the
    whole buffer; both hold the same values. Snapshot/restore puts the stored positions back."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(20, 2, 48, generator=g), torch.randn(20, 2, 40, generator=g)
    eager = Int8KVCache(32, (2, 48), (2, 40))
    graph = Int8KVCache(32, (2, 48), (2, 40))
    for lo, hi in [(0, 7), (7, 8), (8, 20)]:
        k, v = eager.update(lo, kv[0][lo:hi], kv[1][lo:hi])
        assert k.shape == (hi, 2, 48) and v.shape == (hi, 2, 40) and k.dtype == torch.float32
        kg, vg = graph.update(torch.tensor(lo), kv[0][lo:hi], kv[1][lo:hi])
        assert kg.shape == (32, 2, 48) and torch.equal(kg[:hi], k) and torch.equal(vg[:hi], v)
        assert kg[hi:].eq(0).all()                      # unwritten positions decode to 0, never NaN
    for got, want in zip((k, v), kv):
        assert (got - want).abs().max() < want.abs().max() / 127
    snap = eager.snapshot(20)
    eager.update(4, torch.randn(10, 2, 48), torch.randn(10, 2, 40))
    eager.restore(snap)
    assert torch.equal(eager.update(20, kv[0][:0], kv[1][:0])[0], k)
    assert sum(t.numel() * t.element_size() for t in snap) == eager.nbytes * 20 // 32


# ---------------------------------------------------------------- accuracy on the default model
@pytest.fixture(scope="module")
def default_engine():
    return Engine.load(None, EngineConfig(device="cpu", progress=False))


def test_default_model_int8_kl_and_top1_over_1k_positions(default_engine):
    model = default_engine.model
    ids = torch.tensor(default_engine.tokenizer.encode(docs_text())[:1024])
    assert len(ids) == 1024
    ref = teacher_forced_logits(model, ids, session_cache(model, 1024, torch.float32, "cpu", "fp32"))
    got = teacher_forced_logits(model, ids, session_cache(model, 1024, torch.float32, "cpu", "int8"))
    assert all(isinstance(e, Int8KVCache) for e in session_cache(model, 8, torch.float32, "cpu", "int8").layers)
    kl, agree = kl_and_agreement(ref, got)
    assert kl.median().item() <= 0.003 and agree >= 0.97, (kl.median().item(), agree)
    # the check can fail: the model does use its context (a 64-token window moves the logits far more)
    short = torch.cat([model(ids[max(0, i - 63):i + 1], model.make_cache(64, torch.float32, "cpu"))[-1:]
                       for i in range(960, 1024)]).float()
    assert kl_and_agreement(ref[960:], short)[0].median() > 10 * kl[960:].median()


def test_bf16_kv_attends_in_bf16_where_the_cpu_multiplies_bf16(default_engine, monkeypatch):
    """--kv-dtype bf16 on a CPU with bf16 hardware (AMX / AVX512-BF16): attention runs in bf16 (K / V as stored, q
    rounded; layers.attend_in_bf16), prompts and one-token steps; a float32 KV cache or such a CPU's absence keeps
    float32. On the default model over 512 positions of real text (448 as chunks of 128, so later chunks attend to the
    cache, then 64 one token at a time), the bf16 products stay as close to the float32 ones as the int8 cache's
    bound, and they do differ (the path ran)."""
    from moetier.kernels import cpu
    from moetier.models import layers
    model = default_engine.model
    ids = torch.tensor(default_engine.tokenizer.encode(docs_text())[:512])
    seen = []
    sdpa = layers.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.dtype, k.dtype, q.shape[-2]))
        return sdpa(q, k, v, **kw)

    def logits(kv_dtype: str) -> torch.Tensor:
        cache = session_cache(model, 512, torch.float32, "cpu", kv_dtype)
        with torch.inference_mode():
            return torch.cat([teacher_forced_logits(model, ids[:448], cache)]
                             + [model(ids[i:i + 1], cache) for i in range(448, 512)]).float()
    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(cpu, "bf16_native", lambda: False)
    ref = logits("bf16")
    assert seen and all(q == k == torch.float32 for q, k, _ in seen)
    seen.clear()
    monkeypatch.setattr(cpu, "bf16_native", lambda: True)
    got = logits("bf16")
    assert all(q == k == torch.bfloat16 for q, k, _ in seen) and {n for *_, n in seen} >= {1, 128}
    kl, agree = kl_and_agreement(ref, got)
    assert kl.median().item() <= 0.003 and agree >= 0.97, (kl.median().item(), agree)
    assert kl[448:].median().item() <= 0.003                      # the one-token steps too
    assert not torch.equal(ref, got) and not torch.equal(ref[448:], got[448:])
    seen.clear()
    logits("fp32")
    assert all(q == k == torch.float32 for q, k, _ in seen)                          # a float32 cache: float32


def test_engine_int8_greedy_matches_reference(tiny_model_dir):
    engine = Engine.load(tiny_model_dir, EngineConfig(device="cpu", kv_dtype="int8", progress=False))
    ids = engine.tokenizer.encode("Python is a programming language that lets you")
    done = engine.complete(prompt_ids=ids, max_tokens=16, params=SamplingParams(temperature=0), ignore_eos=True)
    assert isinstance(engine.new_session().cache[0], Int8KVCache)
    want = greedy_tokens(engine.model, ids, 16)
    assert done.token_ids[:8] == want[:8], (done.token_ids, want)
    # a session truncates an int8 cache like any KV cache: prefix reuse gives the fresh result
    p, session = SamplingParams(temperature=0), engine.new_session()
    first = engine.complete(prompt_ids=ids, max_tokens=6, params=p, session=session, ignore_eos=True)
    second = ids + first.token_ids + engine.tokenizer.encode(" quickly")
    again = engine.complete(prompt_ids=second, max_tokens=6, params=p, session=session, ignore_eos=True)
    assert again.stats["cached_tokens"] == len(ids) + 5
    assert again.token_ids == engine.complete(prompt_ids=second, max_tokens=6, params=p, ignore_eos=True).token_ids


def test_graph_mode_start_matches_eager(tiny_model_dir):
    """CausalLM.forward(pos=tensor) (the CUDA-graph decode path, run eagerly on the CPU here):
    index_copy writes and a masked attention over the whole int8 buffer give the eager logits."""
    engine = Engine.load(tiny_model_dir, EngineConfig(device="cpu", progress=False))
    model, ids = engine.model, torch.tensor(engine.tokenizer.encode("The quick brown fox jumps"))
    eager = session_cache(model, 32, torch.float32, "cpu", "int8")
    graph = session_cache(model, 32, torch.float32, "cpu", "int8")
    with torch.inference_mode():
        want = [model(ids[:4], eager)[-1]] + [model(ids[i:i + 1], eager)[-1] for i in range(4, len(ids))]
        model(ids[:4], graph)
        for i in range(4, len(ids)):
            got = model(ids[i:i + 1], graph, pos=torch.tensor(graph.length))[-1]
            graph.advance(1)
            torch.testing.assert_close(got, want[i - 3], rtol=1e-4, atol=1e-4)


def test_mla_latent_cache_int8(tmp_path):
    from helpers import tiny_checkpoint
    from test_arch_deepseek_v3 import VOCAB, config, random_correction_bias
    from transformers import DeepseekV3ForCausalLM

    from moetier.weights.loader import load_model
    cfg = config(kv_lora_rank=40)                       # latent: a group of 32 and one of 8; rope key: 8
    tiny_checkpoint(tmp_path, DeepseekV3ForCausalLM, cfg, scale=4.0, init=random_correction_bias)
    model, _, _ = load_model(tmp_path)
    cache = session_cache(model, 96, torch.float32, "cpu", "int8")
    assert cache[0].k.shape == (96, 40) and cache[0].k_scale.shape == (96, 2)
    assert cache[0].v.shape == (96, 8) and cache[0].v_scale.shape == (96, 1)
    ids = torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(5))
    ref = teacher_forced_logits(model, ids, model.make_cache(96, torch.float32, "cpu"), chunk=16)
    kl, agree = kl_and_agreement(ref, teacher_forced_logits(model, ids, cache, chunk=16))
    assert kl.median() <= 0.003 and agree >= 0.95, (kl.median().item(), agree)


# ---------------------------------------------------------------- memory
def test_nbytes_at_32k_is_53_percent_of_bf16():
    """A Qwen3-30B-A3B-sized attention stack (48 layers, 4 KV heads, head_dim 128) at 32K context,
    built on the meta device (sizes without memory)."""
    from moetier.config import ModelArgs
    from moetier.models import model_class
    args = ModelArgs(model_type="qwen3_moe", vocab_size=1000, hidden_size=256, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=2,
                     num_experts_per_tok=1, moe_intermediate_size=8, intermediate_size=8)
    with torch.device("meta"):
        model = model_class("qwen3_moe")(args)
    bf16 = session_cache(model, 32768, torch.bfloat16, "meta").nbytes
    int8 = session_cache(model, 32768, torch.bfloat16, "meta", "int8").nbytes
    assert bf16 == 48 * 2 * 32768 * 4 * 128 * 2                     # 3 GiB
    assert int8 == 48 * 2 * 32768 * 4 * (128 + 4 * 2)               # int8 values + 4 fp16 scales per head
    assert int8 / bf16 == pytest.approx(1.0625 / 2)                  # 0.531
    assert session_cache(model, 32768, torch.bfloat16, "meta", "fp32").nbytes == 2 * bf16


# ---------------------------------------------------------------- other KV dtypes, offload
def test_cast_cache_returns_the_compute_dtype():
    c = kv_layer(8, (2, 16), (2, 16), torch.float32, "cpu", "bf16")
    assert isinstance(c, CastKVCache) and c.k.dtype == torch.bfloat16 and c.nbytes == 2 * 8 * 32 * 2
    k = torch.randn(3, 2, 16)
    got, _ = c.update(0, k, k)
    assert got.dtype == torch.float32 and torch.equal(got, k.bfloat16().float())
    assert type(kv_layer(8, (2, 16), (2, 16), torch.float32, "cpu", "fp32")) is KVCache
    with pytest.raises(UserError, match="unknown KV dtype 'int4'"):
        kv_layer(8, (2, 16), (2, 16), torch.float32, "cpu", "int4")


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_offload_copy_in_reads_every_written_position(kv_dtype):
    """The offload class with "cpu" standing in for the GPU: every step returns fresh copies (not the
    host buffers) of all positions written so far, equal to what a resident cache returns."""
    off = kv_layer(64, (2, 32), (2, 24), torch.float32, "cpu", kv_dtype, offload=True)
    resident = kv_layer(64, (2, 32), (2, 24), torch.float32, "cpu", kv_dtype)
    assert isinstance(off, OffloadKVCache) and off.nbytes == resident.nbytes
    g = torch.Generator().manual_seed(1)
    written, start = [], 0
    for t in [5, 1, 1, 17, 1, 30, 9]:
        k, v = torch.randn(t, 2, 32, generator=g), torch.randn(t, 2, 24, generator=g)
        written.append(k)
        got, want = off.update(start, k, v), resident.update(start, k, v)
        start += t
        assert got[0].shape[0] == start and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        host = {b.untyped_storage().data_ptr() for b in off.store.buffers}
        assert not host & {x.untyped_storage().data_ptr() for x in got}
    if kv_dtype == "auto":
        assert torch.equal(got[0], torch.cat(written))
    with pytest.raises(NotImplementedError, match="CUDA graph"):
        off.update(torch.tensor(start), k[:1], v[:1])


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_generation_with_offload_equals_without(tiny_model_dir, kv_dtype):
    engine = Engine.load(tiny_model_dir, EngineConfig(device="cpu", progress=False))
    model, ids = engine.model, engine.tokenizer.encode("Mixture-of-experts models route each token")

    def greedy(cache, n=12):
        out, logits = [], model(torch.tensor(ids), cache)[-1]
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor(out[-1:]), cache)[-1]
        return out

    base = model.make_cache(1, torch.float32, "cpu")
    offloaded = Cache([kv_layer(64, tuple(e.k.shape[1:]), tuple(e.v.shape[1:]), torch.float32, "cpu",
                                kv_dtype, offload=True) for e in base.layers], 64)
    with torch.inference_mode():
        assert greedy(offloaded) == greedy(session_cache(model, 64, torch.float32, "cpu", kv_dtype))
    # through the engine: --kv-offload is a no-op on the CPU and changes nothing
    off_engine = Engine.load(tiny_model_dir, EngineConfig(device="cpu", kv_offload=True, progress=False))
    p = SamplingParams(temperature=0)
    assert off_engine.complete(prompt_ids=ids, max_tokens=12, params=p, ignore_eos=True).token_ids == \
        engine.complete(prompt_ids=ids, max_tokens=12, params=p, ignore_eos=True).token_ids


def test_cli_flags_reach_the_engine_config():
    p = argparse.ArgumentParser()
    add_model_args(p)
    cfg = engine_config(p.parse_args(["--kv-dtype", "int8", "--kv-offload"]))
    assert cfg.kv_dtype == "int8" and cfg.kv_offload
    cfg = engine_config(p.parse_args([]))
    assert cfg.kv_dtype == "auto" and not cfg.kv_offload
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-dtype", "int4"])


def test_session_cache_keeps_recurrent_states(tmp_path):
    """A hybrid model (Qwen3-Next): attention layers become int8, recurrent states stay full size."""
    from helpers import tiny_checkpoint
    from test_arch_qwen3_next import VOCAB, next_config
    from transformers import Qwen3NextForCausalLM

    from moetier.runtime.kv_cache import RecurrentState
    from moetier.weights.loader import load_model
    tiny_checkpoint(tmp_path, Qwen3NextForCausalLM, next_config(), scale=4.0)
    model, _, _ = load_model(tmp_path)
    plain, int8 = model.make_cache(40, torch.float32, "cpu"), session_cache(model, 40, torch.float32, "cpu", "int8")
    for a, b in zip(plain.layers, int8.layers):
        if isinstance(a, RecurrentState):
            assert type(b) is RecurrentState and a.conv.shape == b.conv.shape and a.ssm.shape == b.ssm.shape
        else:
            assert isinstance(b, Int8KVCache) and b.k.shape == a.k.shape
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(2))
    kl, agree = kl_and_agreement(teacher_forced_logits(model, ids, plain, 8), teacher_forced_logits(model, ids, int8, 8))
    assert kl.median() <= 0.003 and agree >= 0.9, (kl.median().item(), agree)
