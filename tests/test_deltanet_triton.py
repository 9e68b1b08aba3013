"""Triton gated-delta-rule kernels (kernels/triton_deltanet.py) against their torch twins (models/deltanet.py),
and a whole Qwen3-Next model with the kernels against the torch path.

Without CUDA the kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest before triton is imported). Odd head dims (masks), Dv > one 32-column block, prompts that
are not whole chunks; inputs random, never zeros; outputs poisoned with NaN.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from helpers import max_rel_err, ours_logits, tiny_checkpoint

from moetier.kernels import deltanet_ops
from moetier.kernels import triton_deltanet as td
from moetier.models.deltanet import (
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def _interpreted():
    if DEV == "cpu" and type(td._recurrent_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton_deltanet was imported before TRITON_INTERPRET=1 was set; run this file alone")


def rule_inputs(t: int, h: int, dk: int, dv: int, seed: int = 0):
    """q, k l2-normed as the layer feeds them; decays from slow to fast heads; a non-zero state."""
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(t, h, dk, generator=g)) * dk ** -0.5
    k = l2norm(torch.randn(t, h, dk, generator=g))
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * torch.logspace(-2, 0.5, h)
    beta = torch.rand(t, h, generator=g) * 0.9 + 0.05
    state = torch.randn(h, dk, dv, generator=g)
    return [x.to(DEV) for x in (q, k, v, decay, beta, state)]


@pytest.mark.parametrize("t,h,dk,dv", [(1, 3, 12, 10), (1, 2, 16, 70), (5, 4, 20, 33), (3, 1, 128, 128)])
def test_recurrent_kernel_matches_twin(t, h, dk, dv):
    args = rule_inputs(t, h, dk, dv, seed=t + dv)
    want_out, want_s = recurrent_gated_delta_rule(*args)
    out, s = td.recurrent(*args)
    assert out.shape == want_out.shape and out.dtype == torch.float32
    assert max_rel_err(out, want_out) < 1e-5 and max_rel_err(s, want_s) < 1e-5


def test_recurrent_kernel_updates_state_in_place():
    """out_state = state (the decode step's cache entry): programs own disjoint state tiles."""
    q, k, v, g, beta, state = rule_inputs(1, 3, 12, 70, seed=9)
    want_out, want_s = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    out, s = td.recurrent(q, k, v, g, beta, state, out_state=state)
    assert s is state and max_rel_err(state, want_s) < 1e-5 and max_rel_err(out, want_out) < 1e-5


@pytest.mark.parametrize("t,chunk,dk,dv", [(1, 16, 12, 10), (29, 16, 12, 10), (77, 32, 20, 70), (64, 64, 16, 16)])
def test_chunk_kernel_matches_recurrent_twin(t, chunk, dk, dv):
    args = rule_inputs(t, 3, dk, dv, seed=t)
    want_out, want_s = recurrent_gated_delta_rule(*args)
    twin_out, twin_s = chunk_gated_delta_rule(*args, chunk=chunk)
    out_state = torch.full_like(args[-1], float("nan"))
    with deltanet_ops.use("triton"):
        out, s = deltanet_ops.chunk(*args, chunk=chunk, out_state=out_state)
    assert s is out_state and out.shape == want_out.shape
    assert max_rel_err(out, twin_out) < 1e-5 and max_rel_err(s, twin_s) < 1e-5
    assert max_rel_err(out, want_out) < 1e-5 and max_rel_err(s, want_s) < 1e-5


def test_dispatch_stays_on_torch_for_small_chunks_and_cpu():
    args = rule_inputs(9, 3, 12, 10, seed=4)
    want_out, _ = recurrent_gated_delta_rule(*args)
    with deltanet_ops.use("triton"):   # chunk 8 < 16: no tensor-core tile; the twin runs
        out, _ = deltanet_ops.chunk(*args, chunk=8)
    assert max_rel_err(out, want_out) < 1e-5
    with deltanet_ops.use("torch"):
        assert deltanet_ops._kernels(args[0]) is None
    if DEV == "cpu":
        assert deltanet_ops.backend() == "torch"     # the CPU default: no kernels


def test_qwen3_next_logits_with_kernels_equal_torch(tmp_path, monkeypatch):
    """A hybrid model (DeltaNet, attention, DeltaNet, ...) prefilled in 16-token chunks then decoded:
    the Triton path gives the torch path's logits to fp32 precision."""
    from test_arch_qwen3_next import VOCAB, next_config, slow_decay
    from transformers import Qwen3NextForCausalLM

    from moetier.models.qwen3_next import GatedDeltaNet
    from moetier.weights.loader import load_model
    tiny_checkpoint(tmp_path, Qwen3NextForCausalLM, next_config(), scale=4.0, init=slow_decay)
    monkeypatch.setattr(GatedDeltaNet, "chunk", 16)
    model, _, _ = load_model(tmp_path)
    model = model.to(DEV)
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).to(DEV)
    with deltanet_ops.use("torch"):
        want = ours_logits(model, tokens, 37)
    with deltanet_ops.use("triton"):
        got = ours_logits(model, tokens, 37)
    assert got.shape == (40, VOCAB) and max_rel_err(got, want) < 1e-5
