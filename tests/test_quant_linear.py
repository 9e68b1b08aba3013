"""Dense linear layers on their GGUF blocks (models.quant_linear, kernels.triton_qlinear, ops.qlinear).

On the CPU the GEMV runs under the Triton interpreter (dp4a emulated); the GPU test runs it on CUDA in an engine.
"""
from __future__ import annotations

import pytest
import torch

from moetier.kernels import ops
from moetier.models.quant_linear import QuantLinear, gpu_blocks, install

DEV = "cuda" if torch.cuda.is_available() else "cpu"
QTYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4", "Q5_K", "IQ3_XXS", "IQ2_XXS", "Q2_K", "Q3_K")
# K in two pieces per row: 2 + 1 32-blocks (IQ3_XXS / IQ2_XXS 16 + 8); Q4_K / Q5_K 8 + 4 64-chunks, Q6_K / Q2_K /
# Q3_K 4 + 2 128-chunks
K_OF = {"Q8_0": 96, "Q4_0": 96, "MXFP4": 96, "Q4_K": 768, "Q5_K": 768, "Q6_K": 768, "IQ3_XXS": 768, "IQ2_XXS": 768,
        "Q2_K": 768, "Q3_K": 768}


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def layer(fmt: str, n: int, k: int, bias: bool, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    if fmt.endswith("_K") or fmt.startswith("IQ"):
        pytest.importorskip("libgguf", reason="packing K- and i-quants needs libgguf")
    from moetier.quant.pack import quantize
    return QuantLinear.from_blocks(quantize(w, fmt), fmt, b, DEV)


@pytest.mark.parametrize("fmt", QTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_its_twin(fmt, bias):
    """Decode rows (T = 3): the int8 GEMV against the twin that quantizes x alike (1e-4) and against float
    activations (int8 error); N = 77 rows (a partial row tile), K of two pieces (K_OF)."""
    pytest.importorskip("triton")
    from moetier.kernels import triton_qlinear
    k = K_OF[fmt]
    lin = layer(fmt, 77, k, bias)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1)).to(DEV)
    got = triton_qlinear.gemv(x, lin.planes, fmt, lin.bias)
    assert got.shape == (3, 77) and torch.isfinite(got).all()
    assert rel_err(got, ops.qlinear_native(x, lin.planes, fmt, lin.bias, act_q8=True)) <= 1e-4
    assert rel_err(got, ops.qlinear_native(x, lin.planes, fmt, lin.bias)) <= 3e-2


@pytest.mark.parametrize("fmt", QTYPES)
def test_chunked_path_matches_twin(fmt, monkeypatch):
    """More rows than a GEMV takes: W dequantized in row chunks (4 chunks here), float activations, exact to
    float32 rounding; leading dims of x kept."""
    k = 256 if fmt.endswith("_K") or fmt.startswith("IQ") else 64
    monkeypatch.setattr(ops, "DENSE_CHUNK_BYTES", 20 * k * 4)     # 20 rows in float32
    lin = layer(fmt, 70, k, True)
    x = torch.randn(2, 9, k, generator=torch.Generator().manual_seed(2)).to(DEV)
    got = lin(x)
    assert got.shape == (2, 9, 70)
    assert rel_err(got, ops.qlinear_native(x.reshape(-1, k), lin.planes, fmt, lin.bias).view(2, 9, 70)) <= 1e-6


