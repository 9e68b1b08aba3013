"""The torch.compile'd CPU decode step (runtime/cpu_compile.py) against eager decode."""
from __future__ import annotations

import time

import pytest
import torch
from helpers import max_rel_err

from moetier import EngineConfig, SamplingParams
from moetier.models.layers import DenseExperts, grouped_experts
from moetier.runtime import cpu_compile
from moetier.runtime.engine import Engine


@pytest.mark.parametrize("t", [1, 3])
def test_fused_gather_experts_matches_grouped(t):
    """The graph-friendly expert twin equals the eager grouped path on random inputs."""
    g = torch.Generator().manual_seed(0)
    ex = DenseExperts(8, 48, 32)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.2)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.2)
        x = torch.randn(t, 48, generator=g)
        ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)])
        w = torch.softmax(torch.randn(t, 2, generator=g), -1)
        ours = cpu_compile.fused_gather_experts(x, ids, w, ex)
        ref = grouped_experts(x, ids, w, 8, ex.expert)
    assert max_rel_err(ours, ref) < 1e-5


def test_wanted_modes(tiny_model_dir):
    eng = Engine.load(tiny_model_dir, EngineConfig(device="cpu", progress=False, max_context=64))
    cache = eng.new_session().cache
    assert cpu_compile.wanted("on", "cpu", None, cache)
    assert cpu_compile.wanted("auto", "cpu", None, cache)   # auto: used when already built (never builds)
    assert not cpu_compile.wanted("off", "cpu", None, cache)
    assert not cpu_compile.wanted("on", "cuda", None, cache)
    with pytest.raises(ValueError, match="auto, on or off"):
        cpu_compile.wanted("yes", "cpu", None, cache)


def _compare(path, prompt, n):
    """Greedy tokens through the Engine (compiled vs eager), then per-step logits on one cache each."""
    kw = {"prompt_ids": prompt, "max_tokens": n, "params": SamplingParams(temperature=0), "ignore_eos": True}
    toks = {}
    for mode in ("off", "on"):
        eng = Engine.load(path, EngineConfig(device="cpu", progress=False, max_context=256, cpu_compile=mode))
        toks[mode] = [e.token_id for e in eng.generate(**kw) if hasattr(e, "token_id") and e.token_id >= 0]
    assert toks["on"] == toks["off"] and len(toks["on"]) == n
    step = eng._cpu_decode                       # compiled already by the run above
    assert step, "the compiled step could not be built (see the warning) and the engine decoded eagerly"
    eager, fast = eng.new_session().cache, eng.new_session().cache
    with torch.inference_mode():
        eng.model(torch.tensor(prompt), eager)
        eng.model(torch.tensor(prompt), fast)
        for tok in toks["off"][:-1]:             # crosses a BUCKET boundary when prompt + n > 128
            ref = eng.model(torch.tensor([tok]), eager)
            assert max_rel_err(step(fast, tok), ref) < 1e-5
    assert fast.length == eager.length


@pytest.mark.slow
def test_compiled_decode_matches_eager_tiny(tiny_model_dir):
    t0 = time.perf_counter()
    _compare(tiny_model_dir, list(range(3, 123)), 24)
    assert time.perf_counter() - t0 < 120, "compiling the tiny model's decode step took over 2 minutes"


@pytest.mark.slow
def test_compiled_decode_matches_eager_default():
    _compare(None, [(i * 7919) % 8000 + 100 for i in range(120)], 24)
