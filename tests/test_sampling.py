"""Sampling: filters checked against a direct computation; seeds reproducible; temperature 0 == greedy."""
import math

import pytest
import torch

from moetier.errors import UserError
from moetier.runtime.sampling import Sampler, SamplingParams, apply_penalties, filter_logits


def logits(seed=0, v=97):
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 3


def kept(x):
    return set(torch.nonzero(torch.isfinite(x)).flatten().tolist())


@pytest.mark.parametrize("seed", range(5))
def test_top_k_keeps_the_k_largest(seed):
    x = logits(seed)
    want = set(sorted(range(len(x)), key=lambda i: -x[i].item())[:7])
    assert kept(filter_logits(x, top_k=7)) == want


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_smallest_set_reaching_p(seed, p):
    x = logits(seed)
    probs = torch.softmax(x.double(), -1).tolist()
    order = sorted(range(len(x)), key=lambda i: -probs[i])
    want, mass = set(), 0.0
    for i in order:
        want.add(i)
        mass += probs[i]
        if mass >= p:
            break
    assert kept(filter_logits(x, top_p=p)) == want


@pytest.mark.parametrize("seed", range(5))
def test_min_p_drops_tokens_below_fraction_of_max(seed):
    x = logits(seed)
    probs = torch.softmax(x.double(), -1)
    want = {i for i in range(len(x)) if probs[i] >= 0.1 * probs.max()}
    assert kept(filter_logits(x, min_p=0.1)) == want


def test_filters_compose_in_order():
    x = logits(3)
    out = filter_logits(x, top_k=20, top_p=0.8, min_p=0.05)
    assert kept(out) <= kept(filter_logits(x, top_k=20))
    assert len(kept(out)) >= 1


def test_temperature_zero_is_greedy():
    for seed in range(5):
        x = logits(seed)
        s = Sampler(SamplingParams(temperature=0.0, top_k=5, top_p=0.5), len(x), "cpu")
        assert s(x) == int(torch.argmax(x))


def test_same_seed_same_tokens_and_distribution():
    x = logits(1)
    draw = lambda seed: [Sampler(SamplingParams(temperature=1.0, seed=seed), len(x), "cpu")(x) for _ in range(1)]
    a = Sampler(SamplingParams(temperature=0.9, seed=42), len(x), "cpu")
    b = Sampler(SamplingParams(temperature=0.9, seed=42), len(x), "cpu")
    assert [a(x) for _ in range(50)] == [b(x) for _ in range(50)]
    assert draw(1) == draw(1)
    # empirical frequencies follow softmax(x / T)
    s = Sampler(SamplingParams(temperature=2.0, seed=7), len(x), "cpu")
    n = 20000
    counts = torch.bincount(torch.tensor([s(x) for _ in range(n)]), minlength=len(x)).double() / n
    want = torch.softmax(x.double() / 2.0, -1)
    assert (counts - want).abs().max() < 4 * math.sqrt(want.max() / n) + 1e-3


@pytest.mark.parametrize("how", ["apply_penalties", "_penalties_dense", "_penalties_sparse"])
def test_penalties_match_definitions(how):
    """Both implementations (CUDA's over the vocabulary, the CPU's over the seen tokens) against the definitions."""
    from moetier.runtime import sampling
    x = logits(2)
    seen = torch.zeros(len(x), dtype=torch.bool)
    seen[[1, 5, 9]] = True
    counts = torch.zeros(len(x))
    counts[5], counts[9] = 2, 1
    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    x0 = x.clone()
    out = getattr(sampling, how)(x, seen, counts, p)
    assert torch.equal(x, x0)                                            # the caller's logits untouched
    for i in range(len(x)):
        v = x[i].item()
        if seen[i]:
            v = v / 1.3 if v > 0 else v * 1.3
        v -= 0.25 * counts[i].item() + 0.5 * (counts[i].item() > 0)
        assert out[i].item() == pytest.approx(v, abs=1e-5)
    # the CPU's (numpy on float32) and CUDA's (torch over the vocabulary) the same bits
    assert torch.equal(sampling._penalties_sparse(x, seen, counts, p), sampling._penalties_dense(x, seen, counts, p))


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(min_p=2), dict(repetition_penalty=0), dict(presence_penalty=3)])
def test_invalid_params_raise_user_errors(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad).check()


