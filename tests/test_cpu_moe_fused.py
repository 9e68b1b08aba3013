"""The fused CPU MoE layer (kernels/cpu.moe_tokens, torch op moetier::moe_tokens): one C call per
layer for decode, against its pure-torch twin, inside QuantExperts, and inside the AOT-compiled
CPU decode step with GGUF experts kept packed (runtime/cpu_compile.py)."""
from __future__ import annotations

import pytest
import torch
from helpers import max_rel_err

from moetier import EngineConfig, SamplingParams
from moetier.commands.quantize import quantize
from moetier.kernels import cpu
from moetier.models.quant_experts import QuantExperts
from moetier.models.quant_linear import QuantEmbedding
from moetier.quant.formats import get_format
from moetier.quant.pack import quantize as pack
from moetier.runtime import cpu_compile
from moetier.runtime.engine import Engine
from moetier.runtime.generate import greedy_tokens
from test_gguf import build_qwen3_moe, sharpen

needs_c = pytest.mark.skipif(cpu.backend() != "c", reason="the C kernels did not build")


def random_layer(qtype, e=6, d=256, i=256, seed=0):
    """gate, up [e, i, .], down [e, d, .] blocks of random weights; qtype one format or (gate/up, down)."""
    gq, dq = qtype if isinstance(qtype, tuple) else (qtype, qtype)
    g = torch.Generator().manual_seed(seed)
    return [pack(torch.randn(e, r, c, generator=g) * 0.1, q) for q, (r, c) in ((gq, (i, d)), (gq, (i, d)), (dq, (d, i)))]


def random_route(t, e=6, k=2, d=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return x, ids, torch.softmax(torch.randn(t, k, generator=g), -1)


@needs_c
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", ("Q4_K", "Q6_K"), "Q5_K", ("Q5_1", "Q6_K"),
                                   ("Q2_K", "Q3_K")])
@pytest.mark.parametrize("t", [1, 3])
def test_moe_tokens_matches_twin(qtype, t):
    gate, up, down = random_layer(qtype)
    x, ids, w = random_route(t)
    ref = cpu.moe_tokens_native(qtype, gate, up, down, x, ids, w)
    assert max_rel_err(cpu.moe_tokens(qtype, gate, up, down, x, ids, w, threads=2), ref) < 1e-5
    assert max_rel_err(cpu.moe_tokens(qtype, gate, up, down, x, ids, w, threads=1), ref) < 1e-5


@needs_c
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q2_K", "Q3_K"])
def test_moe_tokens_int8_activations_close(qtype):
    """q8: x and the activation rounded to int8 per 32 values (llama.cpp's way): ~1% relative error."""
    gate, up, down = random_layer(qtype)
    x, ids, w = random_route(2)
    ref = cpu.moe_tokens_native(qtype, gate, up, down, x, ids, w)
    y = cpu.moe_tokens(qtype, gate, up, down, x, ids, w, q8=True)
    assert (y - ref).norm() / ref.norm() < 0.03


@needs_c
def test_moe_tokens_rejects_bad_ids():
    gate, up, down = random_layer("Q8_0")
    x, ids, w = random_route(1)
    with pytest.raises(RuntimeError, match="expert ids"):
        cpu.moe_tokens("Q8_0", gate, up, down, x, ids + 6, w)


@needs_c
@pytest.mark.parametrize("qtype", ["Q8_0", ("Q4_K", "Q6_K")])
def test_quant_experts_decode_takes_the_fused_op(qtype):
    gate, up, down = random_layer(qtype)
    ex = QuantExperts(qtype, gate, up, down)
    assert ex.fused_cpu
    x, ids, w = random_route(1)
    assert max_rel_err(ex(x, ids, w), ex.forward_native(x, ids, w)) < 1e-5
    op = torch.ops.moetier.moe_tokens(x, ids, w, gate, up, down, get_format(ex.fmt).type_id,
                                      get_format(ex.down_fmt).type_id, False)
    assert torch.equal(op, ex(x, ids, w))


@needs_c
def test_moe_op_exports_as_one_call():
    """torch.export keeps moetier::moe_tokens whole (its fake impl gives the shape)."""
    gate, up, down = random_layer("Q4_0")
    ex = QuantExperts("Q4_0", gate, up, down)
    x, ids, w = random_route(1)
    ep = torch.export.export(ex, (x, ids, w), strict=False)
    assert "moetier.moe_tokens" in ep.graph_module.code
    assert max_rel_err(ep.module()(x, ids, w), ex.forward_native(x, ids, w)) < 1e-5


@needs_c
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("n", [64, 70])     # 70: rows past the last group of 4
def test_qlinear_matches_twin(qtype, n):
    g = torch.Generator().manual_seed(2)
    w = pack(torch.randn(n, 256, generator=g) * 0.1, qtype)
    x = torch.randn(1, 256, generator=g)
    ref = cpu.qlinear_native(qtype, w, x)
    assert max_rel_err(cpu.qlinear(qtype, w, x), ref) < 1e-5
    assert max_rel_err(cpu.qlinear(qtype, w, torch.cat([x, -x])), torch.cat([ref, -ref])) < 1e-5
    assert (cpu.qlinear(qtype, w, x, q8=True) - ref).norm() / ref.norm() < 0.02     # int8 activations
    op = torch.ops.moetier.qlinear(x, w, get_format(qtype).type_id, True)
    assert torch.equal(op, cpu.qlinear(qtype, w, x, q8=True))


