"""GGUF experts kept in their stored format (models.quant_experts.QuantExperts) against the same file
dequantized at load (--dequantize-experts), and the module against its pure-torch twin.

Measured tolerance (tiny qwen3_moe, CPU fp32, 13 tokens prefill 7 + decode 6): max relative logit
error 2.8e-7 (Q8_0) and 3.9e-7 (Q4_0): the C kernels sum in another order than F.linear; prefill
above the matvec threshold is bit-identical (same dequantizer, same F.linear)."""
from __future__ import annotations

import functools

import pytest
import torch

from helpers import max_rel_err, ours_logits
from moetier.commands.quantize import quantize
from moetier.config import EngineConfig
from moetier.models.layers import DenseExperts
from moetier.models.quant_experts import QuantExperts
from moetier.quant.pack import quantize as pack
from moetier.kernels import cpu
from moetier.runtime.engine import Engine
from moetier.runtime.generate import greedy_tokens
from moetier.runtime.sampling import SamplingParams
from test_gguf import build_qwen3_moe

TOKENS = torch.randint(0, 300, (13,), generator=torch.Generator().manual_seed(1))
LOGIT_TOL = 2e-6     # measured <= 3.9e-7; summation order only


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_qwen3_moe(tmp_path_factory.mktemp("quant_experts") / "model")


def engine(path, dequantize: bool) -> Engine:
    return Engine.load(path, EngineConfig(device="cpu", threads=1, progress=False, dequantize_experts=dequantize))


def experts_of(model) -> list:
    return [blk.mlp.experts for blk in model.model.layers]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_packed_gguf_matches_dequantized(qwen_dir, tmp_path, qtype):
    path = quantize(qwen_dir, qtype, tmp_path / f"m-{qtype}.gguf")
    packed, deq = engine(path, False), engine(path, True)
    assert all(type(m) is QuantExperts and m.fmt == qtype for m in experts_of(packed.model))
    assert all(type(m) is DenseExperts for m in experts_of(deq.model))
    raw = experts_of(packed.model)[0].gate_raw
    assert raw.dtype == torch.uint8 and raw.numel() < experts_of(deq.model)[0].gate_up_proj.numel()  # < 1 B/weight
    got, want = ours_logits(packed.model, TOKENS, 7), ours_logits(deq.model, TOKENS, 7)
    assert max_rel_err(got, want) <= LOGIT_TOL
    prompt = TOKENS[:5].tolist()
    want_ids = greedy_tokens(deq.model, prompt, 20)
    assert greedy_tokens(packed.model, prompt, 20) == want_ids
    # the engine's generation loop too: greedy and past EOS, so a random model's first token cannot end it
    done = packed.complete(prompt_ids=prompt, max_tokens=4, params=SamplingParams(temperature=0.0), ignore_eos=True)
    assert done.token_ids == want_ids[:4]


def experts_as(monkeypatch, qtype, model, tmp_path) -> dict:
    """`moetier quantize` storing every expert tensor as `qtype` (the rest as the file type's mix); -> quantize's
    keywords: a computed importance matrix for the types ggml cannot make without one (IQ1_S, IQ2_XXS, IQ2_XS)."""
    from moetier.quant.mixes import Mix
    plain = Mix.tensor_type
    monkeypatch.setattr(Mix, "tensor_type", lambda self, name, shape, pure=False:
                        qtype if "_exps." in name else plain(self, name, shape, pure))
    if qtype not in ("IQ1_S", "IQ2_XXS", "IQ2_XS"):
        return {}
    from moetier.commands.imatrix import compute
    from test_gguf import TEXT
    return {"imatrix": compute(model, " ".join(TEXT * 8), tmp_path / "imatrix.gguf", chunk=32)}


@pytest.mark.parametrize("qtype", ["IQ3_S", "IQ1_S", "IQ1_M"])
def test_low_bit_experts_pack(tmp_path, monkeypatch, qtype):
    """Experts in IQ3_S / IQ1_S / IQ1_M (the rest of the file Q8_0; rows of 256) stay packed: eager prefill and
    greedy decode as the file dequantized at load (float activations: summation order only); the prefill as the
    engine runs it by default (int8 activations per 256 values on the integer tile, where the build has one): each
    layer's experts within int8 rounding of the dequantized experts."""
    from moetier.runtime import cpu_compile
    model = build_qwen3_moe(tmp_path / "model", hidden_size=256, moe_intermediate_size=256)
    path = quantize(model, "Q8_0", tmp_path / f"m-{qtype}.gguf", **experts_as(monkeypatch, qtype, model, tmp_path))
    tiled = engine(path, False)
    with monkeypatch.context() as m:
        m.setattr(cpu_compile, "PREFILL_INT8_TYPES", cpu_compile.PREFILL_INT8_TYPES - {qtype})
        packed, deq = engine(path, False), engine(path, True)
    assert all(type(m) is QuantExperts and m.fmt == m.down_fmt == qtype for m in experts_of(packed.model))
    want = ours_logits(deq.model, TOKENS, 7)
    assert max_rel_err(ours_logits(packed.model, TOKENS, 7), want) <= LOGIT_TOL
    prompt = TOKENS[:5].tolist()
    assert greedy_tokens(packed.model, prompt, 12) == greedy_tokens(deq.model, prompt, 12)
    g = torch.Generator().manual_seed(3)
    x, ids, w = torch.randn(9, 256, generator=g), torch.randint(0, 8, (9, 2), generator=g), torch.rand(9, 2, generator=g)
    for m in experts_of(tiled.model):    # (the logits of this random model amplify 2% in a layer up to 40% at a token)
        assert m.q8_act == cpu.grouped_int8_tile(qtype)
        got, ref = m(x, ids, w), m.forward_native(x, ids, w)
        assert (got - ref).norm() / ref.norm() < (0.03 if m.q8_act else 1e-5)