@pytest.mark.parametrize("seed", [0, 1])
def test_argmax_matches_torch(seed):
    """The greedy fast path's argmax (numpy on float32 CPU logits) against torch.argmax: random logits, ties (the
    first maximum), NaN (the first NaN), other dtypes and a non-contiguous view."""
    from moetier.runtime.sampling import argmax
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8192, generator=g)
    ties = torch.randint(0, 4, (300,), generator=g).float()
    nan = x.clone()
    nan[[70, 9000 % 8192]] = float("nan")
    for v in (x, ties, nan, x.bfloat16(), x.view(2, -1)[:, 5], x[::3]):
        assert argmax(v) == int(torch.argmax(v))


def nucleus(x, p):
    """The top-p set computed directly (float64, every token ranked)."""
    probs = torch.softmax(x.double(), -1).tolist()
    want, mass = set(), 0.0
    for i in sorted(range(len(x)), key=lambda i: -probs[i]):
        want.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return want


@pytest.mark.parametrize("first", [1024, 8])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("p", [0.3, 0.9, 0.999])
def test_top_p_on_a_large_vocabulary_looks_at_the_largest_first(monkeypatch, seed, p, first):
    """candidates' top-p takes the NUCLEUS_FIRST largest logits (then 8x as many, ...) before sorting them all: the
    same set as ranking every token, where the nucleus fits in the first try and where it does not (first = 8)."""
    from moetier.runtime import sampling
    monkeypatch.setattr(sampling, "NUCLEUS_FIRST", first)
    x = logits(seed, v=5000) * (2.0 if p < 0.5 else 1.0)
    vals, ids = sampling.candidates(x, top_p=p)
    assert set(ids.tolist()) == nucleus(x, p)
    assert torch.equal(vals, x[ids])


@pytest.mark.parametrize("seed", range(3))
def test_candidates_compose_top_k_top_p_min_p_as_the_filters_do(seed):
    """top-k (ties at the k-th kept), then top-p over the survivors, then min-p: against the sets computed directly."""
    from moetier.runtime.sampling import candidates
    x = logits(seed, v=3000)
    x[[10, 20]] = x.max() + 1.0                                       # a tie at the top
    vals, ids = candidates(x, top_k=50, top_p=0.8, min_p=0.02)
    top = sorted(range(len(x)), key=lambda i: -x[i].item())[:50]
    sub = x[top]
    keep = [top[i] for i in nucleus(sub, 0.8)]
    probs = torch.softmax(x[keep].double(), -1)
    want = {t for t, q in zip(keep, probs.tolist()) if q >= 0.02 * probs.max().item()}
    assert set(ids.tolist()) == want and torch.equal(vals, x[ids])
    assert candidates(x)[1] is None and torch.equal(candidates(x)[0], x)   # no filter: all of them, unchanged


def test_draw_follows_the_probabilities_and_never_draws_a_zero():
    """The inverse-CDF draw: frequencies of 20,000 draws against the probabilities (some of them 0), top-k sampling's
    frequencies against the softmax of the k largest logits."""
    from moetier.runtime.sampling import draw
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(logits(4, v=40), -1)
    probs[[0, 7, 39]] = 0.0
    probs /= probs.sum()
    n = 20000
    got = torch.bincount(torch.tensor([draw(probs, g) for _ in range(n)]), minlength=40).double() / n
    assert got[[0, 7, 39]].sum() == 0
    assert (got - probs.double()).abs().max() < 4 * math.sqrt(probs.max().item() / n) + 1e-3
    x = logits(5, v=500)
    s = Sampler(SamplingParams(temperature=1.0, top_k=5, seed=9), len(x), "cpu")
    counts = torch.bincount(torch.tensor([s(x) for _ in range(n)]), minlength=len(x)).double() / n
    top = torch.topk(x, 5).indices
    want = torch.zeros(len(x), dtype=torch.float64)
    want[top] = torch.softmax(x[top].double(), -1)
    assert (counts - want).abs().max() < 4 * math.sqrt(want.max() / n) + 1e-3


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kw", [dict(top_k=30), dict(top_p=0.9), dict(top_p=0.999), dict(min_p=0.03),
                                dict(top_k=200, top_p=0.7, min_p=0.01)])
