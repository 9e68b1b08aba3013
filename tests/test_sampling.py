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