def test_gpt_oss_biases_and_clamp_through_the_engine(tmp_path):
    """gpt-oss: expert biases and the clamped SwiGLU on the packed path (Q8_0 needs 32-multiple rows)."""
    pytest.importorskip("moetier.models.gpt_oss")
    from transformers import GptOssForCausalLM

    from helpers import tiny_checkpoint
    from test_arch_gpt_oss import config
    from test_gguf import build_tokenizer
    d = tmp_path / "gpt_oss"
    tiny_checkpoint(d, GptOssForCausalLM, config(vocab_size=320, swiglu_limit=7.0, hidden_size=64, intermediate_size=32,
                                                 head_dim=16, num_attention_heads=4), scale=4.0)
    build_tokenizer(d)
    path = quantize(d, "Q8_0", tmp_path / "m.gguf")
    packed, deq = engine(path, False), engine(path, True)
    assert all(type(m) is QuantExperts and m.gate_up_bias is not None for m in experts_of(packed.model))
    got, want = ours_logits(packed.model, TOKENS, 7), ours_logits(deq.model, TOKENS, 7)
    assert max_rel_err(got, want) <= LOGIT_TOL
    assert greedy_tokens(packed.model, TOKENS[:5].tolist(), 16) == greedy_tokens(deq.model, TOKENS[:5].tolist(), 16)


def test_formats_without_kernel_are_dequantized_as_before(qwen_dir, tmp_path):
    path = quantize(qwen_dir, "F16", tmp_path / "m.gguf")
    packed, deq = engine(path, False), engine(path, True)
    assert all(type(m) is DenseExperts for m in experts_of(packed.model))
    assert torch.equal(ours_logits(packed.model, TOKENS, 7), ours_logits(deq.model, TOKENS, 7))


def test_tiers_keep_float_experts(qwen_dir, tmp_path):
    path = quantize(qwen_dir, "Q8_0", tmp_path / "m.gguf")
    eng = Engine.load(path, EngineConfig(device="cpu", threads=1, progress=False, ram_mem=64 << 20))
    assert eng.tiers is not None and not any(isinstance(m, QuantExperts) for m in eng.model.modules())


def random_experts(qtype, layout, e=6, d=64, i=32, bias=False, act=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = [pack(torch.randn(e, r, c, generator=g) * 0.1, qtype) for r, c in ((i, d), (i, d), (d, i))]
    biases = (torch.randn(e, 2 * i, generator=g) * 0.1, torch.randn(e, d, generator=g) * 0.1) if bias else None
    kw = {"act": act} if act is not None else {}
    return QuantExperts(qtype, *raw, biases, layout=layout, **kw)


@pytest.mark.parametrize("t,all_experts", [(40, True), (3, False)])
def test_dequant_grouped_prefill_without_a_host_sync(monkeypatch, t, all_experts):
    """The bf16 prefill path (_forward_dequant_grouped): a chunk with DEQUANT_ALL_ROUTES routes per expert or more
    dequantizes all E experts (no torch.unique, whose output size the host must read); fewer routes, the used ones.
    Either way the twin's result (bf16 grouped GEMMs on CPU here: torch._grouped_mm; CUDA in the engine); expert 5
    unused in the big chunk (an empty group)."""
    from moetier.models import quant_experts as qe
    ex = random_experts("Q8_0", "planes", e=6, d=64, i=32)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 64, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(t)])
    w = torch.rand(t, 2, generator=g).to(torch.bfloat16)
    calls = []
    real_unique = torch.unique
    monkeypatch.setattr(torch, "unique", lambda *a, **k: calls.append(1) or real_unique(*a, **k))
    got = ex._forward_dequant_grouped(x, ids, w)
    assert (not calls) == all_experts == (ids.numel() >= qe.DEQUANT_ALL_ROUTES * ex.num_experts)
    want = ex.forward_native(x.float(), ids, w.float())
    assert torch.isfinite(got).all() and max_rel_err(got.float(), want) <= 2e-2     # bf16 GEMMs against float32
    monkeypatch.setattr(qe, "DEQUANT_ALL_BYTES", 0)         # the float copies over the cap: the used experts
    calls.clear()
    assert torch.equal(ex._forward_dequant_grouped(x, ids, w), got) and len(calls) == 1