def test_the_cpu_candidates_are_the_cuda_masks(seed, kw):
    """The two implementations of the filters (candidates on the CPU, filter_logits' masks on CUDA): the same sets,
    on random logits; on logits of 40 distinct values (ties at the k-th: every tied token stays) the same values
    (top-p's cut inside a group of equal logits keeps as many of them, which ones is the sort's choice)."""
    from moetier.runtime.sampling import candidates
    x = logits(seed, v=5000)
    vals, ids = candidates(x, **kw)
    assert set(ids.tolist()) == kept(filter_logits(x, **kw)) and torch.equal(vals, x[ids])
    x = torch.randint(0, 40, (5000,), generator=torch.Generator().manual_seed(seed)) / 8
    vals, ids = candidates(x, **kw)
    assert torch.equal(vals, x[ids])
    assert sorted(vals.tolist()) == sorted(x[sorted(kept(filter_logits(x, **kw)))].tolist())


def _device_freqs(x, p, n, device="cpu", seed=0):
    """n tokens of device_draw on x (the CUDA sampler's function: here run on `device` without a graph)."""
    from moetier.runtime.sampling import device_draw
    v = x.shape[-1]
    seen = torch.zeros(v, dtype=torch.bool, device=device)
    seen[::7] = True
    counts = torch.zeros(v, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    toks = torch.stack([device_draw(x.to(device), seen, counts, p, g) for _ in range(n)]).cpu()
    assert toks[:, 1:].eq(1).all()
    return toks[:, 0], seen.cpu()


@pytest.mark.parametrize("kw", [dict(top_k=30), dict(top_p=0.9), dict(min_p=0.03), dict(), dict(top_k=1),
                                dict(top_p=0.999), dict(top_k=30, top_p=0.6),
                                dict(top_k=200, top_p=0.7, min_p=0.01, repetition_penalty=1.3)])
def test_device_draw_samples_inside_the_filters_with_their_probabilities(kw):
    """device_draw (no host sync: the CUDA sampler's function, run here on the CPU): every token inside
    filter_logits' set of the penalised, tempered logits, and 3,000 draws' frequencies against the softmax over it."""
    from moetier.runtime.sampling import _penalties_dense
    x = logits(11, v=300)
    p = SamplingParams(temperature=0.8, **kw)
    toks, seen = _device_freqs(x, p, 3000)
    y = filter_logits(_penalties_dense(x, seen, torch.zeros(300), p) / 0.8, p.top_k, p.top_p, p.min_p)
    assert set(toks.tolist()) <= kept(y)
    want = torch.softmax(y.double(), -1)
    got = torch.bincount(toks, minlength=300).double() / len(toks)
    assert (got - want).abs().max() < 4 * math.sqrt(want.max() / len(toks)) + 2e-3


def test_device_draw_flags_candidates_that_miss_part_of_top_p(monkeypatch):
    """Top-p alone looks at the DEVICE_NUCLEUS largest logits: on flat logits whose first ones carry less than p the
    flag says so, and full=True (a sort of all V) holds the whole set; ties at the k-th also clear the flag."""
    import moetier.runtime.sampling as sampling
    monkeypatch.setattr(sampling, "DEVICE_NUCLEUS", 16)
    x = logits(14, v=300) / 30
    p, g = SamplingParams(temperature=1.0, top_p=0.9), torch.Generator().manual_seed(0)
    z = (torch.zeros(300, dtype=torch.bool), torch.zeros(300))
    assert sampling.device_draw(x, *z, p, g)[2] == 0
    toks = torch.stack([sampling.device_draw(x, *z, p, g, full=True) for _ in range(200)])
    assert toks[:, 1:].eq(1).all() and set(toks[:, 0].tolist()) <= kept(filter_logits(x, top_p=0.9))
    assert sampling.device_draw(x * 30, *z, p, g)[2] == 1
    tied = torch.randint(0, 5, (300,), generator=torch.Generator().manual_seed(1)).float()
    assert sampling.device_draw(tied, *z, SamplingParams(temperature=1.0, top_k=10), g)[2] == 0


def test_device_draw_greedy_with_penalties_and_no_candidate():
    """Temperature 0 with a repetition penalty: the penalised argmax; logits that allow no token: flag 0."""
    from moetier.runtime.sampling import _penalties_dense, device_draw
    x = logits(12, v=200)
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    seen = torch.zeros(200, dtype=torch.bool)
    seen[int(x.argmax())] = True
    g = torch.Generator().manual_seed(0)
    tok, ok, _ = device_draw(x, seen, torch.zeros(200), p, g).tolist()
    assert ok == 1 and tok == int(_penalties_dense(x, seen, torch.zeros(200), p).argmax()) != int(x.argmax())
    assert device_draw(torch.full((200,), float("-inf")), seen, torch.zeros(200), SamplingParams(top_p=0.9),
                       g)[1] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("sampler", ["torch", "triton"])
@pytest.mark.parametrize("graph", ["1", "0"])
def test_cuda_sampler_graph_draws(monkeypatch, graph, sampler):
    """The CUDA Sampler (one graph replay a token, or eager; device_draw's torch ops, or MOETIER_SAMPLER=triton's
    kernels): tokens inside the filters, frequencies, the same seed the same tokens, penalties read from the sampler's
    live state, and a clear error when no token can be drawn."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("MOETIER_SAMPLER_GRAPH", graph)
    monkeypatch.setenv("MOETIER_SAMPLER", sampler)
    x = logits(13, v=5000).cuda()
    p = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=5)
    a, b = Sampler(p, 5000, "cuda", [1, 2, 3]), Sampler(p, 5000, "cuda", [1, 2, 3])
    ta = [a(x) for _ in range(2000)]
    assert ta[:50] == [b(x) for _ in range(50)]
    assert (a._graph.graph is not None) == (graph == "1") and (a._graph.seed is not None) == (sampler == "triton")
    y = filter_logits(apply_penalties(x, a.seen, a.counts, p) / 0.7, 40, 0.9)
    assert set(ta) <= kept(y.cpu())
    want = torch.softmax(y.double(), -1).cpu()
    got = torch.bincount(torch.tensor(ta), minlength=5000).double() / len(ta)
    assert (got - want).abs().max() < 4 * math.sqrt(want.max() / len(ta)) + 2e-3
    g = Sampler(SamplingParams(temperature=0.0, repetition_penalty=100.0), 5000, "cuda")
    assert g(x) == int(x.argmax())
    g.observe(int(x.argmax()))
    assert g(x) != int(x.argmax())
    with pytest.raises(RuntimeError, match="no token can be sampled"):
        Sampler(SamplingParams(temperature=1.0), 5000, "cuda")(torch.full((5000,), float("-inf"), device="cuda"))


@pytest.mark.parametrize("m", [1, 21, 256, 1024])
def test_largest_by_rows_is_topk(monkeypatch, m):
    """_largest (topk of rows, then of their winners): torch.topk's values, indices that point at them, on 151,936
    logits with -inf ones and on a length no multiple of the rows (the padding never chosen while values remain)."""
    import moetier.runtime.sampling as sampling
    for n in (151_936, 9_001):
        x = logits(15, v=n)
        x[::5] = float("-inf")
        vals, ids = sampling._largest(x, m)
        assert torch.equal(vals, torch.topk(x, m).values) and torch.equal(x[ids], vals)
        assert len(set(ids.tolist())) == m and int(ids.max()) < n
    monkeypatch.setattr(sampling, "TOP_COLS", 64)       # several rounds of rows
    x = logits(16, v=5000)
    vals, ids = sampling._largest(x, 21)
    assert torch.equal(vals, torch.topk(x, 21).values) and torch.equal(x[ids], vals)


@pytest.mark.parametrize("kw", [dict(top_k=20, top_p=0.8), dict(top_p=0.9)])
def test_device_draw_on_a_large_vocabulary(kw):
    """device_draw through _largest's rows (20,000 logits, peaked enough for top-p's set to fit its candidates)."""
    x = logits(17, v=20000) * 1.5
    p = SamplingParams(temperature=0.7, **kw)
    toks, _ = _device_freqs(x, p, 600)
    y = filter_logits(x / 0.7, p.top_k, p.top_p)
    assert set(toks.tolist()) <= kept(y)
    want = torch.softmax(y.double(), -1)
    got = torch.bincount(toks, minlength=20000).double() / len(toks)
    assert (got - want).abs().max() < 4 * math.sqrt(want.max() / len(toks)) + 2e-3


@pytest.mark.parametrize("v,kw", [(300, dict(top_k=5)), (64, dict(top_p=0.9)),
                                  (64, dict(top_k=10, top_p=0.6, repetition_penalty=1.3, frequency_penalty=0.2))])
def test_triton_draw_samples_inside_the_filters_with_their_probabilities(monkeypatch, v, kw):
    """kernels.triton_sample (MOETIER_SAMPLER=triton's draw; Triton's interpreter here, small sorts: it is slow)
    over rows of 64 / 16 logits (several rows, as 151,936 logits make): tokens inside filter_logits' sets of the
    penalised, tempered logits, 160 draws' frequencies against the softmax over them; the counter advances a draw."""
    from moetier.kernels import triton_sample
    from moetier.runtime.sampling import _penalties_dense
    monkeypatch.setattr(triton_sample, "COLS_TOPK", 64 if v == 300 else 16)
    monkeypatch.setattr(triton_sample, "COLS_TOPP", 16)
    x = logits(18, v=v)
    p = SamplingParams(temperature=0.8, **kw)
    seen = torch.zeros(v, dtype=torch.bool)
    seen[::7] = True
    counts = (torch.arange(v) % 3).float()
    seed = torch.tensor([5], dtype=torch.int64)
    toks = torch.stack([triton_sample.triton_draw(x, seen, counts, p, seed, 16) for _ in range(160)])
    assert toks[:, 1:].eq(1).all() and int(seed) == 165
    y = filter_logits(_penalties_dense(x, seen, counts, p) / 0.8, p.top_k, p.top_p, p.min_p)
    assert set(toks[:, 0].tolist()) <= kept(y)
    want = torch.softmax(y.double(), -1)
    got = torch.bincount(toks[:, 0], minlength=v).double() / len(toks)
    assert (got - want).abs().max() < 4 * math.sqrt(want.max() / len(toks)) + 2e-3


