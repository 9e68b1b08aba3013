"""Where llama.cpp and transformers disagree on a tiny DeepSeek-V3 file, and why (docs/models.md,
"llama.cpp vs transformers on small DeepSeek-V3 files").

Each tiny checkpoint is converted by llama.cpp's own convert_hf_to_gguf.py (f32) and run in
llama.cpp (xllamacpp, f32 KV cache, flash attention off: then a config both sides read alike
agrees to ~1e-6 in log-probability). Every disagreement is pinned twice: an xfail saying llama.cpp
does not give transformers' numbers, and a passing test that reproduces llama.cpp's numbers to
1e-4 by changing exactly the one thing named as the cause. Needs what test_gguf_llamacpp.py needs.
"""
from __future__ import annotations

import json
import urllib.request

import pytest
import test_arch_deepseek_v3 as ds
import torch
import torch.nn.functional as F
from conftest import build_tokenizer
from helpers import tiny_checkpoint
from test_gguf_llamacpp import convert
from transformers import DeepseekV3ForCausalLM

from moetier.models.deepseek_v3 import MLA, yarn_mscale
from moetier.models.layers import GroupedSigmoidRouter
from moetier.weights.gguf import GGUFFile
from moetier.weights.loader import load_model

xlc = pytest.importorskip("xllamacpp")

SEQ = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(7))
YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 64}
CONFIGS = {   # test_arch_deepseek_v3.config(), vocab 320, changed as named
    # the agreeing one: config.json names the router's scoring function, and mscale = mscale_all_dim
    "agree": {"scoring_func": "sigmoid", "rope_parameters": {**YARN, "mscale": 0.8, "mscale_all_dim": 0.8}},
    # what transformers' save_pretrained writes: DeepseekV3Config has no scoring_func
    "no_scoring_func": {"rope_parameters": {**YARN, "mscale": 0.8, "mscale_all_dim": 0.8}},
    # YaRN without mscale / mscale_all_dim
    "yarn_no_mscale": {"scoring_func": "sigmoid", "rope_parameters": YARN},
    # rope features stored as two halves rather than interleaved pairs
    "rope_halves": {"scoring_func": "sigmoid", "rope_interleave": False,
                    "rope_parameters": {**YARN, "mscale": 0.8, "mscale_all_dim": 0.8}},
}


@pytest.fixture(scope="module")
def files(tmp_path_factory, llama_cpp_dir):
    if llama_cpp_dir is None:
        pytest.skip("llama.cpp's converter is not in .data/llama.cpp (see .ci/run)")
    root, made = tmp_path_factory.mktemp("ds_disagree"), {}
    for name, kw in CONFIGS.items():
        d = root / name
        ref = tiny_checkpoint(d, DeepseekV3ForCausalLM, ds.config(vocab_size=320, **kw), scale=4.0,
                              init=ds.random_correction_bias)
        build_tokenizer(d)
        with torch.no_grad():
            made[name] = (d, torch.log_softmax(ref(SEQ[None]).logits[0], -1))
    ggufs = convert(llama_cpp_dir, [(d, "f32") for d, _ in made.values()])
    return {name: (d, ggufs[name, "f32"], want) for name, (d, want) in made.items()}