def clamped_swiglu(gate, up, alpha, limit):   # ops.as_act recognises it by name
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K"])
@pytest.mark.parametrize("layout", ["raw", "planes"])
@pytest.mark.parametrize("t", [1, 3, 7, 37])
def test_forward_matches_torch_twin(qtype, layout, t):
    d = 256 if qtype == "Q4_K" else 64            # Q4_K rows hold 256 values
    i = 256 if qtype == "Q4_K" else 32
    ex = random_experts(qtype, layout, d=d, i=i)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, d, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(t)])
    w = torch.rand(t, 2, generator=g) + 0.1
    got, want = ex(x, ids, w), ex.forward_native(x, ids, w)
    assert want.abs().max() > 0.1
    assert max_rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("layout", ["raw", "planes"])
def test_biases_and_clamped_activation(layout):
    act = functools.partial(clamped_swiglu, alpha=1.702, limit=7.0)
    ex = random_experts("Q8_0", layout, bias=True, act=act)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g) * 4
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=g)
    assert max_rel_err(ex(x, ids, w), ex.forward_native(x, ids, w)) <= 1e-5


@pytest.mark.parametrize("t", [3, 11])
def test_planes_through_triton_interpreter(t, qtype="Q8_0"):
    """The CUDA path (ops.moe on repacked planes: decode GEMVs for t <= 8, grouped above), run by
    Triton's interpreter on the CPU, against the twin."""
    import os

    from moetier.kernels import ops
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("runs in the Triton interpreter (CPU-only machine)")
    ex = random_experts(qtype, "planes")          # Q4_K planes: tests/test_kernels_triton.py
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 64, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(t)])
    w = torch.rand(t, 2, generator=g) + 0.1
    prev = ops.backend()
    try:
        assert ops.set_backend("triton") == "triton" and ops.kernel_available(x, ex.act, qtype)
        got = ex(x, ids, w)
    finally:
        ops.set_backend(prev)
    from moetier.kernels import triton_moe as tm
    decode_q8 = t <= ops.MAX_DECODE_TOKENS and tm.variant_of(ops.normalize_fmt(qtype), None).startswith("v5")
    # v5 decode kernels quantize x and h to int8 per 32-block: the twin that does the same is exact
    want = ops.moe_native(x, ids, w, ex.planes("gate_up"), ex.planes("down"), ex.act, None, qtype,
                          act_q8=decode_q8)
    assert max_rel_err(got, want) <= 1e-4
    assert max_rel_err(got, ex.forward_native(x, ids, w)) <= (3e-2 if decode_q8 else 1e-4)


def test_matvec_and_dequantize_paths_agree(monkeypatch):
    ex = random_experts("Q4_0", "raw")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 64, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=g)
    monkeypatch.setattr(ex, "matvec_pairs", 10 ** 6)
    kernel = ex(x, ids, w)
    monkeypatch.setattr(ex, "matvec_pairs", 0)
    assert max_rel_err(kernel, ex(x, ids, w)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ3_XXS", "Q2_K", "Q3_K", "IQ4_XS",
                                   "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_S", "IQ1_S", "IQ1_M"])
@pytest.mark.parametrize("t", [1, 5, 8, 37])
def test_cuda_module_matches_dequantized(qtype, t):
    """Every format with GPU kernels, through the module at its default variant (decode: int8 activations; prefill
    rows: dequantized grouped GEMMs) against bf16 experts of the dequantized weights; decode captured in a graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moetier.quant.pack import packer
    if packer(qtype) == "libgguf":
        pytest.importorskip("libgguf", reason=f"packing {qtype} needs libgguf")
    d = i = 256
    g = torch.Generator().manual_seed(t)
    raw = [pack(torch.randn(8, r, c, generator=g) * 0.1, qtype) for r, c in ((i, d), (i, d), (d, i))]
    ex = QuantExperts(qtype, *raw, layout="planes", device="cuda")
    ref = DenseExperts(8, d, i)
    ref.gate_up_proj.data = ex.weight("gate_up", torch.arange(8, device="cuda")).to(torch.bfloat16)
    ref.down_proj.data = ex.weight("down", torch.arange(8, device="cuda")).to(torch.bfloat16)
    x = torch.randn(t, d, generator=g).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)]).cuda()
    w = (torch.rand(t, 2, generator=g) + 0.1).to("cuda", torch.bfloat16)
    got, want = ex(x, ids, w).float(), ref(x, ids, w).float()
    tol = 3e-2 if t <= 8 else 2e-2      # decode: x and h as int8 per 32-block (v5); else bf16, another sum order
    assert max_rel_err(got, want) <= tol
    if t <= 8:                                       # decode: capturable (no host sync)
        out = torch.empty_like(x)
        graph = torch.cuda.CUDAGraph()
        ex(x, ids, w)
        with torch.cuda.graph(graph):
            out.copy_(ex(x, ids, w))
        graph.replay()
        torch.cuda.synchronize()
        assert max_rel_err(out.float(), want) <= tol