def test_triton_draw_flags_a_partial_nucleus_and_repeats_a_seed():
    """Top-p alone over flat logits whose 16 largest hold less than p: the flag is 0 (DeviceDraw then draws over all
    V); the same counter, the same token; min-p with top-k; what `supported` leaves to device_draw."""
    from moetier.kernels import triton_sample
    x = logits(19, v=300)
    z = (torch.zeros(300, dtype=torch.bool), torch.zeros(300))
    p, sharp = SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.3, top_p=0.9)
    assert triton_sample.triton_draw(x, *z, p, torch.tensor([1]), 16)[2] == 0     # 35 tokens reach 0.9
    a = triton_sample.triton_draw(x, *z, sharp, torch.tensor([77]), 16)
    assert a[2] == 1 and torch.equal(a, triton_sample.triton_draw(x, *z, sharp, torch.tensor([77]), 16))
    q = SamplingParams(temperature=0.5, top_k=40, min_p=0.2)
    y = filter_logits(x / 0.5, 40, 1.0, 0.2)
    toks = {int(triton_sample.triton_draw(x, *z, q, torch.tensor([s]), 256)[0]) for s in range(20)}
    assert toks <= kept(y)
    assert not triton_sample.supported(SamplingParams(temperature=0.7), 300)
    assert not triton_sample.supported(SamplingParams(temperature=0.7, min_p=0.1), 300)
    assert not triton_sample.supported(SamplingParams(temperature=0.7, top_k=64), 300)
    assert triton_sample.supported(SamplingParams(temperature=0.7, top_k=20, top_p=0.8), 151936)


