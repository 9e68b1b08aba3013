"""llama.cpp's Q4_K_M (gate/up Q4_K, ffn_down_exps Q6_K in the "more bits" layers) computed in its
formats: one format per projection, in QuantExperts (no tiers) and in the memory tiers, against the
same file with --dequantize-experts (experts dequantized to float32 at load).

A tiny random qwen3_moe (D = I = 256, so K-quants fit), 4 layers: with MoE layers 0, 2, 3, `moetier
quantize --type Q4_K_M` stores down as Q4_K in layer 0 and Q6_K in layers 2, 3 (use_more_bits: formats
vary by layer); with MoE layers 2, 3 only, every MoE layer has a Q6_K down (one format per param).
The C kernels sum in another order than F.linear: logits within TOL, greedy tokens identical.
"""
import pytest
import torch
from test_gguf import build_qwen3_moe

from moetier.commands.quantize import quantize
from moetier.config import EngineConfig
from moetier.kernels import cpu, ops
from moetier.models.layers import DenseExperts, swiglu
from moetier.models.quant_experts import QuantExperts
from moetier.quant.pack import quantize as pack
from moetier.runtime.engine import Engine
from moetier.runtime.generate import greedy_tokens

CTX, PROMPT, SPLIT, N_GREEDY = 64, 24, 12, 12
TOL = 1e-5          # max |logit diff| / max |logit|; measured 1.3e-6 (QuantExperts), 0-4.8e-7 (tiers)
BASE = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_experts": 8, "num_experts_per_tok": 2}
TOKENS = torch.randint(0, 300, (PROMPT,), generator=torch.Generator().manual_seed(3))


pytestmark = pytest.mark.usefixtures("one_torch_thread", "float_dense")


@pytest.fixture
def float_dense(monkeypatch):
    """Engines keep their dense weights' float32 copies (MOETIER_FLOAT_COPIES=1): on their blocks the linears' int8
    activations would follow how each engine chunks a prompt, and these tests compare where the experts are."""
    from moetier.runtime import cpu_compile
    monkeypatch.setattr(cpu_compile, "KEEP_FLOATS", True)


def q4km(tmp_path_factory, name: str, mlp_only: list[int]):
    d = build_qwen3_moe(tmp_path_factory.mktemp(name) / "model", mlp_only_layers=mlp_only, **BASE)
    return quantize(d, "Q4_K_M", d.parent / "m-Q4_K_M.gguf")


@pytest.fixture(scope="module")
def per_layer_mix(tmp_path_factory):
    """MoE layers 0, 2, 3: down Q4_K, Q6_K, Q6_K."""
    return q4km(tmp_path_factory, "mix_layers", [1])


@pytest.fixture(scope="module")
def uniform_mix(tmp_path_factory):
    """MoE layers 2, 3: down Q6_K in both."""
    return q4km(tmp_path_factory, "mix_uniform", [0, 1])


def engine(path, **kw) -> Engine:
    return Engine.load(path, EngineConfig(device="cpu", threads=1, progress=False, max_context=CTX, **kw))


def logits(model, tokens=TOKENS):
    cache = model.make_cache(CTX, torch.float32, "cpu")
    with torch.inference_mode():
        out = [model(tokens[:SPLIT], cache)]
        out += [model(tokens[i:i + 1], cache) for i in range(SPLIT, len(tokens))]
    return torch.cat(out)


def compare(model, reference) -> float:
    got, want = logits(model), logits(reference)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= TOL, f"max rel logit diff {err:.2e}"
    prompt = TOKENS[:SPLIT].tolist()
    assert greedy_tokens(model, prompt, N_GREEDY) == greedy_tokens(reference, prompt, N_GREEDY)
    return err


def test_quant_experts_keep_q6_k_down_packed(per_layer_mix):
    packed, deq = engine(per_layer_mix), engine(per_layer_mix, dequantize_experts=True)
    mods = {i: blk.mlp.experts for i, blk in enumerate(packed.model.model.layers) if hasattr(blk.mlp, "experts")}
    assert all(type(m) is QuantExperts for m in mods.values())
    assert [(m.fmt, m.down_fmt) for m in mods.values()] == [("Q4_K", "Q4_K"), ("Q4_K", "Q6_K"), ("Q4_K", "Q6_K")]
    assert mods[2].down_raw.dtype == torch.uint8
    assert all(type(blk.mlp.experts) is DenseExperts for blk in deq.model.model.layers if hasattr(blk.mlp, "experts"))
    if cpu.grouped_int8_tile("Q4_K") and cpu.grouped_int8_tile("Q6_K"):
        assert all(m.q8_act for m in mods.values())       # Engine.load: a CPU prefill takes int8 activations (~2%)
    for m in mods.values():
        m.q8_act = False     # float activations: the packed formats' products within TOL of the dequantized ones
    compare(packed.model, deq.model)