def llama_cpp_logprobs(path) -> dict[int, dict[int, float]]:
    """{i: {token: logprob}}: llama.cpp's top-8 next-token log-probabilities after SEQ[:i]."""
    p = xlc.CommonParams()
    p.model.path = str(path)
    p.n_ctx, p.n_gpu_layers, p.warmup = 64, 0, False
    p.cache_type_k = p.cache_type_v = xlc.ggml_type.GGML_TYPE_F32
    p.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED   # f16 inside otherwise
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = 2
    server, out = xlc.Server(p), {}
    try:
        for i in range(6, len(SEQ) + 1):
            body = json.dumps({"prompt": SEQ[:i].tolist(), "n_predict": 1, "temperature": 0.0, "top_k": 1,
                               "n_probs": 8, "post_sampling_probs": False, "cache_prompt": False}).encode()
            req = urllib.request.Request(server.listening_address + "/completion", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                probs = json.loads(r.read()).get("completion_probabilities")
            if probs:   # empty when the token is an incomplete UTF-8 piece
                out[i] = {t["id"]: t["logprob"] for t in probs[0]["top_logprobs"]}
    finally:
        del server
    assert len(out) >= 8
    return out


def max_diff(theirs: dict, ours: torch.Tensor) -> float:
    """Largest |logprob difference| over llama.cpp's top-8 tokens at every position; ours is [S, V]."""
    return max(abs(ours[i - 1, t].item() - lp) for i, top in theirs.items() for t, lp in top.items())


def moetier_logprobs(path, change=None) -> torch.Tensor:
    model = load_model(path)[0]
    if change is not None:
        for m in model.modules():
            change(m)
    with torch.no_grad():
        return torch.log_softmax(model(SEQ, model.make_cache(len(SEQ) + 1, torch.float32, "cpu")), -1)


def softmax_routing(m):
    """llama.cpp's deepseek2 router when the GGUF has no expert_gating_func: the same grouped top-k
    on score + correction bias, but softmax scores instead of sigmoid."""
    if not isinstance(m, GroupedSigmoidRouter):
        return

    def forward(x):
        scores = F.linear(x.float(), m.weight.float()).softmax(-1)              # [T, E]
        choice = scores + m.e_score_correction_bias
        t, e = choice.shape
        groups = choice.view(t, m.n_group, e // m.n_group)
        keep = groups.topk(2, -1).values.sum(-1).topk(m.topk_group, -1).indices   # [T, topk_group]
        mask = torch.zeros(t, m.n_group, dtype=torch.bool).scatter_(1, keep, True)
        ids = choice.masked_fill(~mask.repeat_interleave(e // m.n_group, 1), float("-inf")).topk(m.k, -1).indices
        w = scores.gather(1, ids)
        return ids, w / w.sum(-1, keepdim=True) * m.scaling
    m.forward = forward


def softmax_scale_times_mscale_squared(m):
    """llama.cpp's deepseek2 kq_scale when the GGUF has no yarn_log_multiplier: mscale(factor)^2."""
    if isinstance(m, MLA):
        m.scale *= yarn_mscale(YARN["factor"]) ** 2


def interleaved_pairs(m):
    """llama.cpp's deepseek2 always rotates (x[2i], x[2i+1]) pairs (LLAMA_ROPE_TYPE_NORM)."""
    if isinstance(m, MLA):
        m.interleaved = True


def test_agree_when_config_json_names_sigmoid(files):
    _, gguf, want = files["agree"]
    theirs = llama_cpp_logprobs(gguf)
    assert GGUFFile(gguf).metadata["deepseek2.expert_gating_func"] == 2    # sigmoid
    assert max_diff(theirs, want) <= 1e-4
    assert max_diff(theirs, moetier_logprobs(gguf)) <= 1e-4


CAUSES = {
    "no_scoring_func": (("transformers' DeepseekV3Config has no scoring_func, so the converter writes no "
                         "expert_gating_func and llama.cpp's deepseek2 falls back to softmax routing (its "
                         "DeepSeek-V2 default); DeepSeek-V3 routes with sigmoid"), softmax_routing),
    "yarn_no_mscale": (("YaRN without mscale_all_dim: llama.cpp's deepseek2 multiplies the softmax scale by "
                        "mscale(factor)^2 on top of the mscale(factor) it puts on cos/sin; transformers "
                        "(and DeepSeek's HF modeling code) scale cos/sin only"),
                       softmax_scale_times_mscale_squared),
    "rope_halves": (("rope_interleave=False: GGUF has no such field and the converter does not permute the "
                     "rope rows, so llama.cpp rotates interleaved pairs of a half-split checkpoint"),
                    interleaved_pairs),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=why, strict=True))
                                  for n, (why, _) in CAUSES.items()])
def test_llama_cpp_gives_transformers_numbers(files, name):
    _, gguf, want = files[name]
    assert max_diff(llama_cpp_logprobs(gguf), want) <= 1e-4


@pytest.mark.parametrize("name", list(CAUSES))
def test_the_named_cause_reproduces_llama_cpp(files, name):
    """Changing moetier (reading the safetensors) in exactly the named way gives llama.cpp's numbers;
    without the change moetier gives transformers' numbers, far from llama.cpp's."""
    d, gguf, want = files[name]
    theirs = llama_cpp_logprobs(gguf)
    plain = moetier_logprobs(d)
    assert max_diff({i: {t: want[i - 1, t].item() for t in top} for i, top in theirs.items()}, plain) <= 1e-4
    assert max_diff(theirs, plain) > 0.05
    assert max_diff(theirs, moetier_logprobs(d, CAUSES[name][1])) <= 1e-4
    if name == "no_scoring_func":
        assert "deepseek2.expert_gating_func" not in GGUFFile(gguf).metadata
