"""Qwen3-Next GGUFs written by llama.cpp's convert_hf_to_gguf.py load in moetier with the safetensors'
logits. The converter stores zero-centred norms as 1 + w, A_log as A = -exp(A_log), conv1d squeezed to
[C, K], and splits the per-key-head in_proj_qkvz into attn_qkv (all q | all k | all v) + attn_gate (z);
gguf_arch.py undoes each. Needs llama.cpp's converter in .data/llama.cpp (skipped otherwise).

llama.cpp itself runs the Dv = Dk model to the same greedy tokens.

Two converter limits shape the test model: Qwen3-Next's config has no mtp_num_hidden_layers, so the
converter asserts MTP tensors exist unless run with --no-mtp; and it has no name for a dense MLP
layer, so the model has MoE in every layer (mlp_only_layers=[]), as the released checkpoints do."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import max_rel_err, ours_logits, tiny_checkpoint
from test_arch_qwen3_next import next_config, slow_decay
from test_gguf import build_tokenizer, sharpen
from test_gguf_llamacpp import CONVERT, PROMPT, TOKENS, llama_cpp_greedy
from transformers import Qwen3NextForCausalLM

from moetier.runtime.generate import greedy_tokens
from moetier.weights.gguf_arch import _qkvz_join, _qkvz_split
from moetier.weights.loader import load_model

NO_MTP = CONVERT.replace('"--outfile", outfile]', '"--outfile", outfile, "--no-mtp"]')


def init(model):
    slow_decay(model)
    sharpen(model)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, llama_cpp_dir):
    """{value head dim: (safetensors dir, converter's F32 GGUF)}: Dv 10 != Dk 12 tells q/k rows from v/z
    rows in the regrouping; Dv = Dk = 12 is what llama.cpp itself runs (it takes Dv = ssm.state_size)."""
    if llama_cpp_dir is None:
        pytest.skip("llama.cpp's converter is not in .data/llama.cpp (see .ci/run)")
    assert NO_MTP != CONVERT, "test_gguf_llamacpp.CONVERT changed: pass --no-mtp another way"
    root = tmp_path_factory.mktemp("qwen3next")
    out, jobs = {}, []
    for dv in (10, 12):
        d = root / f"dv{dv}"
        d.mkdir()
        tiny_checkpoint(d, Qwen3NextForCausalLM, next_config(vocab_size=320, mlp_only_layers=[],
                                                             linear_value_head_dim=dv), scale=4.0, init=init)
        build_tokenizer(d)
        out[dv] = (d, root / f"dv{dv}-f32.gguf")
        jobs.append(f"{d}::f32::{out[dv][1]}")
    r = subprocess.run([sys.executable, "-c", NO_MTP, str(llama_cpp_dir), "qwen2", *jobs],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, f"convert_hf_to_gguf.py failed:\n{r.stderr[-3000:]}"
    return out


@pytest.mark.parametrize("dv", [10, 12])
def test_converted_f32_equals_safetensors(converted, dv):
    d, f32 = converted[dv]
    ref, _, _ = load_model(d)
    model, args, _ = load_model(f32)
    assert args.extra["layer_types"] == ["linear_attention", "full_attention"] * 2 + ["linear_attention"]
    assert args.extra["partial_rotary_factor"] == 0.25
    ours, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    for n, p in theirs.items():   # exact but for 1 + w - 1 and log(exp(A_log)) rounding
        assert torch.allclose(ours[n], p, rtol=1e-6, atol=3e-7), n
    assert max_rel_err(ours_logits(model, TOKENS, 7), ours_logits(ref, TOKENS, 7)) <= 1e-4


def test_qkvz_regrouping_round_trips():
    """attn_qkv + attn_gate <-> in_proj_qkvz with Hv/Hk = 3 value heads per key head."""
    from moetier.config import ModelArgs
    args = ModelArgs.from_hf({"model_type": "qwen3_next", "vocab_size": 8, "hidden_size": 5, "num_hidden_layers": 1,
                              "num_attention_heads": 1, "linear_num_key_heads": 2, "linear_key_head_dim": 4,
                              "linear_num_value_heads": 6, "linear_value_head_dim": 3})
    w = torch.randn(2 * (4 + 4 + 9 + 9), 5, generator=torch.Generator().manual_seed(0))
    qkv, z = _qkvz_split(w, args)
    assert qkv.shape == (2 * 4 + 2 * 4 + 18, 5) and z.shape == (18, 5)
    assert torch.equal(z[:9], w[17:26])            # key head 0's z rows follow its q, k, v rows
    assert torch.equal(_qkvz_join(qkv, z, args), w)


def test_moetier_quantize_writes_what_the_converter_writes(converted, tmp_path):
    from moetier.commands.quantize import quantize
    from moetier.weights.gguf import GGUFFile
    d, f32 = converted[10]
    ours = quantize(d, "F32", tmp_path / "ours-F32.gguf")
    a, b = GGUFFile(ours), GGUFFile(f32)
    assert set(a.keys()) == set(b.keys())
    for n in a.keys():   # noqa: SIM118 (GGUFFile is not a dict)
        assert a.qtype(n) == b.qtype(n) and torch.equal(a.raw(n), b.raw(n)), n
    keys = [k for k in b.metadata if k.startswith("qwen3next.ssm.") or k.endswith("recurrent_layers")]
    assert keys and all(a.metadata.get(k) == b.metadata[k] for k in keys)
    ref = load_model(d)[0]
    assert max_rel_err(ours_logits(load_model(ours)[0], TOKENS, 7), ours_logits(ref, TOKENS, 7)) <= 1e-4


def test_same_greedy_tokens_as_llama_cpp(converted):
    d, f32 = converted[12]
    ours = greedy_tokens(load_model(f32)[0], PROMPT, 24)
    assert ours == greedy_tokens(load_model(d)[0], PROMPT, 24)
    assert ours == llama_cpp_greedy(f32, PROMPT, 24)