def test_exact_blocks_finds_the_stored_format():
    """A float tensor that is exactly Q4_0 (or Q8_0) values gets those blocks back; other floats none."""
    from moetier.quant.formats import dequantize
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=g)
    for name in ("Q4_0", "Q8_0"):
        fmt = get_format(name)
        vals = dequantize(pack(w, name), fmt, tuple(w.shape))
        raw, tid = cpu_compile._exact_blocks(vals)
        assert tid == fmt.type_id and torch.equal(dequantize(raw, fmt, tuple(w.shape)), vals)
    assert cpu_compile._exact_blocks(w) is None


@needs_c
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_compiled_step_on_quantized_gguf(tmp_path, qtype):
    """A GGUF file with --cpu-compile on keeps its experts packed, multiplies its other Q8_0/Q4_0 weights
    on quantized copies, decodes through the AOT step, and follows the same file with its experts
    dequantized (eager, float activations) up to the int8 activations (Q8_ACTIVATIONS). --pure: llama.cpp's Q4_0 mix
    would store this 8-expert model's attn_k / attn_v as Q8_0."""
    path = quantize(build_qwen3_moe(tmp_path / "model"), qtype, tmp_path / f"m-{qtype}.gguf", pure=True)
    fast = compiled_follows_eager(path)
    assert any(isinstance(m, QuantExperts) for m in fast.model.modules())
    assert getattr(fast.model.lm_head, "weight_q", None) is not None       # its quantized copy
    tid = get_format(qtype).type_id
    tid = cpu.INTERLEAVED[tid] if cpu.interleaved_supported(tid) else tid
    assert fast.model.model.layers[0].self_attn._quant_copies == {"qkv_weight": tid}   # rows interleaved


K_QUANT_MODEL = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 512, "mlp_only_layers": [1]}


@needs_c
def test_q5_0_fallbacks_run_as_q8_0(tmp_path):
    """Rows whose length is not a multiple of 256 are Q5_0 in a Q4_K_M file (llama.cpp's fallback): on the CPU the
    experts pack as Q8_0 (the exact conversion), the tied lm_head and attention q get Q8_0 copies from the file's
    blocks, and the compiled step follows eager decode."""
    path = quantize(build_qwen3_moe(tmp_path / "model"), "Q4_K_M", tmp_path / "m-Q4_K_M.gguf")
    fast = compiled_follows_eager(path)
    experts = [m for m in fast.model.modules() if isinstance(m, QuantExperts)]
    assert experts and all(m.fmt == "Q8_0" for m in experts)
    q8 = get_format("Q8_0").type_id
    q8 = cpu.INTERLEAVED[q8] if cpu.interleaved_supported(q8) else q8
    assert fast.model.lm_head._quant_copies == {"weight": q8}
    assert q8 in fast.model.model.layers[0].self_attn._quant_copies.values()


@needs_c
def test_q5_1_fallbacks_pack(tmp_path):
    """Q5_K_M stores rows not a multiple of 256 as Q5_1 (d q + m): the experts pack as Q5_1 (its int8 row kernel), the
    attention projections multiply on their Q5_1 blocks, and the compiled step follows eager decode."""
    # peaked next-token distributions (test_gguf.sharpen, as trained models have): the flat ones of the default random
    # weights tied for the top-1 in 4 of 24 tokens here. Peaked logits magnify the int8 activations' KL: per token up
    # to 0.020 on this file and 0.033 on its Q4_K_M twin (medians 0.0003), each product within ~0.5% of float
    path = quantize(build_qwen3_moe(tmp_path / "model", scale=2.0, init=sharpen), "Q5_K_M", tmp_path / "m-Q5_K_M.gguf")
    fast = compiled_follows_eager(path, kl_max=0.05)
    experts = [m for m in fast.model.modules() if isinstance(m, QuantExperts)]
    assert experts and all(m.fmt == "Q5_1" for m in experts)
    att, q51 = fast.model.model.layers[0].self_attn, get_format("Q5_1").type_id
    q51 = cpu.INTERLEAVED[q51] if cpu.interleaved_supported(q51) else q51       # 8k rows: interleaved
    assert att.q_proj._quant_copies == att.o_proj._quant_copies == {"weight": q51}


@needs_c
def test_iq4_files_pack(tmp_path):
    """An IQ4_XS file (IQ4_NL where rows are not a multiple of 256: all of this tiny model's): the experts pack in the
    file's formats and the compiled step follows eager decode (peaked distributions, as test_q5_1_fallbacks_pack)."""
    path = quantize(build_qwen3_moe(tmp_path / "model", scale=2.0, init=sharpen), "IQ4_XS", tmp_path / "m-IQ4_XS.gguf")
    fast = compiled_follows_eager(path, kl_max=0.05)
    experts = [m for m in fast.model.modules() if isinstance(m, QuantExperts)]
    assert experts and all({m.fmt, m.down_fmt} <= {"IQ4_NL", "IQ4_XS"} for m in experts)


IQ2_MODEL = {"hidden_size": 256, "moe_intermediate_size": 256, "mlp_only_layers": []}
IQ2_EXPERTS = [("IQ2_XXS", "IQ2_XS"), ("IQ2_S", "IQ2_S")]       # (gate / up, down) of layer 0, layer 1