def test_fused_qkv_is_one_stacked_layer():
    """fuse_qkv on QuantLinear q/k/v: one QuantLinear of the stacked rows per run of a format (one, or two when v
    has its own format as in Q4_K_M), the same products as the three."""
    from moetier.config import ModelArgs
    from moetier.models.layers import Attention
    args = ModelArgs(model_type="qwen3_moe", vocab_size=100, num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     attention_bias=True)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(DEV)
    gemv = x.is_cuda            # CUDA: 5 rows take the int8 GEMV; the CPU the chunked float path
    for fmts, n_runs in ((("Q8_0",) * 3, 1), (("Q8_0", "Q8_0", "Q4_0"), 2)):   # Q4_K_M-like: v in its own format
        att = Attention(args)
        parts = [layer(f, n, 64, True, seed=s) for s, (f, n) in enumerate(zip(fmts, (64, 32, 32)))]
        att.q_proj, att.k_proj, att.v_proj = parts
        att.fuse_qkv()
        assert att.qkv_rows == [64, 32, 32] and att.q_proj is None and len(att.qkv_q) == n_runs
        assert all(isinstance(m, QuantLinear) for m in att.qkv_q)
        want = torch.cat([ops.qlinear_native(x, p.planes, p.fmt, p.bias, act_q8=gemv) for p in parts], dim=-1)
        assert rel_err(att._qkv(x), want) <= (1e-4 if gemv else 1e-6)


@pytest.mark.parametrize("with_pre", [False, True])
def test_qkv_runs_of_formats_share_one_int8_copy_of_x(with_pre, monkeypatch):
    """Q4_K_M-like q / k (one format) and v (another): ops.qlinear_parts runs each part's GEMV from one int8 copy of
    x (pre, as the norm makes it, or one quantizer launch) into its columns of one buffer: each part's own GEMV's
    values bit for bit (the quantizer launches and the cat saved, not a value changed). Decode rows go through
    Attention._qkv alike."""
    import os

    pytest.importorskip("triton")
    from moetier.config import ModelArgs
    from moetier.kernels import triton_decode_q8 as q8
    from moetier.kernels import triton_qlinear
    from moetier.models.layers import Attention
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs Triton's interpreter or CUDA")
    prev = ops.backend()
    ops.set_backend("triton")
    try:
        args = ModelArgs(model_type="qwen3_moe", vocab_size=100, num_hidden_layers=1, hidden_size=96,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True)
        att = Attention(args)
        att.q_proj, att.k_proj, att.v_proj = (layer(f, n, 96, True, seed=s)
                                              for s, (f, n) in enumerate(zip(("Q8_0", "Q8_0", "Q4_0"), (64, 32, 32))))
        att.fuse_qkv()
        assert len(att.qkv_q) == 2
        x = torch.randn(1, 96, generator=torch.Generator().manual_seed(4)).to(DEV)
        want = torch.cat([triton_qlinear.gemv(x, p.planes, p.fmt, p.bias) for p in att.qkv_q], dim=-1)
        pre = q8.quantize(x) if with_pre else None
        got = ops.qlinear_parts(x, list(att.qkv_q), pre)
        assert got.shape == (1, 128) and torch.equal(got, want)
        assert torch.equal(att._qkv(x, pre), want)
        assert att.q8_input(x) == x.is_cuda            # the Block hands it x's int8 copy on CUDA
        monkeypatch.setenv("MOETIER_QKV_PARTS", "0")   # the path before: each part's own quantizer, then a cat
        assert torch.equal(att._qkv(x), want) and not att.q8_input(x)
    finally:
        ops.set_backend(prev)