def test_tiers_compute_q4_k_gate_up_and_q6_k_down(uniform_mix):
    deq = engine(uniform_mix, dequantize_experts=True)
    eng = engine(uniform_mix, ram_mem=1 << 30)                      # RAM bank only: every expert a CPU miss
    assert eng.tiers.layout.qtypes == ("Q4_K", "Q6_K")
    compare(eng.model, deq.model)
    st = eng.memory_stats()
    assert st["tiers"]["ram"]["all_experts"] and st["hit_rate"] == 0.0
    fb = eng.tiers.layout.fast_bytes(torch.float32)
    eng = engine(uniform_mix, gpu_mem=5 * fb, ram_mem=1 << 30, prefill_copy_tokens=2)   # few fast slots + misses
    compare(eng.model, deq.model)
    c = eng.memory_stats()["cumulative"]
    assert c["hits"]["gpu"] > 0 and c["hits"]["ram"] > 0 and c["admissions"] > 0
    eng = engine(uniform_mix, gpu_mem=1 << 30, ram_mem=1 << 30, n_cpu_moe=3)      # model layer 2 on the CPU
    assert eng.tiers.pl.layer_tiers == ["cpu", "auto"]
    compare(eng.model, deq.model)


def test_kernel_weights_give_both_formats(uniform_mix):
    """FastTier.kernel_weights() -> fmt (gate_up, down) as kernels.ops takes it, over the live arena."""
    eng = engine(uniform_mix, gpu_mem=1 << 30, ram_mem=1 << 30)
    fmt, gate_up, down = eng.tiers.fast.kernel_weights()
    assert fmt == ("Q4_K", "Q6_K") and down is eng.tiers.fast.arena["down_proj"]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 5], [7, 2], [5, 3]])
    w = torch.rand(3, 2, generator=torch.Generator().manual_seed(1))
    got = ops.moe_decode(x, eng.tiers.cache.table[0][ids], w, gate_up, down, swiglu, fmt=fmt)
    deq = engine(uniform_mix, dequantize_experts=True)
    want = deq.model.model.layers[2].mlp.experts(x, ids, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_tiers_with_a_down_format_that_varies_by_layer(per_layer_mix):
    """Layer 0's down Q4_K, layers 2, 3's Q6_K: per-layer specs, every slot with planes of both formats."""
    deq = engine(per_layer_mix, dequantize_experts=True)
    eng = engine(per_layer_mix, ram_mem=1 << 30)
    lay = eng.tiers.layout
    assert lay.varies_by_layer and [lay.layer_qtypes(li) for li in range(3)] == [("Q4_K", "Q4_K"), ("Q4_K", "Q6_K"),
                                                                                 ("Q4_K", "Q6_K")]
    with pytest.raises(ValueError, match="vary by layer"):
        lay.unpack(eng.tiers.bank.slots[0])
    compare(eng.model, deq.model)
    fb = lay.fast_bytes(torch.float32)
    for kw in (dict(gpu_mem=7 * fb, ram_mem=1 << 30, prefill_copy_tokens=2), dict(gpu_mem=1 << 30, ram_mem=1 << 30),
               dict(gpu_mem=1 << 30, ram_mem=1 << 30, n_cpu_moe=3)):
        eng = engine(per_layer_mix, **kw)
        compare(eng.model, deq.model)
        eng.tiers.cache.check()
        c = eng.memory_stats()["cumulative"]
        if "prefill_copy_tokens" in kw:     # hits, CPU misses, admissions and staged prefill experts
            assert min(c["hits"]["gpu"], c["hits"]["ram"], c["admissions"], c["staged_prefill_experts"]) > 0
    fmts = [eng.tiers.fast.kernel_weights(li)[0] for li in range(3)]
    assert fmts == ["Q4_K", ("Q4_K", "Q6_K"), ("Q4_K", "Q6_K")]



@pytest.mark.parametrize("fmts", [("Q4_K", "Q6_K"), ("Q4_K", "Q5_K"), ("Q8_0", "Q6_K")])
@pytest.mark.parametrize("n", [1, 3])
def test_expert_ffn_two_formats_matches_its_torch_twin(fmts, n):
    g = torch.Generator().manual_seed(n)
    d, i = 256, 512
    gate_up, down = pack(torch.randn(2 * i, d, generator=g), fmts[0]), pack(torch.randn(d, i, generator=g), fmts[1])
    x = torch.randn(n, d, generator=g)
    got = cpu.expert_ffn(fmts, gate_up, down, x, swiglu)
    want = cpu.expert_ffn_native(fmts, gate_up, down, x, swiglu)
    assert got.shape == (n, d) and want.abs().min() > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("layout", ["raw", "planes"])
@pytest.mark.parametrize("t", [1, 7, 37])
def test_quant_experts_two_formats_match_torch_twin(layout, t):
    """QuantExperts(("Q4_K", "Q6_K")): raw (C matvec / dequantized prefill) and planes (kernels.ops
    with fmt=(gate_up, down)) against its twin; the twin's down weights are Q6_K's values."""
    from moetier.quant.formats import dequantize
    g = torch.Generator().manual_seed(t)
    e, d, i = 6, 256, 256
    raw = [pack(torch.randn(e, r, c, generator=g) * 0.1, q) for (r, c), q in
           (((i, d), "Q4_K"), ((i, d), "Q4_K"), ((d, i), "Q6_K"))]
    ex = QuantExperts(("Q4_K", "Q6_K"), *raw, layout=layout)
    torch.testing.assert_close(ex.weight("down", 2), dequantize(raw[2][2], "Q6_K", (d, i)))
    x = torch.randn(t, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])
    w = torch.rand(t, 2, generator=g) + 0.1
    got, want = ex(x, ids, w), ex.forward_native(x, ids, w)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