@needs_c
def test_iq2_files_pack(tmp_path, monkeypatch):
    """A file with its experts in IQ2 formats (IQ2_XXS / IQ2_XS in layer 0, IQ2_S in layer 1) and attn_q / attn_k as
    IQ2_S (llama.cpp's IQ3_XXS mixes store them so), the rest Q8_0: the experts pack in their formats (QuantExperts,
    not dequantized at load), q / k multiply on their IQ2_S blocks in the compiled step, and it follows eager decode of
    the file with its experts dequantized."""
    from moetier.commands.imatrix import compute
    from moetier.quant.mixes import Mix
    from test_gguf import TEXT

    def iq2_mix(self, name, shape, pure=False):
        if len(shape) < 2 or not name.endswith(".weight") or "_norm" in name or "ffn_gate_inp" in name:
            return "F32"
        if "_exps" in name:
            gate_up, down = IQ2_EXPERTS[int(name.split(".")[1])]
            return down if "ffn_down" in name else gate_up
        return "IQ2_S" if "attn_q." in name or "attn_k." in name else "Q8_0"

    model = build_qwen3_moe(tmp_path / "model", scale=2.0, init=sharpen, **IQ2_MODEL)
    imatrix = compute(model, " ".join(TEXT * 8), tmp_path / "imatrix.gguf", chunk=32)   # IQ2_XXS / IQ2_XS need one
    monkeypatch.setattr(Mix, "tensor_type", iq2_mix)
    path = quantize(model, "Q8_0", tmp_path / "m-IQ2.gguf", imatrix=imatrix)
    fast = compiled_follows_eager(path, kl_max=0.05)
    experts = [m for m in fast.model.modules() if isinstance(m, QuantExperts)]
    assert [(m.fmt, m.down_fmt) for m in experts] == IQ2_EXPERTS
    for layer in fast.model.model.layers:
        att = layer.self_attn
        assert att.q_proj._quant_copies == att.k_proj._quant_copies == {"weight": get_format("IQ2_S").type_id}


@needs_c
def test_q2_k_q3_k_experts_pack(tmp_path):
    """A Q2_K file: experts stored as Q2_K (gate / up) and Q3_K (down), as llama.cpp's Q2_K mix stores them: they
    pack (QuantExperts in the file's formats, their int8 row kernels), and the compiled step follows eager decode on
    the dequantized experts (peaked distributions, as test_q5_1_fallbacks_pack)."""
    model = build_qwen3_moe(tmp_path / "model", scale=2.0, init=sharpen, **K_QUANT_MODEL)
    path = quantize(model, "Q2_K", tmp_path / "m-Q2_K.gguf")      # llama.cpp's Q2_K mix: ffn_down in Q3_K
    fast = compiled_follows_eager(path, kl_max=0.05)
    experts = [m for m in fast.model.modules() if isinstance(m, QuantExperts)]
    assert experts and all((m.fmt, m.down_fmt) == ("Q2_K", "Q3_K") for m in experts)


@needs_c
def test_iq1_s_experts_pack(tmp_path, monkeypatch, qtype="IQ1_S"):
    """A file whose experts are IQ1_S (the rest Q8_0, as unsloth's 1.58-bit MoE files keep attention in more bits;
    rows of 256): the experts pack as IQ1_S, not dequantized to float32, and the compiled step follows eager decode on
    the dequantized model (peaked distributions, as test_q5_1_fallbacks_pack). IQ3_S / IQ1_M: test_quant_experts."""
    from test_quant_experts import experts_as
    model = build_qwen3_moe(tmp_path / "model", scale=2.0, init=sharpen, hidden_size=256, moe_intermediate_size=256)
    path = quantize(model, "Q8_0", tmp_path / f"m-{qtype}.gguf", **experts_as(monkeypatch, qtype, model, tmp_path))
    fast = compiled_follows_eager(path, kl_max=0.05)
    experts = [m for m in fast.model.modules() if isinstance(m, QuantExperts)]
    assert experts and all(m.fmt == m.down_fmt == qtype for m in experts)


@needs_c
def test_compiled_step_on_k_quant_gguf(tmp_path):
    """Q4_K_M keeps the lm_head as Q6_K, attn_q and the dense MLP as Q4_K/Q6_K, attn_k/v as Q8_0 (tiny rows),
    attn_output as Q5_1: the compiled step multiplies each on the file's own blocks (q/k/v differ, so they stay
    three products); and follows eager decode."""
    path = quantize(build_qwen3_moe(tmp_path / "model", **K_QUANT_MODEL), "Q4_K_M", tmp_path / "m-Q4_K_M.gguf")
    fast = compiled_follows_eager(path)
    tid = {n: get_format(n).type_id for n in ("Q4_K", "Q6_K", "Q8_0", "Q5_1")}
    for f in ("Q8_0", "Q5_1", "Q4_K"):              # copies of 8k rows in these formats: interleaved
        if cpu.interleaved_supported(tid[f]):
            tid[f] = cpu.INTERLEAVED[tid[f]]
    copies = {name: m._quant_copies for name, m in fast.model.named_modules() if getattr(m, "_quant_copies", None)}
    assert copies["lm_head"] == {"weight": tid["Q6_K"]}
    for i in (0, 1):
        att = f"model.layers.{i}.self_attn"
        assert copies[f"{att}.q_proj"] == {"weight": tid["Q4_K"]} and copies[f"{att}.o_proj"] == {"weight": tid["Q5_1"]}
        assert copies[f"{att}.k_proj"] == copies[f"{att}.v_proj"] == {"weight": tid["Q8_0"]}
    mlp = {p: copies[f"model.layers.1.mlp.{p}"]["weight"] for p in ("gate_proj", "up_proj", "down_proj")}
    assert mlp == {"gate_proj": tid["Q4_K"], "up_proj": tid["Q4_K"], "down_proj": tid["Q6_K"]}   # last layer: more bits
    # prefill: Q4_K/Q6_K experts meet int8 activations where the build has their integer tile, and one-row
    # eager calls of the lm_head run on its Q6_K blocks (the decode step's arithmetic)
    experts = [m for m in fast.model.modules() if isinstance(m, QuantExperts)]
    tile = cpu.grouped_int8_tile("Q4_K") and cpu.grouped_int8_tile("Q6_K")
    assert experts and all(bool(getattr(m, "q8_act", False)) == bool(tile) for m in experts
                           if {m.fmt, m.down_fmt} <= {"Q4_K", "Q6_K"})
    assert "forward" in fast.model.lm_head.__dict__