def test_loader_pieces_on_a_synth_gguf(tmp_path):
    """gpu_blocks picks the attention and lm_head weights of a Q4_0 file (not the embeddings, norms, router or
    experts), and install() swaps their nn.Linear for QuantLinear on the same values: each layer's output equals
    the float layer the loader dequantized from the same blocks."""
    from moetier.tools.synth import synth
    from moetier.weights.loader import load_model
    path = tmp_path / "q.gguf"
    synth("qwen3-30b-a3b", "Q4_0", path, layers=1, scale="tiny", log=lambda *a: None, progress=False)
    model, args, ckpt = load_model(path)
    names = [n for n, _ in model.named_parameters()]
    found = gpu_blocks(ckpt, names, "cuda")
    assert gpu_blocks(ckpt, names, "cpu") == {}
    assert sorted(found) == sorted(["lm_head.weight"] + [f"model.layers.0.self_attn.{p}_proj.weight"
                                                         for p in "qkvo"])
    floats = {n: model.get_submodule(n.rpartition(".")[0]) for n in found}
    install(model, found, "cpu")
    for n, old in floats.items():
        new = model.get_submodule(n.rpartition(".")[0])
        assert isinstance(new, QuantLinear) and new.fmt == "Q4_0"
        xi = torch.randn(3, new.in_features)
        assert rel_err(new(xi), old(xi)) <= 1e-5
    with pytest.raises(TypeError, match="not nn.Linear"):
        install(model, {"model.layers.0.self_attn.weight": found["lm_head.weight"]}, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_quant_dense_on_cuda(tmp_path):
    """A Q4_0 file on CUDA: attention and lm_head load as QuantLinear. Teacher-forced (the same tokens fed to
    both, so one flipped near-tie cannot derail the comparison): the CUDA-graph replays give the eager steps'
    logits bit for bit, and both stay near the logits of the weights dequantized to bf16 (--dequantize-dense; int8
    activations change the last bits). A race between the quantizer and its PDL-launched GEMV would show here
    as a large error; session 9 saw greedy tokens of graph and eager part at the 6th token (near-tied logits
    of the tiny random model), which this test separates from a real difference."""
    from moetier import EngineConfig
    from moetier.runtime.cuda_graph import DecodeGraph
    from moetier.runtime.engine import Engine
    from moetier.tools.synth import synth
    path = tmp_path / "q.gguf"
    synth("qwen3-30b-a3b", "Q4_0", path, layers=2, scale="tiny", log=lambda *a: None, progress=False)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 100, (25,), generator=g).cuda()
    forced = torch.randint(3, 100, (16,), generator=g).cuda()
    logits = {}
    for deq in (False, True):
        eng = Engine.load(path, EngineConfig(device="cuda", dtype="bfloat16", dequantize_dense=deq,
                                             max_context=128, progress=False))
        n_q = sum(isinstance(m, QuantLinear) for m in eng.model.modules())
        assert n_q == (0 if deq else 2 * 2 + 1)            # (qkv fused, o) per layer + lm_head
        with torch.inference_mode():
            eager, graphed = eng.new_session().cache, eng.new_session().cache
            eng.model(prompt, eager)
            eng.model(prompt, graphed)
            graph = DecodeGraph(eng.model, graphed)
            rows = {"eager": [], "graph": []}
            for tok in forced:
                rows["eager"].append(eng.model(tok[None], eager)[-1].float())
                rows["graph"].append(graph.step(tok[None])[-1].float().clone())
        logits[deq] = {k: torch.stack(v) for k, v in rows.items()}
        del eng, graph
        torch.cuda.empty_cache()
    q = logits[False]
    assert torch.isfinite(q["graph"]).all() and torch.isfinite(q["eager"]).all()
    errs = {"graph/eager": rel_err(q["graph"], q["eager"]), "q/deq": rel_err(q["eager"], logits[True]["eager"]),
            "deq graph/eager": rel_err(logits[True]["graph"], logits[True]["eager"])}
    print("rel_err", errs)
    # the same kernels on the same inputs: the same bits (session 19: the prefill's bf16 index_add_ had made the two
    # caches differ in the last bits, which this test took for a graph / eager difference of 0.5-1.1%)
    assert errs["graph/eager"] == 0.0, errs
    assert errs["q/deq"] <= 5e-2, errs
    assert errs["deq graph/eager"] == 0.0, errs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_add_norm_q8_changes_no_bit(tmp_path, monkeypatch):
    """The residual add after the MoE making the next block's input norm and its int8 copy (the default;
    MOETIER_ADD_NORM_Q8=0 off): the same logits bit for bit as off, eager and in CUDA-graph replays, on a 3-layer Q4_0
    file (two blocks hand their norm on) at half Qwen3-30B-A3B's widths (hidden 1024: the router's launch makes the
    add + norm before the MoE only from 1024 on, triton_small.router_add_norm_fits)."""
    from moetier import EngineConfig
    from moetier.kernels import triton_small
    from moetier.runtime.cuda_graph import DecodeGraph
    from moetier.runtime.engine import Engine
    from moetier.tools.synth import synth
    path = tmp_path / "q.gguf"
    synth("qwen3-30b-a3b", "Q4_0", path, layers=3, scale=0.5, log=lambda *a: None, progress=False)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 100, (19,), generator=g).cuda()
    forced = torch.randint(3, 100, (8,), generator=g).cuda()
    calls = []
    monkeypatch.setattr(triton_small, "add_norm_q8", lambda *a, _f=triton_small.add_norm_q8: calls.append(1) or _f(*a))
    logits = {}
    for on in ("0", "1"):
        monkeypatch.setenv("MOETIER_ADD_NORM_Q8", on)
        eng = Engine.load(path, EngineConfig(device="cuda", dtype="bfloat16", max_context=64, progress=False))
        with torch.inference_mode():
            eager, graphed = eng.new_session().cache, eng.new_session().cache
            eng.model(prompt, eager)
            eng.model(prompt, graphed)
            graph = DecodeGraph(eng.model, graphed)
            rows = [(eng.model(t[None], eager)[-1].float(), graph.step(t[None])[-1].float().clone()) for t in forced]
        logits[on] = [torch.stack(r) for r in zip(*rows)]
        del eng, graph
        torch.cuda.empty_cache()
    assert calls, "the fused add + norm never ran"
    assert all(torch.equal(a, b) for a, b in zip(logits["0"], logits["1"]))
    assert torch.isfinite(logits["1"][0]).all()