@pytest.mark.parametrize("kw", [dict(top_k=40, top_p=0.9), dict(top_k=20), dict(top_k=30, min_p=0.05),
                                dict(top_k=50, top_p=0.6, min_p=0.01)])
def test_cpu_top_k_draw_samples_the_filters_sets(kw):
    """The CPU sampler's top-k path in numpy (_top_k_draw): 3,000 draws inside filter_logits' set with the softmax's
    frequencies over it; a tie at the k-th leaves it to candidates (None)."""
    from moetier.runtime.sampling import _top_k_draw
    x = logits(20, v=2000) / 0.7
    p = SamplingParams(temperature=0.7, **kw)
    g = torch.Generator().manual_seed(2)
    toks = torch.tensor([_top_k_draw(x, p, g) for _ in range(3000)])
    y = filter_logits(x, p.top_k, p.top_p, p.min_p)
    assert set(toks.tolist()) <= kept(y)
    want = torch.softmax(y.double(), -1)
    got = torch.bincount(toks, minlength=2000).double() / len(toks)
    assert (got - want).abs().max() < 4 * math.sqrt(want.max() / len(toks)) + 2e-3
    tied = torch.randint(0, 5, (2000,), generator=torch.Generator().manual_seed(1)).float()
    assert _top_k_draw(tied, p, g) is None