@needs_c
def test_edited_gguf_weight_loses_its_blocks(tmp_path):
    """A GGUF weight edited in place or replaced after load is no longer its file blocks: no `_q` copy from them."""
    from moetier.weights.loader import load_model
    path = quantize(build_qwen3_moe(tmp_path / "model", **K_QUANT_MODEL), "Q4_K_M", tmp_path / "m-Q4_K_M.gguf")
    model, _, _ = load_model(path)
    att = model.model.layers[0].self_attn
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
        att.q_proj.weight = torch.nn.Parameter(att.q_proj.weight * 1.5, requires_grad=False)
    cpu_compile._quantized_copies(model)
    assert not hasattr(model.lm_head, "weight_q") and not hasattr(att.q_proj, "weight_q")
    assert hasattr(att.k_proj, "weight_q") and hasattr(model.model.layers[1].self_attn.q_proj, "weight_q")


def compiled_follows_eager(path, kl_max: float = 0.01):
    """Generate with the compiled step (experts packed) and eagerly (experts dequantized); teacher-forced on
    the compiled step's tokens, its logits follow eager's up to the int8 activations (Q8_ACTIVATIONS): KL < kl_max.
    -> the compiled engine."""
    prompt, n = [5, 17, 33, 2, 90, 41, 7], 24
    engs = {}
    for mode, deq in (("off", True), ("on", False)):
        engs[mode] = eng = Engine.load(path, EngineConfig(device="cpu", threads=1, progress=False, max_context=256,
                                                          cpu_compile=mode, dequantize_experts=deq))
        toks = [e.token_id for e in eng.generate(prompt_ids=prompt, max_tokens=n, params=SamplingParams(temperature=0),
                                                 ignore_eos=True) if hasattr(e, "token_id") and e.token_id >= 0]
        assert len(toks) == n
    fast = engs["on"]
    assert fast._cpu_decode, "the compiled step could not be built (see the warning) and the engine decoded eagerly"
    ref_cache, cache = engs["off"].new_session().cache, fast.new_session().cache
    agree = []
    def kl(a, b):
        return torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="sum")
    with torch.inference_mode():
        ref = engs["off"].model(torch.tensor(prompt), ref_cache)[-1]
        ours = fast.model(torch.tensor(prompt), cache)[-1]      # eager prefill: int8 where prefill_int8_experts says
        assert kl(ours, ref) < 0.01 and ours.argmax() == ref.argmax()
        for tok in toks:                       # teacher-forced on one sequence
            ref = engs["off"].model(torch.tensor([tok]), ref_cache)[-1]
            ours = fast._cpu_decode(cache, tok)[-1]
            assert kl(ours, ref) < kl_max
            agree.append(int(ours.argmax() == ref.argmax()))
    assert sum(agree) >= 0.9 * n
    return fast


@needs_c
def test_native_op_kernels_match_python_kernels():
    """cpu_ops.cpp (the C++ kernels the compiled step calls) against the Python kernels it replaces."""
    import shutil
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler")
    gate, up, down = random_layer("Q4_0")
    x, ids, w = random_route(2)
    lin = pack(torch.randn(36, 256, generator=torch.Generator().manual_seed(4)) * 0.1, "Q8_0")
    q4, q8 = get_format("Q4_0").type_id, get_format("Q8_0").type_id
    py = [cpu.moe_tokens_op(x, ids, w, gate, up, down, q4, q4, q8_act) for q8_act in (False, True)]
    py += [cpu.qlinear_op(x, lin, q8, q8_act) for q8_act in (False, True)]
    assert cpu.load_native_ops()
    native = [torch.ops.moetier.moe_tokens(x, ids, w, gate, up, down, q4, q4, q8_act) for q8_act in (False, True)]
    native += [torch.ops.moetier.qlinear(x, lin, q8, q8_act) for q8_act in (False, True)]
    for a, b in zip(native, py):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="do not hold K=256"):
        torch.ops.moetier.qlinear(x, lin[:, :10].contiguous(), q8, True)
    with pytest.raises(RuntimeError, match="expert ids outside"):
        torch.ops.moetier.moe_tokens(x, ids + 6, w, gate, up, down, q4, q4, False)