def test_decode_attention_hands_o_proj_its_int8_copy():
    """The fused decode attention with q8: its output's int8 copy is exactly quantize(output) (so the o_proj
    GEMV can skip its quantizer launch), the output itself unchanged, and the GEMV on that copy gives the
    same result as on its own quantization."""
    import os

    pytest.importorskip("triton")
    from moetier.kernels import triton_attention
    from moetier.kernels import triton_decode_q8 as q8
    from moetier.models.layers import Rope
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs Triton's interpreter or CUDA")
    h, hkv, dh, pos = 4, 2, 32, 21
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(1, (h + 2 * hkv) * dh, generator=g).to(DEV)
    caches = [(torch.randn(64, hkv, dh, generator=g).to(DEV), torch.randn(64, hkv, dh, generator=g).to(DEV))]
    caches.append((caches[0][0].clone(), caches[0][1].clone()))
    start = torch.tensor(pos, device=DEV)
    cos, sin = Rope({"rope_theta": 1000.0}, dh, 4096).to(DEV)(start + torch.arange(1, device=DEV), torch.float32)
    plain = triton_attention.decode_attention(qkv, None, None, 1e-6, cos, sin, start, *caches[0], h, hkv, dh ** -0.5)
    out, pre = triton_attention.decode_attention(qkv, None, None, 1e-6, cos, sin, start, *caches[1], h, hkv,
                                                 dh ** -0.5, q8=True)
    assert torch.equal(out, plain)
    for got, want in zip(pre, q8.quantize(out)):
        assert torch.equal(got, want)
    lin = layer("Q8_0", 48, h * dh, True)
    from moetier.kernels import triton_qlinear
    assert torch.equal(triton_qlinear.gemv(out, lin.planes, "Q8_0", lin.bias, pre=pre),
                       triton_qlinear.gemv(out, lin.planes, "Q8_0", lin.bias))


def test_repacked_block_bytes_match_repack():
    """The plan counts QuantLinear's GPU bytes as repacked planes (Q4_K: 148 bytes a block, the file's 144)."""
    from moetier.models.quant_linear import REPACKED_BLOCK_BYTES
    from moetier.quant.formats import get_format
    from moetier.quant.repack import repack
    for name, per in REPACKED_BLOCK_BYTES.items():
        fmt = get_format(name)
        blocks = torch.randint(0, 256, (3, 2 * fmt.type_size), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(0))
        planes = repack(name, blocks)
        assert sum(t.numel() * t.element_size() for t in planes.values()) == 6 * per, name
