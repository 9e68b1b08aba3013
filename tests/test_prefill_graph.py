"""Prefill as a CUDA graph (runtime.cuda_graph.PrefillGraphs): the forward's `last` position, buckets, which
engines and caches take it (CPU), and on a GPU the same tokens and log-probs as the eager prefill."""
import pytest
import torch

from moetier import EngineConfig, SamplingParams
from moetier.runtime.cuda_graph import PrefillGraphs, prefill_graph_context, prefill_graph_max
from moetier.runtime.engine import Engine
from moetier.runtime.kv_cache import Cache
from moetier.weights.loader import load_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_last_position_logits_equal_the_full_forward(tiny_model_dir):
    model, _, _ = load_model(tiny_model_dir)
    toks = torch.randint(0, 300, (23,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        full = model(toks, model.make_cache(32, torch.float32, "cpu"))
        for i in (0, 9, 22):
            got = model(toks, model.make_cache(32, torch.float32, "cpu"), last=torch.tensor([i]))
            assert got.shape == (1, full.shape[1])
            torch.testing.assert_close(got[0], full[i], rtol=1e-5, atol=1e-5)   # (a GEMV against a GEMM's row)


def test_buckets_and_what_a_graph_prefills():
    pg = PrefillGraphs(None, torch.bfloat16, "cpu", 2048)
    assert [pg.bucket(n) for n in (1, 16, 17, 33, 64, 65, 128, 129, 500, 2048)] == \
        [16, 16, 32, 64, 64, 128, 128, 256, 512, 2048]
    cache = Cache([None], 4096)
    cache.layers = []               # no layers: every layer is a plain KVCache
    assert pg.applies(cache, 100) and pg.applies(cache, 2048)
    assert not pg.applies(cache, 2049) and not pg.applies(cache, 0)
    cache.length = 3                # a prompt that extends cached tokens: eager without a context for them
    assert not pg.applies(cache, 100)
    pg = PrefillGraphs(None, torch.bfloat16, "cpu", 2048, context=3000)
    assert pg.applies(cache, 100) and pg.applies(cache, 2048)
    cache.length = 3000 - 128       # start + bucket must fit the context
    assert pg.applies(cache, 100) and not pg.applies(cache, 129)
    assert [pg.keys(e) for e in (1, 1024, 1025, 2048, 2049, 3000)] == [1024, 1024, 2048, 2048, 3000, 3000]
    cache.length = 0
    cache.layers = [object()]       # recurrent state or another KV store: eager
    assert not pg.applies(cache, 100)
    pg.failed = "x"
    cache.layers = []
    assert not pg.applies(cache, 100)


def test_which_models_fit_a_prefill_graph(tiny_model_dir):
    model, _, _ = load_model(tiny_model_dir)
    assert PrefillGraphs.fits(model, torch.bfloat16)
    assert not PrefillGraphs.fits(model, torch.float32)         # _grouped_mm is bf16: the capturable form
    experts = next(m for m in model.modules() if type(m).__name__ == "DenseExperts")
    experts.gate_up_bias = torch.nn.Parameter(torch.zeros(experts.num_experts, 2 * experts.hidden))
    assert not PrefillGraphs.fits(model, torch.bfloat16)        # biased experts: only the gathering form


def test_continuation_in_pos_mode_over_a_padded_view_is_the_eager_continuation(tiny_model_dir):
    """What a continuation graph computes, on the CPU: the cached K/V copied into the first positions of a longer
    scratch, the new tokens padded to their bucket, the forward's pos mode over a KVCache view of `keys` positions
    -> the last real token's logits and the new positions' K/V of the eager continuation."""
    from moetier.runtime.kv_cache import KVCache
    model, _, _ = load_model(tiny_model_dir)
    gen = torch.Generator().manual_seed(11)
    first, more = (torch.randint(0, 300, (n,), generator=gen) for n in (19, 13))
    with torch.inference_mode():
        cache = model.make_cache(64, torch.float32, "cpu")
        model(first, cache)
        want = model(more, cache)[-1]
        scratch = model.make_cache(96, torch.float32, "cpu")
        for mine, layer in zip(scratch.layers, cache.layers):
            mine.k[:19], mine.v[:19] = layer.k[:19], layer.v[:19]
        views = Cache([KVCache.of(m.k[:64], m.v[:64]) for m in scratch.layers], 64)
        padded = torch.cat([more, torch.zeros(3, dtype=torch.long)])          # bucket 16
        got = model(padded, views, pos=torch.tensor(19), last=torch.tensor([12]))[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for mine, layer in zip(scratch.layers, cache.layers):
        torch.testing.assert_close(mine.k[19:32], layer.k[19:32], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.v[19:32], layer.v[19:32], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,read,default,bad", [
    ("MOETIER_PREFILL_GRAPH_MAX", prefill_graph_max, PrefillGraphs.MAX_TOKENS, "lots"),
    ("MOETIER_PREFILL_GRAPH_CONTEXT", prefill_graph_context, PrefillGraphs.MAX_CONTEXT, "-5")])
def test_prefill_graph_limits_from_the_environment(monkeypatch, name, read, default, bad):
    monkeypatch.delenv(name, raising=False)
    assert read() == default
    monkeypatch.setenv(name, "0")
    assert read() == 0
    monkeypatch.setenv(name, bad)
    with pytest.raises(Exception, match=name):
        read()


def test_no_prefill_graphs_on_the_cpu(tiny_model_dir):
    eng = Engine.load(tiny_model_dir, EngineConfig(device="cpu", max_context=64, progress=False))
    assert eng._prefill_graphs() is None


def first_logprobs(eng, prompt, n):
    from moetier.runtime.generate import TokenEvent
    evs = [ev for ev in eng.generate(prompt_ids=prompt, max_tokens=n, params=SamplingParams(temperature=0),
                                     logprobs=5, ignore_eos=True) if isinstance(ev, TokenEvent)]
    return [ev.token_id for ev in evs], dict(evs[0].top_logprobs)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("fmt", ["Q4_0", "bf16"])
def test_graph_prefill_gives_the_eager_tokens(tmp_path, fmt, monkeypatch):
    """A bucket's first prompt runs eagerly, its second captures, its third replays: the same greedy tokens and the
    first token's top log-probs within bf16 rounding (the padded graph runs other GEMM shapes), for prompts that
    fill a bucket and that are padded, on GGUF experts (planes) and stacked bf16 experts (torch._grouped_mm)."""
    from test_gguf import build_qwen3_moe
    model = build_qwen3_moe(tmp_path / "model", hidden_size=256, moe_intermediate_size=256, intermediate_size=512,
                            num_hidden_layers=3, mlp_only_layers=[1], num_experts=16, num_experts_per_tok=4)
    path = model
    if fmt != "bf16":
        from moetier.commands.quantize import quantize
        path = quantize(model, fmt, tmp_path / f"m-{fmt}.gguf", pure=True)
    monkeypatch.setenv("MOETIER_PREFILL_GRAPH_MAX", "256")
    eng = Engine.load(path, EngineConfig(progress=False, device="cuda", dtype="bfloat16", max_context=320))
    pg = eng._prefill_graphs()
    assert pg is not None
    gen = torch.Generator().manual_seed(7)
    for n in (128, 77):                          # a whole bucket; padded to 128 (the graph already captured)
        prompt = torch.randint(0, 300, (n,), generator=gen).tolist()
        runs = [first_logprobs(eng, prompt, 12) for _ in range(3)]
        assert (128, 0) in pg.graphs and pg.failed is None
        for toks, lp in runs[1:]:
            assert toks == runs[0][0], (n, toks, runs[0][0])
            assert lp.keys() == runs[0][1].keys()
            assert max(abs(lp[t] - runs[0][1][t]) for t in lp) < 0.05, (lp, runs[0][1])
    assert not any(b == 384 for b, _ in pg.graphs)     # a prompt past MOETIER_PREFILL_GRAPH_MAX stays eager
    # a chat's next turns extend a session's cache: the first turn of bucket 32 over the context's 320 positions runs
    # eagerly, the second captures the graph, the third replays it; the tokens and first log-probs of an engine
    # without graphs
    monkeypatch.setenv("MOETIER_PREFILL_GRAPH_MAX", "0")
    ref = Engine.load(path, EngineConfig(progress=False, device="cuda", dtype="bfloat16", max_context=320))
    assert ref._prefill_graphs() is None
    extras = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (20, 25, 30, 18)]
    got, want = (turns(e, prompt, extras) for e in (eng, ref))
    assert (32, 320) in pg.graphs and pg.failed is None
    for (toks, lp, cached), (toks0, lp0, cached0) in zip(got, want):
        assert toks == toks0 and cached == cached0 and lp.keys() == lp0.keys(), (toks, toks0)
        assert max(abs(lp[t] - lp0[t]) for t in lp) < 0.05, (lp, lp0)
    assert all(c > 0 for _, _, c in got[1:])


def turns(eng, prompt, extras):
    """A session's turns: the prompt, then the conversation so far plus each of `extras` -> per turn (greedy
    tokens, the first token's top-5 log-probs, the cached tokens it reused)."""
    from moetier.runtime.generate import Done, TokenEvent
    s, ids, out = eng.new_session(), list(prompt), []
    for extra in [[]] + extras:
        ids = ids + extra
        evs = list(eng.generate(prompt_ids=ids, max_tokens=4, params=SamplingParams(temperature=0), logprobs=5,
                                ignore_eos=True, session=s))
        toks = [ev.token_id for ev in evs if isinstance(ev, TokenEvent) and ev.token_id >= 0]
        first = next(ev for ev in evs if isinstance(ev, TokenEvent) and ev.token_id >= 0)
        done = next(ev for ev in evs if isinstance(ev, Done))
        out.append((toks, dict(first.top_logprobs), done.stats["cached_tokens"]))
        ids = ids + toks
    return out