@needs_c
def test_block_ops_are_the_c_calls(tmp_path):
    """moetier::attn_block / moe_block (what the compiled step calls): their Python kernels and cpu_ops.cpp's C++
    ones give cpu.attn_block / moe_block's outputs and cache rows bit for bit, at a 0-d position tensor."""
    import shutil
    path = quantize(build_qwen3_moe(tmp_path / "model"), "Q4_0", tmp_path / "m.gguf", pure=True)
    eng = Engine.load(path, EngineConfig(device="cpu", threads=1, progress=False, max_context=64, cpu_compile="off"))
    eng.complete(prompt_ids=[5, 6, 7], max_tokens=2, params=SamplingParams(temperature=0), ignore_eos=True)
    blk = eng.model.model.layers[0]
    att, moe, norm = blk.self_attn, blk.mlp, blk.input_layernorm
    g = torch.Generator().manual_seed(9)
    h, a = torch.randn(1, eng.args.hidden_size, generator=g), torch.randn(1, eng.args.hidden_size, generator=g)
    pos = 11
    cos, sin = eng.model.rope.span(pos, 1, torch.float32, "cpu")
    cache = eng.model.make_cache(32, torch.float32, "cpu")[0]
    cache.k.normal_(generator=g), cache.v.normal_(generator=g)
    parts, ot, wo, q8 = att.cpu_token_planes(h)
    (t0, w0), = parts
    gq, dq, gate, up, down, mq8 = moe.experts.cpu_token_planes(h)
    qw, kw = att.q_norm.weight, att.k_norm.weight

    def attn(call):
        k, v = cache.k.clone(), cache.v.clone()
        y = call(h, norm.weight, norm.eps, w0, t0, None, 0, None, 0, wo, ot, q8, qw, kw, att.q_norm.eps, cos, sin,
                 torch.tensor(pos), k, v, att.h, att.hkv, att.scale)
        return y, k, v
    k, v = cache.k.clone(), cache.v.clone()
    want = (cpu.attn_block(h, norm.weight, norm.eps, (parts, ot, wo, q8), qw, kw, att.q_norm.eps, cos, sin, pos, k, v,
                           att.h, att.hkv, att.scale), k, v)
    want_moe = cpu.moe_block(h, a, blk.post_attention_layernorm.weight, 1e-6, moe.gate.weight, moe.gate.k,
                             moe.gate.normalize, (gq, dq, gate, up, down, mq8))
    moe_args = (h, a, blk.post_attention_layernorm.weight, 1e-6, moe.gate.weight, moe.gate.k, moe.gate.normalize,
                gate, up, down, gq, dq, mq8)
    impls = [cpu.attn_block_op]
    moe_impls = [cpu.moe_block_op]
    if shutil.which("g++") or shutil.which("c++"):
        assert cpu.load_native_ops()
        impls.append(torch.ops.moetier.attn_block)
        moe_impls.append(torch.ops.moetier.moe_block)
    for call in impls:
        got = attn(call)
        assert all(torch.equal(x, y) for x, y in zip(got, want)), call
        assert not torch.equal(got[1][pos], cache.k[pos])                # the row written
    for call in moe_impls:
        assert torch.equal(call(*moe_args), want_moe), call
    nan_h = h.clone()
    nan_h[0, 0] = float("nan")
    for call in moe_impls:                                                # NaN logits: NaN out (the twin's)
        assert call(nan_h, *moe_args[1:]).isnan().all()


@needs_c
def test_native_qlinear_takes_every_c_format():
    """The compiled step's copies come in any C-kernel format (a GGUF's stored blocks: IQ3_XXS, MXFP4 ... and the
    interleaved ids): the C++ op checks their rows with the C kernels' own block table and gives the Python kernel's
    result. (Its own table knew Q8_0 / Q4_0 / Q5_1 / IQ4_NL / K-quants / IQ4_XS only: IQ3_XXS and MXFP4 rows were
    refused as not holding K values.)"""
    import shutil
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler")
    assert cpu.load_native_ops()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 512, generator=g)
    for name in sorted(cpu.FAST_TYPES):
        tid = get_format(name).type_id
        w = pack(torch.randn(16, 512, generator=g) * 0.1, name)
        ids = [tid] + ([cpu.INTERLEAVED[tid]] if cpu.interleaved_supported(tid) else [])
        for q in ids:
            blocks = cpu.interleave_rows(w, tid) if q != tid else w
            for q8_act in (False, True) if q == tid else (True,):
                got = torch.ops.moetier.qlinear(x, blocks, q, q8_act)
                assert torch.equal(got, cpu.qlinear_op(x, blocks, q, q8_act)), (name, q, q8_act)


@needs_c
def test_quantized_copies_skip_views_and_drop():
    """Exact Q8_0 weights get a copy; a view into a larger weight (fuse_qkv's q/k/v) and float weights
    do not; dropping removes them all."""
    from moetier.quant.formats import dequantize
    g = torch.Generator().manual_seed(5)
    fused = dequantize(pack(torch.randn(96, 64, generator=g), "Q8_0"), get_format("Q8_0"), (96, 64))
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 32, bias=False),
                                torch.nn.Linear(64, 32, bias=False))
    with torch.no_grad():
        model[0].weight = torch.nn.Parameter(fused, requires_grad=False)
        model[1].weight = torch.nn.Parameter(fused[:32], requires_grad=False)    # a view of model[0]'s
        model[2].weight.copy_(torch.randn(32, 64, generator=g))                  # not quantized values
    cpu_compile._quantized_copies(model)
    assert [n for n, _ in model.named_buffers()] == ["0.weight_q"]
    cpu_compile._drop_quantized_copies(model)
    assert not list(model.named_buffers())


@needs_c
def test_half_expert_copies_of_biased_experts_and_drop():
    """Stacked experts whose values are exactly bf16 get 16-bit copies; with biases (gpt-oss's kind) one row runs
    each expert on them (DenseExperts._expert_half) and gives the float expert's values up to the order of the sums;
    float values that are not 16-bit get none; dropping removes them."""
    from moetier.models.layers import DenseExperts
    g = torch.Generator().manual_seed(9)
    ex, other = DenseExperts(4, 64, 32, bias=True), DenseExperts(4, 64, 32)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g).bfloat16().float() * 0.25)
        for p in other.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    model = torch.nn.ModuleList([ex, other])
    x = torch.randn(1, 64, generator=g)
    want = [ex.expert(e, x) for e in range(4)]
    cpu_compile._half_expert_copies(model)
    assert ex._half[0] == get_format("BF16").type_id and "_half" not in other.__dict__
    assert not ex.half_call(x)                   # biased: expert by expert
    for e in range(4):
        torch.testing.assert_close(ex.expert(e, x), want[e], rtol=1e-5, atol=1e-5)
    cpu_compile._drop_quantized_copies(model)
    assert "_half" not in ex.__dict__ and not list(model.named_buffers())


@needs_c
def test_eager_decode_on_gguf_reads_the_blocks(tmp_path, monkeypatch):
    """Without the compiled step (--cpu-compile off) a GGUF file's one-token linears (stacked q/k/v, o, lm_head)
    multiply on its blocks too, and its experts on their copies interleaved by 8 (cpu_compile.eager_blocks): the
    logits follow the float copies' up to the int8 activations, and the bench's byte count is the blocks'."""
    from moetier.tools.bench_core import bytes_per_token
    path = quantize(build_qwen3_moe(tmp_path / "model"), "Q4_0", tmp_path / "m-Q4_0.gguf", pure=True)
    cfg = EngineConfig(device="cpu", threads=1, progress=False, max_context=256, cpu_compile="off")
    ours = Engine.load(path, cfg)           # dense weights and embeddings on their blocks from the load
    assert isinstance(ours.model.model.embed_tokens, QuantEmbedding)
    assert all(getattr(m.weight, "released", False) for m in ours.model.modules() if isinstance(m, torch.nn.Linear))
    monkeypatch.setattr(cpu_compile, "KEEP_FLOATS", True)
    ref = Engine.load(path, cfg)            # the float copies, as before session 42 (MOETIER_FLOAT_COPIES=1)
    monkeypatch.setattr(cpu_compile, "KEEP_FLOATS", False)
    monkeypatch.setenv("MOETIER_CPU_LAYERS", "0")   # the modules' calls, counted (cpu_step: test_cpu_small)
    float_bytes = bytes_per_token(ref, 16)["dense"]
    calls = []
    inner, inner_attn = cpu.qlinear_op, cpu.attn_block   # _on_blocks' call (x, blocks, qtype, q8); a block's
    monkeypatch.setattr(cpu, "qlinear_op", lambda *a, **k: calls.append(a[2]) or inner(*a, **k))
    # attention half: its q/k/v and o GEMVs in one C call
    monkeypatch.setattr(cpu, "attn_block", lambda *a, **k: calls.extend(_gemv_types(a[3])) or inner_attn(*a, **k))
    prompt, n = [5, 17, 33, 2, 90, 41, 7], 12
    done = ours.complete(prompt_ids=prompt, max_tokens=n, params=SamplingParams(temperature=0), ignore_eos=True)
    layers = len(ours.model.model.layers)
    # every decode step (the first token comes from the prefill): q/k/v and o of each layer, the lm_head
    assert done.stats["decode_path"] == "eager" and len(calls) >= (n - 1) * (2 * layers + 1)
    assert bytes_per_token(ours, 16)["dense"] < float_bytes / 3
    experts = [m for m in ours.model.modules() if isinstance(m, QuantExperts)]
    assert experts and all(m._x8_types == (cpu.INTERLEAVED[2],) * 2 for m in experts)   # Q4_0 rows in lanes
    def kl(a, b):
        return torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="sum")
    c1, c2 = ours.new_session().cache, ref.new_session().cache
    agree = []
    with torch.inference_mode():
        ours.model(torch.tensor(prompt), c1)
        ref.model(torch.tensor(prompt), c2)      # ref never decoded through the engine: its float copies
        for tok in done.token_ids:
            a, b = ours.model(torch.tensor([tok]), c1)[-1], ref.model(torch.tensor([tok]), c2)[-1]
            assert kl(a, b) < 0.01
            agree.append(int(a.argmax() == b.argmax()))
    assert sum(agree) >= 0.9 * n


def _gemv_types(planes) -> list:
    """The GEMVs' type ids in cpu.attn_block's planes: its q/k/v parts' (one stacked or three), then o's."""
    parts, o_type = planes[0], planes[1]
    return [t for t, _ in parts] + [o_type]


@needs_c
def test_16_bit_experts_off_32_value_rows_decode_on_their_floats(tmp_path):
    """A 16-bit checkpoint whose hidden size is no multiple of 32 (the C kernel's unit for 16-bit rows): its experts
    get no 16-bit copies and decode eagerly on their float32 weights (this raised in moe_tokens before), the same
    greedy tokens as the float forward."""
    from helpers import tiny_checkpoint
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=320, hidden_size=48, intermediate_size=96, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256)

    def round16(m):
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    tiny_checkpoint(tmp_path, Qwen3MoeForCausalLM, cfg, scale=4.0, init=round16)
    conf = EngineConfig(device="cpu", dtype="float32", threads=1, progress=False, max_context=128, cpu_compile="off")
    ours = Engine.load(tmp_path, conf)
    done = ours.complete(prompt_ids=[5, 17, 33, 2], max_tokens=6, params=SamplingParams(temperature=0),
                         ignore_eos=True)
    assert len(done.token_ids) == 6
    assert all("_half" not in m.__dict__ for m in ours.model.modules() if type(m).__name__ == "DenseExperts")
    ref = Engine.load(tmp_path, conf)
    with torch.inference_mode():
        want = greedy_tokens(ref.model, [5, 17, 33, 2], 6)
    assert done.token_ids == want


@needs_c
@pytest.mark.parametrize("half", ["BF16", "F16"])
def test_eager_decode_of_a_16_bit_checkpoint_reads_16_bit_copies(tmp_path, monkeypatch, half):
    """A checkpoint whose weights are 16-bit floats (the default model's bf16, run in float32 on the CPU): the one-token
    linears and experts (a layer's k in one C call) multiply on BF16 / F16 copies of them (half the float32 bytes;
    products and sums in float32), so the logits are the float forward's up to the order of the sums, and the greedy tokens the same."""
    from helpers import tiny_checkpoint
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    dt = torch.bfloat16 if half == "BF16" else torch.float16
    cfg = Qwen3MoeConfig(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256)
    def round16(m):
        for p in m.parameters():
            p.copy_(p.to(dt).float())
    tiny_checkpoint(tmp_path, Qwen3MoeForCausalLM, cfg, scale=4.0, init=round16)
    conf = EngineConfig(device="cpu", dtype="float32", threads=1, progress=False, max_context=128, cpu_compile="off")
    ours, ref = Engine.load(tmp_path, conf), Engine.load(tmp_path, conf)
    monkeypatch.setenv("MOETIER_CPU_LAYERS", "0")   # the modules' calls, counted (cpu_step: test_cpu_small)
    calls, moe = [], []
    inner, inner_attn, inner_moe = cpu.qlinear_op, cpu.attn_block, cpu.moe_block
    monkeypatch.setattr(cpu, "qlinear_op", lambda *a, **k: calls.append(a[2]) or inner(*a, **k))
    # a block's two C calls: the attention half's q/k/v and o GEMVs, the MoE half's experts (planes' types)
    monkeypatch.setattr(cpu, "attn_block", lambda *a, **k: calls.extend(_gemv_types(a[3])) or inner_attn(*a, **k))
    monkeypatch.setattr(cpu, "moe_block", lambda *a, **k: moe.append(a[7][:2]) or inner_moe(*a, **k))
    prompt, n = [5, 17, 33, 2, 90, 41, 7], 10
    done = ours.complete(prompt_ids=prompt, max_tokens=n, params=SamplingParams(temperature=0), ignore_eos=True)
    tid = get_format(half).type_id
    assert ours.model.lm_head._quant_copies == {"weight": tid} and calls and set(calls) == {tid}
    experts = [m for m in ours.model.modules() if type(m).__name__ == "DenseExperts"]
    assert experts and all(m._half[0] == tid for m in experts)
    layers = len(ours.model.model.layers)       # per decode token: q/k/v and o a layer, the lm_head; one MoE call
    assert len(calls) >= (n - 1) * (2 * layers + 1) and len(moe) >= (n - 1) * layers and set(moe) == {(tid, tid)}
    c1, c2 = ours.new_session().cache, ref.new_session().cache
    with torch.inference_mode():
        ours.model(torch.tensor(prompt), c1)
        ref.model(torch.tensor(prompt), c2)      # ref never decoded through the engine: its float weights
        for tok in done.token_ids:
            a, b = ours.model(torch.tensor([tok]), c1)[-1], ref.model(torch.tensor([tok]), c2)[-1]
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
            assert a.argmax() == b.argmax()


@needs_c
@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_qgemm_is_the_row_kernels_product_for_many_rows(qtype, t):
    """cpu.qgemm (the grouped experts' tile over one weight that every row of x uses): the dequantized product up to
    the int8 activations; Q4_0 / Q8_0 the row-by-row int8 matvec's result up to the order of the float sums, and the
    same bits from a copy interleaved by 8 rows; 44 rows (a task of 32, one of 12), every output written."""
    fmt = get_format(qtype)
    g = torch.Generator().manual_seed(11)
    w = pack(torch.randn(48, 256, generator=g) / 16, qtype)
    x = torch.randn(t, 256, generator=g)
    want = cpu.qlinear_native(qtype, w[:44], x)
    y = cpu.qgemm(qtype, w[:44].contiguous(), x, threads=2)
    assert y.shape == (t, 44) and not y.isnan().any()
    assert max_rel_err(y, want) < (0.05 if fmt.name in ("Q4_K", "Q6_K") else 0.02)     # int8 per 256 / per 32 values
    assert max_rel_err(cpu.qgemm(qtype, w[:44].contiguous(), x, q8=False, threads=1), want) < 1e-5
    if qtype in ("Q4_0", "Q8_0"):
        assert max_rel_err(y, cpu.qlinear(qtype, w[:44].contiguous(), x, q8=True, threads=1)) < 1e-5
        full = cpu.qgemm(qtype, w, x, threads=2)
        x8 = cpu.interleave_rows(w, fmt.type_id)
        assert torch.equal(cpu.qgemm(cpu.INTERLEAVED[fmt.type_id], x8, x, threads=2), full)
    with pytest.raises(ValueError, match=r"x \[T, K\]"):
        cpu.qgemm(qtype, w, x[0])


@needs_c
def test_prefill_multiplies_q4_0_blocks_through_qgemm(tmp_path, monkeypatch):
    """With the experts' prefill on int8 activations (MOETIER_PREFILL_INT8=on here; timed per machine by default), a
    GGUF file's Q4_0 projections multiply the prompt's rows on their blocks (cpu.qgemm: stacked q/k/v and o, every
    layer, and the lm_head); the logits stay those of the float prefill up to the int8 activations. Off: the float
    GEMMs, no qgemm."""
    path = quantize(build_qwen3_moe(tmp_path / "model"), "Q4_0", tmp_path / "m-Q4_0.gguf", pure=True)
    cfg = EngineConfig(device="cpu", threads=1, progress=False, max_context=256, cpu_compile="off")
    calls, inner = [], cpu.qgemm
    monkeypatch.setattr(cpu, "qgemm", lambda *a, **k: calls.append(a[2].shape) or inner(*a, **k))
    prompt = torch.tensor([5, 17, 33, 2, 90, 41, 7, 64, 3])
    logits = {}
    for mode in ("on", "off"):
        monkeypatch.setattr(cpu_compile, "PREFILL_INT8", mode)
        eng = Engine.load(path, cfg)
        eng.complete(prompt_ids=[1, 2, 3], max_tokens=2, params=SamplingParams(temperature=0), ignore_eos=True)
        calls.clear()                           # (the first request installs the eager CPU paths)
        with torch.inference_mode():
            logits[mode] = eng.model(prompt, eng.new_session().cache)
        layers = len(eng.model.model.layers)
        # stacked q/k/v and o of each layer, and the lm_head (this call asks for every position's logits)
        assert len(calls) == (2 * layers + 1 if mode == "on" else 0), (mode, calls)
        assert all(c[0] == len(prompt) for c in calls)
    a, b = logits["on"], logits["off"]
    kl = torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert kl.max() < 0.01 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8
    assert not torch.equal(a, b)            # the int8 path did run


@needs_c
def test_prefill_multiplies_k_quant_blocks_through_qgemm_with_lanes(tmp_path, monkeypatch):
    """A Q2_K file's dense projections (Q2_K / Q3_K / Q4_K / Q6_K blocks, llama.cpp's mix) multiply the prompt's rows
    on their blocks (cpu.qgemm) where the build has the rows-in-lanes tile (grouped_lanes: AVX-512 VNNI or AVX-VNNI),
    and stay on the float GEMM without it; the logits stay the float prefill's up to the int8 activations."""
    if not cpu.grouped_int8_tile("Q2_K"):
        pytest.skip("no integer tile for Q2_K in this build (needs AVX2)")
    model = build_qwen3_moe(tmp_path / "model", scale=2.0, init=sharpen, **K_QUANT_MODEL)
    path = quantize(model, "Q2_K", tmp_path / "m-Q2_K.gguf")
    cfg = EngineConfig(device="cpu", threads=1, progress=False, max_context=256, cpu_compile="off")
    calls, inner = [], cpu.qgemm
    monkeypatch.setattr(cpu, "qgemm", lambda *a, **k: calls.append(a[2].shape) or inner(*a, **k))
    prompt = torch.tensor([5, 17, 33, 2, 90, 41, 7, 64, 3])
    logits = {}
    for lanes in (16, 0):
        monkeypatch.setattr(cpu, "grouped_lanes", lambda lib=None, n=lanes: n)
        eng = Engine.load(path, cfg)
        eng.complete(prompt_ids=[1, 2, 3], max_tokens=2, params=SamplingParams(temperature=0), ignore_eos=True)
        calls.clear()
        with torch.inference_mode():
            logits[lanes] = eng.model(prompt, eng.new_session().cache)
        assert (len(calls) > 0) == (lanes > 0) and all(c[0] == len(prompt) for c in calls), (lanes, calls)
    a, b = logits[16], logits[0]
    kl = torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert kl.max() < 0.01 and not torch.equal(a, b)


@needs_c
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", ("Q4_K", "Q8_0")])
def test_moe_tokens_on_experts_interleaved_by_8(qtype):
    """moetier_moe_tokens on expert banks interleaved by 8 rows (x8 ids) gives the row kernels' layer up to the order
    of the float sums; poisoned outputs fully written; a bank with only one side interleaved is refused."""
    gq, dq = qtype if isinstance(qtype, tuple) else (qtype, qtype)
    gate, up, down = random_layer(qtype, i=512)
    x, ids, w = random_route(3)
    tid = {q: get_format(q).type_id for q in (gq, dq)}
    x8 = [torch.stack([cpu.interleave_rows(b[e].contiguous(), tid[q]) for e in range(b.shape[0])])
          for b, q in ((gate, gq), (up, gq), (down, dq))]
    ref = cpu.moe_tokens_op(x, ids, w, gate, up, down, tid[gq], tid[dq], True)
    y = torch.full((3, 256), float("nan"))
    rc = cpu._lib.moetier_moe_tokens(cpu.INTERLEAVED[tid[gq]], cpu.INTERLEAVED[tid[dq]], x8[0].data_ptr(),
                                     x8[1].data_ptr(), x8[0].stride(0), x8[0].stride(1), x8[2].data_ptr(),
                                     x8[2].stride(0), x8[2].stride(1), 6, 256, 512, 3, 2, ids.contiguous().data_ptr(),
                                     w.contiguous().data_ptr(), x.contiguous().data_ptr(), y.data_ptr(), 1, 2)
    assert rc == 0 and not y.isnan().any()
    assert max_rel_err(y, ref) < 1e-5
    bad = cpu._lib.moetier_moe_tokens(cpu.INTERLEAVED[tid[gq]], tid[dq], x8[0].data_ptr(), x8[1].data_ptr(),
                                      x8[0].stride(0), x8[0].stride(1), down.data_ptr(), down.stride(0),
                                      down.stride(1), 6, 256, 512, 3, 2, ids.contiguous().data_ptr(),
                                      w.contiguous().data_ptr(), x.contiguous().data_ptr(), y.data_ptr(), 1, 2)
    assert bad == -1


@needs_c
def test_x8_experts_follow_ram_or_the_asking_process(tmp_path, monkeypatch):
    """The experts' x8 copies are made where MemAvailable holds twice the experts, or as the process whose background
    build this is decided (cpu_compile.x8_decided): the package key names them, so both processes must agree."""
    path = quantize(build_qwen3_moe(tmp_path / "model"), "Q4_0", tmp_path / "m-Q4_0.gguf", pure=True)
    model = Engine.load(path, EngineConfig(device="cpu", threads=1, progress=False, max_context=64,
                                           cpu_compile="off")).model
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert experts
    keys = {}
    for ram, decided, made in ((0, None, False), (1 << 40, None, True), (0, True, True), (1 << 40, False, False)):
        monkeypatch.setattr(cpu_compile, "ram_info", lambda ram=ram: (ram, ram))
        monkeypatch.setattr(cpu_compile, "x8_decided", decided)
        cpu_compile._drop_quantized_copies(model)
        cpu_compile._quantized_copies(model)
        assert all(bool(getattr(m, "_x8_types", None)) == made and hasattr(m, "gate_x8") == made for m in experts)
        keys.setdefault(made, set()).add(cpu_compile.package_key(model))
    assert len(keys[True]) == len(keys[False]) == 1 and keys[True] != keys[False]
